"""Integration tests run on 8 virtual CPU devices.

``XLA_FLAGS`` is read when the JAX backend starts (the first device query), not at import, so
setting it here at collection time works even though the root conftest imports jax.
"""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def devices8() -> list[jax.Device]:
    """Exactly eight devices; fails loudly if the backend started with fewer."""
    devices = jax.devices()
    if len(devices) < 8:
        pytest.fail(
            f"integration tests need 8 devices, the backend has {len(devices)}: "
            "something initialised JAX before tests/integrations/conftest.py set XLA_FLAGS"
        )
    return devices[:8]
