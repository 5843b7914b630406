"""The peer server: serves a :class:`~fastckpt.replicas._ram.RamTier` to authenticated peers.
A pushed chunk is sealed, a pushed manifest stored, and an id list read only after its
payload's tag verified.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import socket
import threading
from types import TracebackType
from typing import Any

from fastckpt._checksum import crc32c
from fastckpt.errors import (
    AuthenticationError,
    ConfigError,
    FrameAuthenticationError,
    PeerError,
    PeerUnavailableError,
    ProtocolError,
    RamBudgetError,
    StaleStepError,
)
from fastckpt.replicas import _connection
from fastckpt.replicas import _wire as wire
from fastckpt.replicas._channel import Channel, refusal_code, refuse
from fastckpt.replicas._connection import PeerOptions, check_secret, close_gracefully
from fastckpt.replicas._parity import ParityService
from fastckpt.replicas._ram import ChunkLocation, RamTier
from fastckpt.replicas._wire import MsgType

__all__ = ["PeerServer"]

_log = logging.getLogger(__name__)


class PeerServer:
    """Serves a :class:`RamTier` to authenticated peers over TCP, one thread per connection
    (blocking sockets, see ``_connection``); ``stats`` counts what happened.

    A misbehaving or failing client only ever loses its own connection: malformed frames get
    ``ERROR bad_request``/``too_large`` and a disconnect; a frame that fails its tag
    (``options.frame_mac``) is not answered at all, the connection is dropped and counted in
    ``stats["frame_auth_failures"]``; the accept loop and other clients carry on.

    Args:
        tier: The tier served (and written by PUT requests).
        secret: Shared secret (>= 16 bytes) for the handshake.
        host: Interface to bind (default loopback).
        port: TCP port; 0 picks a free one (see :attr:`address`).
        options: Timeouts and limits.
        extension: Serves the parity requests.
    """

    def __init__(
        self,
        tier: RamTier,
        *,
        secret: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        options: PeerOptions | None = None,
        extension: ParityService | None = None,
    ) -> None:
        self._tier = tier
        self._extension = extension
        self._secret = check_secret(secret)
        self._host, self._port = host, port
        self.options = options or PeerOptions()
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.stats: dict[str, int] = dict.fromkeys(
            ("connections", "auth_failures", "frame_auth_failures", "protocol_errors")
            + ("requests", "bytes_sent", "bytes_received"),
            0,
        )

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
        try:  # an IPv6 address (or a name that resolves to one only) needs an IPv6 socket
            family = socket.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM)[0][0]
            self._listener = socket.create_server(
                (self._host, self._port), family=family, backlog=128
            )
        except OSError as e:  # (socket.gaierror is an OSError)
            raise PeerError(f"cannot listen on {self._host}:{self._port}: {e}") from e
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name="fastckpt-peer-accept", daemon=True
        )
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

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.stats[key] += n

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError as e:
                if self._closed.is_set():
                    return
                _log.warning("peer server accept failed: %r", e)
                self._closed.wait(0.05)  # e.g. EMFILE: do not spin
                continue
            with self._lock:
                busy = len(self._conns) >= self.options.max_connections
                if not busy:
                    self._conns.add(conn)
                    self.stats["connections"] += 1
            if busy:
                with contextlib.suppress(OSError):
                    conn.settimeout(1.0)
                self._last_word(conn, None, "busy", "too many connections")
                conn.close()
                continue
            threading.Thread(
                target=self._serve, args=(conn,), name="fastckpt-peer-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        chan: Channel | None = None
        try:
            try:
                chan = _connection.server_handshake(conn, secret=self._secret, options=self.options)
            except AuthenticationError:
                self._count("auth_failures")
                return
            while not self._closed.is_set() and self._handle_one(chan):
                pass
        except FrameAuthenticationError:
            self._count("frame_auth_failures")  # dropped unanswered: the stream is untrustworthy
        except ProtocolError as e:
            self._count("protocol_errors")
            code = "too_large" if isinstance(e, wire.FrameTooLargeError) else "bad_request"
            self._last_word(conn, chan, code, str(e)[:200])
        except (PeerUnavailableError, OSError):
            pass  # the client went away or stalled
        except Exception:  # a bug must cost one connection, never the server
            _log.exception("peer connection failed")
            self._last_word(conn, chan, "internal", "internal error")
        finally:
            with self._lock:
                self._conns.discard(conn)
            close_gracefully(conn)

    @staticmethod
    def _last_word(conn: socket.socket, chan: Channel | None, code: str, message: str) -> None:
        """An ERROR before the connection closes (tagged once the handshake is done)."""
        with contextlib.suppress(PeerError, OSError):
            refuse(chan or Channel(conn, limits=wire.AUTH_LIMITS), code, message)

    def _handle_one(self, chan: Channel) -> bool:
        """Serve one request; False ends the connection (the client closed it)."""
        o = self.options
        try:
            mtype, h, plen = chan.recv_head(
                first_byte_timeout_s=o.idle_timeout_s, timeout_s=o.io_timeout_s
            )
        except PeerUnavailableError:
            return False
        self._count("requests")
        tier = self._tier
        if mtype is MsgType.GET_CHUNKS:
            return self._get_chunks(chan, h, plen)
        elif mtype is MsgType.GET_RANGES:
            return self._get_ranges(chan, h, plen)
        elif mtype is MsgType.PUT_CHUNKS:
            return self._put_chunks(chan, h, plen)
        elif mtype is MsgType.LIST:
            ids = tier.chunk_ids(h["step"])
            payload = json.dumps(ids, separators=(",", ":")).encode()
            chan.send(MsgType.CHUNK_LIST, {"count": len(ids)}, [payload])
        elif mtype is MsgType.GET_MANIFEST:
            data = tier.get_manifest(h["step"])
            if data is None:
                return refuse(chan, "not_found", f"no manifest for step {h['step']}")
            chan.send(MsgType.MANIFEST, {}, [data])
        elif mtype is MsgType.PUT_MANIFEST:
            received = chan.recv_payload()  # verified before it is stored, or refused
            try:
                tier.put_manifest(h["step"], bytes(received))
            except (StaleStepError, RamBudgetError) as e:
                return refuse(chan, refusal_code(e), str(e))
            chan.send(MsgType.OK, {"stored": True})
        elif mtype is MsgType.STEPS:
            chan.send(
                MsgType.STEP_LIST,
                {
                    "steps": tier.steps(),
                    "committed": tier.committed_steps(),
                    "manifests": tier.manifest_steps(),
                },
            )
        elif self._extension is not None and mtype in self._extension.types:
            return self._extension.handle(chan, mtype, h, plen)
        else:
            raise ProtocolError(f"{mtype.name} is not a request")
        return True

    def _get_chunks(self, chan: Channel, h: dict[str, Any], plen: int) -> bool:
        """Answer a batch of whole-chunk reads with one CHUNKS frame (held chunks back to back)."""
        count = h["count"]
        if not 0 < count <= wire.MAX_BATCH_CHUNKS or plen > wire.max_id_list_bytes(count):
            raise ProtocolError(f"GET_CHUNKS: {count} chunks in a {plen}-byte id list")
        ids = wire.decode_id_batch(chan.recv_payload(), count=count, what="GET_CHUNKS")
        views: list[memoryview] = []
        lengths, crcs, missing = [0] * count, [0] * count, []
        for i, cid in enumerate(ids):
            hit = self._tier.read_chunk(h["step"], cid)
            if hit is None:
                missing.append(i)
                continue
            view, loc = hit
            views.append(view)
            lengths[i], crcs[i] = loc.length, loc.raw_crc32c
        header = {"lengths": lengths, "crcs": crcs, "missing": missing}
        return self._send_batch(chan, MsgType.CHUNKS, header, views)

    def _get_ranges(self, chan: Channel, h: dict[str, Any], plen: int) -> bool:
        """Answer a batch of ranged chunk reads with one RANGES frame: each held chunk's
        ranges, and the crc32c of its bytes around them (the client checks the whole chunk)."""
        count, runs, starts, stops = h["count"], h["runs"], h["starts"], h["stops"]
        if (
            not 0 < count <= wire.MAX_BATCH_CHUNKS
            or plen > wire.max_id_list_bytes(count)
            or len(runs) != count
            or 0 in runs
            or len(starts) > wire.MAX_BATCH_RUNS
            or sum(runs) != len(starts)
            or len(stops) != len(starts)
        ):
            raise ProtocolError(
                f"GET_RANGES: {count} chunks, {sum(runs)} runs, {len(starts)} starts, "
                f"{len(stops)} stops in a {plen}-byte id list"
            )
        ids = wire.decode_id_batch(chan.recv_payload(), count=count, what="GET_RANGES")
        views: list[memoryview] = []
        lengths, gaps, missing = [0] * count, list[int](), list[int]()
        j = 0
        for i, (cid, n) in enumerate(zip(ids, runs)):
            spans = list(zip(starts[j : j + n], stops[j : j + n]))
            j += n
            hit = self._tier.read_chunk(h["step"], cid)
            if hit is None or not wire.spans_fit(spans, hit[1].length):
                # not held, or the ranges are not ascending, disjoint and inside it
                missing.append(i)
                continue
            view, loc = hit
            lengths[i] = loc.length
            bounds = [0, *(x for span in spans for x in span), loc.length]  # around the ranges
            gaps.extend(crc32c(view[a:b]) for a, b in zip(bounds[::2], bounds[1::2]))
            views.extend(view[a:b] for a, b in spans)
        header = {"lengths": lengths, "gaps": gaps, "missing": missing}
        return self._send_batch(chan, MsgType.RANGES, header, views)

    def _send_batch(
        self, chan: Channel, msg_type: MsgType, header: dict[str, Any], views: list[memoryview]
    ) -> bool:
        """Send a batch reply carrying ``views`` back to back, or ``too_large`` when they
        exceed the payload limit (the client then asks for fewer at a time)."""
        total = sum(v.nbytes for v in views)
        if total > self.options.max_payload_bytes:
            return refuse(
                chan,
                "too_large",
                f"a {msg_type.name} reply of {total} bytes exceeds "
                f"the payload limit of {self.options.max_payload_bytes}",
            )
        chan.send(msg_type, header, views)
        self._count("bytes_sent", total)
        return True

    def _put_chunks(self, chan: Channel, h: dict[str, Any], plen: int) -> bool:
        """Receive several chunks into one new segment; all are sealed together, or none."""
        step, count, ids_len = h["step"], h["count"], h["ids_len"]
        lengths, crcs = h["lengths"], h["crcs"]
        if (
            not 0 < count == len(lengths) == len(crcs) <= wire.MAX_BATCH_CHUNKS
            or ids_len + sum(lengths) != plen
        ):
            raise ProtocolError(
                f"PUT_CHUNKS: {count} chunks, {len(lengths)} lengths, {len(crcs)} crcs, "
                f"{ids_len} + {sum(lengths)} bytes != payload {plen}"
            )
        if ids_len > wire.max_id_list_bytes(count):
            raise ProtocolError(f"PUT_CHUNKS: {ids_len}-byte id list for {count} chunks")
        raw = chan.recv_bytes(ids_len)  # the id list: decoded once the payload verified
        total = plen - ids_len
        try:
            seg = self._tier.allocate(step, total)
        except (StaleStepError, RamBudgetError) as e:
            chan.drain(total)  # verified: a forged request gets no answer at all
            chan.end_payload()
            return refuse(chan, refusal_code(e), str(e))
        with seg:  # discarded unless sealed
            offsets = list(itertools.accumulate(lengths, initial=0))
            got = [chan.recv_into(seg.buffer[a : a + n].data) for a, n in zip(offsets, lengths)]
            chan.end_payload()  # authentic before anything is decoded, sealed or answered
            ids = wire.decode_id_batch(raw, count=count, what="PUT_CHUNKS")
            bad = [cid for cid, crc, g in zip(ids, crcs, got) if g != crc]
            self._count("bytes_received", total)
            if bad:
                return refuse(
                    chan, "checksum_mismatch", f"{len(bad)} chunks arrived corrupt, e.g. {bad[0]!r}"
                )
            index = {
                cid: ChunkLocation(a, n, crc) for cid, a, n, crc in zip(ids, offsets, lengths, crcs)
            }
            self._tier.seal(step, seg, index)
        chan.send(MsgType.OK, {"stored": True})
        return True
