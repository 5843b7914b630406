"""One peer connection's frames, sent and received through a :class:`Channel` that numbers,
tags and verifies each of them (internal). The handshake (``_connection``) returns it; the
tag layout is in ``_wire_auth``.

Receiving a frame with a payload::

    mtype, header, n = chan.recv_head(allowed=[...])   # header verified before it is decoded
    crc = chan.recv_into(view)                          # any number of times, n bytes in all
    chan.drain(k) / chan.recv_bytes(k)                  # (skip or take bytes)
    chan.end_payload()                                  # verifies the payload tag

Nothing received as a payload may be used (stored, returned, decoded) before
:meth:`Channel.end_payload` returned. A tag that fails raises
:class:`~fastckpt.errors.FrameAuthenticationError`; after any failure to receive, the
channel refuses to receive again: the caller must close it, never reuse it.
"""

from __future__ import annotations

import hmac
import queue
import socket
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import crc32c as _crc32c

from fastckpt.errors import (
    ConfigError,
    FrameAuthenticationError,
    PeerUnavailableError,
    ProtocolError,
    RamBudgetError,
    StaleStepError,
)
from fastckpt.replicas import _wire as wire
from fastckpt.replicas import _wire_auth as wire_auth
from fastckpt.replicas._wire import MsgType

__all__ = ["Channel", "recv_exact", "refusal_code", "refuse", "send_all"]

_WINDOW = 4 << 20  # received bytes are checksummed and MAC-ed in windows still in cache
_SEND_PIECE = 4 << 20  # sent in pieces: MAC-ed while in cache; the timeout bounds a stall
_SMALL = 64 << 10  # frames up to this payload leave in one segment
_DRAIN_PIECE = 1 << 20


def recv_exact(sock: socket.socket, view: memoryview, *, deadline: float | None = None) -> None:
    """Fill ``view`` from ``sock``; the socket timeout bounds each receive, ``deadline``
    (``time.monotonic()``) all of them (a peer trickling bytes cannot stretch the wait).

    Raises:
        PeerUnavailableError: the peer closed early, or a receive failed or stalled.
    """
    pos, n = 0, view.nbytes
    try:
        while pos < n:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerUnavailableError(
                        f"receive timed out after {pos} of {n} bytes (deadline)"
                    )
                sock.settimeout(left)
            got = sock.recv_into(view[pos:], n - pos)
            if not got:
                raise PeerUnavailableError(f"connection closed by peer after {pos} of {n} bytes")
            pos += got
    except OSError as e:  # socket.timeout is an OSError
        raise PeerUnavailableError(f"receive failed after {pos} of {n} bytes: {e!r}") from e


def send_all(sock: socket.socket, data: bytes | memoryview, what: str) -> None:
    try:
        sock.sendall(data)
    except OSError as e:
        raise PeerUnavailableError(f"send of {what} failed: {e!r}") from e


def refusal_code(e: ConfigError | StaleStepError) -> str:
    """The ERROR code refusing a request that the tier refused with ``e``."""
    if isinstance(e, StaleStepError):
        return "stale_step"
    return "budget" if isinstance(e, RamBudgetError) else "bad_request"


def refuse(chan: Channel, code: str, message: str) -> bool:
    """Answer ERROR ``code`` (the message cut to 1000 chars); True: the connection goes on."""
    chan.send(MsgType.ERROR, {"code": code, "message": message[:1000]})
    return True


def _recv_windows(sock: socket.socket, view: memoryview, mac: Any) -> int:
    """Fill ``view`` from ``sock``; return the crc32c of its bytes and feed them to ``mac``
    (if not None) in order, window by window while still in cache (past two windows, on a
    helper thread while the next window arrives)."""
    windows = [view[off : off + _WINDOW] for off in range(0, view.nbytes, _WINDOW)]

    def check(window: memoryview, crc: int) -> int:
        if mac is not None:
            mac.authenticate_additional_data(window)
        return _crc32c.crc32c(window, crc)

    if len(windows) <= 2:
        crc = 0
        for window in windows:
            recv_exact(sock, window)
            crc = check(window, crc)
        return crc
    ready: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
    result = [0]

    def verify() -> None:
        value = 0
        while (window := ready.get()) is not None:
            value = check(window, value)
        result[0] = value

    worker = threading.Thread(target=verify, name="fastckpt-crc", daemon=True)
    worker.start()
    try:
        for window in windows:
            recv_exact(sock, window)
            ready.put(window)
    finally:
        ready.put(None)
        worker.join()
    return result[0]


class Channel:
    """An established peer connection: frames in both directions, tagged and verified when
    the handshake agreed on ``frame_mac`` (then a header is decoded only after its tag
    verified, a payload is whole and authentic once :meth:`end_payload` returned, and a frame
    injected, altered, replayed, reordered or dropped fails). Frames are numbered as they are
    encoded and must leave in that order. Not thread-safe: one user at a time.

    Args:
        sock: The connected socket (the channel owns it: :meth:`close`).
        limits: Bounds checked on every received prefix before anything else is read.
        role: This side of the connection.
        send_key, recv_key: This side's sending and receiving frame keys, or both None:
            frames untagged (the handshake's, a ``busy`` refusal, ``frame_mac=False``).
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        limits: wire.WireLimits,
        role: Literal["client", "server"] = "client",
        send_key: bytes | None = None,
        recv_key: bytes | None = None,
    ) -> None:
        self.sock = sock
        self.limits = limits
        out_dir, in_dir = wire_auth.CLIENT_TO_SERVER, wire_auth.SERVER_TO_CLIENT
        if role == "server":
            out_dir, in_dir = in_dir, out_dir
        self._out = None if send_key is None else wire_auth.FrameTagger(send_key, out_dir)
        self._in = None if recv_key is None else wire_auth.FrameTagger(recv_key, in_dir)
        self._pending: int | None = None  # payload bytes of the current frame still unread
        self._pmac: Any = None  # the current payload's tag context
        self._what = ""
        self._failed = False

    def close(self) -> None:
        self.sock.close()

    def encode(self, msg_type: MsgType, header: Mapping[str, Any], payload: bytes = b"") -> bytes:
        """One whole frame, tags included, ready to send. It takes the next frame number:
        frames must leave in the order they were encoded."""
        head, ctx = self._head(msg_type, header, len(payload))
        if ctx is None:
            return head + payload
        ctx.authenticate_additional_data(payload)
        return head + payload + wire_auth.final_tag(ctx)

    def _head(self, msg_type: MsgType, header: Mapping[str, Any], n: int) -> tuple[bytes, Any]:
        """A frame's prefix, header and header tag, and the context of its payload tag (None:
        untagged or no payload). Takes the next frame number."""
        head = wire.encode_frame(msg_type, header, n)
        if self._out is None:
            return head, None
        htag = self._out.header_tag(head)
        ctx = self._out.payload_mac(htag) if n else None
        self._out.next_frame()
        return head + htag, ctx

    def send_frames(self, frames: Iterable[tuple[MsgType, Mapping[str, Any], bytes]]) -> None:
        """Send small frames ``(type, header, payload)`` in one ``sendall`` (pipelining)."""
        send_all(self.sock, b"".join(self.encode(*f) for f in frames), "requests")

    def send(
        self,
        msg_type: MsgType,
        header: Mapping[str, Any],
        payload: Sequence[memoryview | bytes] = (),
    ) -> None:
        """Send one frame; ``payload`` parts go straight from their buffers (joined only up
        to 64 KiB), in pieces, each fed to the payload tag right before it is sent.

        Raises:
            PeerUnavailableError: a send failed or stalled past the socket timeout.
        """
        parts = [memoryview(p).cast("B") for p in payload]
        total = sum(p.nbytes for p in parts)
        if total <= _SMALL:
            send_all(self.sock, self.encode(msg_type, header, b"".join(parts)), msg_type.name)
            return
        head, ctx = self._head(msg_type, header, total)
        send_all(self.sock, head, msg_type.name)
        for part in parts:
            for off in range(0, part.nbytes, _SEND_PIECE):
                piece = part[off : off + _SEND_PIECE]
                if ctx is not None:
                    ctx.authenticate_additional_data(piece)
                send_all(self.sock, piece, msg_type.name)
        if ctx is not None:
            send_all(self.sock, wire_auth.final_tag(ctx), msg_type.name)

    def recv_head(
        self,
        *,
        allowed: Iterable[MsgType] | None = None,
        first_byte_timeout_s: float | None = None,
        timeout_s: float | None = None,
        deadline: float | None = None,
    ) -> tuple[MsgType, dict[str, Any], int]:
        """Receive the next frame's prefix, header and header tag: ``(type, header,
        payload_len)``, the payload left for the caller (module docstring).

        The prefix is checked against the limits and ``allowed`` (other types raise
        ``ProtocolError``) before anything else is read. ``first_byte_timeout_s`` bounds the
        wait until the frame starts (e.g. idle between requests), ``timeout_s`` each later
        receive (None: the socket's), ``deadline`` (``time.monotonic()``) prefix and header.

        Raises:
            FrameAuthenticationError: the header tag does not verify.
            ProtocolError: a malformed, oversized or unexpected frame.
            PeerUnavailableError: the connection failed or stalled.
        """
        self._check_usable()
        if self._pending is not None:
            raise ProtocolError("a frame was received before the previous payload was finished")
        sock = self.sock
        try:
            prefix = bytearray(wire.PREFIX.size)
            view = memoryview(prefix)
            if first_byte_timeout_s is not None:
                sock.settimeout(first_byte_timeout_s)
                recv_exact(sock, view[:1], deadline=deadline)
                view = view[1:]
            if timeout_s is not None:
                sock.settimeout(timeout_s)
            recv_exact(sock, view, deadline=deadline)
            head = wire.decode_prefix(prefix, self.limits)
            if allowed is not None and head.type not in set(allowed):
                raise ProtocolError(f"unexpected message {head.type.name}")
            tag_len = wire.TAG_BYTES if self._in is not None else 0
            raw = bytearray(head.header_len + tag_len)
            recv_exact(self.sock, memoryview(raw), deadline=deadline)
            htag = b""
            if self._in is not None:
                htag = bytes(raw[head.header_len :])
                want = self._in.header_tag(bytes(prefix) + raw[: head.header_len])
                if not hmac.compare_digest(want, htag):
                    raise FrameAuthenticationError(
                        f"{head.type.name} frame {self._in.seq} failed its header tag (forged, "
                        f"altered, replayed, reordered or after a dropped frame)"
                    )
            header = wire.decode_header(head.type, memoryview(raw)[: head.header_len])
        except BaseException:
            self._failed = True
            raise
        if head.payload_len:
            self._pending = head.payload_len
            self._pmac = None if self._in is None else self._in.payload_mac(htag)
            self._what = f"{head.type.name} frame {self._in.seq if self._in else '-'}"
        if self._in is not None:
            self._in.next_frame()
        return head.type, header, head.payload_len

    def recv_into(self, view: memoryview) -> int:
        """Receive the next ``view.nbytes`` payload bytes into ``view``; return their crc32c.
        The bytes are not authentic before :meth:`end_payload`."""
        self._take(view.nbytes)
        try:
            return _recv_windows(self.sock, view, self._pmac)
        except BaseException:
            self._failed = True
            raise

    def recv_bytes(self, n: int) -> bytearray:
        """The next ``n`` payload bytes (not authentic before :meth:`end_payload`)."""
        buf = bytearray(n)
        self.recv_into(memoryview(buf))
        return buf

    def drain(self, n: int) -> None:
        """Receive and discard the next ``n`` payload bytes (still fed to the payload tag)."""
        self._take(0)
        buf = memoryview(bytearray(min(n, _DRAIN_PIECE)))
        for off in range(0, n, _DRAIN_PIECE):
            self.recv_into(buf[: min(_DRAIN_PIECE, n - off)])

    def end_payload(self) -> None:
        """Finish the current frame's payload: every byte consumed, then its tag verified.
        A no-op for a frame without payload.

        Raises:
            FrameAuthenticationError: the payload tag does not verify (nothing of the
                payload may be used).
            ProtocolError: payload bytes were left unread (a caller bug).
        """
        self._check_usable()
        if self._pending is None:
            return
        if self._pending:
            self._failed = True
            raise ProtocolError(f"{self._pending} bytes of the {self._what} payload left unread")
        try:
            if self._pmac is not None:
                got = bytearray(wire.TAG_BYTES)
                recv_exact(self.sock, memoryview(got))
                if not hmac.compare_digest(wire_auth.final_tag(self._pmac), got):
                    raise FrameAuthenticationError(
                        f"the {self._what} payload failed its tag (forged or altered)"
                    )
        except BaseException:
            self._failed = True
            raise
        self._pending, self._pmac = None, None

    def recv_payload(self) -> bytearray:
        """The current frame's whole (small) payload, verified; empty for none."""
        if self._pending is None:
            return bytearray()
        data = self.recv_bytes(self._pending)
        self.end_payload()
        return data

    def _take(self, n: int) -> None:
        self._check_usable()
        left = self._pending or 0
        if n > left:
            self._failed = True
            raise ProtocolError(f"reading {n} payload bytes past the end of the frame")
        if n:
            self._pending = left - n

    def _check_usable(self) -> None:
        if self._failed:
            raise ProtocolError("the connection failed earlier and is out of sync")
