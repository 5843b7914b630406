"""Fixtures for the replicas tests: tiers under a unique /dev/shm directory, running servers."""

from __future__ import annotations

import shutil
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from fastckpt._checksum import crc32c
from fastckpt.errors import ChecksumMismatchError
from fastckpt.replicas import _wire as wire
from fastckpt.replicas import _wire_auth as wire_auth
from fastckpt.replicas._channel import Channel
from fastckpt.replicas._connection import PeerOptions
from fastckpt.replicas._ram import ChunkLocation, RamTier
from fastckpt.replicas._server import PeerServer
from fastckpt.replicas._wire import MsgType

SECRET = b"test-secret-0123456789abcdef"


def raw_handshake(
    addr: tuple[str, int],
    secret: bytes = SECRET,
    nonce: bytes | None = None,
    *,
    frame_mac: bool = True,
) -> tuple[Channel, MsgType, dict, bytes]:  # type: ignore[type-arg]
    """Handshake by hand, sending AUTH whatever the server proved (a client with ``secret``):
    returns (a channel with the keys ``secret`` derives, reply type, reply header, server
    nonce). Send raw bytes with ``chan.sock``, tagged frames with ``chan.encode`` or
    ``tests.support.tag_raw``."""
    s = socket.create_connection(addr, timeout=5)
    plain = Channel(s, limits=wire.AUTH_LIMITS)
    cn = nonce or wire_auth.new_nonce()
    plain.send(MsgType.HELLO, {"nonce": cn.hex(), "frame_mac": frame_mac})
    _, h, _ = plain.recv_head()
    sn = bytes.fromhex(h["nonce"])
    keys = wire_auth.session_keys(secret, client_nonce=cn, server_nonce=sn, frame_mac=frame_mac)
    plain.send(MsgType.AUTH, {"mac": keys.client_proof.hex()})
    t, h, _ = plain.recv_head()
    chan = Channel(
        s,
        limits=wire.WireLimits(),
        role="client",
        send_key=keys.client_key if frame_mac else None,
        recv_key=keys.server_key if frame_mac else None,
    )
    return chan, t, h, sn


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A fresh directory on tmpfs (``/dev/shm``), removed after the test."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    d = base / f"fastckpt-test-{uuid.uuid4().hex[:12]}"
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


def sent_bytes(server: PeerServer, expected: int, timeout_s: float = 10.0) -> int:
    """``server.stats["bytes_sent"]`` once it reaches ``expected`` (or at ``timeout_s``): the
    server counts a reply after its last byte is handed to the socket, which can be after the
    client has read it all."""
    deadline = time.monotonic() + timeout_s
    while server.stats["bytes_sent"] < expected and time.monotonic() < deadline:
        time.sleep(0.005)
    return int(server.stats["bytes_sent"])


def fill(step: int, sizes: dict[str, int], seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic random chunk contents."""
    rng = np.random.default_rng([seed, step])
    return {cid: np.frombuffer(rng.bytes(n), np.uint8).copy() for cid, n in sizes.items()}


def seal_chunks(
    tier: RamTier, step: int, chunks: dict[str, np.ndarray]
) -> dict[str, ChunkLocation]:
    """Stage ``chunks`` into one segment of ``tier`` and seal it; returns the index."""
    total = sum(a.nbytes for a in chunks.values())
    seg = tier.allocate(step, total)
    index, off = {}, 0
    for cid, a in chunks.items():
        seg.buffer[off : off + a.nbytes] = a
        index[cid] = ChunkLocation(off, a.nbytes, crc32c(a))
        off += a.nbytes
    tier.seal(step, seg, index)
    return index


def verified_chunk(tier: RamTier, step: int, chunk_id: str) -> memoryview | None:
    """``tier``'s view of a chunk, checked against its stored crc32c (ChecksumMismatchError)."""
    hit = tier.read_chunk(step, chunk_id)
    if hit is not None and crc32c(hit[0]) != hit[1].raw_crc32c:
        raise ChecksumMismatchError(f"RAM copy of chunk {chunk_id!r} of step {step} is corrupt")
    return None if hit is None else hit[0]


@pytest.fixture
def make_tier(shm_dir: Path) -> Iterator[Callable[..., RamTier]]:
    """``make_tier(name, budget_bytes=..., keep_steps=...)``: tiers closed after the test."""
    tiers: list[RamTier] = []

    def make(name: str = "t0", *, budget_bytes: int = 256 << 20, **kw: object) -> RamTier:
        tier = RamTier(shm_dir / name, budget_bytes=budget_bytes, **kw)  # type: ignore[arg-type]
        tiers.append(tier)
        return tier

    yield make
    for t in tiers:
        t.close()


@pytest.fixture
def make_server() -> Iterator[Callable[..., PeerServer]]:
    """``make_server(tier, secret=SECRET, options=...)``: started servers, closed after the test."""
    servers: list[PeerServer] = []

    def make(
        tier: RamTier, *, secret: bytes = SECRET, options: PeerOptions | None = None
    ) -> PeerServer:
        server = PeerServer(tier, secret=secret, options=options).start()
        servers.append(server)
        return server

    yield make
    for s in servers:
        s.close()
