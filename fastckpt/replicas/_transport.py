"""Shared pieces of the peer layer: options, the request error, socket settings (internal)."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import time

from fastckpt.errors import ConfigError, PeerError
from fastckpt.replicas import wire
from fastckpt.replicas._secret import MIN_SECRET_BYTES

__all__ = ["PeerOptions", "PeerRequestError"]

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
    max_connections: int = 256
    """Server: concurrent connections (one thread each; idle pooled client connections count
    until ``idle_timeout_s``); more are refused with ``ERROR busy``."""
    pool_size: int = 8
    """Client: idle authenticated connections kept for reuse."""
    socket_buffer_bytes: int | None = None
    """SO_SNDBUF/SO_RCVBUF; None keeps the kernel's autotuning (fastest on loopback here)."""
    accept_pushes: bool = True
    """Server: accept PUT_CHUNK/PUT_MANIFEST (peers replicating into this tier)."""
    frame_mac: bool = True
    """Authenticate every frame after the handshake (GMAC per header and payload, see
    :mod:`~fastckpt.replicas.wire`). Both sides must agree: the flag is part of the
    authenticated handshake, and a mismatch fails it (``AuthenticationError``).

    !!! warning
        False exists only to measure what the MACs cost. Such a connection still starts
        with a mutual handshake, but accepts forged, altered, replayed or injected frames
        from anyone on the network path: a restore may then return bytes the attacker
        chose (with crc32c that match: crc32c is no defence against a forger)."""

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


def check_secret(secret: bytes) -> bytes:
    if not isinstance(secret, (bytes, bytearray)) or len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"the peer secret must be at least {MIN_SECRET_BYTES} bytes")
    return bytes(secret)


def tune(sock: socket.socket, options: PeerOptions) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if options.socket_buffer_bytes is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, options.socket_buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, options.socket_buffer_bytes)


def close_gracefully(sock: socket.socket) -> None:
    """Close so that a last ERROR frame arrives: without reading what the client still sends,
    ``close`` would answer with a reset that can destroy the frame in flight."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + _LINGER_S  # in total: a client trickling bytes cannot hold the thread
        buf = bytearray(65536)
        budget = _LINGER_BYTES
        while budget > 0 and (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not (n := sock.recv_into(buf)):
                break
            budget -= n
    sock.close()
