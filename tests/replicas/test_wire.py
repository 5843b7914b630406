"""Wire protocol: round trips, strict rejection, and fuzzing (ProtocolError and nothing else)."""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastckpt.errors import ProtocolError
from fastckpt.replicas import _wire as wire
from fastckpt.replicas import _wire_auth as wire_auth
from fastckpt.replicas._wire import MsgType, WireLimits

LIMITS = WireLimits(max_header_bytes=4096, max_payload_bytes=1 << 16)
NONCE = "ab" * 32


def decode_frame(data: bytes, limits: WireLimits) -> tuple[MsgType, dict[str, Any], bytes]:
    """Decode exactly one whole frame from ``data`` with the receiver's pieces (prefix, header,
    id-list payloads), as a socket would see it arrive."""
    if len(data) < wire.PREFIX.size:
        raise ProtocolError(f"truncated frame: {len(data)} bytes")
    prefix = wire.decode_prefix(data[: wire.PREFIX.size], limits)
    end = wire.PREFIX.size + prefix.header_len + prefix.payload_len
    if len(data) != end:
        raise ProtocolError(f"frame length mismatch: declared {end} bytes, got {len(data)}")
    header = wire.decode_header(prefix.type, data[wire.PREFIX.size : end - prefix.payload_len])
    payload = data[end - prefix.payload_len :]
    if prefix.type is MsgType.CHUNK_LIST:
        wire.decode_json_list(payload, count=header["count"])
    elif prefix.type is MsgType.GET_CHUNKS:
        wire.decode_id_batch(payload, count=header["count"])
    return prefix.type, header, payload


VALID: list[tuple[MsgType, dict[str, Any], bytes]] = [
    (MsgType.HELLO, {"nonce": NONCE, "frame_mac": True}, b""),
    (MsgType.CHALLENGE, {"nonce": NONCE, "frame_mac": False, "mac": "0f" * 32}, b""),
    (MsgType.AUTH, {"mac": "00" * 32}, b""),
    (MsgType.AUTH_OK, {}, b""),
    (
        MsgType.GET_STREAM,
        {"step": 2**63 - 1, "anchor": "p['w']@0:4", "offset": 3, "length": 5, "stream_len": 9},
        b"",
    ),
    (MsgType.STREAM, {}, b"abc"),
    (
        MsgType.GET_STREAM,
        {"step": 1, "anchor": "ü@0:1", "offset": 0, "length": 2, "stream_len": 2},
        b"",
    ),
    (MsgType.LIST, {"step": 0}, b""),
    (MsgType.CHUNK_LIST, {"count": 2}, b'["a","b"]'),
    (MsgType.GET_MANIFEST, {"step": 1}, b""),
    (MsgType.MANIFEST, {}, b"{}"),
    (MsgType.PUT_MANIFEST, {"step": 1}, b"{}"),
    (MsgType.STEPS, {}, b""),
    (MsgType.STEP_LIST, {"steps": [1, 2], "committed": [2], "manifests": []}, b""),
    (MsgType.OK, {"stored": False}, b""),
    (MsgType.GET_CHUNKS, {"step": 3, "count": 2}, b'["a","p[\'w\']@0:4"]'),
    (MsgType.CHUNKS, {"lengths": [3, 0, 1], "crcs": [7, 0, 2**32 - 1], "missing": [1]}, b"abcd"),
    (MsgType.ERROR, {"code": "not_found", "message": "nope"}, b""),
    (
        MsgType.GET_RANGES,
        {"step": 3, "count": 2, "runs": [2, 1], "starts": [0, 5, 5], "stops": [4, 9, 5]},
        b'["a","b"]',
    ),
    (MsgType.RANGES, {"lengths": [9, 0], "gaps": [0, 7, 2**32 - 1], "missing": [1]}, b"abcd"),
]


STREAM_REQ = b'{"step":1,"anchor":"x","offset":0,"length":0,"stream_len":0}'  # a GET_STREAM


def frame(t: MsgType, h: dict[str, Any], payload: bytes = b"") -> bytes:
    return wire.encode_frame(t, h, len(payload)) + payload


def raw_frame(
    t: int,
    header: bytes,
    payload: bytes = b"",
    *,
    magic: bytes = b"FCKP",
    version: int = 2,
    flags: int = 0,
) -> bytes:
    return (
        struct.pack(">4sBBHIQ", magic, version, t, flags, len(header), len(payload))
        + header
        + payload
    )


@pytest.mark.parametrize(
    ("t", "h", "payload"), VALID, ids=[f"{t.name}-{i}" for i, (t, _, _) in enumerate(VALID)]
)
def test_round_trip(t: MsgType, h: dict[str, Any], payload: bytes) -> None:
    assert decode_frame(frame(t, h, payload), LIMITS) == (t, h, payload)


@pytest.mark.parametrize(
    "data",
    [
        raw_frame(35, STREAM_REQ, magic=b"HTTP"),
        raw_frame(35, STREAM_REQ, version=1),  # v1: untagged
        raw_frame(35, STREAM_REQ, version=3),
        raw_frame(99, b"{}"),
        raw_frame(4, b"{}", flags=1),
        raw_frame(4, b"{}", b"payload-not-allowed"),
        raw_frame(4, b"[]"),
        raw_frame(4, b'{"extra":1}'),
        raw_frame(35, STREAM_REQ.replace(b'"step":1', b'"step":-1')),
        raw_frame(35, STREAM_REQ.replace(b'"step":1', b'"step":true')),
        raw_frame(35, STREAM_REQ.replace(b'"step":1', b'"step":1.0')),
        raw_frame(35, STREAM_REQ.replace(b'"x"', b'""')),
        raw_frame(35, STREAM_REQ.replace(b'"x"', b'"a\\u0000b"')),
        raw_frame(35, STREAM_REQ.replace(b'"step":1', b'"step":1,"step":1')),
        raw_frame(35, STREAM_REQ.replace(b',"stream_len":0', b"")),
        raw_frame(35, STREAM_REQ.replace(b'"step":1', b'"step":' + b"9" * 5000)),
        raw_frame(
            27,
            b'{"step":1,"count":1,"ids_len":5,"lengths":[0],"crcs":[4294967296]}',
            b'["a"]',
        ),
        raw_frame(24, b"{\xff}"),
        raw_frame(24, b"[" * 3000 + b"]" * 3000),
        raw_frame(25, b'{"steps":[NaN],"committed":[]}'),
        raw_frame(25, b'{"steps":[Infinity],"committed":[]}'),
        raw_frame(1, b'{"nonce":"' + b"AB" * 32 + b'","frame_mac":true}'),
        raw_frame(1, b'{"nonce":"abc","frame_mac":true}'),
        raw_frame(1, b'{"nonce":"' + b"ab" * 32 + b'"}'),  # HELLO without frame_mac
        raw_frame(1, b'{"nonce":"' + b"ab" * 32 + b'","frame_mac":1}'),
        raw_frame(20, b'{"count":2}', b'["a"]'),
        raw_frame(20, b'{"count":1}', b"[1]"),
        raw_frame(28, b'{"step":1,"count":2}', b'["a","a"]'),  # GET_CHUNKS: duplicate ids
        raw_frame(28, b'{"step":1,"count":2}', b'["a"]'),  # count disagrees with the ids
        raw_frame(28, b'{"step":1,"count":0}', b"[]"),
        raw_frame(28, b'{"step":1,"count":1}', b'[""]'),
        raw_frame(
            28,
            b'{"step":1,"count":1025}',
            b"[" + b",".join(b'"%d"' % i for i in range(1025)) + b"]",
        ),
        raw_frame(29, b'{"lengths":[1],"crcs":[-1],"missing":[]}', b"a"),
        raw_frame(4, b"{}")[:-1],
        raw_frame(4, b"{}") + b"x",
        b"FCKP",
        b"",
    ],
)
def test_malformed_frames_raise_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_frame(data, LIMITS)


def test_limits_are_checked_from_the_prefix_alone() -> None:
    big_header = struct.pack(">4sBBHIQ", b"FCKP", 2, 24, 0, LIMITS.max_header_bytes + 1, 0)
    big_payload = struct.pack(">4sBBHIQ", b"FCKP", 2, 27, 0, 10, 2**63)
    for prefix in (big_header, big_payload):
        with pytest.raises(wire.FrameTooLargeError):
            wire.decode_prefix(prefix, LIMITS)
    with pytest.raises(ProtocolError):  # the unauthenticated phase accepts no payload at all
        wire.decode_prefix(struct.pack(">4sBBHIQ", b"FCKP", 2, 29, 0, 10, 1), wire.AUTH_LIMITS)


def test_encode_refuses_what_a_peer_would_refuse() -> None:
    with pytest.raises(ProtocolError):
        wire.encode_frame(MsgType.LIST, {"step": -1})
    with pytest.raises(ProtocolError):
        wire.encode_frame(MsgType.LIST, {"step": 1}, payload_len=3)


def test_session_keys_bind_secret_nonces_version_and_mode() -> None:
    """Every value the handshake derives differs from every other, and changes with any input:
    the secret, either nonce, their order, the frame_mac flag, the protocol version."""
    k, a, b = b"k" * 16, b"a" * 32, b"b" * 32
    keys = wire_auth.session_keys(k, client_nonce=a, server_nonce=b, frame_mac=True)
    values = [keys.server_proof, keys.client_proof, keys.client_key, keys.server_key]
    assert all(len(v) == 32 for v in values) and len(set(values)) == 4  # roles and directions apart
    assert keys == wire_auth.session_keys(k, client_nonce=a, server_nonce=b, frame_mac=True)
    others = [
        wire_auth.session_keys(b"j" * 16, client_nonce=a, server_nonce=b, frame_mac=True),
        wire_auth.session_keys(k, client_nonce=b, server_nonce=a, frame_mac=True),
        wire_auth.session_keys(k, client_nonce=a, server_nonce=b"c" * 32, frame_mac=True),
        wire_auth.session_keys(k, client_nonce=a, server_nonce=b, frame_mac=False),
    ]
    for other in others:
        assert not set(values) & {
            other.server_proof,
            other.client_proof,
            other.client_key,
            other.server_key,
        }
    with pytest.raises(ProtocolError):
        wire_auth.session_keys(k, client_nonce=a[:31], server_nonce=b, frame_mac=True)
    assert wire_auth.new_nonce() != wire_auth.new_nonce()


def test_session_keys_depend_on_the_protocol_version(monkeypatch: pytest.MonkeyPatch) -> None:
    k, a, b = b"k" * 16, b"a" * 32, b"b" * 32
    keys = wire_auth.session_keys(k, client_nonce=a, server_nonce=b, frame_mac=True)
    monkeypatch.setattr(wire_auth, "VERSION", wire.VERSION + 1)
    assert (
        wire_auth.session_keys(k, client_nonce=a, server_nonce=b, frame_mac=True).server_proof
        != keys.server_proof
    )


def test_tags_differ_per_direction_frame_number_and_part() -> None:
    head, key = frame(MsgType.STEPS, {}), b"k" * 32
    out = wire_auth.FrameTagger(key, wire_auth.CLIENT_TO_SERVER)
    back = wire_auth.FrameTagger(key, wire_auth.SERVER_TO_CLIENT)
    tags = [out.header_tag(head), back.header_tag(head)]
    tags.append(wire_auth.final_tag(out.payload_mac(tags[0])))
    out.next_frame()
    tags += [out.header_tag(head), wire_auth.final_tag(out.payload_mac(tags[0]))]
    assert len(set(tags)) == 5 and all(len(t) == wire.TAG_BYTES for t in tags)


def _decode_only_protocol_errors(data: bytes) -> None:
    try:
        decode_frame(data, LIMITS)
    except ProtocolError:
        pass


valid_frames = st.sampled_from([frame(t, h, p) for t, h, p in VALID])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_fuzz_random_bytes(data: bytes) -> None:
    _decode_only_protocol_errors(data)
    _decode_only_protocol_errors(b"FCKP\x01" + data)


@settings(max_examples=200, deadline=None)
@given(valid_frames, st.data())
def test_fuzz_truncated_and_mutated(data: bytes, draw: st.DataObject) -> None:
    cut = draw.draw(st.integers(0, len(data) - 1))
    with pytest.raises(ProtocolError):
        decode_frame(data[:cut], LIMITS)
    mutated = bytearray(data)
    for _ in range(draw.draw(st.integers(1, 4))):
        i = draw.draw(st.integers(0, len(data) - 1))
        mutated[i] = draw.draw(st.integers(0, 255))
    _decode_only_protocol_errors(bytes(mutated))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=2)
    ),
    max_leaves=4,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(list(MsgType)),
    st.dictionaries(
        st.sampled_from(
            ["step", "anchor", "offset", "length", "nonce", "mac", "count", "steps", "code", "x"]
        ),
        json_values,
        max_size=5,
    ),
    st.binary(max_size=20),
)
def test_fuzz_json_headers(t: MsgType, header: dict[str, Any], payload: bytes) -> None:
    raw = json.dumps(header).encode()
    _decode_only_protocol_errors(raw_frame(int(t), raw, payload))
