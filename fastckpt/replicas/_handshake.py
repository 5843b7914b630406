"""The peer handshake, and the plain (untagged) frames it is made of (internal).

HELLO, CHALLENGE, AUTH, AUTH_OK (``wire.session_keys`` derives the proofs and the frame
keys); each side's function returns the :class:`~fastckpt.replicas._channel.Channel` that
carries every later frame. Only the handshake and a server's ``busy`` refusal use
:func:`send_frame` and :func:`recv_frame_head`.
"""

from __future__ import annotations

import hmac
import socket
import time
from collections.abc import Iterable, Mapping
from typing import Any

from fastckpt.errors import AuthenticationError
from fastckpt.replicas import wire
from fastckpt.replicas._channel import Channel, recv_prefix, send_all, recv_exact
from fastckpt.replicas._transport import PeerRequestError
from fastckpt.replicas.wire import MsgType

__all__ = ["client_handshake", "recv_frame_head", "send_frame", "server_handshake"]


def recv_frame_head(
    sock: socket.socket,
    limits: wire.WireLimits,
    *,
    allowed: Iterable[MsgType] | None = None,
    first_byte_timeout_s: float | None = None,
    timeout_s: float | None = None,
    deadline: float | None = None,
) -> tuple[MsgType, dict[str, Any], int]:
    """Receive an untagged frame's prefix and header (the handshake's); leave its payload.

    Args:
        sock: A connected blocking socket.
        limits: Bounds checked before the header and payload are read.
        allowed: If given, message types outside it raise ``ProtocolError``.
        first_byte_timeout_s: Timeout for the wait until the frame starts (e.g. the idle
            timeout between requests); ``timeout_s`` applies to everything after.
        timeout_s: Timeout for every later receive (None: leave the socket's timeout).
        deadline: ``time.monotonic()`` by which the whole prefix and header must have
            arrived (overrides the timeouts; e.g. an authentication handshake's).

    Returns:
        ``(type, header, payload_len)``; the caller must consume ``payload_len`` bytes next.
    """
    _, head = recv_prefix(sock, limits, allowed, first_byte_timeout_s, timeout_s, deadline)
    raw = bytearray(head.header_len)
    recv_exact(sock, memoryview(raw), deadline=deadline)
    return head.type, wire.decode_header(head.type, raw), head.payload_len


def send_frame(sock: socket.socket, msg_type: MsgType, header: Mapping[str, Any]) -> None:
    """Send one untagged frame without payload (the handshake's, a ``busy`` refusal).

    Raises:
        PeerUnavailableError: the send failed or stalled past the socket timeout.
    """
    send_all(sock, wire.encode_frame(msg_type, header), msg_type.name)


def client_handshake(sock: socket.socket, *, secret: bytes, frame_mac: bool,
                     limits: wire.WireLimits, timeout_s: float, name: str) -> Channel:
    """Authenticate ``sock`` as a client (HELLO, CHALLENGE, AUTH, AUTH_OK) within ``timeout_s``.

    Raises:
        AuthenticationError: the server cannot prove the secret for this handshake (other
            secret, altered handshake), runs another ``frame_mac`` mode, or refused us.
        PeerRequestError: the server refused otherwise (e.g. ``busy``).
        PeerUnavailableError, ProtocolError: the connection failed or spoke garbage.
    """
    sock.settimeout(timeout_s)
    deadline = time.monotonic() + timeout_s  # for the whole handshake
    client_nonce = wire.new_nonce()
    send_frame(sock, MsgType.HELLO, {"nonce": client_nonce.hex(), "frame_mac": frame_mac})
    mtype, h, _ = recv_frame_head(sock, wire.AUTH_LIMITS,
                                  allowed=[MsgType.CHALLENGE, MsgType.ERROR], deadline=deadline)
    if mtype is MsgType.ERROR:
        if h["code"] == "auth_failed":
            raise AuthenticationError(f"peer {name} refused the handshake: {h['message']}")
        raise PeerRequestError(h["code"], h["message"])
    if h["frame_mac"] != frame_mac:
        raise AuthenticationError(f"peer {name} runs with frame_mac={h['frame_mac']}, this "
                                  f"client with frame_mac={frame_mac}: set PeerOptions alike")
    keys = wire.session_keys(secret, client_nonce=client_nonce,
                             server_nonce=bytes.fromhex(h["nonce"]), frame_mac=frame_mac)
    if not hmac.compare_digest(keys.server_proof, bytes.fromhex(h["mac"])):
        raise AuthenticationError(f"peer {name} failed to prove it knows our secret for this "
                                  "handshake (secrets differ, or the handshake was altered)")
    send_frame(sock, MsgType.AUTH, {"mac": keys.client_proof.hex()})
    mtype, h, _ = recv_frame_head(sock, wire.AUTH_LIMITS,
                                  allowed=[MsgType.AUTH_OK, MsgType.ERROR], deadline=deadline)
    if mtype is MsgType.ERROR:
        if h["code"] == "auth_failed":
            raise AuthenticationError(f"peer {name} refused our proof (secrets differ?): "
                                      f"{h['message']}")
        raise PeerRequestError(h["code"], h["message"])
    return Channel(sock, limits=limits, role="client",
                   send_key=keys.client_key if frame_mac else None,
                   recv_key=keys.server_key if frame_mac else None)


def server_handshake(sock: socket.socket, *, secret: bytes, frame_mac: bool,
                     limits: wire.WireLimits, timeout_s: float) -> Channel:
    """Authenticate the client on ``sock`` (the server's side) within ``timeout_s``.

    Before it succeeds only HELLO and AUTH frames of at most ``AUTH_LIMITS`` are accepted.

    Raises:
        AuthenticationError: the client's proof is wrong, or it asked for another
            ``frame_mac`` mode (``ERROR auth_failed`` was sent, saying which).
        PeerUnavailableError, ProtocolError: the connection failed or spoke garbage.
    """
    sock.settimeout(timeout_s)
    deadline = time.monotonic() + timeout_s  # for the whole handshake, not each receive
    _, hello, _ = recv_frame_head(sock, wire.AUTH_LIMITS, allowed=[MsgType.HELLO],
                                  deadline=deadline)
    if hello["frame_mac"] != frame_mac:
        message = (f"frame_mac mismatch: this server runs with frame_mac={frame_mac}, the "
                   f"client asked for frame_mac={hello['frame_mac']}")
        send_frame(sock, MsgType.ERROR, {"code": "auth_failed", "message": message})
        raise AuthenticationError(message)
    client_nonce, server_nonce = bytes.fromhex(hello["nonce"]), wire.new_nonce()
    keys = wire.session_keys(secret, client_nonce=client_nonce, server_nonce=server_nonce,
                             frame_mac=frame_mac)
    send_frame(sock, MsgType.CHALLENGE, {"nonce": server_nonce.hex(), "frame_mac": frame_mac,
                                         "mac": keys.server_proof.hex()})
    _, auth, _ = recv_frame_head(sock, wire.AUTH_LIMITS, allowed=[MsgType.AUTH], deadline=deadline)
    if not hmac.compare_digest(keys.client_proof, bytes.fromhex(auth["mac"])):
        send_frame(sock, MsgType.ERROR, {"code": "auth_failed", "message": "authentication failed"})
        raise AuthenticationError("a client failed to prove it knows the secret")
    send_frame(sock, MsgType.AUTH_OK, {})
    return Channel(sock, limits=limits, role="server",
                   send_key=keys.server_key if frame_mac else None,
                   recv_key=keys.client_key if frame_mac else None)
