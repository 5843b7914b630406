"""TieredChunkSource: own RAM first, then peers; every failure falls through to the next."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from fastckpt._checksum import crc32c
from fastckpt.errors import ConfigError
from fastckpt.replicas._client import PeerClient
from fastckpt.replicas._connection import PeerOptions
from fastckpt.replicas._ram import RamTier
from fastckpt.replicas._server import PeerServer
from fastckpt.replicas._sources import TieredChunkSource

from . import _proc
from .conftest import SECRET, fill, seal_chunks

MakeTier = Callable[..., RamTier]
MakeServer = Callable[..., PeerServer]
FAST = PeerOptions(connect_timeout_s=2, handshake_timeout_s=2, io_timeout_s=3)


def corrupt_one_byte(root: Path, step: int) -> None:
    (f,) = (root / f"step-{step}").glob("*.data")
    with f.open("r+b") as fh:
        fh.seek(7)
        b = fh.read(1)
        fh.seek(7)
        fh.write(bytes([b[0] ^ 1]))


def test_own_ram_then_peers_then_none(make_tier: MakeTier, make_server: MakeServer) -> None:
    data = fill(1, {"mine": 5000, "theirs": 7000, "both": 100})
    own = make_tier("own")
    seal_chunks(own, 1, {k: data[k] for k in ("mine", "both")})
    p1, p2 = make_tier("p1"), make_tier("p2")
    seal_chunks(p1, 1, {"both": data["both"]})
    seal_chunks(p2, 1, {"theirs": data["theirs"]})
    peers = [
        PeerClient(make_server(p).address, secret=SECRET, options=FAST, name=n)
        for p, n in ((p1, "p1"), (p2, "p2"))
    ]
    src = TieredChunkSource(own, peers)
    for cid, expect in (("mine", "ram"), ("both", "ram"), ("theirs", "peer:p2")):
        a = data[cid]
        into = np.zeros(a.nbytes, np.uint8)
        assert src.fetch_many(1, [(cid, a.nbytes, crc32c(a), into)])[0] == expect
        assert into.tobytes() == a.tobytes()
    assert src.fetch_many(1, [("nowhere", 10, 0, np.zeros(10, np.uint8))])[0] is None
    stats = src.stats()
    assert stats.tiers["ram"].chunks == 2 and stats.tiers["peer:p2"].bytes == 7000
    assert stats.not_found == 1
    assert stats.fallbacks == {"miss": 2}  # own RAM lacked "theirs" and "nowhere"
    # p1 never listed "theirs"/"nowhere": listing saved those round-trips
    with pytest.raises(ConfigError):
        src.fetch_many(1, [("mine", 4999, 0, np.zeros(5000, np.uint8))])


def test_corrupt_copies_fall_back(shm_dir: Path, make_server: MakeServer) -> None:
    a = fill(1, {"a": 1 << 16})["a"]
    for name in ("own", "p1", "p2"):
        with RamTier(shm_dir / name, budget_bytes=1 << 20) as t:
            seal_chunks(t, 2, {"a": a})
    for name in ("own", "p1"):  # bit flips in the shm files of own RAM and the first peer
        corrupt_one_byte(shm_dir / name, 2)
    own, p1, p2 = (RamTier(shm_dir / n, budget_bytes=1 << 20) for n in ("own", "p1", "p2"))
    try:
        peers = [
            PeerClient(make_server(p1).address, secret=SECRET, options=FAST, name="p1"),
            PeerClient(make_server(p2).address, secret=SECRET, options=FAST, name="p2"),
        ]
        src = TieredChunkSource(own, peers)
        into = np.zeros(a.nbytes, np.uint8)
        assert src.fetch_many(2, [("a", a.nbytes, crc32c(a), into)])[0] == "peer:p2"
        assert into.tobytes() == a.tobytes()
        stats = src.stats()
        assert stats.fallbacks == {"corrupt": 2}
        assert [(f.tier, f.reason) for f in stats.recent_fallbacks] == [
            ("ram", "corrupt"),
            ("peer:p1", "corrupt"),
        ]
        assert stats.dead_peers == []  # corruption does not make a peer dead
    finally:
        for t in (own, p1, p2):
            t.close()


def test_unreachable_peer_is_skipped_after_first_failure(
    make_tier: MakeTier, make_server: MakeServer
) -> None:
    a = fill(1, {"a": 1000})["a"]
    good = make_tier("good")
    seal_chunks(good, 1, {"a": a})
    dead = PeerClient(("127.0.0.1", 1), secret=SECRET, options=FAST, name="dead")
    src = TieredChunkSource(
        None,
        [dead, PeerClient(make_server(good).address, secret=SECRET, name="good")],
        use_listing=False,
    )
    for _ in range(3):
        assert (
            src.fetch_many(1, [("a", a.nbytes, crc32c(a), np.zeros(a.nbytes, np.uint8))])[0]
            == "peer:good"
        )
    stats = src.stats()
    assert stats.fallbacks == {"unavailable": 1} and stats.dead_peers == ["dead"]


def test_peer_sigkilled_mid_transfer_falls_back_to_next_peer(
    make_tier: MakeTier, make_server: MakeServer, shm_dir: Path
) -> None:
    nbytes = 64 << 20
    proc = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).with_name("_proc.py")),
            "serve",
            str(shm_dir / "victim"),
            str(nbytes),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        data = _proc.big_chunk(nbytes)
        backup = make_tier("backup", budget_bytes=2 * nbytes)
        seal_chunks(backup, 1, {"big": data})
        victim = PeerClient(("127.0.0.1", port), secret=SECRET, options=FAST, name="victim")
        src = TieredChunkSource(
            None, [victim, PeerClient(make_server(backup).address, secret=SECRET, name="backup")]
        )
        into = np.full(nbytes, 0xAA, np.uint8)
        result: list[str | None] = []
        fetcher = threading.Thread(
            target=lambda: result.append(
                src.fetch_many(1, [("big", nbytes, crc32c(data), into)])[0]
            )
        )
        fetcher.start()
        deadline = time.monotonic() + 30
        while into[0] == 0xAA and into[1] == 0xAA and into[2] == 0xAA:  # wait for the first bytes
            assert time.monotonic() < deadline
            time.sleep(0.0002)
        proc.send_signal(signal.SIGSTOP)  # freeze it mid-transfer, then kill it
        partial = int(np.count_nonzero(into[-4096:] != 0xAA))
        proc.send_signal(signal.SIGKILL)
        fetcher.join(timeout=30)
        assert result == ["peer:backup"]
        assert partial < 4096  # the victim had not finished when it died
        assert into.tobytes() == data.tobytes()
        stats = src.stats()
        assert stats.fallbacks == {"unavailable": 1} and stats.dead_peers == ["victim"]
    finally:
        proc.kill()
        proc.wait()


def test_fetch_many_streams_from_peers_and_falls_back(
    make_tier: MakeTier, make_server: MakeServer
) -> None:
    own, p1, p2 = make_tier("own"), make_tier("p1"), make_tier("p2")
    data = fill(1, {f"c{i}": 1000 + i for i in range(6)})
    seal_chunks(own, 1, {k: data[k] for k in ("c0",)})
    seal_chunks(p1, 1, {k: data[k] for k in ("c1", "c2", "c3")})
    seal_chunks(p2, 1, {k: data[k] for k in ("c3", "c4")})
    peers = [
        PeerClient(
            make_server(t).address, secret=SECRET, options=PeerOptions(io_timeout_s=2), name=n
        )
        for n, t in (("p1", p1), ("p2", p2))
    ]
    src = TieredChunkSource(own, peers)
    items = [(k, a.nbytes, crc32c(a), np.zeros(a.nbytes, np.uint8)) for k, a in data.items()]
    items[2] = (
        "c2",
        1002,
        crc32c(data["c2"]) ^ 1,
        items[2][3],
    )  # p1's copy "disagrees": nobody has a good one
    assert src.fetch_many(1, items) == ["ram", "peer:p1", None, "peer:p1", "peer:p2", None]
    for (k, _, _, into), tier in zip(items, ["ram", 1, None, 1, 2, None]):
        if tier is not None:
            assert into.tobytes() == data[k].tobytes()
    st = src.stats()
    assert st.tiers["peer:p1"].chunks == 2 and st.tiers["peer:p2"].chunks == 1 and st.not_found == 2
    assert st.fallbacks.get("corrupt") == 1
    for p in peers:
        p.close()


class _RangesFail:
    """A streaming peer whose whole-chunk reads work and whose ranged stream breaks."""

    name = "flaky"

    def __init__(self, data: dict[str, np.ndarray]) -> None:
        self.data = data

    def list_chunks(self, step: int) -> list[str]:
        return list(self.data)

    def get_chunks(self, step: int, items: list[tuple[str, np.ndarray, int]]) -> list[str]:
        for cid, into, _ in items:
            into[:] = self.data[cid]
        return ["ok"] * len(items)

    def get_ranges(self, step: int, items: object) -> list[str]:
        from fastckpt.errors import PeerUnavailableError

        raise PeerUnavailableError("connection reset mid-stream")


def test_a_broken_ranged_stream_keeps_the_whole_chunks_already_received() -> None:
    data = fill(1, {"whole": 3000, "part": 5000})
    src = TieredChunkSource(None, [_RangesFail(data)])  # type: ignore[list-item]
    intos = {k: np.zeros(a.nbytes, np.uint8) for k, a in data.items()}
    items = [(k, a.nbytes, crc32c(a), intos[k]) for k, a in data.items()]
    assert src.fetch_many(1, items, runs=[None, [(100, 50)]]) == ["peer:flaky", None]
    assert intos["whole"].tobytes() == data["whole"].tobytes()
    st = src.stats()
    assert (
        st.fallbacks == {"unavailable": 1}
        and st.dead_peers == ["flaky"]
        and st.tiers["peer:flaky"].chunks == 1
    )
    with pytest.raises(ConfigError):
        src.fetch_many(1, items, runs=[None])
