"""The peer protocol's handshake key schedule and frame tags (no sockets; frames: ``_wire``;
both laid out in ``docs/replicas.md``, "Authentication handshake" and "Frame tags").

:func:`session_keys` derives both proofs and one frame key per direction from the shared
secret and a transcript of every handshake field, so an altered or downgraded handshake fails
and no two connections share a key. A frame's tags are GMAC under its direction's key and
number (``seq``, implicit): each (key, nonce) pair is used once, and a frame injected,
altered, replayed (on its connection or another), reordered or dropped fails its own tag or
the next frame's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets
import struct
from typing import Any

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from fastckpt.errors import ProtocolError
from fastckpt.replicas._wire import NONCE_BYTES, VERSION

__all__ = [
    "CLIENT_TO_SERVER",
    "HEADER_TAG",
    "PAYLOAD_TAG",
    "SERVER_TO_CLIENT",
    "FrameTagger",
    "SessionKeys",
    "final_tag",
    "new_nonce",
    "session_keys",
]

_KDF_DOMAIN = b"fastckpt-peer-v2\x00"
#: The first 4 bytes of a tag's GCM nonce: which tag of the frame it is.
HEADER_TAG = 1
PAYLOAD_TAG = 2
#: The direction byte of a header tag's input.
CLIENT_TO_SERVER = 0
SERVER_TO_CLIENT = 1
_NONCE = struct.Struct(">IQ")
_SEQ = struct.Struct(">Q")


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SessionKeys:
    """What :func:`session_keys` derives for one connection (32 bytes each): the proofs that
    the server and the client know the secret and saw this transcript (CHALLENGE's and AUTH's
    ``mac``), and the AES-256 keys of the client → server and server → client frame tags."""

    server_proof: bytes
    client_proof: bytes
    client_key: bytes
    server_key: bytes


def session_keys(
    secret: bytes, *, client_nonce: bytes, server_nonce: bytes, frame_mac: bool
) -> SessionKeys:
    """The handshake proofs and frame keys of one connection: HMAC-SHA256 of distinct labels
    under ``HMAC(secret, transcript)``; the transcript (fixed-length fields: no two collide)
    holds the version, this side's ``frame_mac`` and both nonces, so an altered handshake
    fails; role labels stop a proof being reflected.

    Raises:
        ProtocolError: a nonce is not ``NONCE_BYTES`` long.
    """
    if len(client_nonce) != NONCE_BYTES or len(server_nonce) != NONCE_BYTES:
        raise ProtocolError(f"handshake nonces must be {NONCE_BYTES} bytes")
    transcript = _KDF_DOMAIN + bytes([VERSION, int(bool(frame_mac))]) + client_nonce + server_nonce
    master = hmac.new(secret, transcript, hashlib.sha256).digest()

    def label(name: bytes) -> bytes:
        return hmac.new(master, name, hashlib.sha256).digest()

    return SessionKeys(
        server_proof=label(b"server proof"),
        client_proof=label(b"client proof"),
        client_key=label(b"client->server frame key"),
        server_key=label(b"server->client frame key"),
    )


class FrameTagger:
    """The tags of one direction of a connection, under its key: frame ``seq`` (the next
    frame's number; :meth:`next_frame` moves on)."""

    __slots__ = ("_aead", "_cipher", "_direction", "seq")

    def __init__(self, key: bytes, direction: int) -> None:
        self._aead = AESGCM(key)
        self._cipher = algorithms.AES(key)
        self._direction = direction
        self.seq = 0

    def header_tag(self, head: bytes | bytearray) -> bytes:
        """The header tag of ``head`` (the frame's prefix and header)."""
        data = bytes([self._direction]) + _SEQ.pack(self.seq) + head
        return self._aead.encrypt(_NONCE.pack(HEADER_TAG, self.seq), b"", data)

    def payload_mac(self, header_tag: bytes | bytearray) -> Any:
        """The GCM context of the payload tag: ``authenticate_additional_data`` each piece in
        order, then :func:`final_tag`."""
        ctx = Cipher(self._cipher, modes.GCM(_NONCE.pack(PAYLOAD_TAG, self.seq))).encryptor()
        ctx.authenticate_additional_data(_SEQ.pack(self.seq) + bytes(header_tag))
        return ctx

    def next_frame(self) -> None:
        self.seq += 1


def final_tag(ctx: Any) -> bytes:
    """The tag of a finished :meth:`FrameTagger.payload_mac` context."""
    ctx.finalize()
    return bytes(ctx.tag)
