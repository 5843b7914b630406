"""Own-RAM restores are zero copy: the restored arrays alias the RAM tier's shared memory.

These tests pin down the hazard that design creates: later saves drop the restored step and
recycle segment files, and the restored arrays must not change.
"""

from __future__ import annotations

import os
import threading
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fastckpt import CheckpointManager, ManagerOptions, RetentionOptions, SaveOptions
from fastckpt.options import RamOptions
from tests.support.arrays import P, named

MIB = 1 << 20


def _state(step: int) -> dict[str, Any]:
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("d", "m"))
    rng = np.random.default_rng(step)
    return {
        "w": jax.device_put(
            rng.standard_normal((64, 512), dtype=np.float32), NamedSharding(mesh, P("d", "m"))
        ),
        "r": jax.device_put(
            rng.standard_normal((1000,), dtype=np.float32), NamedSharding(mesh, P())
        ),
        "host": rng.integers(0, 100, (7, 3)).astype(np.int64),
        "step": step,
    }


def test_restored_arrays_survive_later_saves(tmp_path: Path, shm_dir: Path) -> None:
    """The zero-copy restore's hazard: arrays aliasing a RAM step that later saves drop."""
    import jax

    options = ManagerOptions(
        save_interval_steps=1000,  # RAM-only steps
        retention=RetentionOptions(keep_last=None),
        ram=RamOptions(
            root=str(shm_dir / "h0"), interval_steps=1, replicas=0, budget_bytes=256 * MIB
        ),
    )
    expected = jax.tree.map(np.asarray, _state(1))
    with CheckpointManager(str(tmp_path / "ckpt"), options=options) as mgr:
        mgr.save(1, _state(1))
        mgr.wait()
        target = jax.tree.map(
            lambda a: (
                jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
                if isinstance(a, jax.Array)
                else a
            ),
            _state(1),
        )
        restored = mgr.restore(1, target=target)
        stats = mgr.last_restore_stats
        assert stats.bytes_by_tier == {"ram": stats.restored_bytes}
        restored["host"][0, 0] = -1  # numpy leaves come back writable (copied, not lent)
        restored["host"][0, 0] = expected["host"][0, 0]
        for step in range(2, 6):  # every RAM commit drops the previous step; files get reused
            mgr.save(step, _state(step))
            mgr.wait()
        assert mgr.steps_by_tier().keys() <= {5}
        for k in ("w", "r", "host"):
            np.testing.assert_array_equal(np.asarray(restored[k]), expected[k])
        doubled = jax.jit(lambda x: x * 2, donate_argnums=0)(
            restored["w"]
        )  # donation must not write shm
        np.testing.assert_array_equal(np.asarray(doubled), expected["w"] * 2)
        again = mgr.restore(5, target=target)
        np.testing.assert_array_equal(np.asarray(again["w"]), np.asarray(_state(5)["w"]))
    assert not [p for p in (shm_dir / "h0" / "spare").iterdir() if not os.stat(p).st_mode & 0o200]


class _GatedPeer:
    """A real PeerClient whose chunk pushes wait until ``gate`` is set (a link that stalls)."""

    def __init__(self, client: Any, gate: threading.Event) -> None:
        self.client, self.gate, self.name = client, gate, client.name

    def push_chunks(self, step: int, chunks: Any) -> None:
        assert self.gate.wait(timeout=60)
        self.client.push_chunks(step, chunks)

    def list_chunks(self, step: int) -> list[str]:
        return list(self.client.list_chunks(step))

    def put_manifest(self, step: int, data: bytes) -> None:
        self.client.put_manifest(step, data)


@pytest.mark.parametrize("if_busy", ["wait", "skip"])
def test_a_ram_save_waits_for_the_previous_steps_push(
    tmp_path: Path, shm_dir: Path, if_busy: str
) -> None:
    """Backpressure: pushes slower than the RAM interval delay the next RAM save (or skip it,
    with ``if_busy="skip"``) instead of being superseded, which would leave a window where
    losing this host loses both RAM steps."""
    from fastckpt.replicas._client import PeerClient
    from fastckpt.replicas._ram import RamTier
    from fastckpt.replicas._server import PeerServer

    secret = b"s" * 32
    peer_tier = RamTier(shm_dir / "peer", budget_bytes=256 * MIB, replicated=True)
    server = PeerServer(peer_tier, secret=secret).start()
    options = ManagerOptions(
        save_interval_steps=1000,
        save=SaveOptions(if_busy=if_busy),  # type: ignore[arg-type]
        ram=RamOptions(
            root=str(shm_dir / "h0"),
            interval_steps=1,
            replicas=1,
            secret=secret,
            budget_bytes=256 * MIB,
        ),
    )
    gate = threading.Event()
    try:
        with (
            CheckpointManager(str(tmp_path / "ckpt"), options=options) as mgr,
            PeerClient(server.address, secret=secret, name="peer") as client,
        ):
            mgr._tier._peers = lambda: {"peer": _GatedPeer(client, gate)}  # type: ignore[method-assign,union-attr]
            mgr.save(1, _state(1))
            mgr.wait()  # committed here; the push of step 1 is held at the gate
            assert peer_tier.get_manifest(1) is None
            if (
                if_busy == "skip"
            ):  # the push of step 1 still runs: this RAM step is skipped, nothing waits
                assert mgr.save(2, _state(2)) is False
                assert peer_tier.get_manifest(1) is None
                gate.set()
                (first,) = mgr.wait_replication()  # the push of step 1, now finished
                assert (
                    first.step == 1
                    and first.ok
                    and first.targets == ("peer",)
                    and first.bytes_pushed > 0
                )
            else:
                threading.Timer(0.5, gate.set).start()  # the link recovers while save(2) waits
            mgr.save(2, _state(2))
            # save(2) staged step 2 only after step 1 had fully reached the peer
            assert peer_tier.get_manifest(1) is not None
            assert peer_tier.chunk_ids(1) == sorted(mgr._tier.tier.chunk_ids(1))  # type: ignore[union-attr]
            mgr.wait()
            assert mgr.last_save_stats is not None
            assert (mgr.last_save_stats.push_wait_s > 0.3) == (if_busy == "wait")
            reports = (
                mgr.wait_replication()
            )  # the pushes finished since the last call, oldest first
            assert [r.step for r in reports] == ([2] if if_busy == "skip" else [1, 2])
            assert all(r.ok and r.targets == ("peer",) and r.bytes_pushed > 0 for r in reports)
            assert mgr.wait_replication() == []  # each report is returned once
            assert peer_tier.get_manifest(2) is not None
            got = mgr.restore(2)
            np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(_state(2)["w"]))
    finally:
        gate.set()
        server.close()
        peer_tier.close()


@pytest.mark.parametrize(
    "one_planner_below", [0, 1 << 40], ids=["parallel planning", "one planner"]
)
def test_both_planning_schedules_restore_bit_exact_from_ram_and_storage(
    tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch, one_planner_below: int
) -> None:
    """Small units are planned on one thread, large ones in parallel (reader/fetch.py's
    prepare_all); forcing each schedule, RAM and storage restores are bit-exact."""
    import jax

    from fastckpt.reader import fetch

    monkeypatch.setattr(fetch, "_ONE_PLANNER_UNIT_BYTES", one_planner_below)
    options = ManagerOptions(
        save_interval_steps=2,
        ram=RamOptions(
            root=str(shm_dir / "h0"), interval_steps=1, replicas=0, budget_bytes=256 * MIB
        ),
    )
    with CheckpointManager(str(tmp_path / "ckpt"), options=options) as mgr:
        for step in (2, 3):  # 2: storage and RAM; 3: RAM only
            mgr.save(step, _state(step))
        mgr.wait()
        target = jax.tree.map(
            lambda x: (
                jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                if isinstance(x, jax.Array)
                else x
            ),
            _state(3),
        )
        for step, tier in ((3, "ram"), (2, None)):
            restored = mgr.restore(step, target=target)
            stats = mgr.last_restore_stats
            expected = jax.tree.map(np.asarray, _state(step))
            got = jax.tree.map(np.asarray, restored)
            assert jax.tree.all(jax.tree.map(np.array_equal, got, expected))
            if tier is not None:
                assert set(stats.bytes_by_tier) == {tier}


@pytest.mark.parametrize(
    "one_planner_below", [0, 1 << 40], ids=["parallel planning", "one planner"]
)
def test_a_corrupt_lent_unit_is_caught_after_planning_and_read_from_the_next_tier(
    tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch, one_planner_below: int
) -> None:
    """Own-RAM units are borrowed unverified while planning and checked together afterwards
    (LeafFiller.verify_lent): a flipped byte in one chunk sends exactly that unit to the next
    tier (storage here), the source records the corrupt copy, the rest stays zero copy."""
    import json

    import jax

    from fastckpt.reader import fetch

    monkeypatch.setattr(fetch, "_ONE_PLANNER_UNIT_BYTES", one_planner_below)
    options = ManagerOptions(
        save_interval_steps=1,
        ram=RamOptions(
            root=str(shm_dir / "h0"), interval_steps=1, replicas=0, budget_bytes=256 * MIB
        ),
    )
    root = str(tmp_path / "ckpt")
    with CheckpointManager(root, options=options) as mgr:
        mgr.save(2, _state(2))
        mgr.wait()
        nchunks = sum(len(a.chunks) for a in mgr.manifest(2).arrays())
    (index,) = (shm_dir / "h0" / "step-2").glob("*.index.json")
    doc = json.loads(index.read_text())
    cid, off, length, _ = next(c for c in doc["chunks"] if c[0].startswith("['w']@"))
    with (index.parent / doc["data"]).open("r+b") as f:
        f.seek(off + length // 2)
        byte = f.read(1)
        f.seek(off + length // 2)
        f.write(bytes([byte[0] ^ 0x40]))
    target = jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            if isinstance(x, jax.Array)
            else x
        ),
        _state(2),
    )
    with CheckpointManager(root, options=options) as mgr:
        restored = mgr.restore(2, target=target)
        stats = mgr.last_restore_stats
    got, expected = jax.tree.map(np.asarray, restored), jax.tree.map(np.asarray, _state(2))
    assert jax.tree.all(jax.tree.map(np.array_equal, got, expected))
    assert stats.chunks_by_tier == {"ram": nchunks - 1, "storage": 1}, (cid, stats)
    assert stats.bytes_by_tier["storage"] == length and stats.fallbacks == {"corrupt": 1}, stats


def test_a_failure_while_planning_fails_the_restore_and_leaves_the_manager_usable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planning runs one group after another (small units); a host that refuses one leaf's
    buffer mid-way fails the restore with a MemoryError naming it, after the fetches already
    started, and the next restore works."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from fastckpt.reader import leaf_filler

    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("d", "m"))
    sharding = NamedSharding(mesh, P("d", "m"))
    state = {
        f"l{i:02d}": jax.device_put(np.full((16, 64), i, np.float32), sharding) for i in range(40)
    }
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    real = leaf_filler.allocate

    def refuse_l30(nbytes: int, what: Any, **kw: Any) -> np.ndarray:
        if "l30" in what():
            raise MemoryError(
                f"restore cannot allocate {nbytes} bytes of host memory for {what()}: refused"
            )
        return real(nbytes, what, **kw)

    with CheckpointManager(str(tmp_path / "ckpt")) as mgr:
        mgr.save(1, state)
        mgr.wait()
        monkeypatch.setattr(leaf_filler, "allocate", refuse_l30)
        with pytest.raises(MemoryError, match="l30"):
            mgr.restore(1, target=target)
        monkeypatch.setattr(leaf_filler, "allocate", real)
        restored = mgr.restore(1, target=target)
        assert all(np.array_equal(np.asarray(restored[k]), np.asarray(state[k])) for k in state)


def test_the_next_ram_save_reuses_a_segment_provisioned_in_the_background(
    tmp_path: Path, shm_dir: Path
) -> None:
    """After a RAM step commits, the save's background part provisions a spare segment of the
    same size; the next RAM save stages straight into it (the same file), instead of creating
    a segment file while the step waits."""
    import jax

    def _big(step: int) -> dict[str, Any]:  # 2 MiB: above the size worth recycling
        return {
            "w": jax.device_put(
                np.random.default_rng(step).standard_normal((1024, 512), dtype=np.float32)
            )
        }

    options = ManagerOptions(
        save_interval_steps=1000,
        ram=RamOptions(
            root=str(shm_dir / "h0"), interval_steps=1, replicas=0, budget_bytes=256 * MIB
        ),
    )
    with CheckpointManager(str(tmp_path / "ckpt"), options=options) as mgr:
        mgr.save(1, _big(1))
        mgr.wait()
        (spare,) = (shm_dir / "h0" / "spare").iterdir()
        (first,) = (shm_dir / "h0" / "step-1").glob("*.data")
        assert spare.stat().st_size == first.stat().st_size
        inode = spare.stat().st_ino
        mgr.save(2, _big(2))
        mgr.wait()
        (second,) = (shm_dir / "h0" / "step-2").glob("*.data")
        assert second.stat().st_ino == inode
        got = mgr.restore(2)
        np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(_big(2)["w"]))


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_a_vanished_or_shrunk_ram_segment_falls_back_to_storage(
    tmp_path: Path, shm_dir: Path, damage: str
) -> None:
    """A RAM-tier data file deleted or truncated behind the tier's back (mapped only when first
    read): the restore reads those chunks from storage, bit-exact, instead of failing on an
    OSError/ValueError from the mapping."""
    import glob

    import jax

    sharding = named((8,), ("x",), P("x"))
    w = np.arange(256 * 256, dtype=np.float32).reshape(256, 256)
    opts = ManagerOptions(
        save_interval_steps=1,
        ram=RamOptions(
            root=str(shm_dir / "h0"), interval_steps=1, replicas=0, budget_bytes=64 << 20
        ),
    )
    with CheckpointManager(str(tmp_path / "ck"), options=opts) as mgr:
        mgr.save(1, {"w": jax.device_put(w, sharding)})
        mgr.wait()
    with CheckpointManager(
        str(tmp_path / "ck"), options=opts
    ) as mgr:  # reopened: segments not mapped yet
        (data,) = glob.glob(str(shm_dir / "h0" / "step-1" / "*.data"))
        if damage == "delete":
            os.remove(data)
        else:
            os.truncate(data, 100)
        got = mgr.restore(
            1, target={"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=sharding)}
        )
        stats = mgr.last_restore_stats
        np.testing.assert_array_equal(np.asarray(got["w"]), w)
        assert set(stats.bytes_by_tier) == {"storage"}


def test_restore_stats_count_this_restores_fallbacks_only(tmp_path: Path, shm_dir: Path) -> None:
    """A long-lived chunk source (``chunk_source=``) counts fallbacks since it was made; each
    restore's stats report its own."""
    import jax

    from fastckpt.replicas._ram import RamTier
    from fastckpt.replicas._sources import TieredChunkSource

    sharding = named((8,), ("x",), P("x"))
    w = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    with RamTier(shm_dir / "t", budget_bytes=1 << 20) as tier:
        source = TieredChunkSource(tier)  # lacks the step: every chunk is a miss
        with CheckpointManager(str(tmp_path / "ck"), chunk_source=source) as mgr:
            mgr.save(1, {"w": jax.device_put(w, sharding)})
            mgr.wait()
            seen = []
            for _ in range(3):
                mgr.restore(
                    1, target={"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=sharding)}
                )
                seen.append(mgr.last_restore_stats)
    assert [s.fallbacks for s in seen] == [{"miss": 8}] * 3


def test_no_job_of_a_failed_restore_outlives_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One leaf group fails while others are still fetching from a (slow) fast tier: by the time
    restore() raises, every worker job has finished."""
    import time

    import jax

    from fastckpt import RestoreOptions
    from fastckpt.reader import leaf_filler

    class SlowSource:  # a fast tier that is slow and never has anything
        def __init__(self) -> None:
            self.done: list[float] = []

        def fetch_many(self, step: int, items: list[Any], *, runs: Any = None) -> list[None]:
            time.sleep(0.5)
            self.done.append(time.perf_counter())
            return [None] * len(items)

        def lend_many(self, step: int, groups: list[Any], *, verify: bool = True) -> list[None]:
            return [None] * len(groups)

        def stats(self) -> Any:
            return types.SimpleNamespace(fallbacks={})

    sharding = named((8,), ("x",), P("x"))
    # 8 MiB leaves: planned in parallel, a job per group (small units are planned by one job)
    state = {
        f"l{i:02d}": jax.device_put(np.full((1024, 2048), i, np.float32), sharding)
        for i in range(8)
    }
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    source = SlowSource()
    real = leaf_filler.allocate

    def refuse(n: int, what: Any, **kw: Any) -> Any:
        if "l05" in what():
            time.sleep(0.1)
            raise MemoryError("refused " + what())
        return real(n, what, **kw)

    with CheckpointManager(str(tmp_path / "ck")) as mgr:
        mgr.save(1, state)
        mgr.wait()
    with CheckpointManager(
        str(tmp_path / "ck"),
        chunk_source=source,
        options=ManagerOptions(restore=RestoreOptions(decode_threads=8)),
    ) as mgr:
        monkeypatch.setattr(leaf_filler, "allocate", refuse)
        with pytest.raises(MemoryError, match="l05"):
            mgr.restore(1, target=target)
        failed_at = time.perf_counter()
        monkeypatch.undo()
        time.sleep(1.0)
        assert source.done and all(t <= failed_at for t in source.done)


def test_ram_saves_go_on_after_a_restore_fell_back_to_an_older_step(
    tmp_path: Path, shm_dir: Path
) -> None:
    """RAM step 120's only copy is corrupt: restore() falls back to storage's 100, and the
    re-trained steps 110 and 120 save to RAM again (the abandoned 120 no longer sets the
    tier's retention floor, nor is it served for the new 120)."""
    opts = ManagerOptions(
        save_interval_steps=100,
        retention=RetentionOptions(keep_last=None),
        ram=RamOptions(
            root=str(shm_dir / "h0"), interval_steps=10, replicas=0, budget_bytes=64 << 20
        ),
    )

    def state(s: int) -> dict[str, np.ndarray]:
        return {"w": np.full((256,), s, np.float32)}

    with CheckpointManager(str(tmp_path / "ck"), options=opts) as mgr:
        for s in (100, 110, 120):
            assert mgr.save(s, state(s))
            mgr.wait()
        data = next((shm_dir / "h0" / "step-120").glob("*.data"))
        with open(data, "r+b") as f:
            b = f.read(1)
            f.seek(0)
            f.write(bytes([b[0] ^ 0xFF]))
        restored = mgr.restore(target=state(0))
        stats = mgr.last_restore_stats
        assert stats.step == 100 and restored["w"][0] == 100
        for s in (110, 120):
            assert mgr.save(s, state(s + 1000))  # the re-trained values
            mgr.wait()
        again = mgr.restore(target=state(0))
        stats = mgr.last_restore_stats
        assert stats.step == 120 and again["w"][0] == 1120 and set(stats.bytes_by_tier) == {"ram"}
