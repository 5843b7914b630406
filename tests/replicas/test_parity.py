"""Parity in one process over real servers and sockets: four members push their parity parts,
one is lost (server closed, tier deleted), its chunks are rebuilt bit-exact from the other
three; the restoring host receives only the lost bytes; corrupt parity or survivor data is
detected, never returned; two lost members of one group cannot be rebuilt."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fastckpt._checksum import crc32c
from fastckpt.errors import ChecksumMismatchError
from fastckpt.replicas._connection import PeerOptions
from fastckpt.replicas._parity import ParityPusher, ParityService, ParityStore
from fastckpt.replicas._parity_client import ParityClient
from fastckpt.replicas._parity_layout import ChunkPlace, parity_groups
from fastckpt.replicas._parity_rebuild import ParityRebuilder
from fastckpt.replicas._ram import RamTier
from fastckpt.replicas._server import PeerServer
from fastckpt.replicas._sources import TieredChunkSource

from .conftest import SECRET, fill, seal_chunks

FAST = PeerOptions(connect_timeout_s=2, handshake_timeout_s=2, io_timeout_s=5)
MEMBERS = ["m0", "m1", "m2", "m3"]
STEP = 7
# unequal streams (m3 writes nothing at all): parts of different sizes, zero padding
SIZES = {
    "m0": {"a0": 5000, "b0": 3001},
    "m1": {"a1": 70001},
    "m2": {"a2": 4099, "b2": 12345, "c2": 7},
    "m3": {},
}


class Job:
    """Four members with tiers, parity stores and servers; clients to each."""

    def __init__(self, root: Path, window: int = 4096) -> None:
        self.root = root
        self.tiers: dict[str, RamTier] = {}
        self.services: dict[str, ParityService] = {}
        self.servers: dict[str, PeerServer] = {}
        self.clients: dict[str, ParityClient] = {}
        self.places: dict[str, ChunkPlace] = {}
        self.data: dict[str, np.ndarray] = {}
        for m in MEMBERS:
            tier = self.tiers[m] = RamTier(root / m, budget_bytes=64 << 20, replicated=True)
            svc = self.services[m] = ParityService(
                ParityStore(tier, m),
                lambda me=m: {k: c for k, c in self.clients.items() if k != me},
            )
            self.servers[m] = PeerServer(tier, secret=SECRET, options=FAST, extension=svc).start()
            self.clients[m] = ParityClient(
                self.servers[m].address, secret=SECRET, options=FAST, name=m
            )
        (self.group,) = parity_groups(MEMBERS, 4)
        self.pusher = ParityPusher(window_bytes=window)
        for i, m in enumerate(MEMBERS):
            chunks = fill(STEP, SIZES[m], seed=i)
            self.data.update(chunks)
            index = seal_chunks(self.tiers[m], STEP, chunks) if chunks else {}
            for cid, loc in index.items():
                self.places[cid] = ChunkPlace(m, loc.offset, loc.length, loc.raw_crc32c)

    def push(self, m: str) -> None:
        ids = [c for c, p in self.places.items() if p.writer == m]
        length = max((self.places[c].offset + self.places[c].nbytes for c in ids), default=0)
        view = self.tiers[m].segment_of(STEP, ids[0]) if ids else memoryview(b"")
        assert view is not None
        others = {k: c for k, c in self.clients.items() if k != m}
        self.pusher.submit(STEP, stream=view[:length], group=self.group, me=m, targets=others)

    def lose(self, m: str) -> None:
        self.servers.pop(m).close()
        self.clients.pop(m).close()
        self.tiers.pop(m).close()
        shutil.rmtree(self.root / m)

    def rebuilder(self) -> ParityRebuilder:
        return ParityRebuilder(STEP, self.places, dict(self.clients), group_size=4)

    def close(self) -> None:
        self.pusher.close()
        for c in self.clients.values():
            c.close()
        for s in self.servers.values():
            s.close()
        for t in self.tiers.values():
            t.close()


@pytest.fixture
def job(shm_dir: Path) -> Iterator[Job]:
    j = Job(shm_dir)
    for m in MEMBERS:
        j.push(m)
    reports = j.pusher.wait(30)
    assert all(r.ok for r in reports), reports
    yield j
    j.close()


def _lost_chunks(job: Job, m: str) -> list[str]:
    return [c for c, p in job.places.items() if p.writer == m]


def _rebuilt(rb: ParityRebuilder, job: Job, cid: str) -> np.ndarray:
    a = job.data[cid]
    out = np.zeros(a.nbytes, np.uint8)
    assert rb.rebuild(cid, a.nbytes, crc32c(a), out)
    return out


def test_parity_is_sealed_complete_with_about_a_third_of_the_largest_share(job: Job) -> None:
    for m in MEMBERS:
        rec = job.services[m].store.record(STEP)
        assert rec is not None and rec.complete() and rec.holder == m
        own = sum(SIZES[m].values())
        held = job.tiers[m].nbytes()  # measured from the tier (no spares, no manifest here)
        biggest = max(sum(SIZES[x].values()) for x in MEMBERS if x != m)
        assert held - own == -(-biggest // 3)  # the parity: the longest part received


def test_lost_member_rebuilt_bit_exact_with_only_its_bytes_into_the_restorer(job: Job) -> None:
    job.lose("m2")
    rb = job.rebuilder()
    assert rb.covers(set(_lost_chunks(job, "m2")))
    for cid in _lost_chunks(job, "m2"):
        assert _rebuilt(rb, job, cid).tobytes() == job.data[cid].tobytes()
    lost_bytes = sum(SIZES["m2"].values())
    rebuilt = sum(s.stats["rebuilt_bytes"] for s in job.services.values())
    assert rebuilt == lost_bytes  # the restorer received exactly the lost share
    # the holders read the survivors' matching ranges (partial results combined there)
    assert sum(s.stats["stream_bytes"] for s in job.services.values()) <= 2 * lost_bytes
    rb.close()


def test_source_reports_rebuilt_tier_and_never_storage(job: Job) -> None:
    job.lose("m2")
    rb = job.rebuilder()

    src = TieredChunkSource(
        None, list(job.clients.values()), rebuild=lambda step: rb if step == STEP else None
    )
    items = [
        (c, job.data[c].nbytes, crc32c(job.data[c]), np.zeros(job.data[c].nbytes, np.uint8))
        for c in job.data
    ]
    tiers = src.fetch_many(STEP, items)
    for (cid, _, _, into), tier in zip(items, tiers):
        assert into.tobytes() == job.data[cid].tobytes()
        assert tier == (
            "rebuilt" if job.places[cid].writer == "m2" else f"peer:{job.places[cid].writer}"
        )
    assert src.stats().tiers["rebuilt"].bytes == sum(SIZES["m2"].values())
    assert src.stats().not_found == 0
    # ranged fetch of a rebuilt chunk: only the runs land in the destination
    a = job.data["b2"]
    into = np.full(a.nbytes, 0xAB, np.uint8)
    (tier,) = src.fetch_many(STEP, [("b2", a.nbytes, crc32c(a), into)], runs=[[(10, 100)]])
    assert tier == "rebuilt" and into[10:110].tobytes() == a[10:110].tobytes()
    assert (into[:10] == 0xAB).all() and (into[110:] == 0xAB).all()
    rb.close()


def _flip(root: Path, parity: bool, at: int) -> None:
    """Flip byte ``at`` of the member's parity (or own data) file."""
    for index in (root / f"step-{STEP}").glob("*.index.json"):
        doc = json.loads(index.read_text())
        if any(c[0].startswith("parity#") for c in doc["chunks"]) == parity:
            with (index.parent / doc["data"]).open("r+b") as f:
                f.seek(at)
                b = f.read(1)
                f.seek(at)
                f.write(bytes([b[0] ^ 0x40]))
            return
    raise AssertionError("no such file")


@pytest.mark.parametrize("what", ["parity", "survivor"])
def test_corrupt_parity_or_survivor_byte_is_detected_not_returned(job: Job, what: str) -> None:
    # m2's part 0 is held by m0 (m0's parity), rebuilt with m1's and m3's part 0 for m0
    _flip(job.root / ("m0" if what == "parity" else "m1"), what == "parity", 0)
    job.lose("m2")
    rb = job.rebuilder()
    a = job.data["a2"]  # at offset 0 of m2's stream
    with pytest.raises(ChecksumMismatchError):
        rb.rebuild("a2", a.nbytes, crc32c(a), np.zeros(a.nbytes, np.uint8))

    src = TieredChunkSource(
        None, list(job.clients.values()), rebuild=lambda step: rb if step == STEP else None
    )
    assert (
        src.fetch_many(STEP, [("a2", a.nbytes, crc32c(a), np.zeros(a.nbytes, np.uint8))])[0] is None
    )
    assert src.stats().fallbacks.get("corrupt") == 1
    rb.close()


def test_two_lost_in_a_group_are_not_rebuildable(job: Job) -> None:
    job.lose("m2")
    job.lose("m0")
    rb = job.rebuilder()
    assert not rb.covers({"a2"})
    a = job.data["a2"]
    assert not rb.rebuild("a2", a.nbytes, crc32c(a), np.zeros(a.nbytes, np.uint8))
    rb.close()


def test_incomplete_parity_is_never_sealed_nor_used(shm_dir: Path) -> None:
    j = Job(shm_dir)
    try:
        for m in ("m0", "m1", "m2"):  # m3 never pushes: only m3's own parity is complete
            j.push(m)
        j.pusher.wait(30)
        for m in ("m0", "m1", "m2"):
            assert j.services[m].store.record(STEP) is None
        assert j.services["m3"].store.record(STEP) is not None
        j.lose("m2")
        rb = j.rebuilder()
        assert not rb.covers({"a2"})
        rb.close()
    finally:
        j.close()


def test_a_repeated_push_changes_nothing(job: Job) -> None:
    job.push("m1")
    (report,) = job.pusher.wait(30)
    assert report.ok
    job.lose("m1")
    rb = job.rebuilder()
    assert _rebuilt(rb, job, "a1").tobytes() == job.data["a1"].tobytes()
    rb.close()


def test_parity_is_dropped_with_its_step(job: Job) -> None:
    tier = job.tiers["m0"]
    tier.drop_step(STEP)
    assert job.services["m0"].store.record(STEP) is None
    assert tier.nbytes() == 0


def test_store_applies_a_window_once_and_zeroes_a_recycled_file(shm_dir: Path) -> None:
    """A window pushed twice (a retried push) is XORed once; the parity's file, recycled from
    a dropped step's segment full of old bytes, starts from zeros."""
    tier = RamTier(shm_dir / "a", budget_bytes=64 << 20, replicated=True, recycle=True)
    try:
        old = fill(1, {"old": 2 << 20}, seed=9)
        seal_chunks(tier, 1, old)
        tier.drop_step(1)  # its 2 MiB file becomes a spare the parity reuses
        store = ParityStore(tier, "a")
        group = ("a", "b", "c")
        streams = fill(2, {"b": 4 << 20, "c": 4 << 20}, seed=3)  # S = 2 MiB, part 0 -> "a"
        half = 1 << 20
        applied = [
            store.add(2, group, m, 4 << 20, 2 << 20, 0, streams[m][:half]) for m in ("b", "b", "c")
        ]
        assert applied == [True, False, True]  # "b"'s first window twice: applied once
        assert store.add(2, group, "b", 4 << 20, 2 << 20, half, streams["b"][half : 2 * half])
        assert store.record(2) is None  # "c" still owes its second window
        assert store.add(2, group, "c", 4 << 20, 2 << 20, half, streams["c"][half : 2 * half])
        hit = store.parity(2)
        assert hit is not None and hit[0].complete()
        expect = streams["b"][: 2 << 20] ^ streams["c"][: 2 << 20]
        assert bytes(hit[1]) == expect.tobytes()
    finally:
        tier.close()


def test_open_parity_of_an_abandoned_step_starts_over(shm_dir: Path) -> None:
    """A step saved again (the job went back): the unfinished parity of its first timeline is
    discarded, so the new pushes build it from zeros."""
    tier = RamTier(shm_dir / "a", budget_bytes=64 << 20, replicated=True)
    try:
        store = ParityStore(tier, "a")
        group = ("a", "b", "c")
        first = fill(5, {"b": 1000}, seed=1)["b"]
        assert store.add(5, group, "b", 2000, 1000, 0, first)  # "c" never came
        store.discard_from(5)
        assert tier.nbytes() == 0  # its segment is freed
        new = fill(5, {"b": 2000, "c": 2000}, seed=2)
        assert store.add(5, group, "b", 2000, 1000, 0, new["b"][:1000])
        assert store.add(5, group, "c", 2000, 1000, 0, new["c"][:1000])
        hit = store.parity(5)
        assert hit is not None and bytes(hit[1]) == (new["b"][:1000] ^ new["c"][:1000]).tobytes()
    finally:
        tier.close()


def test_a_tampered_parity_window_is_dropped_unanswered_and_never_applied(
    shm_dir: Path,
) -> None:
    """A PUT_PARITY whose payload was altered on the way fails its tag: the server drops the
    connection without applying it; the parity built afterwards is exact."""
    from fastckpt.errors import PeerUnavailableError
    from fastckpt.replicas._wire import MsgType
    from tests.support.peer_relay import PeerRelay, RelayedFrame

    tier = RamTier(shm_dir / "a", budget_bytes=64 << 20, replicated=True)
    svc = ParityService(ParityStore(tier, "a"), dict)
    server = PeerServer(tier, secret=SECRET, options=FAST, extension=svc).start()
    group = ("a", "b", "c")
    data = fill(3, {"b": 3000, "c": 3000}, seed=4)

    def flip(f: RelayedFrame) -> list[bytes]:
        if f.type is not MsgType.PUT_PARITY:
            return [f.raw]
        payload = bytearray(f.payload)
        payload[len(payload) // 2] ^= 1
        return [f.replace(payload=bytes(payload)).raw]

    def push(client: ParityClient, m: str) -> bool:
        return client.put_parity(
            3,
            group=group,
            contributor=m,
            stream_len=3000,
            part_size=1500,
            offset=0,
            data=data[m][:1500].data,
        )

    try:
        with (
            PeerRelay(server.address, tamper=flip) as relay,
            ParityClient(relay.address, secret=SECRET, options=FAST) as evil,
        ):
            with pytest.raises(PeerUnavailableError):
                push(evil, "b")
        assert server.stats["frame_auth_failures"] == 1 and tier.nbytes() == 0
        with ParityClient(server.address, secret=SECRET, options=FAST) as client:
            assert push(client, "b") and push(client, "c")
        hit = svc.store.parity(3)
        assert hit is not None
        assert bytes(hit[1]) == (data["b"][:1500] ^ data["c"][:1500]).tobytes()
    finally:
        server.close()
        tier.close()


def test_a_survivor_without_its_own_data_makes_the_group_unrebuildable(job: Job) -> None:
    """m1 lists its parity but no longer its own chunks: m2's chunks cannot be rebuilt (they
    would need m1's part), so a restore never counts on them."""
    job.lose("m2")
    m1 = [c for c in job.clients["m1"].list_chunks(STEP) if c.startswith("parity#")]
    rb = ParityRebuilder(
        STEP, job.places, dict(job.clients), group_size=4, known={(STEP, "m1"): frozenset(m1)}
    )
    assert not rb.covers({"a2"})
    rb.close()
    rb = job.rebuilder()  # with m1's real listing it can
    assert rb.covers({"a2"})
    rb.close()


def test_rebuilds_take_turns_between_the_parity_holders(shm_dir: Path) -> None:
    """In stream order every request in flight would go to the holder of one part at a time."""
    sizes = {m: {f"{m}-{k}": 1000 for k in range(6)} for m in MEMBERS}
    old = dict(SIZES)
    SIZES.update(sizes)
    try:
        job = Job(shm_dir)
    finally:
        SIZES.clear()
        SIZES.update(old)
    try:
        for m in MEMBERS:
            job.push(m)
        assert all(r.ok for r in job.pusher.wait(30))
        job.lose("m3")
        rb = job.rebuilder()
        ids = [f"m3-{k}" for k in range(6)]  # parts of 2000 bytes: 2 chunks per holder
        holders = [rb.holder(ids[i]) for i in rb.order(ids)]
        assert holders == ["m0", "m1", "m2", "m0", "m1", "m2"]
        assert sorted(rb.order(ids)) == list(range(6))
        assert rb.holder("no-such-chunk") is None
        rb.close()
    finally:
        job.close()
