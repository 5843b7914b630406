"""Both ends of a peer connection: options, socket settings, and the handshake (internal).

Threads and blocking sockets, not asyncio: payloads leave with ``sendall`` straight from the
tier's mmap and arrive with ``recv_into`` straight into the caller's buffer (both release the
GIL).

Security (``docs/replicas.md``, "Security properties"): the mutual handshake returns the
:class:`~fastckpt.replicas._channel.Channel` that tags and verifies every later frame; until
it succeeds the server accepts only tiny untagged frames and reveals nothing. Traffic is
authenticated, not encrypted; a holder of the secret is a peer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import socket
import time
from typing import Any, Literal

from fastckpt.errors import AuthenticationError, ConfigError, PeerRequestError
from fastckpt.replicas import _wire as wire
from fastckpt.replicas import _wire_auth as wire_auth
from fastckpt.replicas._channel import Channel
from fastckpt.replicas._secret import MIN_SECRET_BYTES
from fastckpt.replicas._wire import MsgType

__all__ = [
    "PeerOptions",
    "check_secret",
    "client_handshake",
    "close_gracefully",
    "server_handshake",
]

_LINGER_S = 0.5  # how long a closing server connection waits for the client's EOF
_LINGER_BYTES = 4 << 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeerOptions:
    """Timeouts, limits and socket settings shared by :class:`PeerServer` and
    :class:`PeerClient`."""

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
    frame_mac: bool = True
    """Authenticate every frame after the handshake (GMAC per header and payload). Both sides
    must agree: the flag is part of the authenticated handshake, and a mismatch fails it
    (``AuthenticationError``).

    !!! warning
        False exists only to measure what the MACs cost: such connections accept forged,
        altered, replayed or injected frames from anyone on the network path (crc32c is no
        defence against a forger)."""

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "handshake_timeout_s", "io_timeout_s", "idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("max_header_bytes", "max_payload_bytes", "max_connections", "pool_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)!r}")

    @property
    def limits(self) -> wire.WireLimits:
        """The frame limits these options imply."""
        return wire.WireLimits(
            max_header_bytes=self.max_header_bytes, max_payload_bytes=self.max_payload_bytes
        )


def check_secret(secret: bytes) -> bytes:
    if not isinstance(secret, (bytes, bytearray)) or len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"the peer secret must be at least {MIN_SECRET_BYTES} bytes")
    return bytes(secret)


def close_gracefully(sock: socket.socket) -> None:
    """Close so that a last ERROR frame arrives: without reading what the client still sends,
    ``close`` would answer with a reset that can destroy the frame in flight."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
        # in total: a client trickling bytes cannot hold the thread
        deadline = time.monotonic() + _LINGER_S
        buf = bytearray(65536)
        budget = _LINGER_BYTES
        while budget > 0 and (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not (n := sock.recv_into(buf)):
                break
            budget -= n
    sock.close()


def client_handshake(
    sock: socket.socket, *, secret: bytes, options: PeerOptions, name: str
) -> Channel:
    """Authenticate ``sock`` as a client (HELLO, CHALLENGE, AUTH, AUTH_OK) within
    ``options.handshake_timeout_s``; the channel's socket then has ``options.io_timeout_s``.

    Raises:
        AuthenticationError: the server cannot prove the secret for this handshake (other
            secret, altered handshake), runs another ``frame_mac`` mode, or refused us.
        PeerRequestError: the server refused otherwise (e.g. ``busy``).
        PeerUnavailableError, ProtocolError: the connection failed or spoke garbage.
    """
    frame_mac = options.frame_mac
    plain, deadline = _plain(sock, options)
    client_nonce = wire_auth.new_nonce()
    plain.send(MsgType.HELLO, {"nonce": client_nonce.hex(), "frame_mac": frame_mac})
    h = _handshake_reply(plain, MsgType.CHALLENGE, deadline, f"peer {name} refused the handshake")
    if h["frame_mac"] != frame_mac:
        raise AuthenticationError(
            f"peer {name} runs with frame_mac={h['frame_mac']}, this "
            f"client with frame_mac={frame_mac}: set PeerOptions alike"
        )
    server_nonce = bytes.fromhex(h["nonce"])
    keys = wire_auth.session_keys(
        secret, client_nonce=client_nonce, server_nonce=server_nonce, frame_mac=frame_mac
    )
    if not hmac.compare_digest(keys.server_proof, bytes.fromhex(h["mac"])):
        raise AuthenticationError(
            f"peer {name} failed to prove it knows our secret for this "
            "handshake (secrets differ, or the handshake was altered)"
        )
    plain.send(MsgType.AUTH, {"mac": keys.client_proof.hex()})
    _handshake_reply(
        plain, MsgType.AUTH_OK, deadline, f"peer {name} refused our proof (secrets differ?)"
    )
    return _tagged(sock, options, keys.client_key, keys.server_key, "client")


def _plain(sock: socket.socket, options: PeerOptions) -> tuple[Channel, float]:
    """The untagged channel of a handshake (the socket tuned), and its deadline (for the
    whole handshake)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # buffers: kernel autotuning
    sock.settimeout(options.handshake_timeout_s)
    return Channel(sock, limits=wire.AUTH_LIMITS), time.monotonic() + options.handshake_timeout_s


def _tagged(
    sock: socket.socket,
    options: PeerOptions,
    send_key: bytes,
    recv_key: bytes,
    role: Literal["client", "server"],
) -> Channel:
    """The channel of an authenticated connection, its socket set to ``io_timeout_s``."""
    sock.settimeout(options.io_timeout_s)
    if not options.frame_mac:
        return Channel(sock, limits=options.limits, role=role)
    return Channel(sock, limits=options.limits, role=role, send_key=send_key, recv_key=recv_key)


def _handshake_reply(
    plain: Channel, expected: MsgType, deadline: float, refused: str
) -> dict[str, Any]:
    """The header of the server's ``expected`` handshake frame, or its refusal raised."""
    mtype, h, _ = plain.recv_head(allowed=[expected, MsgType.ERROR], deadline=deadline)
    if mtype is MsgType.ERROR:
        if h["code"] == "auth_failed":
            raise AuthenticationError(f"{refused}: {h['message']}")
        raise PeerRequestError(h["code"], h["message"])
    return h


def server_handshake(sock: socket.socket, *, secret: bytes, options: PeerOptions) -> Channel:
    """Authenticate the client on ``sock`` (the server's side) within
    ``options.handshake_timeout_s``; the channel's socket then has ``options.io_timeout_s``.

    Before it succeeds only HELLO and AUTH frames of at most ``AUTH_LIMITS`` are accepted.

    Raises:
        AuthenticationError: the client's proof is wrong, or it asked for another
            ``frame_mac`` mode (``ERROR auth_failed`` was sent, saying which).
        PeerUnavailableError, ProtocolError: the connection failed or spoke garbage.
    """
    frame_mac = options.frame_mac
    plain, deadline = _plain(sock, options)
    _, hello, _ = plain.recv_head(allowed=[MsgType.HELLO], deadline=deadline)
    if hello["frame_mac"] != frame_mac:
        message = (
            f"frame_mac mismatch: this server runs with frame_mac={frame_mac}, the "
            f"client asked for frame_mac={hello['frame_mac']}"
        )
        plain.send(MsgType.ERROR, {"code": "auth_failed", "message": message})
        raise AuthenticationError(message)
    client_nonce, server_nonce = bytes.fromhex(hello["nonce"]), wire_auth.new_nonce()
    keys = wire_auth.session_keys(
        secret, client_nonce=client_nonce, server_nonce=server_nonce, frame_mac=frame_mac
    )
    plain.send(
        MsgType.CHALLENGE,
        {"nonce": server_nonce.hex(), "frame_mac": frame_mac, "mac": keys.server_proof.hex()},
    )
    _, auth, _ = plain.recv_head(allowed=[MsgType.AUTH], deadline=deadline)
    if not hmac.compare_digest(keys.client_proof, bytes.fromhex(auth["mac"])):
        plain.send(MsgType.ERROR, {"code": "auth_failed", "message": "authentication failed"})
        raise AuthenticationError("a client failed to prove it knows the secret")
    plain.send(MsgType.AUTH_OK, {})
    return _tagged(sock, options, keys.server_key, keys.client_key, "server")
