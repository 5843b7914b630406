"""The connection pool under :class:`~fastckpt.replicas._client.PeerClient` (internal).

Authenticated connections to one peer server, borrowed per call and returned when the call
left them in sync; a call whose reused connection turns out to be closed is retried once on
a fresh one (every request is idempotent); batch requests are pipelined over one connection
(:meth:`ConnectionPool._stream`). How replies and refusals map to errors is here too.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar

from fastckpt.errors import ChecksumMismatchError, PeerError, PeerRequestError, PeerUnavailableError
from fastckpt.replicas import _connection
from fastckpt.replicas._batched import Outcome
from fastckpt.replicas._channel import Channel
from fastckpt.replicas._connection import PeerOptions, check_secret, tune
from fastckpt.replicas._wire import MsgType

__all__ = ["Conn", "ConnectionPool", "Request"]

_T = TypeVar("_T")
Request = tuple[MsgType, dict[str, Any], bytes]


class Conn:
    """One pooled connection: its channel, and whether the current request got a reply."""

    __slots__ = ("chan", "replied")

    def __init__(self, chan: Channel) -> None:
        self.chan = chan
        self.replied = False
        """Whether the current request got any reply (then it must not be retried)."""


_CLOSING_CODES = frozenset({"too_large", "bad_request", "internal", "auth_failed"})
"""ERROR codes after which a server may have closed the connection (a malformed or oversized
request, or a server fault): such a connection is not reused."""


def _early_refusal(chan: Channel) -> PeerRequestError | None:
    """The ERROR frame a peer sent before closing, if one is readable now (None otherwise)."""
    try:
        chan.sock.settimeout(0.5)
        _mtype, h, _ = chan.recv_head(allowed=[MsgType.ERROR], deadline=time.monotonic() + 0.5)
    except (PeerError, OSError):
        return None
    return PeerRequestError(h["code"], h["message"])


class ConnectionPool:
    """Authenticated connections to one peer server (the base of ``PeerClient``; its
    docstring has the arguments and errors). Thread-safe."""

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
        self._limits = self.options.limits
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

    def _stream(
        self,
        batches: Sequence[tuple[int, int]],
        request: Callable[[int, int], Request],
        receive: Callable[[Conn, int, int], list[Outcome]],
        window: int,
    ) -> list[Outcome]:
        """Send the batch requests ``request(lo, hi)`` over one connection, up to ``window``
        ahead of the replies (several frames in one send; they are numbered in that order),
        and collect ``receive(conn, lo, hi)`` of each in order."""

        def op(c: Conn) -> list[Outcome]:
            out: list[Outcome] = []
            sent = 0
            try:
                for b, (lo, hi) in enumerate(batches):
                    if sent <= b:
                        upto = min(len(batches), b + window)
                        c.chan.send_frames(request(*batches[k]) for k in range(sent, upto))
                        sent = upto
                    out.extend(receive(c, lo, hi))
            except (
                PeerRequestError,
                ChecksumMismatchError,
            ) as e:  # replies still in flight: out of sync
                c.chan.close()
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
        if mtype is MsgType.ERROR:
            if h["code"] == "not_found" and missing_ok:
                return mtype, h, plen
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
        try:
            c.chan.send(msg_type, header, payload)
        except PeerUnavailableError:
            refusal = _early_refusal(c.chan)
            if refusal is None:
                raise
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
            tune(sock, o)
            chan = _connection.client_handshake(
                sock, secret=self._secret, options=o, name=self.name
            )
        except BaseException:
            sock.close()
            raise
        with self._lock:
            self.handshakes += 1
        return Conn(chan)
