"""Every storage backend passes the public StoreTests conformance suite."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fastckpt.storage import GcsStore, LocalStore, MemoryStore, RetryingStore, RetryPolicy, Store
from fastckpt.storage._local import TEMP_SUFFIX
from fastckpt.testing.store_tests import StoreTests, run


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

    def test_sweep_prunes_empty_directories(self, store: Store) -> None:
        assert isinstance(store, LocalStore)
        run(store.put("steps/1/a/x", b"1"))
        run(store.put("steps/2/y", b"2"))
        run(store.delete("steps/1/a/x"))
        assert (store.root / "steps/1/a").is_dir()  # delete leaves directories
        assert (
            run(store.sweep(older_than=0.0, dry_run=True)) == []
            and (store.root / "steps/1/a").is_dir()
        )
        assert run(store.sweep(older_than=0.0)) == []
        assert (
            sorted(p.name for p in (store.root / "steps").iterdir()) == ["2"]
            and store.root.is_dir()
        )


class TestGcsStore(StoreTests):
    """GcsStore against fake-gcs-server (memory backend), listing 5 objects per page."""

    @pytest.fixture
    def store(self, gcs_store: GcsStore) -> Store:
        return GcsStore(
            gcs_store.bucket,
            gcs_store.prefix,
            options=dataclasses.replace(gcs_store.options, list_page_size=5),
        )


class TestRetryingMemoryStore(StoreTests):
    """The retry wrapper is transparent when nothing fails."""

    @pytest.fixture
    def store(self) -> Store:
        return RetryingStore(
            MemoryStore(), policy=RetryPolicy(max_attempts=3, initial_backoff_s=0.001)
        )
