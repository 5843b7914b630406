"""Hostile input: manifests built to break the parser or the reader, and peers that lie.

Beyond ``tests/format`` and ``tests/replicas``: values injected as raw JSON text anywhere in a
real manifest (nesting 10^5 deep, 10^4-digit integers, ``1e400``, ``NaN``, unicode, path
traversal in object keys), decodable manifests that describe impossible data, frames
generated against a live PeerServer after authentication (and before it), and a hostile
*server* answering a PeerClient. Every case must end in a typed error; the parser and the
server must never crash or hang; the server must keep serving a well-behaved client, on its
old pooled connection and on new ones.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastckpt import CheckpointManager
from fastckpt._checksum import crc32c
from fastckpt.errors import (
    AuthenticationError,
    ChecksumMismatchError,
    ConfigError,
    CorruptionError,
    FastckptError,
    FrameAuthenticationError,
    ManifestError,
    PeerError,
    PeerRequestError,
    PeerUnavailableError,
    ProtocolError,
)
from fastckpt.format.chunk_table import table_from_entries
from fastckpt.format.codec import decode_manifest, encode_manifest, seal_document
from fastckpt.format.dtypes import dtype_from_name
from fastckpt.format.manifest import ArrayLeaf, ChunkEntry, Manifest
from fastckpt.replicas import _wire as wire
from fastckpt.replicas import _wire_auth as wire_auth
from fastckpt.replicas._channel import Channel
from fastckpt.replicas._client import PeerClient
from fastckpt.replicas._connection import PeerOptions, server_handshake
from fastckpt.replicas._ram import ChunkLocation, RamTier
from fastckpt.replicas._server import PeerServer
from fastckpt.replicas._wire import MsgType
from fastckpt.storage import LocalStore, MemoryStore
from tests.support.peer_read import get_one
from tests.support.tag_raw import tag_raw
from tests.support.wrapping import ForwardingStore

from ._util import Recorder

SECRET = b"hostile-test-secret-0123456789"
#: The ERROR codes a server may send (docs/replicas.md, "Error codes").
ERROR_CODES = frozenset(
    "not_found bad_request too_large auth_failed stale_step budget checksum_mismatch busy "
    "internal".split()
)
FAST = PeerOptions(
    connect_timeout_s=2, handshake_timeout_s=1.0, io_timeout_s=1.0, max_payload_bytes=1 << 20
)

# ============================================================================ manifests


def _real_manifest(*, listed: bool = False) -> bytes:
    """A real manifest of one 2-chunk leaf (its table a grid, or ``listed`` boxes)."""
    chunk = ChunkEntry(
        box=((0, 4), (0, 8)),
        key="steps/000000000007/ab12/p00000-00000.fck",
        offset=0,
        length=128,
        raw_length=128,
        codec="raw",
        crc32c=1,
        raw_crc32c=1,
    )
    chunks = [
        chunk,
        ChunkEntry(
            box=((4, 8), (0, 8)),
            key=chunk.key,
            offset=128,
            length=128,
            raw_length=128,
            codec="raw",
            crc32c=2,
            raw_crc32c=2,
        ),
    ]
    leaf = ArrayLeaf(
        path=(("d", "params"), ("d", "w")),
        shape=(8, 8),
        dtype="float32",
        chunks=table_from_entries(chunks[::-1] if listed else chunks, shape=(8, 8), itemsize=4),
    )
    return encode_manifest(Manifest(step=7, leaves=(leaf,), metadata={"note": "x", "n": 1.5}))


# The documents without their manifest_crc32c: a value is injected into the JSON text and the
# checksum of the result put back in front (``_sealed``), so that the structural checks after
# parsing are what these tests are after, not the checksum. A leaf's table with a grid (as
# fastckpt writes a sharding) and with listed boxes.
_BASES = {
    name: {
        k: x
        for k, x in json.loads(_real_manifest(listed=name == "listed")).items()
        if k != "manifest_crc32c"
    }
    for name in ("grid", "listed")
}


def _slots(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _slots(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _slots(v, (*prefix, i))
    return out


_SLOTS = [(v, s) for v, base in _BASES.items() for s in _slots(base)]
# Where an object key is written: an "objects" entry.
_KEYS = [(v, s) for v, s in _SLOTS if len(s) == 2 and s[0] == "objects"]
assert _KEYS
_SEGMENT = st.sampled_from(
    [
        "..",
        ".",
        "",
        "steps",
        "a",
        "\\",
        "C:",
        "~",
        "%2e%2e",
        "\u2024\u2024",
        "\uff0e\uff0e",  # fullwidth full stops
        "\u202e",
        "\x00",
        "/",
        "\U0001f4a5",
        "con",
        "a b",
        "\n",
    ]
)
_TRAVERSAL = st.one_of(
    st.sampled_from(
        [
            "../x",
            "a/../../etc/passwd",
            "/etc/passwd",
            "//host/share",
            "C:\\x",
            "a//b",
            "./a",
            "a/.",
            "\\\\srv\\s",
            "a/\x00b",
            "..",
            ".",
            "",
            "a/",
            "/",
            "steps/../../../x",
        ]
    ),
    st.lists(_SEGMENT, min_size=1, max_size=6).map("/".join),
)


def _raw_json(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


_INJECT = st.one_of(
    st.integers(1, 100_000).map(lambda d: "[" * d + "]" * d),
    st.integers(1, 100_000).map(lambda d: '{"a":' * d + "1" + "}" * d),
    st.integers(19, 10_000).map(lambda n: "9" * n),
    st.sampled_from(
        [
            "1e400",
            "-1e400",
            "1e-400",
            "NaN",
            "Infinity",
            "-Infinity",
            "-0",
            "1.0",
            "-1",
            "18446744073709551616",
            "9223372036854775808",
            "true",
            "null",
            '""',
            "{}",
            "[]",
        ]
    ),
    _TRAVERSAL.map(_raw_json),
    st.text(max_size=30).map(_raw_json),
)


def _sealed(data: bytes) -> bytes:
    """``data`` with the ``manifest_crc32c`` of what it parses to put in front (the decoder
    then checks it on the canonical form), or as it is if it does not parse to an object
    (the decoder refuses it anyway)."""
    try:
        doc = json.loads(data)
        crc = seal_document(doc).split(b",", 1)[0] if isinstance(doc, dict) and doc else None
    except (ValueError, RecursionError):  # ManifestError is a ValueError
        return data
    return data if crc is None else crc + b"," + data.lstrip()[1:]


def _inject(at: tuple[str, tuple[Any, ...]], raw: str) -> bytes:
    version, slot = at
    doc = json.loads(json.dumps(_BASES[version]))
    parent = doc
    for p in slot[:-1]:
        parent = parent[p]
    parent[slot[-1]] = "\x00INJECT\x00"
    text = json.dumps(doc, ensure_ascii=False).replace('"\\u0000INJECT\\u0000"', raw)
    return _sealed(text.encode("utf-8", "surrogatepass"))


def _decode_is_safe(data: bytes, root: Path) -> Manifest | None:
    try:
        m = decode_manifest(data)
    except ManifestError:
        return None
    # Accepted: it is a valid manifest (round-trips), and every key stays inside a store root.
    again = decode_manifest(encode_manifest(m))
    assert encode_manifest(again) == encode_manifest(m)
    store = LocalStore(root)
    for key in m.object_keys():
        path = store._path(key).resolve()
        assert path.is_relative_to(root.resolve()), key
    return m


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(slot=st.sampled_from(_SLOTS), raw=_INJECT)
def test_manifest_parser_survives_injected_values(
    slot: tuple[str, tuple[Any, ...]], raw: str, tmp_path_factory: Any, recorder: Recorder
) -> None:
    """Only ManifestError ever escapes (no RecursionError, ValueError, OverflowError...)."""
    m = _decode_is_safe(_inject(slot, raw), tmp_path_factory.getbasetemp())
    recorder.add(
        "hostile_manifests_injected",
        examples=1,
        outcomes={"ManifestError": int(m is None), "accepted_valid": int(m is not None)},
    )


@settings(max_examples=150, deadline=None)
@given(slot=st.sampled_from(_KEYS), key=_TRAVERSAL)
def test_manifest_object_keys_cannot_escape_the_root(
    slot: tuple[str, tuple[Any, ...]], key: str, tmp_path_factory: Any, recorder: Recorder
) -> None:
    m = _decode_is_safe(_inject(slot, _raw_json(key)), tmp_path_factory.getbasetemp())
    recorder.add(
        "hostile_manifest_keys",
        examples=1,
        outcomes={"ManifestError": int(m is None), "accepted_inside_root": int(m is not None)},
    )
    if m is not None:  # only keys that are plain relative paths got through
        assert (
            ".." not in key.split("/")
            and not key.startswith("/")
            and "\\" not in key
            and "\x00" not in key
        )


def test_edited_manifest_is_refused_by_its_checksum() -> None:
    """A manifest whose body changed (a renamed leaf, a changed value or dtype) no longer
    matches its ``manifest_crc32c``; without one it is refused, edited or not."""
    data = _real_manifest()
    assert decode_manifest(data).step == 7
    for a, b in (
        (b'"w"', b'"v"'),
        (b'"float32"', b'"uint32"'),
        (b'"n":1.5', b'"n":2.5'),
        (b'"step":7', b'"step":8'),
    ):
        assert a in data
        with pytest.raises(ManifestError, match="checksum"):
            decode_manifest(data.replace(a, b, 1))
    doc = json.loads(data)
    del doc["manifest_crc32c"]
    for note in ("x", "edited by hand"):
        doc["metadata"]["note"] = note
        with pytest.raises(ManifestError, match="no manifest_crc32c"):
            decode_manifest(json.dumps(doc).encode())
    assert decode_manifest(_sealed(json.dumps(doc).encode())).metadata["note"] == "edited by hand"


def _hostile(leaf: ArrayLeaf, step: int = 9) -> MemoryStore:
    store = MemoryStore()
    asyncio.run(
        store.put("steps/000000000009/aa/p00000-00000.fck", np.arange(64, dtype=np.uint8).tobytes())
    )
    asyncio.run(
        store.put(
            f"manifests/{step:012d}.json", encode_manifest(Manifest(step=step, leaves=(leaf,)))
        )
    )
    return store


def _leaf(
    shape: tuple[int, ...], *chunks: ChunkEntry, dtype: str = "uint8", kind: str = "numpy"
) -> ArrayLeaf:
    table = table_from_entries(chunks, shape=shape, itemsize=dtype_from_name(dtype).itemsize)
    return ArrayLeaf(path=(("d", "x"),), shape=shape, dtype=dtype, chunks=table, kind=kind)  # type: ignore[arg-type]


_OBJ = "steps/000000000009/aa/p00000-00000.fck"
_GOOD_CRC = crc32c(np.arange(64, dtype=np.uint8).tobytes())
HOSTILE_RESTORES: dict[str, tuple[ArrayLeaf, type[BaseException]]] = {
    # 4 TiB declared for a tiny object: refused at allocation, typed and named.
    "huge_array": (
        _leaf((1 << 42,), ChunkEntry(((0, 1 << 42),), _OBJ, 0, 64, 1 << 42, "zstd", 0, 0)),
        MemoryError,
    ),
    # 8 GiB declared (the host may map it lazily): the short read is caught before any use.
    # The stored object is shorter than the chunk: a typed CorruptionError naming the array.
    "lazy_huge_array": (
        _leaf((1 << 33,), ChunkEntry(((0, 1 << 33),), _OBJ, 0, 1 << 33, 1 << 33, "raw", 0, 0)),
        CorruptionError,
    ),
    "range_past_end": (
        _leaf((100,), ChunkEntry(((0, 100),), _OBJ, 10, 100, 100, "raw", 0, 0)),
        CorruptionError,
    ),
    "offset_past_end": (
        _leaf((8,), ChunkEntry(((0, 8),), _OBJ, 10_000, 8, 8, "raw", 0, 0)),
        FastckptError,
    ),
    "missing_object": (
        _leaf((8,), ChunkEntry(((0, 8),), "steps/000000000009/zz/none.fck", 0, 8, 8, "raw", 0, 0)),
        FastckptError,
    ),
    "manifest_as_data": (
        _leaf((8,), ChunkEntry(((0, 8),), "manifests/000000000009.json", 0, 8, 8, "raw", 0, 0)),
        ChecksumMismatchError,
    ),
    # Valid crc32c of the stored bytes, but they are not zstd: the decoder error is typed.
    "not_zstd": (
        _leaf((1000,), ChunkEntry(((0, 1000),), _OBJ, 0, 64, 1000, "zstd", _GOOD_CRC, 0)),
        FastckptError,
    ),
    "wrong_crc": (
        _leaf((64,), ChunkEntry(((0, 64),), _OBJ, 0, 64, 64, "raw", _GOOD_CRC ^ 1, _GOOD_CRC ^ 1)),
        ChecksumMismatchError,
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_RESTORES))
def test_decodable_but_hostile_manifests_fail_typed(case: str, recorder: Recorder) -> None:
    leaf, error = HOSTILE_RESTORES[case]
    store = _hostile(leaf)
    t0 = time.monotonic()
    with CheckpointManager(store) as mgr:
        with pytest.raises(error) as info:
            mgr.restore(9)
    assert time.monotonic() - t0 < 10
    assert "['x']" in str(info.value), info.value
    recorder.add("hostile_decodable_manifests", cases=1, errors={case: type(info.value).__name__})


# ============================================================================ peer server


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[RamTier]:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    root = base / f"fastckpt-hostile-{os.getpid()}-{time.monotonic_ns()}"
    t = RamTier(root, budget_bytes=16 << 20)
    data = np.frombuffer(np.random.default_rng(0).bytes(100_000), np.uint8)
    seg = t.allocate(1, data.nbytes)
    seg.buffer[:] = data
    t.seal(
        1,
        seg,
        {
            "a": ChunkLocation(0, 60_000, crc32c(data[:60_000])),
            "b": ChunkLocation(60_000, 40_000, crc32c(data[60_000:])),
        },
    )
    t.put_manifest(1, b'{"m": 1}')
    yield t
    t.close()
    import shutil

    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def server(tier: RamTier) -> Iterator[PeerServer]:
    s = PeerServer(tier, secret=SECRET, options=FAST).start()
    yield s
    s.close()


@pytest.fixture
def good(server: PeerServer) -> Iterator[PeerClient]:
    """A well-behaved client, opened before the attacks; it keeps one pooled connection
    (hypothesis runs every example of a test with the same one)."""
    with PeerClient(server.address, secret=SECRET, options=FAST) as c:
        assert c.steps() == [1]
        yield c


def _expected(tier: RamTier, cid: str) -> bytes:
    hit = tier.read_chunk(1, cid)
    assert hit is not None
    return bytes(hit[0])


def _raw_auth(address: tuple[str, int], secret: bytes = SECRET) -> Channel:
    """An authenticated connection of a client with the secret (it sends raw bytes with
    ``chan.sock``, tagged as the server expects with ``tag_raw``)."""
    s = socket.create_connection(address, timeout=5)
    plain = Channel(s, limits=wire.AUTH_LIMITS)
    cn = wire_auth.new_nonce()
    plain.send(MsgType.HELLO, {"nonce": cn.hex(), "frame_mac": True})
    _, h, _ = plain.recv_head()
    keys = wire_auth.session_keys(
        secret, client_nonce=cn, server_nonce=bytes.fromhex(h["nonce"]), frame_mac=True
    )
    plain.send(MsgType.AUTH, {"mac": keys.client_proof.hex()})
    t, _, _ = plain.recv_head()
    assert t is MsgType.AUTH_OK
    return Channel(
        s,
        limits=wire.WireLimits(max_payload_bytes=1 << 30),
        role="client",
        send_key=keys.client_key,
        recv_key=keys.server_key,
    )


def _answer(s: socket.socket | Channel, timeout_s: float = 5.0) -> tuple[str, Any]:
    """What the server did: ("error", code), ("reply", type), ("closed", None). Bounded."""
    sock = s.sock if isinstance(s, Channel) else s
    sock.settimeout(timeout_s)
    try:
        if isinstance(s, Channel):
            t, h, _plen = s.recv_head()
        else:
            t, h, _plen = Channel(s, limits=wire.WireLimits(max_payload_bytes=1 << 30)).recv_head()
    except PeerUnavailableError as e:
        if "timed out" in str(e):
            raise AssertionError("the server neither answered nor closed") from e
        return "closed", None
    if t is MsgType.ERROR:
        return "error", h["code"]
    return "reply", t


def _frame_strategy() -> st.SearchStrategy[bytes]:
    """Frames a hostile authenticated client might send: valid-schema requests with hostile
    values, lying prefixes, junk JSON headers, and truncations of all of these."""
    request_types = [
        MsgType.LIST,
        MsgType.GET_MANIFEST,
        MsgType.PUT_MANIFEST,
        MsgType.STEPS,
        MsgType.GET_CHUNKS,
        MsgType.PUT_CHUNKS,
        MsgType.GET_RANGES,
    ]
    ints = st.one_of(
        st.integers(0, 3), st.integers(-5, 2**64 + 5), st.sampled_from([2**63 - 1, 2**63, 2**32])
    )
    values = st.one_of(
        ints,
        st.text(max_size=20),
        st.none(),
        st.booleans(),
        st.floats(allow_nan=False),
        st.sampled_from(["a", "b", "x" * 20000]),
    )
    header = st.one_of(
        st.dictionaries(
            st.sampled_from(["step", "chunk_id", "offset", "length", "raw_crc32c", "count", "x"]),
            values,
            max_size=5,
        ).map(lambda d: json.dumps(d).encode()),
        st.integers(1, 50_000).map(lambda d: b"[" * d + b"]" * d),
        st.sampled_from(
            [
                b'{"step": NaN}',
                b'{"step": 1, "step": 2}',
                b"\xff\xfe",
                b"",
                b"{",
                b'{"step": 1e400}',
            ]
        ),
        st.binary(max_size=64),
    )

    @st.composite
    def frames(draw: st.DrawFn) -> bytes:
        t = draw(st.one_of(st.sampled_from(request_types), st.integers(0, 255)))
        raw_header = draw(header)
        payload = draw(st.binary(max_size=200))
        version = draw(st.sampled_from([wire.VERSION] * 4 + [0, 2, 255]))
        magic = draw(st.sampled_from([wire.MAGIC] * 6 + [b"FCKQ", b"\x00\x00\x00\x00"]))
        flags = draw(st.sampled_from([0] * 6 + [1, 0x8000]))
        hlen = draw(st.sampled_from([len(raw_header)] * 4 + [0, len(raw_header) + 7, 2**32 - 1]))
        plen = draw(st.sampled_from([len(payload)] * 4 + [0, len(payload) + 9, 2**40, 2**64 - 1]))
        frame = wire.PREFIX.pack(magic, version, int(t), flags, hlen, plen) + raw_header + payload
        cut = draw(st.one_of(st.none(), st.integers(0, max(0, len(frame) - 1))))
        return frame if cut is None else frame[:cut]

    return frames()


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(frame=_frame_strategy(), authenticated=st.booleans())
def test_generated_frames_get_typed_answers_and_the_server_keeps_serving(
    server: PeerServer,
    tier: RamTier,
    good: PeerClient,
    frame: bytes,
    authenticated: bool,
    recorder: Recorder,
) -> None:
    s = (
        _raw_auth(server.address)
        if authenticated
        else socket.create_connection(server.address, timeout=5)
    )
    try:
        if isinstance(
            s, Channel
        ):  # tagged as from a client with the secret: the parser is under test
            s.sock.sendall(tag_raw(s, frame))
            s.sock.shutdown(socket.SHUT_WR)  # a truncated frame ends here
        else:
            s.sendall(frame)
            s.shutdown(socket.SHUT_WR)
        what, detail = _answer(s)
    finally:
        s.close()
    assert what in ("error", "reply", "closed")
    if what == "error":
        assert detail in ERROR_CODES
    recorder.add(
        "hostile_peer_frames", examples=1, answers={f"{what}:{detail}" if detail else what: 1}
    )
    # The well-behaved client keeps its pooled connection and still gets exact bytes.
    assert get_one(good, 1, "b", len(_expected(tier, "b"))) == _expected(tier, "b")
    with PeerClient(server.address, secret=SECRET, options=FAST) as fresh:
        assert fresh.steps() == [1]


def _frame(t: MsgType, h: dict[str, Any], payload: bytes = b"") -> bytes:
    raw = json.dumps(h).encode()
    return (
        wire.PREFIX.pack(wire.MAGIC, wire.VERSION, int(t), 0, len(raw), len(payload))
        + raw
        + payload
    )


def _nonce_hex() -> str:
    return wire_auth.new_nonce().hex()


#: name -> (authenticate first?, bytes to send, expected answer)
SCRIPTED: dict[str, tuple[bool, Callable[[], bytes], tuple[str, Any]]] = {
    "unknown_version": (
        True,
        lambda: wire.PREFIX.pack(wire.MAGIC, 9, MsgType.STEPS, 0, 2, 0) + b"{}",
        ("error", "bad_request"),
    ),
    "unknown_type": (
        True,
        lambda: wire.PREFIX.pack(wire.MAGIC, wire.VERSION, 99, 0, 2, 0) + b"{}",
        ("error", "bad_request"),
    ),
    "server_only_type": (
        True,
        lambda: _frame(MsgType.CHUNKS, {"lengths": [], "crcs": [], "missing": []}),
        ("error", "bad_request"),
    ),
    "second_auth_replayed": (
        True,
        lambda: _frame(MsgType.AUTH, {"mac": "0" * 64}),
        ("error", "bad_request"),
    ),
    "hello_again": (
        True,
        lambda: _frame(MsgType.HELLO, {"nonce": _nonce_hex(), "frame_mac": True}),
        ("error", "bad_request"),
    ),
    "range_outside_chunk": (
        True,
        lambda: _frame(
            MsgType.GET_RANGES,
            {"step": 1, "count": 1, "runs": [1], "starts": [59_999], "stops": [60_001]},
            b'["a"]',
        ),
        ("reply", MsgType.RANGES),  # the chunk is reported missing for it
    ),
    "chunk_id_too_long": (
        True,
        lambda: _frame(
            MsgType.GET_CHUNKS,
            {"step": 1, "count": 1},
            json.dumps(["x" * (wire.MAX_CHUNK_ID_CHARS + 1)]).encode(),
        ),
        ("error", "bad_request"),
    ),
    "batch_duplicate_ids": (
        True,
        lambda: _frame(MsgType.GET_CHUNKS, {"step": 1, "count": 2}, b'["a","a"]'),
        ("error", "bad_request"),
    ),
    "batch_too_many_ids": (
        True,
        lambda: _frame(
            MsgType.GET_CHUNKS,
            {"step": 1, "count": wire.MAX_BATCH_CHUNKS + 1},
            json.dumps([str(i) for i in range(wire.MAX_BATCH_CHUNKS + 1)]).encode(),
        ),
        ("error", "bad_request"),
    ),
    "batch_ids_not_a_list": (
        True,
        lambda: _frame(MsgType.GET_CHUNKS, {"step": 1, "count": 1}, b'{"a":1}'),
        ("error", "bad_request"),
    ),
    "batch_of_absent_chunks": (
        True,
        lambda: _frame(MsgType.GET_CHUNKS, {"step": 9, "count": 1}, b'["a"]'),
        ("reply", MsgType.CHUNKS),
    ),
    "header_over_limit": (
        True,
        lambda: wire.PREFIX.pack(
            wire.MAGIC, wire.VERSION, MsgType.LIST, 0, FAST.max_header_bytes + 1, 0
        ),
        ("error", "too_large"),
    ),
    "payload_over_limit": (
        True,
        lambda: (
            wire.PREFIX.pack(
                wire.MAGIC, wire.VERSION, MsgType.PUT_CHUNKS, 0, 2, FAST.max_payload_bytes + 1
            )
            + b"{}"
        ),
        ("error", "too_large"),
    ),
    "missing_secret": (
        False,
        lambda: (
            _frame(MsgType.HELLO, {"nonce": _nonce_hex(), "frame_mac": True})
            + _frame(MsgType.AUTH, {"mac": ""})
        ),
        ("reply", MsgType.CHALLENGE),
    ),
    "request_before_auth": (False, lambda: _frame(MsgType.STEPS, {}), ("error", "bad_request")),
    "deep_json_header": (
        True,
        lambda: (
            wire.PREFIX.pack(wire.MAGIC, wire.VERSION, MsgType.LIST, 0, 60_000, 0)
            + b"[" * 30_000
            + b"]" * 30_000
        ),
        ("error", "bad_request"),
    ),
}


@pytest.mark.parametrize("name", sorted(SCRIPTED))
def test_scripted_hostile_requests(
    server: PeerServer, tier: RamTier, good: PeerClient, name: str, recorder: Recorder
) -> None:
    authenticate, make, want = SCRIPTED[name]
    handshakes = good.handshakes
    s = (
        _raw_auth(server.address)
        if authenticate
        else socket.create_connection(server.address, timeout=5)
    )
    try:
        if isinstance(s, Channel):
            s.sock.sendall(tag_raw(s, make()))
        else:
            s.sendall(make())
        got = _answer(s)
        if name == "missing_secret":  # the CHALLENGE first, then the refusal of an empty MAC
            got = _answer(s)
            want = ("error", "bad_request")
    finally:
        s.close()
    assert got == want
    assert get_one(good, 1, "a", len(_expected(tier, "a"))) == _expected(tier, "a")
    assert good.handshakes == handshakes  # on its old connection
    recorder.add("hostile_peer_requests", cases=1, typed_answers=1)


def test_wrong_secret_and_over_budget_push_are_refused_typed(
    server: PeerServer, tmp_path: Path
) -> None:
    with pytest.raises(AuthenticationError):
        PeerClient(server.address, secret=b"not-the-secret-0123456789", options=FAST).steps()
    small = RamTier(tmp_path / "small", budget_bytes=256 << 10)
    try:
        with (
            PeerServer(small, secret=SECRET, options=FAST).start() as srv,
            PeerClient(srv.address, secret=SECRET, options=FAST) as c,
        ):
            with pytest.raises(PeerRequestError) as info:
                c.push_chunks(2, [("big", np.zeros(512 << 10, np.uint8), 0)])
            assert info.value.code == "budget"
            c.push_chunks(2, [("fits", np.ones(1000, np.uint8), crc32c(np.ones(1000, np.uint8)))])
            assert small.chunk_ids(2) == ["fits"]  # same connection, still in sync
    finally:
        small.close()


def test_slowloris_connections_are_dropped_and_service_resumes(tier: RamTier) -> None:
    opts = PeerOptions(
        connect_timeout_s=2, handshake_timeout_s=0.5, io_timeout_s=1.0, max_connections=4
    )
    with PeerServer(tier, secret=SECRET, options=opts).start() as srv:
        idle = [
            socket.create_connection(srv.address, timeout=5) for _ in range(4)
        ]  # never say HELLO
        try:
            time.sleep(0.1)
            with pytest.raises(PeerRequestError) as info:
                PeerClient(srv.address, secret=SECRET, options=opts).steps()
            assert info.value.code == "busy"
            time.sleep(1.0)  # past the handshake timeout: the idle connections are gone
            with PeerClient(srv.address, secret=SECRET, options=opts) as c:
                assert c.steps() == [1]
        finally:
            for s in idle:
                s.close()


# ============================================================================ hostile server


class LyingServer:
    """Completes a genuine handshake (it knows the secret), then answers the first request
    with ``reply(request_type, header) -> bytes`` (tagged as from a server with the secret,
    unless ``tag`` is False: a forger on the path) and hangs up (or, for None, says nothing)."""

    def __init__(
        self,
        reply: Callable[[MsgType, dict[str, Any]], bytes | None],
        *,
        secret: bytes = SECRET,
        tag: bool = True,
    ) -> None:
        self.reply, self.secret, self.tag = reply, secret, tag
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        self._socks: list[socket.socket] = []
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self._socks.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            chan = server_handshake(conn, secret=self.secret, options=PeerOptions())
            t, h, plen = chan.recv_head()
            if plen:
                chan.recv_payload()
            out = self.reply(t, h)
            if out is None:
                self._stop.wait(30)  # say nothing (until closed)
                return
            conn.sendall(
                tag_raw(chan, out) if self.tag else out
            )  # one answer per connection, then hang up
        except (PeerError, OSError):
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self.listener.close()
        for s in self._socks:
            s.close()


_DATA = np.frombuffer(np.random.default_rng(1).bytes(4096), np.uint8)


def _chunk(header: dict[str, Any], payload: bytes, declared: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    n = len(payload) if declared is None else declared
    return (
        wire.PREFIX.pack(wire.MAGIC, wire.VERSION, MsgType.CHUNKS, 0, len(raw), n) + raw + payload
    )


_GOOD_HEADER = {"lengths": [_DATA.nbytes], "crcs": [crc32c(_DATA)], "missing": []}
#: name -> (the lying reply, the error raised or the outcome reported)
LIES: dict[
    str, tuple[Callable[[MsgType, dict[str, Any]], bytes | None], type[BaseException] | str]
] = {
    # a frame right in every way but its tags, which the liar leaves out (run untagged below)
    "untagged_forgery": (
        lambda t, h: _chunk(_GOOD_HEADER, _DATA.tobytes()),
        FrameAuthenticationError,
    ),
    "garbage": (lambda t, h: os.urandom(64), ProtocolError),
    "wrong_crc": (
        lambda t, h: _chunk({**_GOOD_HEADER, "crcs": [1]}, _DATA.tobytes()),
        "corrupt",
    ),
    "length_mismatch": (
        lambda t, h: _chunk({**_GOOD_HEADER, "lengths": [10]}, _DATA.tobytes()),
        ProtocolError,
    ),
    "missing_with_bytes": (
        lambda t, h: _chunk({**_GOOD_HEADER, "missing": [0]}, _DATA.tobytes()),
        ProtocolError,
    ),
    "payload_over_limit": (
        lambda t, h: _chunk(_GOOD_HEADER, b"", declared=FAST.max_payload_bytes + 1),
        ProtocolError,
    ),
    "closes_mid_payload": (
        lambda t, h: _chunk(_GOOD_HEADER, _DATA.tobytes()[:100], declared=_DATA.nbytes),
        PeerUnavailableError,
    ),
    "never_answers": (lambda t, h: None, PeerUnavailableError),
    "unexpected_type": (
        lambda t, h: _frame(MsgType.STEP_LIST, {"steps": [1], "committed": [1]}),
        ProtocolError,
    ),
    "error_with_unknown_code": (
        lambda t, h: _frame(MsgType.ERROR, {"code": "\u2603" * 10, "message": "x"}),
        PeerError,
    ),
    "wrong_size_for_buffer": (
        lambda t, h: _chunk(
            {**_GOOD_HEADER, "lengths": [4095], "crcs": [crc32c(_DATA[:4095])]},
            _DATA.tobytes()[:4095],
        ),
        "corrupt",
    ),
}


@pytest.mark.parametrize("lie", sorted(LIES))
def test_client_against_a_lying_server_fails_typed_and_bounded(
    lie: str, recorder: Recorder
) -> None:
    reply, want = LIES[lie]
    srv = LyingServer(reply, tag=lie != "untagged_forgery")
    try:
        items = [("a", np.zeros(_DATA.nbytes, np.uint8), crc32c(_DATA))]
        t0 = time.monotonic()
        with PeerClient(srv.address, secret=SECRET, options=FAST) as c:
            if isinstance(want, str):
                assert c.get_chunks(1, items) == [want]
            else:
                with pytest.raises(want):
                    c.get_chunks(1, items)
        assert time.monotonic() - t0 < 5 * FAST.io_timeout_s
    finally:
        srv.close()
    recorder.add("hostile_peer_server", cases=1, typed_errors=1)


def test_config_error_for_unusable_secret() -> None:
    with pytest.raises(ConfigError):
        PeerClient(("127.0.0.1", 1), secret=b"short")


class _SlowExceptOne(ForwardingStore):
    """Reads of ``broken`` fail at once; every other read takes ``delay_s`` (cancellable)."""

    def __init__(self, inner: MemoryStore, broken: str, delay_s: float) -> None:
        super().__init__(inner)
        self.broken, self.delay_s = broken, delay_s
        self.in_flight = 0

    async def get(self, key: str, *, byte_range: Any = None) -> Any:
        from fastckpt.errors import NotFoundError

        if key == self.broken:
            raise NotFoundError(f"{self.url}/{key}")
        if key.startswith("steps/"):
            self.in_flight += 1
            try:
                await asyncio.sleep(self.delay_s)
            finally:
                self.in_flight -= 1
        return await self.inner.get(key, byte_range=byte_range)


def test_a_failed_restore_leaves_no_read_running() -> None:
    """When one range fails, the reader cancels the others and waits for them: nothing keeps
    reading after ``restore`` raised, and closing the manager right away is clean (before,
    orphaned reads outlived the restore and later hit a closed event loop)."""
    from fastckpt.errors import NotFoundError

    good, bad = "steps/000000000009/aa/p00000-00000.fck", "steps/000000000009/aa/p00000-00001.fck"
    leaves = tuple(
        ArrayLeaf(
            path=(("d", f"x{i}"),),
            shape=(64,),
            dtype="uint8",
            kind="numpy",
            chunks=table_from_entries(
                [
                    ChunkEntry(
                        ((0, 64),), good if i else bad, 0, 64, 64, "raw", _GOOD_CRC, _GOOD_CRC
                    )
                ],
                shape=(64,),
                itemsize=1,
            ),
        )
        for i in range(6)
    )
    inner = MemoryStore()
    asyncio.run(inner.put(good, np.arange(64, dtype=np.uint8).tobytes()))
    asyncio.run(
        inner.put("manifests/000000000009.json", encode_manifest(Manifest(step=9, leaves=leaves)))
    )
    store = _SlowExceptOne(inner, bad, delay_s=5.0)
    t0 = time.monotonic()
    with CheckpointManager(store) as mgr:
        with pytest.raises(NotFoundError, match=r"\['x0'\]"):
            mgr.restore(9)
        assert store.in_flight == 0
    assert time.monotonic() - t0 < 3.0
