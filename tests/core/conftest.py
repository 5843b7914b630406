"""In-process core tests run on 8 virtual CPU devices.

XLA reads the device count when the CPU backend is created (the first ``jax.devices()``),
not at ``import jax``: setting the flag here, at collection time, is early enough as long as
nothing touches devices while collecting. Every in-process jax test in this repository
shares the one backend, so all of them see 8 devices; subprocess-based tests (multiprocess,
elastic, replicas) set their own count in the child environment.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

N_DEVICES = 8
_FLAG = "--xla_force_host_platform_device_count"
_flags = re.sub(rf"{_FLAG}=\S+", "", os.environ.get("XLA_FLAGS", "")).strip()
os.environ["XLA_FLAGS"] = f"{_flags} {_FLAG}={N_DEVICES}".strip()


@pytest.fixture(scope="session", autouse=True)
def eight_devices() -> None:
    import jax

    n = len(jax.devices())
    if n != N_DEVICES:
        pytest.fail(
            f"core tests need {N_DEVICES} CPU devices but the backend has {n}: something initialised "
            "jax before tests/core/conftest.py set XLA_FLAGS"
        )


@pytest.fixture(params=["memory", "local"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[object]:
    """Where checkpoints go: a fresh MemoryStore, or a local directory opened by path (the
    public ``open_store`` route: RetryingStore over a durable LocalStore)."""
    if request.param == "memory":
        from fastckpt.storage import MemoryStore

        yield MemoryStore()
    else:
        yield str(tmp_path / "ckpt")


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A fresh directory on tmpfs (``/dev/shm``), removed after the test."""
    d = Path("/dev/shm") / f"fastckpt-test-{uuid.uuid4().hex[:12]}"
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)
