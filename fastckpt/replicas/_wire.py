"""The peer wire protocol (version 2; the frame layout: ``docs/replicas.md``, "Wire
protocol"): length-prefixed frames with a JSON header of exactly its type's ``SCHEMAS`` fields,
their encoding and strict decoding. No pickle, no sockets (``_channel`` moves frames; the
handshake and frame tags are in ``_wire_auth``).

Decoding is strict and bounded: a wrong magic, an unknown version, type or flag, a header or
payload over the receiver's :class:`WireLimits`, invalid UTF-8/JSON, a duplicate, missing,
extra or ill-typed field, or a frame cut short all raise
:class:`~fastckpt.errors.ProtocolError`, and nothing else.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import struct
from collections.abc import Iterable, Mapping
from typing import Any

from fastckpt.errors import ConfigError, ProtocolError

__all__ = [
    "AUTH_LIMITS",
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
    "FramePrefix",
    "FrameTooLargeError",
    "MsgType",
    "WireLimits",
    "check_chunk_id",
    "decode_header",
    "decode_id_batch",
    "decode_json_list",
    "decode_prefix",
    "encode_frame",
    "max_id_list_bytes",
    "spans_fit",
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
    """Message types (fields: ``SCHEMAS``; the handshake: ``_wire_auth``). Clients send HELLO,
    AUTH and the requests, servers the rest."""

    HELLO = 1
    CHALLENGE = 2
    AUTH = 3
    AUTH_OK = 4
    LIST = 19
    CHUNK_LIST = 20
    GET_MANIFEST = 21
    MANIFEST = 22
    PUT_MANIFEST = 23
    STEPS = 24
    STEP_LIST = 25
    OK = 26
    PUT_CHUNKS = 27
    GET_CHUNKS = 28
    CHUNKS = 29
    ERROR = 31
    GET_RANGES = 32
    RANGES = 33
    PUT_PARITY = 34
    GET_STREAM = 35
    STREAM = 36
    REBUILD = 37
    REBUILT = 38


#: Each type's header fields and their kinds: "u63" int in [0, 2**63), "u32", "str" (chunk id),
#: "msg" (short text), "nonce"/"mac" (64 hex chars), "u63[]"/"u32[]" (lists), "bool". What
#: each field and payload means: the message table in docs/replicas.md.
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
    MsgType.STEP_LIST: {"steps": "u63[]", "committed": "u63[]", "manifests": "u63[]"},
    MsgType.OK: {"stored": "bool"},
    # Payload: a JSON array of ``count`` chunk ids (``ids_len`` bytes), then the chunks.
    MsgType.PUT_CHUNKS: {
        "step": "u63",
        "count": "u63",
        "ids_len": "u63",
        "lengths": "u63[]",
        "crcs": "u32[]",
    },
    MsgType.GET_CHUNKS: {"step": "u63", "count": "u63"},
    # Per requested id, in order; ``missing``: indexes not held. Payload: the held chunks.
    MsgType.CHUNKS: {"lengths": "u63[]", "crcs": "u32[]", "missing": "u63[]"},
    MsgType.ERROR: {"code": "msg", "message": "msg"},
    # Chunk ``i`` of the payload's ids asks for ``runs[i]`` ranges ``[starts[j], stops[j])``.
    MsgType.GET_RANGES: {
        "step": "u63",
        "count": "u63",
        "runs": "u63[]",
        "starts": "u63[]",
        "stops": "u63[]",
    },
    # ``gaps``: per held chunk, the crc32c of its bytes around its ranges (runs + 1 values).
    MsgType.RANGES: {"lengths": "u63[]", "gaps": "u32[]", "missing": "u63[]"},
    # Parity (``_parity``): ``group`` is a JSON array of member ids, ``offset`` in the part.
    MsgType.PUT_PARITY: {
        "step": "u63",
        "group": "str",
        "contributor": "str",
        "stream_len": "u63",
        "part_size": "u63",
        "offset": "u63",
    },
    MsgType.GET_STREAM: {
        "step": "u63",
        "anchor": "str",
        "offset": "u63",
        "length": "u63",
        "stream_len": "u63",
    },
    MsgType.STREAM: {},
    # ``anchors``: a JSON object member id -> a chunk id of that member's stream.
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


_U63 = (1 << 63) - 1
_HEX = frozenset("0123456789abcdef")


def spans_fit(spans: Iterable[tuple[int, int]], length: int) -> bool:
    """Whether byte ranges ``[start, stop)`` are ascending, disjoint and inside ``length``
    bytes (a GET_RANGES chunk's runs)."""
    pos = 0
    for start, stop in spans:
        if not pos <= start <= stop:
            return False
        pos = stop
    return pos <= length


def check_chunk_id(chunk_id: str) -> str:
    """Return ``chunk_id`` if the protocol can carry it, else raise ``ConfigError`` (a caller
    bug)."""
    if not _check_value("str", chunk_id):
        raise ConfigError(
            f"chunk id must be a non-empty str of <= {MAX_CHUNK_ID_CHARS} chars without NUL"
        )
    return chunk_id


def encode_frame(msg_type: MsgType, header: Mapping[str, Any], payload_len: int = 0) -> bytes:
    """Prefix + JSON header for a frame whose ``payload_len`` payload bytes follow.

    Raises:
        ProtocolError: the header does not match the message type's schema (a bug in the
            sender; checked so that a peer never receives a frame it would refuse).
    """
    _check_fields(msg_type, dict(header))
    if payload_len and msg_type not in PAYLOAD_TYPES:
        raise ProtocolError(f"{msg_type.name} carries no payload")
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()
    return PREFIX.pack(MAGIC, VERSION, int(msg_type), 0, len(raw), payload_len) + raw


def decode_prefix(data: bytes | bytearray | memoryview, limits: WireLimits) -> FramePrefix:
    """Validate and decode a 20-byte frame prefix against ``limits``."""
    if len(data) != PREFIX.size:
        raise ProtocolError(f"frame prefix must be {PREFIX.size} bytes, got {len(data)}")
    magic, version, mtype, flags, header_len, payload_len = PREFIX.unpack(data)
    if magic != MAGIC:
        raise ProtocolError("bad frame magic (not a fastckpt peer)")
    if version != VERSION:
        raise ProtocolError(
            f"unsupported peer protocol version {version} (this side speaks {VERSION})"
        )
    try:
        msg_type = MsgType(mtype)
    except ValueError:
        raise ProtocolError(f"unknown message type {mtype}") from None
    if flags:
        raise ProtocolError(f"unknown frame flags {flags:#x}")
    if header_len > limits.max_header_bytes:
        raise FrameTooLargeError(
            f"header of {header_len} bytes exceeds the limit of {limits.max_header_bytes}"
        )
    if payload_len and msg_type not in PAYLOAD_TYPES:
        raise ProtocolError(f"{msg_type.name} must not carry a payload")
    if payload_len > limits.max_payload_bytes:
        raise FrameTooLargeError(
            f"payload of {payload_len} bytes exceeds the limit of {limits.max_payload_bytes}"
        )
    return FramePrefix(msg_type, header_len, payload_len)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ProtocolError("duplicate key in frame header")
    return out


def _no_constants(name: str) -> Any:
    raise ProtocolError(f"non-finite number {name} in frame header")


def _loads(raw: bytes | bytearray | memoryview, what: str) -> Any:
    try:
        text = bytes(raw).decode("utf-8")
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
    except ProtocolError:
        raise
    except (ValueError, RecursionError, TypeError) as e:  # UnicodeDecodeError is a ValueError
        raise ProtocolError(f"{what} is not valid UTF-8 JSON: {e}") from None


def _check_value(kind: str, value: Any) -> bool:
    if kind.endswith("[]"):
        return type(value) is list and all(_check_value(kind[:-2], v) for v in value)
    if kind in ("u63", "u32"):
        return type(value) is int and 0 <= value <= (_U63 if kind == "u63" else 0xFFFFFFFF)
    if kind == "str":
        return type(value) is str and 0 < len(value) <= MAX_CHUNK_ID_CHARS and "\x00" not in value
    if kind == "msg":
        return type(value) is str and len(value) <= MAX_MESSAGE_CHARS
    if kind in ("nonce", "mac"):
        return type(value) is str and len(value) == 2 * NONCE_BYTES and _HEX.issuperset(value)
    if kind == "bool":
        return type(value) is bool
    raise AssertionError(kind)  # pragma: no cover - SCHEMAS is closed


def _check_fields(msg_type: MsgType, header: dict[str, Any]) -> None:
    schema = SCHEMAS[msg_type]
    if set(header) != set(schema):
        missing = sorted(set(schema) - set(header))
        extra = sorted(set(header) - set(schema))
        raise ProtocolError(f"{msg_type.name} header fields: missing {missing}, unexpected {extra}")
    for name, kind in schema.items():
        if not _check_value(kind, header[name]):
            raise ProtocolError(
                f"{msg_type.name}.{name} is not a valid {kind}: {header[name]!r:.80}"
            )


def decode_header(msg_type: MsgType, raw: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Decode and validate the JSON header of a ``msg_type`` frame against ``SCHEMAS``."""
    header = _loads(raw, f"{msg_type.name} header")
    if type(header) is not dict:
        raise ProtocolError(f"{msg_type.name} header must be a JSON object")
    _check_fields(msg_type, header)
    return header


def decode_json_list(raw: bytes | bytearray | memoryview, *, count: int) -> list[str]:
    """Decode a CHUNK_LIST payload: a JSON array of exactly ``count`` non-empty strings."""
    value: list[str] = _loads(raw, "chunk list")  # (checked next)
    if not (_check_value("str[]", value) and len(value) == count):
        raise ProtocolError(f"chunk list must be a JSON array of {count} chunk ids")
    return value


def decode_id_batch(
    raw: bytes | bytearray | memoryview, *, count: int, what: str = "GET_CHUNKS"
) -> list[str]:
    """Decode the id list of a ``what`` (GET_CHUNKS, GET_RANGES, PUT_CHUNKS): a JSON array of
    ``count`` (1..MAX_BATCH_CHUNKS) distinct chunk ids."""
    if not 0 < count <= MAX_BATCH_CHUNKS:
        raise ProtocolError(f"{what} asks for {count} chunks (1..{MAX_BATCH_CHUNKS} allowed)")
    ids = decode_json_list(raw, count=count)
    if len(set(ids)) != count:
        raise ProtocolError(f"{what}: duplicate chunk ids")
    return ids


def max_id_list_bytes(count: int) -> int:
    """The longest JSON array of ``count`` chunk ids as ``json.dumps`` writes it (ASCII-escaped:
    at most 12 bytes a character, for one outside the BMP)."""
    return count * (12 * MAX_CHUNK_ID_CHARS + 3) + 2
