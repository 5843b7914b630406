"""Encode and strictly decode peer protocol frames and the payloads of specific messages
(pure; the frame layout and the message schemas are in ``_wire``).

Decoding is strict and bounded: a wrong magic, an unknown version, type or flag, a header or
payload over the receiver's :class:`~fastckpt.replicas._wire.WireLimits`, invalid UTF-8/JSON,
a missing, extra or ill-typed field, or a frame cut short all raise
:class:`~fastckpt.errors.ProtocolError`, and nothing else (the fuzz tests hold the decoder to
this).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from fastckpt.errors import ConfigError, ProtocolError
from fastckpt.replicas._wire import (
    MAGIC,
    MAX_BATCH_CHUNKS,
    MAX_CHUNK_ID_CHARS,
    MAX_MESSAGE_CHARS,
    NONCE_BYTES,
    PAYLOAD_TYPES,
    PREFIX,
    SCHEMAS,
    VERSION,
    Frame,
    FramePrefix,
    FrameTooLargeError,
    MsgType,
    WireLimits,
)

__all__ = [
    "check_chunk_id",
    "decode_distinct_ids",
    "decode_frame",
    "decode_header",
    "decode_id_batch",
    "decode_json_list",
    "decode_prefix",
    "encode_frame",
    "max_id_list_bytes",
    "spans_fit",
]

_U63 = (1 << 63) - 1


def spans_fit(spans: Iterable[tuple[int, int]], length: int) -> bool:
    """Whether byte ranges ``[start, stop)`` are ascending, disjoint and inside ``length``
    bytes (a GET_RANGES chunk's runs: checked by the client before asking, by the server
    against the chunk it holds)."""
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
    if kind in ("u63", "u32"):
        limit = _U63 if kind == "u63" else 0xFFFFFFFF
        return type(value) is int and 0 <= value <= limit
    if kind == "str":
        return type(value) is str and 0 < len(value) <= MAX_CHUNK_ID_CHARS and "\x00" not in value
    if kind == "msg":
        return type(value) is str and len(value) <= MAX_MESSAGE_CHARS
    if kind in ("nonce", "mac"):
        return (
            type(value) is str
            and len(value) == 2 * NONCE_BYTES
            and all(c in "0123456789abcdef" for c in value)
        )
    if kind in ("u63[]", "u32[]"):
        limit = _U63 if kind == "u63[]" else 0xFFFFFFFF
        return type(value) is list and all(type(v) is int and 0 <= v <= limit for v in value)
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
    value = _loads(raw, "chunk list")
    if (
        type(value) is not list
        or len(value) != count
        or not all(_check_value("str", v) for v in value)
    ):
        raise ProtocolError(f"chunk list must be a JSON array of {count} chunk ids")
    return value


def decode_id_batch(
    raw: bytes | bytearray | memoryview, *, count: int, what: str = "GET_CHUNKS"
) -> list[str]:
    """Decode a GET_CHUNKS (or GET_RANGES) payload: ``count`` (1..MAX_BATCH_CHUNKS) distinct
    chunk ids."""
    if not 0 < count <= MAX_BATCH_CHUNKS:
        raise ProtocolError(f"{what} asks for {count} chunks (1..{MAX_BATCH_CHUNKS} allowed)")
    return decode_distinct_ids(raw, count=count, what=what)


def decode_distinct_ids(raw: bytes | bytearray | memoryview, *, count: int, what: str) -> list[str]:
    """Decode a JSON array of exactly ``count`` distinct chunk ids (the id list of a ``what``)."""
    ids = decode_json_list(raw, count=count)
    if len(set(ids)) != count:
        raise ProtocolError(f"{what}: duplicate chunk ids")
    return ids


def max_id_list_bytes(count: int) -> int:
    """The longest JSON array of ``count`` chunk ids as ``json.dumps`` writes it (ASCII-escaped:
    at most 12 bytes a character, for one outside the BMP)."""
    return count * (12 * MAX_CHUNK_ID_CHARS + 3) + 2


def decode_frame(data: bytes | bytearray | memoryview, limits: WireLimits) -> Frame:
    """Decode exactly one whole frame from ``data`` (no bytes missing, none left over)."""
    data = bytes(data)
    if len(data) < PREFIX.size:
        raise ProtocolError(
            f"truncated frame: {len(data)} bytes, the prefix alone is {PREFIX.size}"
        )
    prefix = decode_prefix(data[: PREFIX.size], limits)
    end = PREFIX.size + prefix.header_len + prefix.payload_len
    if len(data) != end:
        raise ProtocolError(f"frame length mismatch: declared {end} bytes, got {len(data)}")
    header = decode_header(prefix.type, data[PREFIX.size : PREFIX.size + prefix.header_len])
    payload = data[PREFIX.size + prefix.header_len :]
    if prefix.type is MsgType.CHUNK_LIST:
        decode_json_list(payload, count=header["count"])
    elif prefix.type is MsgType.GET_CHUNKS:
        decode_id_batch(payload, count=header["count"])
    return Frame(prefix.type, header, payload)
