"""Fixtures for the real-process replica tests: unique /dev/shm directories, always removed."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest


def _new_shm_dir(tag: str) -> Path:
    base = Path("/dev/shm")
    if not base.is_dir():
        pytest.fail("these tests need a tmpfs at /dev/shm")
    d = base / f"fastckpt-rmp-{tag}-{uuid.uuid4().hex[:10]}"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture(scope="module")
def module_shm(request: pytest.FixtureRequest) -> Iterator[Path]:
    """A fresh /dev/shm directory for a whole module (removed afterwards)."""
    d = _new_shm_dir(request.module.__name__.rsplit(".", 1)[-1])
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A fresh /dev/shm directory for one test (removed afterwards)."""
    d = _new_shm_dir("t")
    yield d
    shutil.rmtree(d, ignore_errors=True)
