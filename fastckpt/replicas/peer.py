"""Serving a RAM tier to peers over TCP, and the client that reads from and pushes to them.

Threads and blocking sockets, not asyncio: a payload leaves with ``sendall`` straight from
the tier's mmap and arrives with ``recv_into`` straight into the caller's buffer (both release
the GIL), which is what keeps a peer transfer near raw loopback TCP speed. The client API is
synchronous and thread-safe; run it on a pool of threads for parallel streams.

Security: every connection starts with a mutual HMAC-SHA256 challenge/response (see
:mod:`fastckpt.replicas.wire`). Until it succeeds the server accepts only tiny frames and
reveals nothing; a failed handshake is answered with ``ERROR auth_failed`` and a disconnect.
The secret only authenticates: traffic is not encrypted, so bind to a trusted interface
(loopback by default).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import json
import logging
import socket
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

import crc32c as _crc32c
import numpy as np

from fastckpt.errors import (
    AuthenticationError,
    ChecksumMismatchError,
    ConfigError,
    PeerError,
    PeerUnavailableError,
    ProtocolError,
)
from fastckpt.replicas import wire
from fastckpt.replicas.ram import ChunkLocation, RamBudgetError, RamTier, StaleStepError
from fastckpt.replicas.wire import MsgType

__all__ = ["PeerClient", "PeerOptions", "PeerRequestError", "PeerServer"]

_log = logging.getLogger(__name__)
_T = TypeVar("_T")
_CRC_WINDOW = 4 << 20  # received bytes are checksummed in windows that are still in cache
_DRAIN_PIECE = 1 << 20
_LINGER_S = 0.5  # how long a closing server connection waits for the client's EOF
_LINGER_BYTES = 4 << 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeerOptions:
    """Timeouts, limits and socket settings shared by :class:`PeerServer` and :class:`PeerClient`."""

    connect_timeout_s: float = 5.0
    """Longest wait for a TCP connect."""
    handshake_timeout_s: float = 5.0
    """Longest the authentication handshake may take (each side)."""
    io_timeout_s: float = 30.0
    """Longest a started request or transfer may stall without progress."""
    idle_timeout_s: float = 120.0
    """Server: an authenticated connection idle this long is closed."""
    max_header_bytes: int = 64 << 10
    """Largest JSON header either side accepts."""
    max_payload_bytes: int = 1 << 30
    """Largest payload (chunk, manifest, chunk list) either side accepts."""
    max_connections: int = 64
    """Server: concurrent connections; more are refused with ``ERROR busy``."""
    pool_size: int = 8
    """Client: idle authenticated connections kept for reuse."""
    socket_buffer_bytes: int | None = None
    """SO_SNDBUF/SO_RCVBUF; None keeps the kernel's autotuning (fastest on loopback here)."""
    accept_pushes: bool = True
    """Server: accept PUT_CHUNK/PUT_MANIFEST (peers replicating into this tier)."""

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "handshake_timeout_s", "io_timeout_s", "idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("max_header_bytes", "max_payload_bytes", "max_connections", "pool_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.socket_buffer_bytes is not None and self.socket_buffer_bytes < 4096:
            raise ConfigError(f"socket_buffer_bytes must be >= 4096 or None, got {self.socket_buffer_bytes}")

    @property
    def limits(self) -> wire.WireLimits:
        """The frame limits these options imply."""
        return wire.WireLimits(max_header_bytes=self.max_header_bytes, max_payload_bytes=self.max_payload_bytes)


class PeerRequestError(PeerError):
    """The peer answered a request with an ERROR frame (``code`` says which)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"peer error {code}: {message}")
        self.code = code


def _check_secret(secret: bytes) -> bytes:
    if not isinstance(secret, (bytes, bytearray)) or len(secret) < 16:
        raise ConfigError("the peer secret must be at least 16 bytes")
    return bytes(secret)


def _tune(sock: socket.socket, options: PeerOptions) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if options.socket_buffer_bytes is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, options.socket_buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, options.socket_buffer_bytes)


def _recv_into_crc(sock: socket.socket, view: memoryview, crc: int = 0) -> int:
    """Fill ``view`` from ``sock`` and return the running crc32c, computed window by window."""
    for off in range(0, view.nbytes, _CRC_WINDOW):
        window = view[off : off + _CRC_WINDOW]
        wire.recv_exact(sock, window)
        crc = _crc32c.crc32c(window, crc)
    return crc


def _drain(sock: socket.socket, n: int) -> None:
    buf = memoryview(bytearray(min(n, _DRAIN_PIECE)))
    while n:
        k = min(n, buf.nbytes)
        wire.recv_exact(sock, buf[:k])
        n -= k


def _close_gracefully(sock: socket.socket) -> None:
    """Close so that a last ERROR frame arrives: without reading what the client still sends,
    ``close`` would answer with a reset that can destroy the frame in flight."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(_LINGER_S)
        buf = bytearray(65536)
        budget = _LINGER_BYTES
        while budget > 0 and (n := sock.recv_into(buf)):
            budget -= n
    sock.close()


# ================================================================================== server


class PeerServer:
    """Serves a :class:`RamTier` to authenticated peers over TCP. Thread per connection.

    A misbehaving or failing client only ever loses its own connection: malformed frames get
    ``ERROR bad_request``/``too_large`` and a disconnect; the accept loop and other clients
    carry on.

    Args:
        tier: The tier served (and written by PUT requests when ``options.accept_pushes``).
        secret: Shared secret (>= 16 bytes) for the handshake.
        host: Interface to bind (default loopback).
        port: TCP port; 0 picks a free one (see :attr:`address`).
        options: Timeouts and limits.
    """

    def __init__(
        self,
        tier: RamTier,
        *,
        secret: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        options: PeerOptions | None = None,
    ) -> None:
        self._tier = tier
        self._secret = _check_secret(secret)
        self._host, self._port = host, port
        self.options = options or PeerOptions()
        self._limits = self.options.limits
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.stats: dict[str, int] = {
            "connections": 0,
            "auth_failures": 0,
            "protocol_errors": 0,
            "requests": 0,
            "bytes_sent": 0,
            "bytes_received": 0,
        }
        """Counters (connections accepted, auth failures, protocol errors, requests, bytes)."""

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` the server listens on (after :meth:`start`)."""
        if self._listener is None:
            raise ConfigError("PeerServer is not started")
        host, port = self._listener.getsockname()[:2]
        return str(host), int(port)

    def start(self) -> PeerServer:
        """Bind, listen and start accepting. Returns self.

        Raises:
            PeerError: the address cannot be bound.
        """
        if self._listener is not None:
            return self
        try:
            self._listener = socket.create_server((self._host, self._port), backlog=128)
        except OSError as e:
            raise PeerError(f"cannot listen on {self._host}:{self._port}: {e}") from e
        self._accept_thread = threading.Thread(target=self._accept_loop, name="fastckpt-peer-accept", daemon=True)
        self._accept_thread.start()
        return self

    def close(self) -> None:
        """Stop accepting, disconnect every client and join the accept thread. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept() on Linux
            self._listener.close()
        with self._lock:
            for conn in list(self._conns):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=5)

    def __enter__(self) -> PeerServer:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.stats[key] += n

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._closed.is_set():
                    return
                continue
            with self._lock:
                busy = len(self._conns) >= self.options.max_connections
                if not busy:
                    self._conns.add(conn)
                    self.stats["connections"] += 1
            if busy:
                with contextlib.suppress(OSError, PeerError):
                    conn.settimeout(1.0)
                    wire.send_frame(conn, MsgType.ERROR, {"code": "busy", "message": "too many connections"})
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="fastckpt-peer-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            _tune(conn, self.options)
            if self._handshake(conn):
                while not self._closed.is_set() and self._handle_one(conn):
                    pass
        except ProtocolError as e:
            self._count("protocol_errors")
            code = "too_large" if isinstance(e, wire.FrameTooLargeError) else "bad_request"
            with contextlib.suppress(PeerError, OSError):
                wire.send_frame(conn, MsgType.ERROR, {"code": code, "message": str(e)[:200]})
        except PeerUnavailableError:
            pass  # the client went away or stalled
        except Exception:  # a bug must cost one connection, never the server
            _log.exception("peer connection failed")
            with contextlib.suppress(PeerError, OSError):
                wire.send_frame(conn, MsgType.ERROR, {"code": "internal", "message": "internal error"})
        finally:
            with self._lock:
                self._conns.discard(conn)
            _close_gracefully(conn)

    def _handshake(self, conn: socket.socket) -> bool:
        t = self.options.handshake_timeout_s
        conn.settimeout(t)
        _, hello, _ = wire.recv_frame_head(conn, wire.AUTH_LIMITS, allowed=[MsgType.HELLO])
        client_nonce, server_nonce = bytes.fromhex(hello["nonce"]), wire.new_nonce()
        proof = wire.auth_mac(self._secret, "server", client_nonce, server_nonce)
        wire.send_frame(conn, MsgType.CHALLENGE, {"nonce": server_nonce.hex(), "mac": proof.hex()})
        _, auth, _ = wire.recv_frame_head(conn, wire.AUTH_LIMITS, allowed=[MsgType.AUTH])
        expected = wire.auth_mac(self._secret, "client", client_nonce, server_nonce)
        if not hmac.compare_digest(expected, bytes.fromhex(auth["mac"])):
            self._count("auth_failures")
            wire.send_frame(conn, MsgType.ERROR, {"code": "auth_failed", "message": "authentication failed"})
            return False
        wire.send_frame(conn, MsgType.AUTH_OK, {})
        return True

    def _error(self, conn: socket.socket, code: str, message: str) -> bool:
        wire.send_frame(conn, MsgType.ERROR, {"code": code, "message": message[:1000]})
        return True

    def _handle_one(self, conn: socket.socket) -> bool:
        """Serve one request; False ends the connection (the client closed it)."""
        o = self.options
        try:
            mtype, h, plen = wire.recv_frame_head(
                conn, self._limits, first_byte_timeout_s=o.idle_timeout_s, timeout_s=o.io_timeout_s
            )
        except PeerUnavailableError:
            return False
        self._count("requests")
        tier = self._tier
        if mtype is MsgType.GET_CHUNK:
            loc = tier.chunk_location(h["step"], h["chunk_id"])
            view = tier.get_chunk(h["step"], h["chunk_id"]) if loc else None
            if loc is None or view is None:
                return self._error(conn, "not_found", f"no chunk {h['chunk_id']!r} of step {h['step']}")
            start = h["offset"]
            stop = loc.length if h["length"] is None else start + h["length"]
            if start > loc.length or stop > loc.length:
                return self._error(conn, "bad_request", f"range {start}:{stop} outside a {loc.length}-byte chunk")
            header = {"raw_crc32c": loc.raw_crc32c, "chunk_length": loc.length, "offset": start}
            wire.send_frame(conn, MsgType.CHUNK, header, [view[start:stop]])
            self._count("bytes_sent", stop - start)
        elif mtype is MsgType.PUT_CHUNK:
            return self._put_chunk(conn, h, plen)
        elif mtype is MsgType.LIST:
            ids = tier.chunk_ids(h["step"])
            payload = json.dumps(ids, separators=(",", ":")).encode()
            wire.send_frame(conn, MsgType.CHUNK_LIST, {"count": len(ids)}, [payload])
        elif mtype is MsgType.GET_MANIFEST:
            data = tier.get_manifest(h["step"])
            if data is None:
                return self._error(conn, "not_found", f"no manifest for step {h['step']}")
            wire.send_frame(conn, MsgType.MANIFEST, {}, [data])
        elif mtype is MsgType.PUT_MANIFEST:
            data = bytearray(plen)
            wire.recv_exact(conn, memoryview(data))
            if not o.accept_pushes:
                return self._error(conn, "bad_request", "this peer does not accept pushes")
            try:
                tier.put_manifest(h["step"], data)
            except StaleStepError as e:
                return self._error(conn, "stale_step", str(e))
            except RamBudgetError as e:
                return self._error(conn, "budget", str(e))
            wire.send_frame(conn, MsgType.OK, {"stored": True})
        elif mtype is MsgType.STEPS:
            wire.send_frame(conn, MsgType.STEP_LIST, {"steps": tier.steps(), "committed": tier.committed_steps()})
        else:
            raise ProtocolError(f"{mtype.name} is not a request")
        return True

    def _put_chunk(self, conn: socket.socket, h: dict[str, Any], plen: int) -> bool:
        step, cid, crc = h["step"], h["chunk_id"], h["raw_crc32c"]
        tier = self._tier
        if not self.options.accept_pushes:
            _drain(conn, plen)
            return self._error(conn, "bad_request", "this peer does not accept pushes")
        if tier.has_chunk(step, cid, length=plen, raw_crc32c=crc):
            _drain(conn, plen)
            wire.send_frame(conn, MsgType.OK, {"stored": False})
            return True
        try:
            seg = tier.allocate(step, plen)
        except (StaleStepError, RamBudgetError) as e:
            _drain(conn, plen)
            return self._error(conn, "stale_step" if isinstance(e, StaleStepError) else "budget", str(e))
        with seg:  # discarded unless sealed
            got = _recv_into_crc(conn, memoryview(seg.buffer))
            self._count("bytes_received", plen)
            if got != crc:
                return self._error(conn, "checksum_mismatch", f"chunk {cid!r} arrived corrupt")
            try:
                tier.seal(step, seg, {cid: ChunkLocation(0, plen, crc)})
            except StaleStepError as e:
                return self._error(conn, "stale_step", str(e))
        wire.send_frame(conn, MsgType.OK, {"stored": True})
        return True


# ================================================================================== client


class _Conn:
    __slots__ = ("sock",)

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock


class PeerClient:
    """Synchronous, thread-safe client of one :class:`PeerServer`, with a connection pool.

    Every call borrows an authenticated connection (or opens one: connect + handshake), so a
    restore does not handshake per chunk; concurrent calls use separate connections. A call
    whose reused connection turns out to be closed is retried once on a fresh one (every
    request is idempotent).

    Errors: unreachable/timeouts/disconnects → :class:`PeerUnavailableError`; handshake
    refused → :class:`AuthenticationError`; malformed replies → :class:`ProtocolError`;
    ERROR replies → :class:`PeerRequestError`. A connection that saw any error is discarded.

    Args:
        address: ``(host, port)`` of the server.
        secret: Shared secret (>= 16 bytes).
        options: Timeouts and limits.
        name: Label used in messages and stats (default ``host:port``).
    """

    def __init__(
        self,
        address: tuple[str, int],
        *,
        secret: bytes,
        options: PeerOptions | None = None,
        name: str | None = None,
    ) -> None:
        self.address = (str(address[0]), int(address[1]))
        self._secret = _check_secret(secret)
        self.options = options or PeerOptions()
        self._limits = self.options.limits
        self.name = name or f"{self.address[0]}:{self.address[1]}"
        self._idle: list[_Conn] = []
        self._lock = threading.Lock()
        self._closed = False
        self.handshakes = 0
        """Connections opened (and authenticated) so far."""

    def __repr__(self) -> str:
        return f"PeerClient({self.name!r})"

    # ---------------------------------------------------------------- public API

    def get_chunk(
        self,
        step: int,
        chunk_id: str,
        *,
        into: memoryview | np.ndarray | None = None,
        expected_crc32c: int | None = None,
    ) -> memoryview | None:
        """Fetch a whole chunk, verified against the crc32c the peer reports (and ``expected_crc32c``).

        Args:
            step: Step number.
            chunk_id: Chunk id (``format.manifest.chunk_id``).
            into: Writable buffer the chunk is received into (no other copy); its size must be
                the chunk's length. None: a new buffer is allocated.
            expected_crc32c: The crc32c the caller knows (e.g. from the manifest).

        Returns:
            A view of the filled bytes, or None if the peer does not hold the chunk.

        Raises:
            ChecksumMismatchError: the bytes (or their length) do not match. ``into`` may
                have been partly overwritten.
        """

        def op(c: _Conn) -> memoryview | None:
            req = {"step": step, "chunk_id": chunk_id, "offset": 0, "length": None}
            wire.send_frame(c.sock, MsgType.GET_CHUNK, req)
            mtype, h, plen = self._reply(c, MsgType.CHUNK)
            if mtype is MsgType.ERROR:
                return None
            if h["offset"] != 0 or plen != h["chunk_length"]:
                raise ProtocolError(f"CHUNK reply covers {h['offset']}+{plen} of {h['chunk_length']}, asked for all")
            dst = memoryview(np.empty(plen, np.uint8) if into is None else into).cast("B")
            if dst.nbytes != plen:
                _drain(c.sock, plen)
                raise ChecksumMismatchError(
                    f"peer {self.name} holds chunk {chunk_id!r} with {plen} bytes, expected {dst.nbytes}"
                )
            got = _recv_into_crc(c.sock, dst)
            if got != h["raw_crc32c"] or (expected_crc32c is not None and got != expected_crc32c):
                raise ChecksumMismatchError(f"chunk {chunk_id!r} of step {step} from peer {self.name} is corrupt")
            return dst

        return self._call(op)

    def push_chunk(
        self, step: int, chunk_id: str, data: memoryview | bytes | np.ndarray, *, raw_crc32c: int | None = None
    ) -> bool:
        """Store a chunk in the peer's tier (sent straight from ``data``).

        Returns:
            True if stored; False if the peer already held an identical chunk.

        Raises:
            PeerRequestError: refused (``code``: ``stale_step``, ``budget``,
                ``checksum_mismatch``, ``bad_request``).
        """
        view = memoryview(data).cast("B") if not isinstance(data, np.ndarray) else memoryview(data.reshape(-1).view(np.uint8))
        crc = _crc32c.crc32c(view) if raw_crc32c is None else raw_crc32c

        def op(c: _Conn) -> bool:
            wire.send_frame(c.sock, MsgType.PUT_CHUNK, {"step": step, "chunk_id": chunk_id, "raw_crc32c": crc}, [view])
            _, h, _ = self._reply(c, MsgType.OK, missing_ok=False)
            return bool(h["stored"])

        return self._call(op)

    def list_chunks(self, step: int) -> list[str]:
        """Sorted ids of the chunks the peer holds for ``step``."""

        def op(c: _Conn) -> list[str]:
            wire.send_frame(c.sock, MsgType.LIST, {"step": step})
            _, h, plen = self._reply(c, MsgType.CHUNK_LIST, missing_ok=False)
            raw = bytearray(plen)
            wire.recv_exact(c.sock, memoryview(raw))
            return wire.decode_json_list(raw, count=h["count"])

        return self._call(op)

    def get_manifest(self, step: int) -> bytes | None:
        """The manifest the peer holds for ``step``, or None."""

        def op(c: _Conn) -> bytes | None:
            wire.send_frame(c.sock, MsgType.GET_MANIFEST, {"step": step})
            mtype, _, plen = self._reply(c, MsgType.MANIFEST)
            if mtype is MsgType.ERROR:
                return None
            raw = bytearray(plen)
            wire.recv_exact(c.sock, memoryview(raw))
            return bytes(raw)

        return self._call(op)

    def put_manifest(self, step: int, data: bytes | memoryview) -> None:
        """Store ``data`` as the manifest of ``step`` in the peer's tier."""

        def op(c: _Conn) -> None:
            wire.send_frame(c.sock, MsgType.PUT_MANIFEST, {"step": step}, [memoryview(data)])
            self._reply(c, MsgType.OK, missing_ok=False)

        self._call(op)

    def steps(self) -> list[int]:
        """Sorted steps the peer holds any data for."""

        def op(c: _Conn) -> list[int]:
            wire.send_frame(c.sock, MsgType.STEPS, {})
            _, h, _ = self._reply(c, MsgType.STEP_LIST, missing_ok=False)
            return sorted(h["steps"])

        return self._call(op)

    def close(self) -> None:
        """Close pooled connections; later calls raise ``PeerUnavailableError``. Idempotent."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for c in idle:
            c.sock.close()

    def __enter__(self) -> PeerClient:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # ---------------------------------------------------------------- internals

    def _reply(self, c: _Conn, want: MsgType, *, missing_ok: bool = True) -> tuple[MsgType, dict[str, Any], int]:
        mtype, h, plen = wire.recv_frame_head(c.sock, self._limits, allowed=[want, MsgType.ERROR])
        if mtype is MsgType.ERROR:
            if h["code"] == "not_found" and missing_ok:
                return mtype, h, plen
            if h["code"] == "checksum_mismatch":
                raise ChecksumMismatchError(f"peer {self.name}: {h['message']}")
            raise PeerRequestError(h["code"], h["message"])
        return mtype, h, plen

    def _call(self, op: Callable[[_Conn], _T]) -> _T:
        for attempt in (0, 1):
            conn, reused = self._acquire()
            try:
                result = op(conn)
            except PeerUnavailableError:
                conn.sock.close()
                if reused and attempt == 0:
                    continue  # the pooled connection had gone stale (e.g. server idle timeout)
                raise
            except BaseException:
                conn.sock.close()
                raise
            self._release(conn)
            return result
        raise AssertionError("unreachable")  # pragma: no cover

    def _acquire(self) -> tuple[_Conn, bool]:
        with self._lock:
            if self._closed:
                raise PeerUnavailableError(f"client for {self.name} is closed")
            if self._idle:
                return self._idle.pop(), True
        return self._connect(), False

    def _release(self, conn: _Conn) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.options.pool_size:
                self._idle.append(conn)
                return
        conn.sock.close()

    def _connect(self) -> _Conn:
        o = self.options
        try:
            sock = socket.create_connection(self.address, timeout=o.connect_timeout_s)
        except OSError as e:
            raise PeerUnavailableError(f"cannot connect to peer {self.name}: {e}") from e
        try:
            _tune(sock, o)
            sock.settimeout(o.handshake_timeout_s)
            client_nonce = wire.new_nonce()
            wire.send_frame(sock, MsgType.HELLO, {"nonce": client_nonce.hex()})
            mtype, h, _ = wire.recv_frame_head(sock, wire.AUTH_LIMITS, allowed=[MsgType.CHALLENGE, MsgType.ERROR])
            if mtype is MsgType.ERROR:
                raise PeerRequestError(h["code"], h["message"])
            server_nonce = bytes.fromhex(h["nonce"])
            expected = wire.auth_mac(self._secret, "server", client_nonce, server_nonce)
            if not hmac.compare_digest(expected, bytes.fromhex(h["mac"])):
                raise AuthenticationError(f"peer {self.name} failed to prove it knows our secret (secrets differ?)")
            proof = wire.auth_mac(self._secret, "client", client_nonce, server_nonce)
            wire.send_frame(sock, MsgType.AUTH, {"mac": proof.hex()})
            mtype, h, _ = wire.recv_frame_head(sock, wire.AUTH_LIMITS, allowed=[MsgType.AUTH_OK, MsgType.ERROR])
            if mtype is MsgType.ERROR:
                if h["code"] == "auth_failed":
                    raise AuthenticationError(f"peer {self.name} refused our secret")
                raise PeerRequestError(h["code"], h["message"])
            sock.settimeout(o.io_timeout_s)
        except BaseException:
            sock.close()
            raise
        with self._lock:
            self.handshakes += 1
        return _Conn(sock)
