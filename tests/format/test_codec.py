"""Manifest JSON codec: exact round trips, and hostile input fails with ManifestError only."""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastckpt.errors import ManifestError, UnsupportedFormatVersionError
from fastckpt.format import codec
from fastckpt.format.codec import decode_manifest, encode_manifest
from fastckpt.format.dtypes import dtype_from_name, dtype_name
from fastckpt.format.layout import (
    data_key,
    fragment_key,
    manifest_key,
    step_data_prefix,
    step_from_data_key,
    step_from_manifest_key,
)
from fastckpt.format.manifest import ArrayLeaf, ChunkEntry, ChunkTable, Manifest, ShardingSpec, ValueLeaf
from fastckpt.storage._protocol import validate_key
from fastckpt.testing.strategies import DTYPE_NAMES, json_values, manifests


def norm(x: Any) -> Any:
    """A comparable form that tells nan, -0.0 and int/float apart."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (type(x).__name__, tuple((f.name, norm(getattr(x, f.name))) for f in dataclasses.fields(x)))
    if isinstance(x, float):
        return ("float", repr(x))
    if isinstance(x, ChunkTable):  # format 2's chunks: equal to the tuple of its entries
        return ("tuple", tuple(norm(v) for v in x))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(norm(v) for v in x))
    if isinstance(x, dict):
        return ("dict", tuple(sorted((k, norm(v)) for k, v in x.items())))
    return (type(x).__name__, x)


@pytest.mark.parametrize("version", [1, 2, 3])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=manifests())
def test_round_trip_is_exact(version: int, m: Manifest) -> None:
    m = dataclasses.replace(m, format_version=version)
    data = encode_manifest(m)
    back = decode_manifest(data)
    assert norm(back) == norm(m)
    assert encode_manifest(back) == data  # deterministic encoding


# ------------------------------------------------------------------ hostile input

def base_doc(version: int = 1) -> dict[str, Any]:
    """A small valid manifest document: one 2-chunk float32 array, one value leaf. Without
    ``manifest_crc32c`` (allowed, as in a hand-written manifest), so that a mutation is caught
    by the check made for it, not by the checksum."""
    m = Manifest(
        step=7,
        leaves=(
            ArrayLeaf(
                path=(("d", "w"),), shape=(4, 2), dtype="float32", kind="jax",
                sharding=ShardingSpec(("x",), (2,), ("x", None)),
                chunks=(
                    ChunkEntry(((0, 2), (0, 2)), "steps/a/p0.fck", 0, 16, 16, "raw", 1, 1),
                    ChunkEntry(((2, 4), (0, 2)), "steps/a/p1.fck", 0, 9, 16, "zstd", 2, 3),
                ),
            ),
            ValueLeaf(path=(("d", "step"),), vtype="int", value=7),
        ),
        metadata={"loader": {"pos": 3}},
        format_version=version,
    )
    doc = json.loads(encode_manifest(m))
    del doc[codec.CHECKSUM_FIELD]
    return doc


def decode_doc(doc: Any) -> Manifest:
    return decode_manifest(json.dumps(doc).encode())


@pytest.mark.parametrize("version", [1, 2, 3])
def test_base_doc_is_valid(version: int) -> None:
    assert decode_doc(base_doc(version)).step == 7


def _set(doc: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    node = doc
    for p in path[:-1]:
        node = node[p]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return doc


_DELETE = object()
W = ("leaves", 0)
C0 = ("leaves", 0, "chunks", 0)

MALFORMED: dict[str, tuple[tuple[Any, ...], Any]] = {
    "step negative": (("step",), -1),
    "step float": (("step",), 1.5),
    "step bool": (("step",), True),
    "step string": (("step",), "7"),
    "step missing": (("step",), _DELETE),
    "leaves not a list": (("leaves",), {"a": 1}),
    "leaf not an object": (W, [1, 2]),
    "leaf type unknown": ((*W, "type"), "tensor"),
    "leaf type unhashable": ((*W, "type"), ["array"]),
    "path not a list": ((*W, "path"), "w"),
    "path entry kind": ((*W, "path"), [["q", "w"]]),
    "path entry arity": ((*W, "path"), [["d"]]),
    "path index negative": ((*W, "path"), [["i", -1]]),
    "path dict key float": ((*W, "path"), [["d", 1.5]]),
    "shape negative": ((*W, "shape"), [-4, 2]),
    "shape float": ((*W, "shape"), [4.0, 2]),
    "shape not list": ((*W, "shape"), 8),
    "shape rank huge": ((*W, "shape"), [1] * 65),
    "dtype unknown": ((*W, "dtype"), "float128"),
    "dtype unhashable": ((*W, "dtype"), ["float32"]),
    "dtype object": ((*W, "dtype"), {"name": "float32"}),
    "kind unknown": ((*W, "kind"), "torch"),
    "prng key without impl": ((*W, "kind"), "prng_key"),
    "key_impl not str": ((*W, "key_impl"), 3),
    "chunks not list": ((*W, "chunks"), None),
    "box outside shape": ((*C0, "box"), [[0, 5], [0, 2]]),
    "box reversed": ((*C0, "box"), [[2, 0], [0, 2]]),
    "box negative": ((*C0, "box"), [[-2, 0], [0, 2]]),
    "box rank": ((*C0, "box"), [[0, 2]]),
    "box interval arity": ((*C0, "box"), [[0, 2, 3], [0, 2]]),
    "box not list": ((*C0, "box"), "0:2"),
    "chunk volumes short": ((*W, "chunks"), "DROP1"),
    "chunk overlap, same volume": ((*C0, "box"), [[1, 3], [0, 2]]),
    "raw_length wrong": ((*C0, "raw_length"), 12),
    "raw length != length": ((*C0, "length"), 15),
    "offset negative": ((*C0, "offset"), -1),
    "offset huge": ((*C0, "offset"), 2**64),
    "crc negative": ((*C0, "crc32c"), -5),
    "codec unknown": ((*C0, "codec"), "lz4"),
    "codec unhashable": ((*C0, "codec"), {"zstd": 1}),
    "key parent": ((*C0, "key"), "../x"),
    "key absolute": ((*C0, "key"), "/abs"),
    "key inner parent": ((*C0, "key"), "steps/../../etc/passwd"),
    "key empty": ((*C0, "key"), ""),
    "key empty segment": ((*C0, "key"), "steps//x"),
    "key backslash": ((*C0, "key"), "steps\\x"),
    "key nul": ((*C0, "key"), "steps/\x00"),
    "key not str": ((*C0, "key"), 5),
    "chunk missing field": ((*C0, "crc32c"), _DELETE),
    "sharding not object": ((*W, "sharding"), [1]),
    "sharding names/shape rank": ((*W, "sharding", "mesh_shape"), [2, 2]),
    "sharding mesh zero": ((*W, "sharding", "mesh_shape"), [0]),
    "sharding unknown axis": ((*W, "sharding", "partition_spec"), ["y", None]),
    "sharding axis twice": ((*W, "sharding", "partition_spec"), ["x", "x"]),
    "sharding spec longer than rank": ((*W, "sharding", "partition_spec"), [None, None, "x"]),
    "sharding duplicate names": ((*W, "sharding"), {"mesh_axis_names": ["x", "x"], "mesh_shape": [1, 2],
                                                    "partition_spec": []}),
    "value vtype unknown": (("leaves", 1, "vtype"), "bytes"),
    "value int is str": (("leaves", 1, "value"), "7"),
    "value float garbage": (("leaves", 1), {"path": [["d", "s"]], "type": "value", "vtype": "float", "value": "x"}),
    "value complex arity": (("leaves", 1), {"path": [["d", "s"]], "type": "value", "vtype": "complex", "value": [1]}),
    "value none with value": (("leaves", 1), {"path": [["d", "s"]], "type": "value", "vtype": "none", "value": 1}),
    "duplicate path": (("leaves", 1, "path"), [["d", "w"]]),
    "metadata not object": (("metadata",), [1]),
    "created not number": (("created_unix",), "now"),
    "num_processes zero": (("num_processes",), 0),
    "writer_version not str": (("writer_version",), 1),
    "format_version str": (("format_version",), "1"),
    "format_version bool": (("format_version",), True),
    "format_version missing": (("format_version",), _DELETE),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_field_raises_manifest_error(case: str) -> None:
    path, value = MALFORMED[case]
    if value == "DROP1":
        doc = copy.deepcopy(base_doc())
        doc["leaves"][0]["chunks"].pop()
    else:
        doc = _set(base_doc(), path, value)
    with pytest.raises(ManifestError) as info:
        decode_doc(doc)
    assert not isinstance(info.value, UnsupportedFormatVersionError)


@pytest.mark.parametrize("version", [0, 4, 99, 2**40])
def test_unknown_format_version(version: int) -> None:
    with pytest.raises(UnsupportedFormatVersionError, match="format_version"):
        decode_doc(_set(base_doc(), ("format_version",), version))


@pytest.mark.parametrize(
    "data",
    [b"", b"{", b"[]", b"null", b"42", b'"x"', b"\xff\xfe", b'{"format_version": 1}',
     b'{"format_version": 1, "step": NaN, "leaves": []}',
     b'{"format_version": 1, "step": 1, "leaves": [], "created_unix": Infinity}',
     b'{"format_version": 1, "step": 1, "leaves": [], "metadata": {"x": -Infinity}}',
     b"[" * 100_000 + b"]" * 100_000,
     b'{"format_version": 1, "step": ' + b"[" * 5000 + b"]" * 5000 + b', "leaves": []}'],
    ids=lambda d: repr(d[:24]),
)
def test_non_manifest_bytes(data: bytes) -> None:
    with pytest.raises(ManifestError):
        decode_manifest(data)


def test_oversized_manifest_refused_before_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    data = json.dumps(base_doc()).encode()
    monkeypatch.setattr(codec, "MAX_MANIFEST_BYTES", len(data) - 1)
    with pytest.raises(ManifestError, match="limit"):
        decode_manifest(data)
    monkeypatch.setattr(codec, "MAX_MANIFEST_BYTES", len(data))
    decode_manifest(data)


def test_encode_rejects_non_json_metadata() -> None:
    m = Manifest(step=1, leaves=(), metadata={"x": object()})
    with pytest.raises(ManifestError):
        encode_manifest(m)
    with pytest.raises(ManifestError):
        encode_manifest(Manifest(step=1, leaves=(), metadata={"x": float("nan")}))


# ------------------------------------------------------------------ fuzzing


def _locations(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _locations(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _locations(v, (*prefix, i))
    return out


_NASTY = st.one_of(
    json_values(max_leaves=4),
    st.integers(-(2**70), 2**70),
    st.sampled_from(["../x", "/abs", "", "nan", "inf", "raw", "zstd", "prng_key", "value", "array", "float32"]),
    st.lists(st.lists(st.integers(-3, 10), max_size=3), max_size=3),
)


def _check_decode(data: bytes) -> None:
    try:
        m = decode_manifest(data)
    except ManifestError:
        return
    # Whatever is accepted is a valid manifest: it re-encodes and decodes to itself.
    assert norm(decode_manifest(encode_manifest(m))) == norm(m)


@pytest.mark.parametrize("version", [1, 2, 3])
@settings(max_examples=250, deadline=None)
@given(data=st.data())
def test_fuzz_field_mutations(version: int, data: st.DataObject) -> None:
    doc = base_doc(version)
    for _ in range(data.draw(st.integers(1, 3))):
        locs = _locations(doc)[1:]
        loc = data.draw(st.sampled_from(locs))
        action = data.draw(st.sampled_from(["replace", "delete", "dup"]))
        parent = doc
        for p in loc[:-1]:
            parent = parent[p]
        if action == "replace":
            parent[loc[-1]] = data.draw(_NASTY)
        elif action == "delete":
            if isinstance(parent, dict):
                del parent[loc[-1]]
            else:
                parent.pop(loc[-1])
        elif isinstance(parent, list):
            parent.append(copy.deepcopy(parent[loc[-1]]))
    _check_decode(json.dumps(doc).encode())


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_chunk_decode_with_key_cache_and_lazy_name_agrees_with_the_plain_call(data: st.DataObject) -> None:
    """How the decoder validates every chunk (a key cache filled by earlier chunks, a name
    built only for an error) and the plain call agree on every mutation of a valid chunk:
    same entry, or the same error message."""
    base = base_doc()["leaves"][0]
    shape, itemsize = (4, 2), 4
    chunk = copy.deepcopy(base["chunks"][data.draw(st.integers(0, 1))])
    for _ in range(data.draw(st.integers(0, 3))):
        loc = data.draw(st.sampled_from(_locations(chunk)[1:]))
        parent = chunk
        for p in loc[:-1]:
            parent = parent[p]
        if data.draw(st.booleans()):
            parent[loc[-1]] = data.draw(st.one_of(_NASTY, st.integers(-3, 10), st.booleans()))
        elif isinstance(parent, dict):
            del parent[loc[-1]]
        else:
            parent.pop(loc[-1])
    def outcome(call: Any) -> Any:
        try:
            return call()
        except ManifestError as e:
            return str(e)

    keys_ok: set[str] = set()
    for valid in base["chunks"]:  # the cache as decoding the earlier chunks left it
        codec._chunk(valid, shape, itemsize, "earlier", keys_ok)
    assert keys_ok == {c["key"] for c in base["chunks"]}
    expected = outcome(lambda: codec._chunk(chunk, shape, itemsize, "chunk"))
    assert outcome(lambda: codec._chunk(chunk, shape, itemsize, lambda: "chunk", keys_ok)) == expected
    assert outcome(lambda: codec._chunk(chunk, shape, itemsize, lambda: "chunk", set())) == expected


@pytest.mark.parametrize("version", [1, 2, 3])
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_fuzz_bytes(version: int, data: st.DataObject) -> None:
    raw = bytearray(json.dumps(base_doc(version)).encode())
    how = data.draw(st.sampled_from(["truncate", "flip", "insert"]))
    if how == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif how == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] = data.draw(st.integers(0, 255))
    else:
        i = data.draw(st.integers(0, len(raw)))
        raw[i:i] = data.draw(st.binary(min_size=1, max_size=8))
    _check_decode(bytes(raw))


@pytest.mark.parametrize("version", [1, 2, 3])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=manifests(max_leaves=3), data=st.data())
def test_fuzz_random_manifest_mutations(version: int, m: Manifest, data: st.DataObject) -> None:
    doc = json.loads(encode_manifest(dataclasses.replace(m, format_version=version)))
    locs = _locations(doc)[1:]
    if locs:
        loc = data.draw(st.sampled_from(locs))
        parent = doc
        for p in loc[:-1]:
            parent = parent[p]
        parent[loc[-1]] = data.draw(_NASTY)
    _check_decode(json.dumps(doc).encode())


# ------------------------------------------------------------------ dtypes and key layout


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_dtype_names_round_trip(name: str) -> None:
    assert dtype_name(dtype_from_name(name)) == name


@pytest.mark.parametrize("name", ["float128", "object", "", None, 3, ["int8"], "U4"])
def test_unknown_dtype_names(name: Any) -> None:
    with pytest.raises(ManifestError):
        dtype_from_name(name)


def test_unsupported_dtypes_refused() -> None:
    import numpy as np

    for dt in (np.dtype(object), np.dtype("U3"), np.dtype([("a", "i4")]), np.dtype(">i4")):
        with pytest.raises(ManifestError):
            dtype_name(dt)


@given(st.integers(0, 10**12 - 1), st.text("0123456789abcdef", min_size=1, max_size=12), st.integers(0, 99999),
       st.integers(0, 99999))
def test_layout_keys(step: int, save_id: str, process: int, n: int) -> None:
    assert step_from_manifest_key(manifest_key(step)) == step
    for key in (data_key(step, save_id, process, n), fragment_key(step, save_id, process)):
        assert validate_key(key) == key
        assert key.startswith(step_data_prefix(step))
        assert step_from_data_key(key) == step
        assert step_from_manifest_key(key) is None
    assert step_from_manifest_key("manifests/12.json") is None
    assert step_from_manifest_key(manifest_key(step) + ".tmp") is None


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_chunk_id_with_a_precomputed_prefix_is_the_same_id(data: st.DataObject) -> None:
    from fastckpt.format.manifest import chunk_id, chunk_id_prefix
    from fastckpt.testing.strategies import boxes_in, key_paths, shapes

    path = data.draw(key_paths())
    box = data.draw(boxes_in(data.draw(shapes(max_rank=3, max_side=9)), allow_empty=True))
    assert chunk_id(path, box, prefix=chunk_id_prefix(path)) == chunk_id(path, box)
    assert chunk_id(path, box).startswith(chunk_id_prefix(path))


@pytest.mark.parametrize("version", [1, 2, 3])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=manifests(max_leaves=4))
def test_chunk_ids_of_a_leaf_are_each_chunks_id_in_order(version: int, m: Manifest) -> None:
    """The grid shortcut (cut intervals formatted once, joined per cell) and the listed boxes
    give exactly chunk_id of every chunk, in the leaf's order, in every format."""
    from fastckpt.format.manifest import chunk_id, chunk_ids

    decoded = decode_manifest(encode_manifest(dataclasses.replace(m, format_version=version)))
    for a in decoded.arrays():
        assert chunk_ids(a) == [chunk_id(a.path, c.box) for c in a.chunks]
