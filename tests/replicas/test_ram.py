"""RamTier: sealing and visibility, reopen after a crash, retention, budget, recycling."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from fastckpt._checksum import crc32c
from fastckpt.errors import ChecksumMismatchError, ConfigError, RamBudgetError, StaleStepError
from fastckpt.replicas._ram import ChunkLocation, RamTier

from .conftest import fill, seal_chunks, verified_chunk

MakeTier = Callable[..., RamTier]
ODD_IDS = ["params['dense']['kernel']@0:4,0:8", "opt.mu[0]@4:8,0:8", "ünïcødé/../x@0:1"]


def test_seal_makes_chunks_visible_bit_exact(make_tier: MakeTier) -> None:
    tier = make_tier()
    data = fill(3, {cid: 1000 + i for i, cid in enumerate(ODD_IDS)})
    seg = tier.allocate(3, sum(a.nbytes for a in data.values()))
    assert tier.steps() == [] and tier.chunk_ids(3) == []  # allocated, not sealed: invisible
    off, index = 0, {}
    for cid, a in data.items():
        seg.buffer[off : off + a.nbytes] = a
        index[cid] = ChunkLocation(off, a.nbytes, crc32c(a))
        off += a.nbytes
    assert tier.get_chunk(3, ODD_IDS[0]) is None
    tier.seal(3, seg, index)
    assert tier.steps() == [3]
    assert tier.chunk_ids(3) == sorted(ODD_IDS)
    for cid, a in data.items():
        view = verified_chunk(tier, 3, cid)
        assert view is not None and view.readonly
        assert bytes(view) == a.tobytes()
        hit = tier.read_chunk(3, cid)
        assert hit is not None and (hit[1].length, hit[1].raw_crc32c) == (a.nbytes, crc32c(a))
    assert tier.read_chunk(3, "missing") is None and tier.read_chunk(4, cid) is None
    with pytest.raises(ConfigError):
        _ = seg.buffer  # a sealed segment is no longer writable through the tier's handle


def test_seal_rejects_bad_index(make_tier: MakeTier) -> None:
    tier = make_tier()
    seg = tier.allocate(1, 100)
    with pytest.raises(ConfigError):
        tier.seal(1, seg, {"a": ChunkLocation(50, 51, 0)})
    with pytest.raises(ConfigError):
        tier.seal(2, seg, {})
    tier.discard(seg)
    assert tier.steps() == [] and tier.nbytes() == 0


def test_segment_context_discards_on_error(make_tier: MakeTier, shm_dir: Path) -> None:
    tier = make_tier()
    with pytest.raises(RuntimeError), tier.allocate(1, 1 << 20):
        raise RuntimeError("save failed")
    assert tier.nbytes() == 0
    assert list((shm_dir / "t0" / "tmp").iterdir()) == []


def test_reopen_sees_sealed_steps_and_manifest(make_tier: MakeTier, shm_dir: Path) -> None:
    tier = make_tier()
    data = fill(5, {"a": 3000, "b": 0, "c": 17})
    seal_chunks(tier, 5, data)
    tier.put_manifest(5, b'{"step": 5}')
    tier.close()
    again = RamTier(shm_dir / "t0", budget_bytes=1 << 20)
    try:
        assert again.steps() == [5] and again.committed_steps() == [5]
        assert again.get_manifest(5) == b'{"step": 5}'
        for cid, a in data.items():
            assert bytes(verified_chunk(again, 5, cid)) == a.tobytes()  # type: ignore[arg-type]
    finally:
        again.close()


def test_second_live_owner_is_refused(make_tier: MakeTier, shm_dir: Path) -> None:
    make_tier()
    with pytest.raises(ConfigError, match="in use"):
        RamTier(shm_dir / "t0", budget_bytes=1 << 20)


def test_sigkilled_writer_leaves_only_sealed_data(shm_dir: Path) -> None:
    """A process killed after sealing step 1 and while staging step 2: only step 1 survives."""
    root = shm_dir / "crash"
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("_proc.py")), "write", str(root)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert len(list((root / "tmp").iterdir())) == 1  # the unsealed step-2 segment
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with RamTier(root, budget_bytes=64 << 20) as tier:  # the flock died with the process
        assert tier.steps() == [1]
        assert bytes(verified_chunk(tier, 1, "a")) == b"\x07" * 1000  # type: ignore[arg-type]
        assert list((root / "tmp").iterdir()) == []  # the crashed temp file is cleaned
        assert tier.nbytes() == 1000


def test_open_cleans_debris_of_a_crash_between_rename_and_index(
    make_tier: MakeTier, shm_dir: Path
) -> None:
    tier = make_tier()
    seal_chunks(tier, 1, fill(1, {"a": 10}))
    tier.close()
    step_dir = shm_dir / "t0" / "step-1"
    (step_dir / "deadbeef.data").write_bytes(b"x" * 50)  # renamed, index never written
    (step_dir / ".x.index.json.1234.tmp").write_bytes(b"{")  # half-written index temp
    (step_dir / "bad.index.json").write_text(
        '{"version": 1, "data": "missing.data", "nbytes": 5, "chunks": []}'
    )
    (shm_dir / "t0" / "step-9").mkdir()  # empty step dir
    with RamTier(shm_dir / "t0", budget_bytes=1 << 20) as again:
        assert again.steps() == [1] and again.chunk_ids(1) == ["a"]
        assert sorted(p.suffix for p in step_dir.iterdir()) == [".data", ".json"]
        assert not (shm_dir / "t0" / "step-9").exists()


def test_retention_keeps_newest_committed_steps_and_newer(make_tier: MakeTier) -> None:
    tier = make_tier(keep_steps=2)
    for step in (1, 2, 3):
        seal_chunks(tier, step, fill(step, {"a": 100}))
        tier.put_manifest(step, b"m")
    assert tier.steps() == [2, 3]
    seal_chunks(tier, 4, fill(4, {"a": 100}))  # in progress: nothing dropped yet
    assert tier.steps() == [2, 3, 4]
    tier.put_manifest(4, b"m")
    assert tier.steps() == [3, 4]
    with pytest.raises(StaleStepError):
        tier.allocate(2, 10)
    with pytest.raises(StaleStepError):
        seal_chunks(tier, 1, {"late": np.ones(1, np.uint8)})
    tier.drop_step(3)
    assert tier.steps() == [4] and tier.get_chunk(3, "a") is None


def test_replicated_tier_holds_the_previous_step_across_commits_and_reopen(
    make_tier: MakeTier, shm_dir: Path
) -> None:
    """Host loss between the commit of step N and the end of the lost host's push of N must
    leave step N-1 complete on the survivors (own chunks + the replica of N-1 pushed earlier):
    a replicated tier keeps keep_steps + 1 committed steps, also after reopening."""
    tier = make_tier(keep_steps=1, replicated=True)
    seal_chunks(tier, 2, fill(2, {"own": 100}))
    seal_chunks(tier, 2, {"peer": np.frombuffer(b"p2", np.uint8)})
    tier.put_manifest(2, b"m2")
    seal_chunks(tier, 4, fill(4, {"own": 100}))
    tier.put_manifest(4, b"m4")  # committed; the peer's replica of 4 may never come
    assert tier.steps() == [2, 4] and tier.get_chunk(2, "peer") == b"p2"
    seal_chunks(tier, 4, {"peer": np.frombuffer(b"p4", np.uint8)})
    tier.put_manifest(4, b"m4")  # the peer's push of 4 is complete: still both held
    assert tier.steps() == [2, 4]
    seal_chunks(tier, 6, fill(6, {"own": 100}))
    assert tier.steps() == [2, 4, 6]  # sealed, not committed: nothing goes yet
    tier.put_manifest(6, b"m6")
    assert tier.steps() == [4, 6] and tier.get_chunk(4, "peer") == b"p4"
    with pytest.raises(StaleStepError):
        seal_chunks(tier, 2, {"late": np.ones(1, np.uint8)})
    tier.close()
    with RamTier(shm_dir / "t0", budget_bytes=1 << 20, keep_steps=1, replicated=True) as again:
        assert again.steps() == [4, 6]
    # Without replication a committed step is complete here alone: only keep_steps are held.
    with RamTier(shm_dir / "t0", budget_bytes=1 << 20, keep_steps=1) as alone:
        assert alone.steps() == [6]


def test_budget_is_enforced_and_older_steps_make_room(make_tier: MakeTier) -> None:
    mib = 1 << 20
    tier = make_tier(budget_bytes=10 * mib, keep_steps=3, recycle=False)
    with pytest.raises(RamBudgetError):
        tier.allocate(1, 11 * mib)
    seal_chunks(tier, 1, fill(1, {"a": 4 * mib}))
    seal_chunks(tier, 2, fill(2, {"a": 4 * mib}))
    assert tier.nbytes() == 8 * mib
    seal_chunks(tier, 3, fill(3, {"a": 4 * mib}))  # evicts step 1 (oldest) to fit
    assert tier.steps() == [2, 3] and tier.nbytes() <= 10 * mib
    seg = tier.allocate(4, 6 * mib)  # step 2 goes, step 3 still fits
    assert tier.steps() == [3] and tier.nbytes() == 10 * mib
    tier.discard(seg)
    seg = tier.allocate(4, 7 * mib)  # needs step 3 gone too
    assert tier.steps() == [] and tier.nbytes() == 7 * mib
    with pytest.raises(RamBudgetError):  # steps >= 4 and unsealed data are never evicted
        tier.allocate(4, 4 * mib)
    tier.discard(seg)
    assert tier.nbytes() == 0


def test_superseded_segments_are_recycled(make_tier: MakeTier, shm_dir: Path) -> None:
    mib = 1 << 20
    tier = make_tier(budget_bytes=20 * mib)
    seal_chunks(tier, 1, fill(1, {"a": 4 * mib}))
    tier.put_manifest(1, b"m")
    seal_chunks(tier, 2, fill(2, {"a": 4 * mib}))
    tier.put_manifest(2, b"m")  # step 1 superseded: its file becomes a spare
    spare_dir = shm_dir / "t0" / "spare"
    assert len(list(spare_dir.iterdir())) == 1
    assert tier.nbytes() == 8 * mib + 1  # step 2 (data + manifest) and the spare
    data = fill(3, {"a": 4 * mib - 5})
    seal_chunks(tier, 3, data)  # reuses (and shrinks) the spare
    assert list(spare_dir.iterdir()) == []
    assert bytes(verified_chunk(tier, 3, "a")) == data["a"].tobytes()  # type: ignore[arg-type]


def test_views_survive_drop(make_tier: MakeTier) -> None:
    tier = make_tier()
    data = fill(1, {"a": 2 << 20})
    seal_chunks(tier, 1, data)
    view = tier.get_chunk(1, "a")
    tier.drop_step(1)
    assert tier.get_chunk(1, "a") is None
    assert view is not None and bytes(view) == data["a"].tobytes()
    seal_chunks(tier, 2, fill(2, {"a": 2 << 20}))  # must not reuse memory still viewed
    assert bytes(view) == data["a"].tobytes()


def test_corrupted_ram_chunk_is_detected(make_tier: MakeTier, shm_dir: Path) -> None:
    tier = make_tier()
    seal_chunks(tier, 1, fill(1, {"a": 4096}))
    tier.close()
    (data_file,) = (shm_dir / "t0" / "step-1").glob("*.data")
    with data_file.open("r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x10]))
    with RamTier(shm_dir / "t0", budget_bytes=1 << 20) as again:
        assert again.get_chunk(1, "a") is not None  # unverified reads are the caller's call
        with pytest.raises(ChecksumMismatchError):
            verified_chunk(again, 1, "a")


def test_bad_arguments(make_tier: MakeTier, shm_dir: Path) -> None:
    with pytest.raises(ConfigError):
        RamTier(shm_dir / "x", budget_bytes=0)
    tier = make_tier()
    with pytest.raises(ConfigError):
        tier.allocate(-1, 10)
    tier.close()
    with pytest.raises(ConfigError):
        tier.allocate(1, 10)


def test_concurrent_reads_while_steps_are_replaced(make_tier: MakeTier) -> None:
    import threading

    tier = make_tier(budget_bytes=64 << 20)
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader() -> None:
        try:
            while not stop.is_set():
                for step in tier.steps():
                    view = tier.get_chunk(step, "a")
                    if view is not None:
                        assert bytes(view[:1]) == bytes([step % 256])  # never another step's bytes
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for step in range(1, 40):
        with tier.allocate(step, 2 << 20) as seg:
            seg.buffer[:] = step % 256
            tier.seal(step, seg, {"a": ChunkLocation(0, 2 << 20, crc32c(seg.buffer))})
        tier.put_manifest(step, b"m")
    stop.set()
    for t in threads:
        t.join()
    assert not errors and tier.steps() == [39]


def test_full_tmpfs_fails_cleanly(
    make_tier: MakeTier, shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import os

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    tier = make_tier()
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(RamBudgetError, match="tmpfs full"):
        tier.allocate(1, 1 << 20)  # fails here, not with SIGBUS during the copy
    monkeypatch.undo()
    assert tier.nbytes() == 0 and list((shm_dir / "t0" / "tmp").iterdir()) == []
    seal_chunks(tier, 1, fill(1, {"a": 10}))
    assert tier.steps() == [1]


def test_same_size_spare_reuses_its_mapping_unless_viewed(make_tier: MakeTier) -> None:
    mib = 1 << 20
    tier = make_tier(budget_bytes=64 * mib)
    seg = tier.allocate(1, 4 * mib)
    addr = seg.buffer.ctypes.data
    seg.buffer[:] = 1
    tier.seal(1, seg, {"a": ChunkLocation(0, 4 * mib, crc32c(seg.buffer))})
    tier.put_manifest(1, b"m")
    seal_chunks(tier, 2, fill(2, {"a": 4 * mib}))
    tier.put_manifest(2, b"m")  # step 1 dropped: its file and mapping become a spare
    again = tier.allocate(3, 4 * mib)
    assert again.buffer.ctypes.data == addr  # the same mapping, page tables and all
    data = fill(3, {"a": 4 * mib})["a"]
    again.buffer[:] = data
    tier.seal(3, again, {"a": ChunkLocation(0, 4 * mib, crc32c(data))})
    tier.put_manifest(3, b"m")
    view = tier.get_chunk(3, "a")
    seal_chunks(tier, 4, fill(4, {"a": 4 * mib}))
    tier.put_manifest(4, b"m")  # step 3 dropped while viewed: its memory must not be reused
    for step in (5, 6):
        seal_chunks(tier, step, fill(step, {"a": 4 * mib}))
        tier.put_manifest(step, b"m")
    assert view is not None and bytes(view) == data.tobytes()


def test_a_commit_record_commits_without_a_manifest(make_tier: MakeTier, shm_dir: Path) -> None:
    """``mark_committed`` (a multi-host RAM step whose manifest other hosts hold) counts as
    committed for listing and retention, across a reopen; a manifest arriving later (the
    push of the host that holds it) replaces the record; dropping removes both."""
    tier = make_tier(keep_steps=1)
    for step in (1, 2):
        seal_chunks(tier, step, fill(step, {"a": 100}))
        tier.mark_committed(step)
    tier.mark_committed(2)  # idempotent
    assert tier.steps() == [2] and tier.committed_steps() == [2] and tier.get_manifest(2) is None
    d = shm_dir / "t0" / "step-2"
    assert sorted(p.name for p in d.iterdir() if not p.name.endswith((".data", ".index.json"))) == [
        "commit.json"
    ]
    with pytest.raises(StaleStepError):
        tier.mark_committed(1)
    seal_chunks(tier, 3, fill(3, {"a": 100}))
    tier.put_manifest(3, b'{"step": 3}')  # the manifest came with the push
    tier.mark_committed(3)  # the record after it changes nothing
    assert (d.parent / "step-3" / "manifest.json").exists() and not (
        d.parent / "step-3" / "commit.json"
    ).exists()
    assert tier.committed_steps() == [3] and not d.exists()
    seal_chunks(tier, 4, fill(4, {"a": 100}))
    tier.mark_committed(4)
    tier.put_manifest(4, b'{"step": 4}')
    assert (
        not (d.parent / "step-4" / "commit.json").exists()
        and tier.get_manifest(4) == b'{"step": 4}'
    )
    seal_chunks(tier, 5, fill(5, {"a": 100}))
    tier.mark_committed(5)
    tier.close()
    again = RamTier(shm_dir / "t0", budget_bytes=1 << 20, keep_steps=1)
    try:
        assert again.committed_steps() == [5] and again.get_manifest(5) is None
        assert bytes(verified_chunk(again, 5, "a")) == fill(5, {"a": 100})["a"].tobytes()  # type: ignore[arg-type]
        again.drop_step(5)
        assert not (shm_dir / "t0" / "step-5").exists() and again.committed_steps() == []
    finally:
        again.close()


def test_provision_creates_a_spare_that_the_next_allocation_takes_as_is(
    make_tier: MakeTier, shm_dir: Path
) -> None:
    """A provisioned spare is reserved and mapped; an allocation of its size renames it into
    place with its mapping (no new file); no second spare is made while one fits."""
    mib = 1 << 20
    tier = make_tier(budget_bytes=16 * mib)
    spare_dir = shm_dir / "t0" / "spare"
    assert tier.provision(4 * mib) is True
    (spare,) = spare_dir.iterdir()
    assert spare.stat().st_size == 4 * mib and tier.nbytes() == 4 * mib
    inode = spare.stat().st_ino
    assert tier.provision(4 * mib) is False  # one that fits exists
    seg = tier.allocate(1, 4 * mib)
    assert list(spare_dir.iterdir()) == []
    data = fill(1, {"a": 4 * mib})["a"]
    seg.buffer[:] = data
    tier.seal(1, seg, {"a": ChunkLocation(0, 4 * mib, crc32c(data))})
    tier.put_manifest(1, b"m")
    (sealed,) = (shm_dir / "t0" / "step-1").glob("*.data")
    assert sealed.stat().st_ino == inode
    view = tier.get_chunk(1, "a")
    assert view is not None and bytes(view) == data.tobytes()


def test_provision_stays_inside_the_budget_and_frees_nothing(
    make_tier: MakeTier, shm_dir: Path
) -> None:
    mib = 1 << 20
    tier = make_tier(budget_bytes=10 * mib)
    seal_chunks(tier, 1, fill(1, {"a": 4 * mib}))
    tier.put_manifest(1, b"m")
    assert tier.provision(8 * mib) is False  # would need step 1's room: not taken
    assert tier.steps() == [1] and list((shm_dir / "t0" / "spare").iterdir()) == []
    assert tier.provision(1 << 10) is False  # below the recycling size: not worth a file
    assert make_tier("t1", recycle=False).provision(4 * mib) is False
    assert tier.provision(4 * mib) is True
    seal_chunks(tier, 2, fill(2, {"a": 5 * mib}))  # needs room: the spare goes first, step 1 stays
    assert tier.steps() == [1, 2] and tier.nbytes() <= 10 * mib


def test_an_unreserved_segment_gets_its_pages_only_when_reserved(
    make_tier: MakeTier, shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``allocate(reserve=False)`` (a save whose copies run in the background) creates the file
    with no pages; ``reserve`` allocates them (a full tmpfs fails there, cleanly); sealing an
    unreserved segment is refused."""
    import errno
    import os

    mib = 1 << 20
    tier = make_tier(budget_bytes=64 * mib)
    seg = tier.allocate(1, 4 * mib, reserve=False)
    (path,) = (shm_dir / "t0" / "tmp").iterdir()
    assert (
        path.stat().st_blocks == 0 and tier.nbytes() == 4 * mib
    )  # charged to the budget all the same
    with pytest.raises(ConfigError, match="reserve"):
        tier.seal(1, seg, {})

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(RamBudgetError, match="tmpfs full"):
        seg.reserve()
    monkeypatch.undo()
    assert not seg.reserved
    seg.reserve()
    assert seg.reserved and path.stat().st_blocks * 512 >= 4 * mib
    data = fill(1, {"a": 4 * mib})["a"]
    seg.buffer[:] = data
    tier.seal(1, seg, {"a": ChunkLocation(0, 4 * mib, crc32c(data))})
    view = verified_chunk(tier, 1, "a")
    assert view is not None and bytes(view) == data.tobytes()


def test_provision_never_leaves_its_spare_uncounted(make_tier: MakeTier, shm_dir: Path) -> None:
    """An allocation on another thread (a peer's push) that runs at any moment of
    ``provision`` after the spare file exists must see it counted (in the pool, freeable): the
    bytes held never exceed the budget."""
    import threading

    mib = 1 << 20
    tier = make_tier(budget_bytes=3 * mib)
    seal_chunks(tier, 5, fill(5, {"a": mib}))
    tier.put_manifest(5, b"m")
    real, others = tier._lock, []

    # the tier's lock; after a release, once the spare file exists: another thread allocates
    class Hook:
        fired = False

        def __enter__(self) -> object:
            return real.__enter__()

        def __exit__(self, *exc: object) -> None:
            real.__exit__(*exc)
            if not Hook.fired and any((shm_dir / "t0" / "spare").iterdir()):
                Hook.fired = True
                t = threading.Thread(target=lambda: others.append(tier.allocate(7, int(1.9 * mib))))
                t.start()
                t.join()

    tier._lock = Hook()  # type: ignore[assignment]
    try:
        tier.provision(mib)
    finally:
        tier._lock = real
    assert Hook.fired and others  # the spare was freed for it
    held = sum(p.stat().st_blocks * 512 for p in (shm_dir / "t0").rglob("*.data"))
    assert tier.nbytes() <= 3 * mib and held <= 3 * mib
    tier.discard(others[0])


def test_a_failed_seal_leaves_nothing_behind(
    make_tier: MakeTier, shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The index write fails (e.g. a full tmpfs): the data file goes back, the segment stays
    open for ``discard``, and after it the budget and the folder are as before."""
    from fastckpt.replicas import _ram as ram

    mib = 1 << 20
    tier = make_tier(budget_bytes=8 * mib)
    seg = tier.allocate(3, 4 * mib)
    data = fill(3, {"a": 4 * mib})["a"]
    seg.buffer[:] = data

    def full(path: Path, data: bytes) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ram, "atomic_write", full)
    with pytest.raises(OSError):
        tier.seal(3, seg, {"a": ChunkLocation(0, 4 * mib, crc32c(data))})
    monkeypatch.undo()
    assert seg.state == "open" and tier.steps() == []
    tier.discard(seg)
    assert tier.nbytes() == 0 and not list((shm_dir / "t0").rglob("*.data"))
    seal_chunks(tier, 4, fill(4, {"b": 7 * mib}))  # the whole budget is there again


def test_a_reopened_tier_serves_the_copy_sealed_last(make_tier: MakeTier, shm_dir: Path) -> None:
    """A chunk sealed again in the same step (a peer's re-push with other bytes) replaces the
    first copy; after a restart (the tier reopened over the same folder) the later copy still
    wins, whatever order the folder lists the indexes in."""
    tier = make_tier()
    first = fill(1, {"a": 4096}, seed=1)["a"]
    seal_chunks(tier, 1, {"a": first})
    second = fill(1, {"a": 4096}, seed=2)["a"]
    seal_chunks(tier, 1, {"a": second})
    tier.close()
    for _ in range(5):
        again = RamTier(shm_dir / "t0", budget_bytes=64 << 20)
        view = verified_chunk(again, 1, "a")
        assert view is not None and bytes(view) == second.tobytes()
        again.close()


def test_provision_maps_a_spare_left_by_an_earlier_tier_and_resizes_a_close_one(
    make_tier: MakeTier, shm_dir: Path
) -> None:
    """A tier reopened over a directory finds the spare files an earlier owner left, unmapped:
    an allocation takes one over but is not ready (it maps and faults it in); ``provision``
    maps and pre-faults it first, so the allocation is ready (same file). A spare of another
    size within 2x is resized to the size asked for."""
    mib = 1 << 20
    inodes = {}
    for name in ("t0", "t1"):
        tier = make_tier(name, budget_bytes=32 * mib)
        assert tier.provision(4 * mib) is True
        (spare,) = (shm_dir / name / "spare").iterdir()
        inodes[name] = spare.stat().st_ino
        tier.close()
    plain = RamTier(shm_dir / "t1", budget_bytes=32 * mib, keep_steps=1)
    try:
        plain.discard(plain.allocate(1, 4 * mib))
        assert plain.allocated_ready == 0
    finally:
        plain.close()
    again = RamTier(shm_dir / "t0", budget_bytes=32 * mib, keep_steps=1)
    try:
        assert again.provision(4 * mib) is True and again.provision(4 * mib) is False
        seg = again.allocate(1, 4 * mib)
        assert again.allocated_ready == 1
        data = fill(1, {"a": 4 * mib})["a"]
        seg.buffer[:] = data
        again.seal(1, seg, {"a": ChunkLocation(0, 4 * mib, crc32c(data))})
        (sealed,) = (shm_dir / "t0" / "step-1").glob("*.data")
        assert sealed.stat().st_ino == inodes["t0"]
        assert again.provision(3 * mib) is True  # no spare: a new one
        assert again.provision(5 * mib) is True  # that one, grown
        (grown,) = (shm_dir / "t0" / "spare").iterdir()
        assert grown.stat().st_size == 5 * mib
        again.discard(again.allocate(2, 5 * mib))
        assert again.allocated_ready == 2
        view = verified_chunk(again, 1, "a")
        assert view is not None and bytes(view) == data.tobytes()
    finally:
        again.close()
