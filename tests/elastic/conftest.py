"""Elastic tests: in-process ones run on 8 virtual CPU devices (as every in-process test,
tests/conftest.py); the supervisor tests launch real worker processes that set their own
device count."""

from __future__ import annotations

import os
import re
from typing import Any

import pytest

N_DEVICES = 8
_FLAG = "--xla_force_host_platform_device_count"
_flags = re.sub(rf"{_FLAG}=\S+", "", os.environ.get("XLA_FLAGS", "")).strip()
os.environ["XLA_FLAGS"] = f"{_flags} {_FLAG}={N_DEVICES}".strip()


@pytest.fixture(scope="session")
def runner(eight_devices: None) -> Any:
    """Reference programs per device count, compiled once per session."""
    from ._common import Runner

    return Runner()


@pytest.fixture(scope="session")
def eight_devices() -> None:
    import jax

    n = len(jax.devices())
    if n != N_DEVICES:
        pytest.fail(f"elastic tests need {N_DEVICES} CPU devices but the backend has {n}")
