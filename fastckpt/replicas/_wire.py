"""The peer wire protocol (version 2): length-prefixed binary frames with a strict JSON
header, authenticated frame by frame. No pickle. Pure: no sockets here (``_channel`` moves
frames).

A frame is::

    prefix      20 bytes, big-endian: magic b"FCKP" | version u8 | type u8 | flags u16 (= 0)
                                      | header_len u32 | payload_len u64
    header      header_len bytes of UTF-8 JSON: one object whose keys are exactly the fields
                of the message type (see ``SCHEMAS``), no duplicates, no extras
    header tag  16 bytes (after the handshake, with ``frame_mac``)
    payload     payload_len raw bytes (only message types in ``PAYLOAD_TYPES`` may carry one)
    payload tag 16 bytes (after the handshake, with ``frame_mac``, if payload_len > 0)

The handshake and the frame tags are in ``_wire_auth``, encoding and strict decoding in
``_wire_codec``; this module holds what they share: the message types, their schemas and
the frame layout's constants and limits.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from collections.abc import Mapping
from typing import Any

from fastckpt.errors import ProtocolError

__all__ = [
    "AUTH_LIMITS",
    "ERROR_CODES",
    "MAGIC",
    "MAX_BATCH_CHUNKS",
    "MAX_BATCH_RUNS",
    "MAX_CHUNK_ID_CHARS",
    "MAX_MESSAGE_CHARS",
    "NONCE_BYTES",
    "PAYLOAD_TYPES",
    "PREFIX",
    "SCHEMAS",
    "TAG_BYTES",
    "VERSION",
    "Frame",
    "FramePrefix",
    "FrameTooLargeError",
    "MsgType",
    "WireLimits",
]

MAGIC = b"FCKP"
VERSION = 2
#: magic, version, type, flags, header_len, payload_len.
PREFIX = struct.Struct(">4sBBHIQ")
NONCE_BYTES = 32
MAX_CHUNK_ID_CHARS = 16384
MAX_MESSAGE_CHARS = 4096
#: Most chunks one GET_CHUNKS or GET_RANGES may ask for (keeps every header of theirs below 64 KiB).
MAX_BATCH_CHUNKS = 1024
#: Most byte ranges one GET_RANGES may ask for, over all its chunks (the same reason).
MAX_BATCH_RUNS = 1024
#: Bytes of a frame tag (GMAC).
TAG_BYTES = 16


class MsgType(enum.IntEnum):
    """Message types. Requests are sent by clients, the rest by servers."""

    HELLO = 1
    """Client → server: ``nonce`` (client nonce), ``frame_mac`` (the client's mode)."""
    CHALLENGE = 2
    """Server → client: ``nonce`` (server nonce), ``frame_mac`` (the server's mode), ``mac``
    (server proof)."""
    AUTH = 3
    """Client → server: ``mac`` (client proof)."""
    AUTH_OK = 4
    """Server → client: the connection is authenticated."""
    LIST = 19
    CHUNK_LIST = 20
    GET_MANIFEST = 21
    MANIFEST = 22
    PUT_MANIFEST = 23
    STEPS = 24
    STEP_LIST = 25
    OK = 26
    PUT_CHUNKS = 27
    """Client → server: several chunks of one step, stored as one segment (see ``SCHEMAS``)."""
    GET_CHUNKS = 28
    """Client → server: several whole chunks of one step, answered by one CHUNKS frame."""
    CHUNKS = 29
    """Server → client: the chunks a GET_CHUNKS asked for, back to back (see ``SCHEMAS``)."""
    ERROR = 31
    GET_RANGES = 32
    """Client → server: a byte range of each of several chunks of one step (see ``SCHEMAS``)."""
    RANGES = 33
    """Server → client: the ranges a GET_RANGES asked for, back to back, with the checksums
    of each chunk's bytes around its range (the client checks the whole chunk's crc32c)."""
    PUT_PARITY = 34
    """Client → server: a window of the contributor's stream part for the server's parity."""
    GET_STREAM = 35
    """Client → server: a byte range of the server's own stream of a step (parity rebuild)."""
    STREAM = 36
    """Server → client: the range a GET_STREAM asked for, cut at the stream's end."""
    REBUILD = 37
    """Client → server: a range of a lost member's part the server holds the parity of."""
    REBUILT = 38
    """Server → client: the rebuilt bytes a REBUILD asked for."""


#: Field kinds: "u63" int in [0, 2**63), "u32", "str" (chunk id), "msg" (short text),
#: "nonce"/"mac" (64 hex chars), "u63[]"/"u32[]" (lists), "bool".
SCHEMAS: Mapping[MsgType, Mapping[str, str]] = {
    MsgType.HELLO: {"nonce": "nonce", "frame_mac": "bool"},
    MsgType.CHALLENGE: {"nonce": "nonce", "frame_mac": "bool", "mac": "mac"},
    MsgType.AUTH: {"mac": "mac"},
    MsgType.AUTH_OK: {},
    MsgType.LIST: {"step": "u63"},
    MsgType.CHUNK_LIST: {"count": "u63"},
    MsgType.GET_MANIFEST: {"step": "u63"},
    MsgType.MANIFEST: {},
    MsgType.PUT_MANIFEST: {"step": "u63"},
    MsgType.STEPS: {},
    # ``committed``: steps with a manifest or a commit record; ``manifests``: with a manifest.
    MsgType.STEP_LIST: {"steps": "u63[]", "committed": "u63[]", "manifests": "u63[]"},
    MsgType.OK: {"stored": "bool"},
    # Payload: a JSON array of ``count`` chunk ids (``ids_len`` bytes), then the chunks'
    # bytes back to back in that order; ``lengths[i]``/``crcs[i]`` describe chunk ``i``.
    MsgType.PUT_CHUNKS: {
        "step": "u63",
        "count": "u63",
        "ids_len": "u63",
        "lengths": "u63[]",
        "crcs": "u32[]",
    },
    # Payload: a JSON array of ``count`` (<= MAX_BATCH_CHUNKS) distinct chunk ids.
    MsgType.GET_CHUNKS: {"step": "u63", "count": "u63"},
    # One entry per requested id, in request order; ``missing`` lists the indexes the server
    # does not hold (their lengths/crcs are 0). Payload: the held chunks back to back.
    MsgType.CHUNKS: {"lengths": "u63[]", "crcs": "u32[]", "missing": "u63[]"},
    MsgType.ERROR: {"code": "msg", "message": "msg"},
    # Payload: a JSON array of ``count`` (<= MAX_BATCH_CHUNKS) distinct chunk ids. Chunk ``i``
    # asks for ``runs[i]`` (>= 1) byte ranges ``[starts[j], stops[j])``, ascending and disjoint;
    # ``starts``/``stops`` hold every chunk's in turn (at most MAX_BATCH_RUNS in all).
    MsgType.GET_RANGES: {
        "step": "u63",
        "count": "u63",
        "runs": "u63[]",
        "starts": "u63[]",
        "stops": "u63[]",
    },
    # One ``lengths`` entry per requested id, in request order (the held chunk's length);
    # ``gaps``: for each held chunk in turn, the crc32c of its bytes before, between and after
    # its ranges (runs + 1 values); ``missing`` lists the indexes the server does not hold or
    # whose ranges do not fit the chunk (their length is 0, they have no gaps).
    # Payload: every held chunk's ranges back to back.
    MsgType.RANGES: {"lengths": "u63[]", "gaps": "u32[]", "missing": "u63[]"},
    # Parity (``_parity``): ``group`` is a JSON array of member ids (the group in order);
    # ``offset`` is where the payload lies in the contributor's part (``part_size`` bytes of
    # its ``stream_len``-byte stream).
    MsgType.PUT_PARITY: {
        "step": "u63",
        "group": "str",
        "contributor": "str",
        "stream_len": "u63",
        "part_size": "u63",
        "offset": "u63",
    },
    # ``anchor``: a chunk id of the server's own stream (names its segment).
    MsgType.GET_STREAM: {
        "step": "u63",
        "anchor": "str",
        "offset": "u63",
        "length": "u63",
        "stream_len": "u63",
    },
    MsgType.STREAM: {},
    # ``offset``/``length``: within the lost member's part held by the server; ``anchors``: a
    # JSON object member id -> a chunk id of that member's stream (the survivors to read).
    MsgType.REBUILD: {
        "step": "u63",
        "lost": "str",
        "stream_len": "u63",
        "offset": "u63",
        "length": "u63",
        "anchors": "str",
    },
    MsgType.REBUILT: {},
}

#: Message types that may carry a payload; every other type must have ``payload_len == 0``.
PAYLOAD_TYPES = frozenset(
    {
        MsgType.PUT_CHUNKS,
        MsgType.CHUNK_LIST,
        MsgType.MANIFEST,
        MsgType.PUT_MANIFEST,
        MsgType.GET_CHUNKS,
        MsgType.CHUNKS,
        MsgType.GET_RANGES,
        MsgType.RANGES,
        MsgType.PUT_PARITY,
        MsgType.STREAM,
        MsgType.REBUILT,
    }
)

#: ERROR codes a server sends. Clients map them onto the :mod:`fastckpt.errors` tree.
ERROR_CODES = frozenset(
    {
        "not_found",
        "bad_request",
        "too_large",
        "auth_failed",
        "stale_step",
        "budget",
        "checksum_mismatch",
        "busy",
        "internal",
    }
)


class FrameTooLargeError(ProtocolError):
    """A frame's header or payload exceeds the receiver's :class:`WireLimits`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class WireLimits:
    """Upper bounds a receiver enforces before it reads a frame's header or payload."""

    max_header_bytes: int = 64 << 10
    """Largest JSON header accepted."""
    max_payload_bytes: int = 1 << 30
    """Largest payload accepted (a chunk, a manifest or a chunk list)."""


#: The limits of the unauthenticated phase: tiny headers, no payloads.
AUTH_LIMITS = WireLimits(max_header_bytes=1024, max_payload_bytes=0)


@dataclasses.dataclass(frozen=True, slots=True)
class FramePrefix:
    """The decoded fixed-size prefix of a frame."""

    type: MsgType
    header_len: int
    payload_len: int


@dataclasses.dataclass(frozen=True, slots=True)
class Frame:
    """A whole decoded frame (used by :func:`decode_frame`; sockets stream payloads instead)."""

    type: MsgType
    header: dict[str, Any]
    payload: bytes
