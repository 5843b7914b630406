"""Shared pytest fixtures. Storage: a session-wide GCS emulator and a fresh GcsStore per test."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator

import pytest

from fastckpt.storage import GcsOptions, GcsStore
from fastckpt.testing.gcs_emulator import GcsEmulator

_GCS_TEST_BUCKET = "fastckpt-test"
_prefix_counter = itertools.count()


@pytest.fixture(scope="session")
def gcs_emulator() -> Iterator[GcsEmulator]:
    """A fake-gcs-server (memory backend) for the whole session; fails if it cannot start."""
    with GcsEmulator(backend="memory") as emulator:
        emulator.create_bucket(_GCS_TEST_BUCKET)
        yield emulator


@pytest.fixture
def gcs_store(gcs_emulator: GcsEmulator) -> Iterator[GcsStore]:
    """A GcsStore on the emulator under a fresh prefix, closed after the test."""
    store = GcsStore(
        _GCS_TEST_BUCKET,
        f"t{next(_prefix_counter):05d}",
        options=GcsOptions(endpoint=gcs_emulator.endpoint, max_workers=8),
    )
    yield store
    asyncio.run(store.close())
