"""A frame-aware man in the middle for peer-wire tests, and a crc32c forger.

:class:`PeerRelay` listens (on ``127.0.0.1`` by default) and relays every connection to an upstream
:class:`~fastckpt.replicas._server.PeerServer`, frame by frame. It holds no secret: like an attacker
on the network path, it can parse frames (prefix, header, tags, payload), and drop, delay,
reorder, replay, rewrite or inject them, but cannot compute a tag. A ``tamper`` callback
sees each :class:`RelayedFrame` and returns the bytes to forward instead::

    def tamper(f: RelayedFrame) -> list[bytes]:
        if f.direction == "down" and f.type is MsgType.CHUNKS:
            payload = bytearray(f.payload)
            payload[0] ^= 1
            forge_crc32c(payload, 1, crc32c(f.payload))  # the crc32c still matches
            return [f.replace(payload=bytes(payload)).raw]
        return [f.raw]

    with PeerRelay(server.address, tamper=tamper) as relay:
        PeerClient(relay.address, secret=...).get_chunks(...)

The relay follows the handshake (the first two frames each way carry no tags; CHALLENGE
says whether the rest do). Every frame it saw is kept in :attr:`PeerRelay.frames`, so a
test can replay one later, on the same connection or another. Test-only: threads are
daemons, a connection ends when either side closes.

:func:`forge_crc32c` patches 4 bytes of a buffer so that its crc32c is any chosen value:
crc32c is linear, so it proves nothing against someone who can change the data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import threading
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Literal

from fastckpt._checksum import crc32c
from fastckpt.replicas import _wire as wire
from fastckpt.replicas._wire import MsgType

__all__ = ["PeerRelay", "RelayedFrame", "Tamper", "forge_crc32c"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RelayedFrame:
    """One frame as it crossed the relay (tags empty where the connection has none)."""

    conn: int
    """Connection number at the relay, from 0."""
    direction: Literal["up", "down"]
    """``"up"``: client → server; ``"down"``: server → client."""
    index: int
    """Frame number in this direction on this connection, from 0 (handshake included)."""
    prefix: bytes
    header: bytes
    header_tag: bytes
    payload: bytes
    payload_tag: bytes

    @property
    def type(self) -> MsgType | int:
        """The message type the prefix names (an int if unknown)."""
        t = self.prefix[5]
        return MsgType(t) if t in MsgType._value2member_map_ else t

    @property
    def raw(self) -> bytes:
        """The frame's bytes as they travel."""
        return self.prefix + self.header + self.header_tag + self.payload + self.payload_tag

    def replace(self, **changes: Any) -> RelayedFrame:
        """A copy with fields changed; the prefix's lengths follow a new header or payload
        (tags are kept: they no longer match, as for any attacker)."""
        new = dataclasses.replace(self, **changes)
        if "prefix" in changes:
            return new
        magic, version, t, flags, _, _ = wire.PREFIX.unpack(new.prefix)
        prefix = wire.PREFIX.pack(magic, version, t, flags, len(new.header), len(new.payload))
        return dataclasses.replace(new, prefix=prefix)

    def json(self) -> dict[str, Any]:
        """The decoded header."""
        return dict(json.loads(self.header))

    def with_header(self, header: dict[str, Any]) -> RelayedFrame:
        """A copy with ``header`` as its JSON header (prefix adjusted, tags kept)."""
        return self.replace(header=json.dumps(header, separators=(",", ":")).encode())


Tamper = Callable[[RelayedFrame], Sequence[bytes]]
"""Given a frame, the bytes to forward in its place (``[f.raw]``: unchanged; ``[]``: drop)."""


def _recv(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        got = sock.recv(min(n - len(buf), 1 << 20))
        if not got:
            return None
        buf += got
    return bytes(buf)


class _Conn:
    def __init__(self, number: int) -> None:
        self.number = number
        self.tagged = threading.Event()  # set once CHALLENGE says frame_mac
        self.challenge_seen = threading.Event()


class PeerRelay:
    """Relays connections to ``upstream`` frame by frame through ``tamper`` (see the module).

    Args:
        upstream: The server's ``(host, port)``.
        tamper: Called for every frame in both directions, in a relay thread; returns the
            bytes to forward. None forwards everything unchanged.
        bind: Where the relay listens (default: a free port on loopback; a man in the middle
            on a simulated host listens on that host's address).
    """

    def __init__(
        self,
        upstream: tuple[str, int],
        *,
        tamper: Tamper | None = None,
        bind: tuple[str, int] = ("127.0.0.1", 0),
    ) -> None:
        self.upstream = upstream
        self.tamper: Tamper = tamper or (lambda f: [f.raw])
        self.frames: list[RelayedFrame] = []
        """Every frame seen, in the order the relay read them."""
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._conns = 0
        self._closed = False
        self._listener = socket.create_server(bind)
        threading.Thread(target=self._accept, name="peer-relay", daemon=True).start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._listener.getsockname()[:2]
        return str(host), int(port)

    @property
    def connections(self) -> int:
        """Connections accepted so far."""
        return self._conns

    def __enter__(self) -> PeerRelay:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._socks += [client, server]
                conn = _Conn(self._conns)
                self._conns += 1
            for src, dst, direction in ((client, server, "up"), (server, client, "down")):
                threading.Thread(
                    target=self._pump,
                    args=(conn, src, dst, direction),
                    name="peer-relay-pump",
                    daemon=True,
                ).start()

    def _pump(self, conn: _Conn, src: socket.socket, dst: socket.socket, direction: str) -> None:
        try:
            index = 0
            while True:
                prefix = _recv(src, wire.PREFIX.size)
                if prefix is None:
                    break
                *_, hlen, plen = wire.PREFIX.unpack(prefix)
                header = _recv(src, hlen)
                if header is None:
                    break
                if direction == "down" and index == 0:
                    with contextlib.suppress(ValueError, KeyError):
                        if prefix[5] == MsgType.CHALLENGE and json.loads(header)["frame_mac"]:
                            conn.tagged.set()
                    conn.challenge_seen.set()
                if direction == "up" and index >= 2:
                    conn.challenge_seen.wait(10)
                tagged = index >= 2 and conn.tagged.is_set()
                tag_n = wire.TAG_BYTES if tagged else 0
                htag = _recv(src, tag_n) if tag_n else b""
                payload = _recv(src, plen) if plen else b""
                ptag = _recv(src, tag_n) if tag_n and plen else b""
                if htag is None or payload is None or ptag is None:
                    break
                frame = RelayedFrame(
                    conn=conn.number,
                    direction=direction,  # type: ignore[arg-type]
                    index=index,
                    prefix=prefix,
                    header=header,
                    header_tag=htag,
                    payload=payload,
                    payload_tag=ptag,
                )
                with self._lock:
                    self.frames.append(frame)
                index += 1
                for data in self.tamper(frame):
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


def forge_crc32c(buf: bytearray, pos: int, target: int) -> None:
    """Patch ``buf[pos:pos + 4]`` in place so that ``crc32c(buf) == target``.

    The crc32c of ``buf`` is an affine function of those 32 bits over GF(2), and any 32
    consecutive bits can reach every value, so a 32 x 32 linear system decides them.
    """
    if not 0 <= pos <= len(buf) - 4:
        raise ValueError(f"no 4 bytes at {pos} of a {len(buf)}-byte buffer")
    base = crc32c(bytes(buf))
    basis: dict[int, tuple[int, int]] = {}  # pivot bit -> (column, bits that make it)
    for bit in range(32):
        trial = bytearray(buf)
        trial[pos + bit // 8] ^= 1 << (bit % 8)
        vec, comb = crc32c(bytes(trial)) ^ base, 1 << bit
        while vec:
            top = vec.bit_length() - 1
            if top not in basis:
                basis[top] = (vec, comb)
                break
            vec, comb = vec ^ basis[top][0], comb ^ basis[top][1]
    want, flips = target ^ base, 0
    while want:
        top = want.bit_length() - 1
        if top not in basis:  # pragma: no cover - 32 consecutive bits always suffice
            raise ValueError("crc32c not reachable from these bytes")
        want, flips = want ^ basis[top][0], flips ^ basis[top][1]
    for bit in range(32):
        if flips >> bit & 1:
            buf[pos + bit // 8] ^= 1 << (bit % 8)
