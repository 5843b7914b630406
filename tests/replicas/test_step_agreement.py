"""Step selection across processes (threads stand in for them): each process checks only the
chunks its restore needs, and all agree on the newest RAM step every one of them can restore,
in as few key-value rounds as the disagreement needs."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fastckpt.coordination.distributed import LocalCoordinator
from fastckpt.errors import BarrierTimeoutError, DistributedError, TreeStructureError
from fastckpt.format.chunk_table import table_from_entries
from fastckpt.format.codec import encode_manifest
from fastckpt.format.layout import ram_object_key
from fastckpt.format.manifest import ArrayLeaf, ChunkEntry, KeyPath, Manifest, chunk_id
from fastckpt.options import RamOptions
from fastckpt.replicas import RamReplication
from fastckpt.replicas._client import StepLists
from fastckpt.storage import MemoryStore
from tests.support.threaded_job import ThreadedJob

from .conftest import fill, seal_chunks

W: KeyPath = (("d", "w"),)
N = 4  # chunks of w: ids CID[0..3]
CID = [chunk_id(W, ((2 * i, 2 * i + 2),)) for i in range(N)]


def _manifest(step: int) -> bytes:
    chunks = tuple(
        ChunkEntry(((2 * i, 2 * i + 2),), f"ram/{step:012d}", 2 * i, 2, 2, "raw", 0, 0)
        for i in range(N)
    )
    leaf = ArrayLeaf(
        path=W,
        shape=(2 * N,),
        dtype="uint8",
        chunks=table_from_entries(chunks, shape=(2 * N,), itemsize=1),
    )
    return encode_manifest(
        Manifest(step=step, leaves=(leaf,), num_processes=3, metadata={"fastckpt_tier": "ram"})
    )


def _job(shm_dir: Path, held: dict[int, dict[int, list[int]]]) -> list[RamReplication]:
    """Three processes without a peer service (each reaches only its own tier); process
    ``p`` holds, of step ``s``, the chunks ``held[p][s]`` and the step's manifest."""
    coords = ThreadedJob.of(3)
    out = []
    for p, coord in enumerate(coords):
        rr = RamReplication(
            RamOptions(root=str(shm_dir / f"host{p}"), replicas=0, keep_steps=3),
            coordinator=coord,
            store=MemoryStore(),
            namespace="t",
            run=lambda c: None,
        )
        for step, ids in sorted(held[p].items()):
            seal_chunks(rr.tier, step, fill(step, {CID[i]: 2 for i in ids}))
            rr.tier.put_manifest(step, _manifest(step))
        out.append(rr)
    return out


def _select(
    job: list[RamReplication],
    wanted: Callable[[int], Iterable[str]] | None,
    persistent_latest: int | None = None,
) -> list[int | None]:
    def one(p: int) -> int | None:
        want = (
            None
            if wanted is None
            else (lambda m, p=p: dict.fromkeys(wanted(p), f"ram/{m.step:012d}"))
        )
        choice = job[p].select_step(persistent_latest, key="sel", timeout_s=10, wanted=want)
        assert choice is None or (
            choice.manifest is not None and choice.manifest.step == choice.step
        )
        return None if choice is None else choice.step

    try:
        with ThreadPoolExecutor(len(job)) as pool:
            return list(pool.map(one, range(len(job))))
    finally:
        for rr in job:
            rr.close()


def _rounds(job: list[RamReplication]) -> int:
    return sum(1 for k in job[0]._coord.keys() if k.startswith("sel/round") and k.endswith("/0"))  # type: ignore[attr-defined]


def test_each_process_needs_only_its_chunk_and_the_newest_step_all_can_restore_wins(
    shm_dir: Path,
) -> None:
    # Process p needs chunk p; process 1 lost its chunk of step 30 and of step 20.
    job = _job(
        shm_dir, {0: {10: [0], 20: [0], 30: [0]}, 1: {10: [1]}, 2: {10: [2], 20: [2], 30: [2]}}
    )
    assert _select(job, wanted=lambda p: [CID[p]]) == [10, 10, 10]
    # Round 0 names 30, 10, 30; round 1 has processes 0 and 2 check 10: all agree. Two rounds.
    assert _rounds(job) == 2


def test_a_chunk_nobody_needs_does_not_make_a_step_unrestorable(shm_dir: Path) -> None:
    """Chunk 3 of step 20 is in no tier; a restore that reads chunks 0-2 only (a subtree, or
    a mesh that needs them) still gets step 20; checking every chunk would fall back to 10."""
    held = {p: {10: [0, 1, 2, 3], 20: [0, 1, 2]} for p in range(3)}
    assert _select(_job(shm_dir / "a", held), wanted=lambda p: [CID[p]]) == [20, 20, 20]
    assert _select(_job(shm_dir / "b", held), wanted=None) == [10, 10, 10]


def test_one_round_when_all_agree_and_none_when_a_process_can_restore_nothing(
    shm_dir: Path,
) -> None:
    held = {p: {10: [p], 20: [p]} for p in range(3)}
    job = _job(shm_dir / "a", held)
    assert _select(job, wanted=lambda p: [CID[p]]) == [20, 20, 20] and _rounds(job) == 1
    held[2] = {10: [0], 20: [0]}  # process 2 holds no chunk it needs: storage's latest is used
    assert _select(_job(shm_dir / "b", held), wanted=lambda p: [CID[p]]) == [None, None, None]
    # Steps at or below storage's latest are not candidates.
    assert _select(
        _job(shm_dir / "c", {p: {10: [p], 20: [p]} for p in range(3)}),
        wanted=lambda p: [CID[p]],
        persistent_latest=20,
    ) == [None, None, None]


def test_a_process_that_never_takes_part_times_the_others_out(shm_dir: Path) -> None:
    job = _job(shm_dir, {p: {10: [p]} for p in range(3)})
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [
                pool.submit(job[p].select_step, None, key="sel", timeout_s=0.5) for p in (0, 1)
            ]
            for f in futures:
                with pytest.raises(BarrierTimeoutError):
                    f.result(timeout=30)
    finally:
        for rr in job:
            rr.close()


def test_a_process_whose_plan_fails_fails_every_process_at_once(shm_dir: Path) -> None:
    """Processes 0 and 2 hold the whole step (they accept it without planning); process 1's
    plan raises (its target does not match): it raises that, the others a DistributedError
    naming it, at once rather than after the barrier timeout."""
    job = _job(shm_dir, {0: {10: [0, 1, 2, 3]}, 1: {10: [1]}, 2: {10: [0, 1, 2, 3]}})

    def bad_target(m: Manifest) -> dict[str, str]:
        raise TreeStructureError("target has no leaf ['w']")

    def one(p: int) -> BaseException | None:
        try:
            job[p].select_step(None, key="sel", timeout_s=60, wanted=bad_target)
        except (TreeStructureError, DistributedError) as e:
            return e
        return None

    try:
        with ThreadPoolExecutor(3) as pool:
            t0 = time.monotonic()
            got = list(pool.map(one, range(3)))
            assert time.monotonic() - t0 < 30
    finally:
        for rr in job:
            rr.close()
    assert isinstance(got[1], TreeStructureError)
    for p in (0, 2):
        assert (
            isinstance(got[p], DistributedError)
            and "process 1" in str(got[p])
            and "no leaf" in str(got[p])
        )


class _ListingPeer:
    """A peer holding some chunk ids of step 10; counts the chunk lists asked of it."""

    def __init__(self, name: str, ids: list[str]) -> None:
        self.name, self.ids, self.asked = name, ids, 0

    def step_lists(self) -> StepLists:
        return StepLists(steps=[10], committed=[10], manifests=[])

    def list_chunks(self, step: int) -> list[str]:
        self.asked += 1
        return list(self.ids) if step == 10 else []


def test_a_host_asks_the_writer_of_what_it_needs_and_its_ring_successor_not_every_peer(
    shm_dir: Path,
) -> None:
    """Six members h0..h5 wrote step 10, one chunk each, and pushed it to their ring
    successor (k = 1). h0 restores with an empty tier and needs h3's chunk only: it asks its
    own successor h1, then h3 and h4 (the holders the manifest's writer keys point to), and
    never h2 or h5. The source it makes next takes those lists and asks no peer again."""
    members = [f"h{i}" for i in range(6)]
    chunks = tuple(
        ChunkEntry(((2 * i, 2 * i + 2),), ram_object_key(10, members[i]), 0, 2, 2, "raw", 0, 0)
        for i in range(6)
    )
    manifest = Manifest(
        step=10,
        leaves=(
            ArrayLeaf(
                path=W,
                shape=(12,),
                dtype="uint8",
                chunks=table_from_entries(chunks, shape=(12,), itemsize=1),
            ),
        ),
        num_processes=6,
        metadata={"fastckpt_tier": "ram"},
    )
    ids = [chunk_id(W, c.box) for c in chunks]
    peers = {
        m: _ListingPeer(m, [ids[i], ids[i - 1]]) for i, m in enumerate(members) if i
    }  # own + predecessor's
    rr = RamReplication(
        RamOptions(root=str(shm_dir / "h0"), member_id="h0", replicas=1),
        coordinator=LocalCoordinator(),
        store=MemoryStore(),
        namespace="t",
        run=lambda c: None,
    )
    try:
        rr._peers = lambda: peers  # type: ignore[assignment]
        rr.tier.put_manifest(10, encode_manifest(manifest))
        choice = rr.select_step(
            None, key="sel", timeout_s=10, wanted=lambda m: {ids[3]: ram_object_key(10, "h3")}
        )
        assert choice is not None and choice.step == 10
        assert {m: p.asked for m, p in peers.items()} == {
            "h1": 1,
            "h2": 0,
            "h3": 1,
            "h4": 1,
            "h5": 0,
        }
        source = rr.source()
        assert source._listed(
            source._peers.index(peers["h3"]), 10, ids[3]
        )  # the kept list: no new request
        assert [p.name for p in source._peers][:3] == ["h1", "h3", "h4"] and peers["h3"].asked == 1
    finally:
        rr.close()
