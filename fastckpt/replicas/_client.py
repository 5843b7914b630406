"""The peer client: reads chunks from and pushes chunks to one
:class:`~fastckpt.replicas._server.PeerServer` over a pool of authenticated connections,
borrowed per call and returned when the call left them in sync. A call whose reused
connection turns out to be closed is retried once on a fresh one (every request is
idempotent). A chunk is reported ``"ok"`` or bytes returned only after the payload's tag
verified.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, NamedTuple, Self, TypeVar

import numpy as np

from fastckpt.errors import (
    ChecksumMismatchError,
    ConfigError,
    PeerError,
    PeerRequestError,
    PeerUnavailableError,
)
from fastckpt.replicas import _batched
from fastckpt.replicas import _wire as wire
from fastckpt.replicas._batched import Outcome
from fastckpt.replicas._channel import Channel
from fastckpt.replicas._connection import PeerOptions, check_secret, client_handshake
from fastckpt.replicas._wire import MsgType

__all__ = ["Conn", "PeerClient", "StepLists"]

_T = TypeVar("_T")


class StepLists(NamedTuple):
    """A peer's steps, sorted: with any data, committed (manifest or commit record), with a
    manifest."""

    steps: list[int]
    committed: list[int]
    manifests: list[int]


@dataclasses.dataclass(slots=True)
class Conn:
    """One pooled connection: its channel, and whether the current request got any reply
    (then it must not be retried)."""

    chan: Channel
    replied: bool = False


_CLOSING_CODES = frozenset({"too_large", "bad_request", "internal", "auth_failed"})
"""ERROR codes after which a server may have closed the connection (a malformed or oversized
request, or a server fault): such a connection is not reused."""


def _bytes_of(buf: memoryview | bytes | np.ndarray) -> memoryview:
    """``buf``'s bytes in place, as a flat byte view."""
    return (buf.data if isinstance(buf, np.ndarray) else memoryview(buf)).cast("B")


class PeerClient:
    """Synchronous, thread-safe client of one :class:`PeerServer`; concurrent calls use
    separate pooled connections.

    Errors: unreachable/timeouts/disconnects → :class:`PeerUnavailableError`; handshake
    refused → :class:`AuthenticationError`; malformed replies → :class:`ProtocolError`; a
    reply that fails its tag (forged or altered on the way) →
    :class:`~fastckpt.errors.FrameAuthenticationError` (a ``ProtocolError``); ERROR replies
    → :class:`PeerRequestError`. A connection that saw any error other than a well-formed
    refusal is discarded.

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
        self._secret = check_secret(secret)
        self.options = options or PeerOptions()
        self.name = name or f"{self.address[0]}:{self.address[1]}"
        self._idle: list[Conn] = []
        self._lock = threading.Lock()
        self._closed = False
        self.handshakes = 0
        """Connections opened (and authenticated) so far."""

    def __repr__(self) -> str:
        return f"PeerClient({self.name!r})"

    def close(self) -> None:
        """Close pooled connections; later calls raise ``PeerUnavailableError``. Idempotent."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for c in idle:
            c.chan.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def get_chunks(
        self,
        step: int,
        items: Sequence[tuple[str, memoryview | np.ndarray, int | None]],
        *,
        batch_chunks: int = 16,
        window: int = 4,
    ) -> list[Outcome]:
        """Fetch several whole chunks of ``step`` over one connection: batches of up to
        ``batch_chunks`` (1..``wire.MAX_BATCH_CHUNKS``) chunks and ``max_payload_bytes``, each
        one GET_CHUNKS answered by one CHUNKS frame, up to ``window`` requests in flight.

        Args:
            items: ``(chunk_id, into, expected_crc32c)``; each ``into`` is received into
                directly and must have the chunk's exact length.

        Returns:
            Per item: ``"ok"`` (``into`` holds the verified bytes), ``"missing"`` (the peer
            lacks it) or ``"corrupt"`` (wrong length or checksum; ``into`` may be garbage).

        Raises:
            PeerUnavailableError: the connection failed or the peer refused mid-stream (the
                connection is discarded; no item after the failure is done).
            ProtocolError: the peer's reply is malformed (the connection is discarded).
        """
        ids = [wire.check_chunk_id(cid) for cid, _, _ in items]
        dsts = [_bytes_of(i) for _, i, _ in items]
        expected = [e for _, _, e in items]

        def receive(chan: Channel, h: dict[str, Any], plen: int, lo: int, hi: int) -> list[Outcome]:
            return _batched.recv_chunks(chan, h, plen, dsts[lo:hi], expected[lo:hi])

        return self._stream(
            MsgType.GET_CHUNKS,
            ids,
            [d.nbytes for d in dsts],
            lambda lo, hi: {"step": step, "count": hi - lo},
            receive,
            batch_chunks=batch_chunks,
            window=window,
        )

    def get_ranges(
        self,
        step: int,
        items: Sequence[tuple[str, memoryview | np.ndarray, int, Sequence[tuple[int, int]]]],
        *,
        batch_chunks: int = 16,
        window: int = 4,
    ) -> list[Outcome]:
        """Fetch byte ranges of several chunks like :meth:`get_chunks` (a batch also holds at
        most ``wire.MAX_BATCH_RUNS`` runs), with only the ranges on the wire. Each item is
        verified against the whole chunk's crc32c (the peer sends the crc32c of the bytes
        around the ranges), so a byte corrupt anywhere fails it, as it would a whole read.

        Args:
            items: ``(chunk_id, into, expected_crc32c, runs)``: ``into`` has the chunk's length
                (``expected_crc32c`` is the whole chunk's) and receives the bytes of each run
                ``(start, n)`` at their place; ``runs`` are ascending, disjoint, not empty.

        Returns:
            Per item: ``"ok"``, ``"missing"`` (the peer lacks the chunk or it is shorter than
            the runs) or ``"corrupt"`` (another length, or the checksums do not combine;
            ``into``'s runs may be garbage).

        Raises:
            PeerUnavailableError, ProtocolError: As for :meth:`get_chunks`.
        """
        ids = [wire.check_chunk_id(cid) for cid, *_ in items]
        dsts = [_bytes_of(i) for _, i, *_ in items]
        expected = [e for _, _, e, _ in items]
        runs = [list(r) for *_, r in items]
        for cid, dst, rs in zip(ids, dsts, runs):
            if (
                not rs
                or len(rs) > wire.MAX_BATCH_RUNS
                or not wire.spans_fit(((a, a + n) for a, n in rs), dst.nbytes)
            ):
                raise ConfigError(
                    f"runs {rs[:4]}... of chunk {cid!r} ({dst.nbytes} bytes) are not ascending, "
                    f"disjoint and inside it (1..{wire.MAX_BATCH_RUNS} of them)"
                )

        def header(lo: int, hi: int) -> dict[str, Any]:
            return {
                "step": step,
                "count": hi - lo,
                "runs": [len(r) for r in runs[lo:hi]],
                "starts": [a for r in runs[lo:hi] for a, _ in r],
                "stops": [a + n for r in runs[lo:hi] for a, n in r],
            }

        def receive(chan: Channel, h: dict[str, Any], plen: int, lo: int, hi: int) -> list[Outcome]:
            return _batched.recv_ranges(chan, h, plen, dsts[lo:hi], runs[lo:hi], expected[lo:hi])

        return self._stream(
            MsgType.GET_RANGES,
            ids,
            [sum(n for _, n in r) for r in runs],
            header,
            receive,
            batch_chunks=batch_chunks,
            window=window,
            runs=[len(r) for r in runs],
        )

    def push_chunks(
        self, step: int, chunks: Sequence[tuple[str, memoryview | bytes | np.ndarray, int]]
    ) -> None:
        """Store several chunks of ``step`` in the peer's tier as one segment, all or none.
        ``chunks`` are ``(chunk_id, data, raw_crc32c)``, sent straight from ``data``.

        Raises:
            PeerRequestError: refused (``stale_step``, ``budget``, ``bad_request``).
            ChecksumMismatchError: a chunk arrived corrupt (nothing was stored).
        """
        if not chunks:
            return
        ids = [wire.check_chunk_id(cid) for cid, _, _ in chunks]
        views = [_bytes_of(d) for _, d, _ in chunks]
        id_bytes = json.dumps(ids, separators=(",", ":")).encode()
        header = {
            "step": step,
            "count": len(ids),
            "ids_len": len(id_bytes),
            "lengths": [v.nbytes for v in views],
            "crcs": [crc for _, _, crc in chunks],
        }

        def op(c: Conn) -> None:
            self._send_push(c, MsgType.PUT_CHUNKS, header, [id_bytes, *views])
            self._reply(c, MsgType.OK, missing_ok=False)

        self._call(op)

    def list_chunks(self, step: int) -> list[str]:
        """Sorted ids of the chunks the peer holds for ``step``."""

        def op(c: Conn) -> list[str]:
            c.chan.send(MsgType.LIST, {"step": step})
            _, h, _ = self._reply(c, MsgType.CHUNK_LIST, missing_ok=False)
            return wire.decode_json_list(c.chan.recv_payload(), count=h["count"])

        return self._call(op)

    def get_manifest(self, step: int) -> bytes | None:
        """The manifest the peer holds for ``step``, or None."""

        def op(c: Conn) -> bytes | None:
            c.chan.send(MsgType.GET_MANIFEST, {"step": step})
            mtype, _, _ = self._reply(c, MsgType.MANIFEST)
            if mtype is MsgType.ERROR:
                return None
            return bytes(c.chan.recv_payload())

        return self._call(op)

    def put_manifest(self, step: int, data: bytes | memoryview) -> None:
        """Store ``data`` as the manifest of ``step`` in the peer's tier."""

        def op(c: Conn) -> None:
            c.chan.send(MsgType.PUT_MANIFEST, {"step": step}, [memoryview(data)])
            self._reply(c, MsgType.OK, missing_ok=False)

        self._call(op)

    def steps(self) -> list[int]:
        """Sorted steps the peer holds any data for."""
        return self.step_lists().steps

    def step_lists(self) -> StepLists:
        """All three step lists of the peer, in one request."""

        def op(c: Conn) -> StepLists:
            c.chan.send(MsgType.STEPS, {})
            _, h, _ = self._reply(c, MsgType.STEP_LIST, missing_ok=False)
            return StepLists(sorted(h["steps"]), sorted(h["committed"]), sorted(h["manifests"]))

        return self._call(op)

    def _stream(
        self,
        mtype: MsgType,
        ids: list[str],
        sizes: list[int],
        header: Callable[[int, int], dict[str, Any]],
        receive: Callable[[Channel, dict[str, Any], int, int, int], list[Outcome]],
        *,
        batch_chunks: int,
        window: int,
        runs: list[int] | None = None,
    ) -> list[Outcome]:
        """Ask for ``ids`` in batches ``[lo, hi)`` over one connection: ``mtype`` requests
        (``header(lo, hi)``, the ids as payload) sent up to ``window`` ahead of the replies,
        several in one send; ``receive(chan, header, payload_len, lo, hi)`` each reply."""
        _batched.check_stream(batch_chunks, window)
        batches = _batched.batches(ids, sizes, batch_chunks, self.options.max_payload_bytes, runs)
        reply = MsgType.CHUNKS if mtype is MsgType.GET_CHUNKS else MsgType.RANGES

        def request(lo: int, hi: int) -> tuple[MsgType, dict[str, Any], bytes]:
            return mtype, header(lo, hi), json.dumps(ids[lo:hi], separators=(",", ":")).encode()

        def op(c: Conn) -> list[Outcome]:
            out: list[Outcome] = []
            sent = 0
            try:
                for b, (lo, hi) in enumerate(batches):
                    if sent <= b:
                        upto = min(len(batches), b + window)
                        c.chan.send_frames(request(*batches[k]) for k in range(sent, upto))
                        sent = upto
                    _, h, plen = self._reply(c, reply, missing_ok=False)
                    out.extend(receive(c.chan, h, plen, lo, hi))
            except (PeerRequestError, ChecksumMismatchError) as e:
                c.chan.close()  # replies still in flight: out of sync
                raise PeerUnavailableError(f"peer {self.name} refused mid-stream: {e}") from e
            return out

        return self._call(op)

    def _reply(
        self, c: Conn, want: MsgType, *, missing_ok: bool = True
    ) -> tuple[MsgType, dict[str, Any], int]:
        try:  # wait for the reply to start: a stale pooled connection fails here, retryably
            started = c.chan.sock.recv(1, socket.MSG_PEEK)
        except OSError as e:
            raise PeerUnavailableError(f"peer {self.name} did not answer: {e!r}") from e
        if not started:
            raise PeerUnavailableError(f"peer {self.name} closed the connection")
        c.replied = True
        mtype, h, plen = c.chan.recv_head(allowed=[want, MsgType.ERROR])
        if mtype is MsgType.ERROR and not (missing_ok and h["code"] == "not_found"):
            if h["code"] == "checksum_mismatch":
                raise ChecksumMismatchError(f"peer {self.name}: {h['message']}")
            raise PeerRequestError(h["code"], h["message"])
        return mtype, h, plen

    def _send_push(
        self, c: Conn, msg_type: MsgType, header: dict[str, Any], payload: list[Any]
    ) -> None:
        """Send a push; if the send fails because the peer refused it early (e.g. ``too_large``
        right after the header) and closed, raise that refusal instead of a lost connection
        (and do not retry it)."""
        chan = c.chan
        try:
            chan.send(msg_type, header, payload)
        except PeerUnavailableError:
            refusal = None
            with contextlib.suppress(PeerError, OSError):  # an ERROR sent before closing?
                chan.sock.settimeout(0.5)
                _, h, _ = chan.recv_head(allowed=[MsgType.ERROR], deadline=time.monotonic() + 0.5)
                refusal = PeerRequestError(h["code"], h["message"])
            if refusal is None:
                raise  # the send's error
            c.replied = True
            raise refusal from None

    def _call(self, op: Callable[[Conn], _T]) -> _T:
        for attempt in (0, 1):
            conn, reused = self._acquire()
            try:
                result = op(conn)
            except PeerUnavailableError:
                conn.chan.close()
                if reused and attempt == 0 and not conn.replied:
                    continue  # the pooled connection had gone stale (e.g. server idle timeout)
                raise
            except PeerRequestError as e:
                if e.code in _CLOSING_CODES:  # the server ends the connection after these
                    conn.chan.close()
                else:
                    self._release(conn)  # a well-formed refusal: the connection is still in sync
                raise
            except BaseException:
                conn.chan.close()
                raise
            self._release(conn)
            return result
        raise AssertionError("unreachable")  # pragma: no cover

    def _acquire(self) -> tuple[Conn, bool]:
        with self._lock:
            if self._closed:
                raise PeerUnavailableError(f"client for {self.name} is closed")
            if self._idle:
                conn = self._idle.pop()
                conn.replied = False
                return conn, True
        return self._connect(), False

    def _release(self, conn: Conn) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.options.pool_size:
                self._idle.append(conn)
                return
        conn.chan.close()

    def _connect(self) -> Conn:
        o = self.options
        try:
            sock = socket.create_connection(self.address, timeout=o.connect_timeout_s)
        except OSError as e:
            raise PeerUnavailableError(f"cannot connect to peer {self.name}: {e}") from e
        try:
            chan = client_handshake(sock, secret=self._secret, options=o, name=self.name)
        except BaseException:
            sock.close()
            raise
        with self._lock:
            self.handshakes += 1
        return Conn(chan)
