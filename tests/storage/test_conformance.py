"""Every storage backend passes the public StoreTests conformance suite."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastckpt.storage import GcsStore, LocalStore, MemoryStore, RetryingStore, RetryPolicy, Store
from fastckpt.storage._local import TEMP_SUFFIX
from fastckpt.testing.store_tests import StoreTests


class TestMemoryStore(StoreTests):
    @pytest.fixture
    def store(self) -> Store:
        return MemoryStore()


class TestLocalStore(StoreTests):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        return LocalStore(tmp_path / "root")

    def write_stray_temp(self, store: Store, key: str) -> bool:
        assert isinstance(store, LocalStore)
        path = store.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / f".{path.name}.deadbeef{TEMP_SUFFIX}").write_bytes(b"partial")
        return True


class TestGcsStore(StoreTests):
    """GcsStore against fake-gcs-server (memory backend)."""

    @pytest.fixture
    def store(self, gcs_store: GcsStore) -> Store:
        return gcs_store


class TestRetryingMemoryStore(StoreTests):
    """The retry wrapper is transparent when nothing fails."""

    @pytest.fixture
    def store(self) -> Store:
        return RetryingStore(MemoryStore(), policy=RetryPolicy(max_attempts=3, initial_backoff_s=0.001))
