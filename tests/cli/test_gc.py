"""``fastckpt.maintenance.collect_garbage`` as a library function, on every backend."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import fastckpt
import fastckpt.storage
from fastckpt.errors import ConfigError
from fastckpt.format.layout import manifest_key
from fastckpt.maintenance import collect_garbage
from fastckpt.options import RetentionOptions
from fastckpt.storage import LocalStore, MemoryStore, Store

_LOSER_10 = "steps/000000000010/aaaa/p00000-00000.fck"  # a losing attempt of committed step 10
_DEAD_15 = "steps/000000000015/bbbb/p00000-00000.fck"  # died before commit; 30 is committed since
_NEW_40 = "steps/000000000040/cccc/p00000-00000.fck"  # newer than anything committed


def _put(store: Store, key: str, data: bytes = b"junk") -> None:
    asyncio.run(store.put(key, data))


def _keys(store: Store, prefix: str = "") -> list[str]:
    return asyncio.run(store.list(prefix))


@pytest.fixture(params=["memory", "local", "gcs"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """Steps 10, 20, 30 committed, plus three leftovers."""
    if request.param == "gcs":
        s: Store = request.getfixturevalue("gcs_store")
    else:
        s = MemoryStore() if request.param == "memory" else LocalStore(tmp_path / "ckpt")
    for step in (10, 20, 30):
        fastckpt.save(s, step, {"x": np.full(4, step, np.float32)})
    for key in (_LOSER_10, _DEAD_15, _NEW_40):
        _put(s, key)
    yield s
    asyncio.run(s.close())


def test_grace_period_counts_from_the_listed_mtime(store: Store) -> None:
    """Uncommitted data is kept until it is ``grace_s`` old by the store's listed mtime (also
    when a newer step is committed: a slow save of an old step may still be in flight);
    unreferenced data of a committed step goes at once. Ages and sizes are the listing's."""
    listed = {i.key: i for i in asyncio.run(store.list_info("steps/"))}
    written = listed[_DEAD_15].mtime
    report = collect_garbage(store, grace_s=600, dry_run=True, now=written + 599)
    assert report.committed_steps == [10, 20, 30]
    assert [(lo.key, lo.reason) for lo in report.removed] == [(_LOSER_10, "unreferenced")]
    assert sorted(lo.key for lo in report.kept) == [_DEAD_15, _NEW_40]
    for lo in report.removed + report.kept:
        assert lo.size == 4 and lo.age_s == pytest.approx(written + 599 - listed[lo.key].mtime)
    late = max(i.mtime for i in listed.values()) + 600
    report = collect_garbage(store, grace_s=600, dry_run=True, now=late)
    assert (
        sorted(lo.key for lo in report.removed) == [_LOSER_10, _DEAD_15, _NEW_40]
        and not report.kept
    )
    assert (
        report.removed_bytes == 12 and len(_keys(store, "steps/")) == 6
    )  # dry run deleted nothing
    report = collect_garbage(store, grace_s=600, now=written + 599)
    assert [lo.key for lo in report.removed] == [_LOSER_10] and not report.errors
    assert _DEAD_15 in _keys(store, "steps/")
    report = collect_garbage(store, grace_s=0)  # "nothing is writing": the young ones go too
    assert sorted(lo.key for lo in report.removed) == [_DEAD_15, _NEW_40]
    assert len(_keys(store, "steps/")) == 3 and fastckpt.restore(store)["x"][0] == 30.0


def test_retention_and_unreadable_manifests() -> None:
    store = MemoryStore()
    for step in (10, 20, 30):
        fastckpt.save(store, step, {"x": np.full(4, step, np.float32)})
    _put(store, manifest_key(5), b"{not json")
    _put(store, "steps/000000000005/dddd/p00000-00000.fck")
    report = collect_garbage(store, retention=RetentionOptions(keep_last=1))
    assert report.retention_steps == [5, 10, 20]
    assert report.errors and "step 5" in report.errors[0]
    assert "steps/000000000005/dddd/p00000-00000.fck" not in {lo.key for lo in report.removed}
    assert _keys(store, "manifests/") == [manifest_key(30)]
    assert fastckpt.restore(store)["x"][0] == 30.0
    for bad in (-1.0, float("nan")):
        with pytest.raises(ConfigError):
            collect_garbage(store, grace_s=bad)


def test_a_step_committed_while_gc_runs_keeps_its_data(tmp_path: Path) -> None:
    """A save that ran longer than the grace period commits right after gc read the manifests:
    its data, old enough to look abandoned, is kept (the manifests are checked again before
    deleting), and the step restores."""
    import os
    import time

    from fastckpt.format.layout import MANIFEST_PREFIX, STEPS_PREFIX
    from fastckpt.maintenance import collect_garbage_async

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
