"""``fastckpt._gc.collect_garbage`` as a library function (stores that cannot tell ages)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

import fastckpt
import fastckpt.storage
from fastckpt._gc import collect_garbage
from fastckpt.errors import ConfigError
from fastckpt.format.layout import manifest_key
from fastckpt.options import RetentionOptions
from fastckpt.storage import MemoryStore


def _put(store: MemoryStore, key: str, data: bytes = b"junk") -> None:
    asyncio.run(store.put(key, data))


def _keys(store: MemoryStore, prefix: str = "") -> list[str]:
    return asyncio.run(store.list(prefix))


@pytest.fixture
def store() -> MemoryStore:
    s = MemoryStore()
    for step in (10, 20, 30):
        fastckpt.save(s, step, {"x": np.full(4, step, np.float32)})
    _put(s, "steps/000000000010/aaaa/p00000-00000.fck")  # a losing attempt of committed step 10
    _put(s, "steps/000000000015/bbbb/p00000-00000.fck")  # died before commit; 30 is committed since
    _put(s, "steps/000000000040/cccc/p00000-00000.fck")  # newer than anything committed: maybe in flight
    return s


def test_unknown_ages_use_the_newest_committed_step(store: MemoryStore) -> None:
    report = collect_garbage(store, dry_run=True)
    assert report.committed_steps == [10, 20, 30]
    assert sorted(lo.key for lo in report.removed) == [
        "steps/000000000010/aaaa/p00000-00000.fck", "steps/000000000015/bbbb/p00000-00000.fck"]
    assert [lo.reason for lo in sorted(report.removed, key=lambda lo: lo.key)] == ["unreferenced", "uncommitted"]
    assert [lo.key for lo in report.kept] == ["steps/000000000040/cccc/p00000-00000.fck"]
    assert all(lo.age_s is None for lo in report.removed + report.kept)
    assert len(_keys(store, "steps/")) == 6  # dry run deleted nothing
    report = collect_garbage(store)
    assert len(_keys(store, "steps/")) == 4 and not report.errors
    report = collect_garbage(store, grace_s=0)  # "nothing is writing": the in-flight guess goes too
    assert [lo.key for lo in report.removed] == ["steps/000000000040/cccc/p00000-00000.fck"]
    assert fastckpt.restore(store)["x"][0] == 30.0


def test_retention_and_unreadable_manifests(store: MemoryStore) -> None:
    _put(store, manifest_key(5), b"{not json")
    _put(store, "steps/000000000005/dddd/p00000-00000.fck")
    report = collect_garbage(store, retention=RetentionOptions(keep_last=1))
    assert report.retention_steps == [5, 10, 20]
    assert report.errors and "step 5" in report.errors[0]
    assert "steps/000000000005/dddd/p00000-00000.fck" not in {lo.key for lo in report.removed}
    assert _keys(store, "manifests/") == [manifest_key(30)]
    assert fastckpt.restore(store)["x"][0] == 30.0
    with pytest.raises(ConfigError):
        collect_garbage(store, grace_s=-1)


def test_a_step_committed_while_gc_runs_keeps_its_data(tmp_path: Path) -> None:
    """A save that ran longer than the grace period commits right after gc read the manifests:
    its data, old enough to look abandoned, is kept (the manifests are checked again before
    deleting), and the step restores."""
    import os
    import time

    from fastckpt._gc import collect_garbage_async
    from fastckpt.format.layout import MANIFEST_PREFIX, STEPS_PREFIX
    from fastckpt.storage import LocalStore

    root = tmp_path / "ckpt"
    fastckpt.save(str(root), 7, {"w": np.arange(1000, dtype=np.float32)})
    plain = LocalStore(root)
    manifest = bytes(asyncio.run(plain.get(manifest_key(7))))
    asyncio.run(plain.delete(manifest_key(7)))  # the save of step 7, its data written 15 min ago
    old = time.time() - 900
    for k in asyncio.run(plain.list(STEPS_PREFIX)):
        os.utime(root / k, (old, old))

    class CommitsDuringGc(LocalStore):
        async def list(self, prefix: str = "") -> list[str]:
            out = await super().list(prefix)
            if prefix == MANIFEST_PREFIX:  # the save commits right after gc listed the manifests
                await super().put(manifest_key(7), manifest, mode="create")
            return out

    report = asyncio.run(collect_garbage_async(CommitsDuringGc(root), grace_s=600))
    assert report.removed == [] and {lo.step for lo in report.kept} == {7}
    restored = fastckpt.restore(str(root), step=7)
    np.testing.assert_array_equal(restored["w"], np.arange(1000, dtype=np.float32))


def test_steps_past_twelve_digits_are_listed_restored_and_kept(tmp_path: Path) -> None:
    """A Unix-millisecond step (13 digits) is committed, listed, restored and not collected;
    steps beyond the key format are refused up front."""
    root = str(tmp_path / "ckpt")
    step = 1_700_000_000_000
    fastckpt.save(root, step, {"w": np.arange(10, dtype=np.float32)})
    with fastckpt.CheckpointManager(root) as mgr:
        assert mgr.all_steps() == [step] and mgr.latest_step() == step
        with pytest.raises(ConfigError, match="step must be"):
            mgr.save(10**18, {"w": np.zeros(1)})
    assert collect_garbage(fastckpt.storage.open_store(root), grace_s=0).removed == []
    np.testing.assert_array_equal(fastckpt.restore(root)["w"], np.arange(10, dtype=np.float32))
