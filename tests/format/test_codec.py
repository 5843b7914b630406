"""Manifest JSON codec: exact round trips; hostile input fails with ManifestError only; any
format_version but 3 and any manifest without its checksum are refused."""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastckpt._checksum import crc32c
from fastckpt.errors import ManifestError, UnsupportedFormatVersionError
from fastckpt.format import codec
from fastckpt.format.chunk_table import table_from_entries
from fastckpt.format.codec import decode_manifest, encode_manifest, seal_document
from fastckpt.format.dtypes import dtype_from_name, dtype_name
from fastckpt.format.layout import (
    data_key,
    fragment_key,
    manifest_key,
    step_data_prefix,
    step_from_data_key,
    step_from_manifest_key,
)
from fastckpt.format.manifest import (
    ArrayLeaf,
    ChunkEntry,
    ChunkTable,
    Manifest,
    ShardingSpec,
    ValueLeaf,
)
from fastckpt.storage._protocol import validate_key
from fastckpt.testing.strategies import DTYPE_NAMES, json_values, manifests


def norm(x: Any) -> Any:
    """A comparable form that tells nan, -0.0 and int/float apart."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (
            type(x).__name__,
            tuple((f.name, norm(getattr(x, f.name))) for f in dataclasses.fields(x)),
        )
    if isinstance(x, float):
        return ("float", repr(x))
    if isinstance(x, ChunkTable):  # compared by its entries
        return ("table", tuple(norm(v) for v in x))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(norm(v) for v in x))
    if isinstance(x, dict):
        return ("dict", tuple(sorted((k, norm(v)) for k, v in x.items())))
    return (type(x).__name__, x)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=manifests())
def test_round_trip_is_exact(m: Manifest) -> None:
    data = encode_manifest(m)
    back = decode_manifest(data)
    assert norm(back) == norm(m)
    assert encode_manifest(back) == data  # deterministic encoding
    assert all(isinstance(a.chunks, ChunkTable) for a in back.arrays())


def test_an_array_leaf_holds_a_chunk_table_only() -> None:
    entry = ChunkEntry(((0, 4),), "steps/a/p0.fck", 0, 4, 4, "raw", 1, 1)
    with pytest.raises(TypeError, match="ChunkTable"):
        ArrayLeaf(path=(("d", "w"),), shape=(4,), dtype="uint8", chunks=(entry,))  # type: ignore[arg-type]


# ------------------------------------------------------------------ hostile input

W_CHUNKS = (
    ChunkEntry(((0, 2), (0, 2)), "steps/a/p0.fck", 0, 16, 16, "raw", 1, 1),
    ChunkEntry(((2, 4), (0, 2)), "steps/a/p1.fck", 0, 9, 16, "zstd", 2, 3),
)


def base_manifest() -> Manifest:
    """A small valid manifest: one 2-chunk float32 array (a 2 x 1 grid), one value leaf."""
    return Manifest(
        step=7,
        leaves=(
            ArrayLeaf(
                path=(("d", "w"),),
                shape=(4, 2),
                dtype="float32",
                kind="jax",
                sharding=ShardingSpec(("x",), (2,), ("x", None)),
                chunks=table_from_entries(W_CHUNKS, shape=(4, 2), itemsize=4),
            ),
            ValueLeaf(path=(("d", "step"),), vtype="int", value=7),
        ),
        metadata={"loader": {"pos": 3}},
    )


def base_doc() -> dict[str, Any]:
    """:func:`base_manifest`'s document without its ``manifest_crc32c``: tests edit it and
    :func:`decode_doc` seals it again, so that an edit is caught by the check made for it,
    not by the checksum."""
    doc = json.loads(encode_manifest(base_manifest()))
    del doc[codec.CHECKSUM_FIELD]
    return doc


def seal(doc: Any) -> bytes:
    """``doc`` as manifest bytes with a matching checksum (as the writer would put it); a doc
    the checksum cannot be computed for (not an object, NaN, too deep) as plain JSON."""
    if isinstance(doc, dict):
        try:
            return seal_document(doc)
        except (ManifestError, RecursionError):
            pass
    return json.dumps(doc).encode()


def decode_doc(doc: Any) -> Manifest:
    return decode_manifest(seal(doc))


def test_base_doc_is_valid() -> None:
    assert decode_doc(base_doc()) == base_manifest()


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
K0 = ("objects", 0)

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
    "chunks not an object": ((*W, "chunks"), None),
    "chunks missing": ((*W, "chunks"), _DELETE),
    "chunks as one object per chunk": (
        (*W, "chunks"),
        [
            {
                "box": [[0, 4], [0, 2]],
                "key": "steps/a/p0.fck",
                "offset": 0,
                "length": 32,
                "raw_length": 32,
                "codec": "raw",
                "crc32c": 1,
                "raw_crc32c": 1,
            }
        ],
    ),
    "objects missing": (("objects",), _DELETE),
    "key parent": (K0, "../x"),
    "key absolute": (K0, "/abs"),
    "key inner parent": (K0, "steps/../../etc/passwd"),
    "key empty": (K0, ""),
    "key empty segment": (K0, "steps//x"),
    "key backslash": (K0, "steps\\x"),
    "key nul": (K0, "steps/\x00"),
    "key not str": (K0, 5),
    "sharding not object": ((*W, "sharding"), [1]),
    "sharding names/shape rank": ((*W, "sharding", "mesh_shape"), [2, 2]),
    "sharding mesh zero": ((*W, "sharding", "mesh_shape"), [0]),
    "sharding unknown axis": ((*W, "sharding", "partition_spec"), ["y", None]),
    "sharding axis twice": ((*W, "sharding", "partition_spec"), ["x", "x"]),
    "sharding spec longer than rank": ((*W, "sharding", "partition_spec"), [None, None, "x"]),
    "sharding duplicate names": (
        (*W, "sharding"),
        {"mesh_axis_names": ["x", "x"], "mesh_shape": [1, 2], "partition_spec": []},
    ),
    "value vtype unknown": (("leaves", 1, "vtype"), "bytes"),
    "value int is str": (("leaves", 1, "value"), "7"),
    "value float garbage": (
        ("leaves", 1),
        {"path": [["d", "s"]], "type": "value", "vtype": "float", "value": "x"},
    ),
    "value complex arity": (
        ("leaves", 1),
        {"path": [["d", "s"]], "type": "value", "vtype": "complex", "value": [1]},
    ),
    "value none with value": (
        ("leaves", 1),
        {"path": [["d", "s"]], "type": "value", "vtype": "none", "value": 1},
    ),
    "duplicate path": (("leaves", 1, "path"), [["d", "w"]]),
    "metadata not object": (("metadata",), [1]),
    "created not number": (("created_unix",), "now"),
    "num_processes zero": (("num_processes",), 0),
    "writer_version not str": (("writer_version",), 1),
    "format_version str": (("format_version",), "3"),
    "format_version float": (("format_version",), 3.0),
    "format_version bool": (("format_version",), True),
    "format_version missing": (("format_version",), _DELETE),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_field_raises_manifest_error(case: str) -> None:
    path, value = MALFORMED[case]
    with pytest.raises(ManifestError) as info:
        decode_doc(_set(base_doc(), path, value))
    assert not isinstance(info.value, UnsupportedFormatVersionError)


@pytest.mark.parametrize("version", [0, 1, 2, 4, 99, 2**40])
def test_any_other_format_version_is_refused(version: int) -> None:
    with pytest.raises(
        UnsupportedFormatVersionError, match=rf"format_version {version} is not supported.*3 only"
    ):
        decode_doc(_set(base_doc(), ("format_version",), version))


# What the formats this fastckpt no longer reads looked like, as their writer stored them
# (checksum first): format 1 (an object per chunk, no "objects"), format 2 (the table with
# JSON int columns).
_OLD_LEAF = {
    "path": [["d", "w"]],
    "type": "array",
    "kind": "jax",
    "shape": [4],
    "dtype": "uint8",
    "key_impl": None,
    "sharding": None,
}
OLD_FORMATS = {
    1: {
        "format_version": 1,
        "step": 7,
        "num_processes": 1,
        "created_unix": 0.0,
        "writer_version": "0.1.0",
        "metadata": {},
        "leaves": [
            {
                **_OLD_LEAF,
                "chunks": [
                    {
                        "box": [[0, 4]],
                        "key": "steps/a/p0.fck",
                        "offset": 0,
                        "length": 4,
                        "raw_length": 4,
                        "codec": "raw",
                        "crc32c": 1,
                        "raw_crc32c": 1,
                    }
                ],
            }
        ],
    },
    2: {
        "format_version": 2,
        "step": 7,
        "num_processes": 1,
        "created_unix": 0.0,
        "writer_version": "0.1.0",
        "metadata": {},
        "objects": ["steps/a/p0.fck"],
        "leaves": [
            {
                **_OLD_LEAF,
                "chunks": {
                    "grid": [[0, 4]],
                    "object": [0],
                    "offset": [0],
                    "length": [4],
                    "codec": "raw",
                    "crc32c": [1],
                    "raw_crc32c": [1],
                },
            }
        ],
    },
}


@pytest.mark.parametrize("version", sorted(OLD_FORMATS))
@pytest.mark.parametrize("sealed", [True, False])
def test_a_manifest_of_an_earlier_format_is_refused_by_its_version(
    version: int, sealed: bool
) -> None:
    """Formats 1 and 2, checksummed as their writer stored them or not: the version is
    refused before anything else is read."""
    doc = OLD_FORMATS[version]
    data = seal_document(doc) if sealed else json.dumps(doc).encode()
    with pytest.raises(
        UnsupportedFormatVersionError, match=f"format_version {version} is not supported"
    ):
        decode_manifest(data)


def test_a_manifest_without_its_checksum_is_refused() -> None:
    """The checksum is mandatory: the same document decodes with it and is refused without
    it (no manifest is taken on trust)."""
    data = encode_manifest(base_manifest())
    assert data.startswith(b'{"manifest_crc32c":') and decode_manifest(data) == base_manifest()
    for unsealed in (json.dumps(base_doc()).encode(), b"{" + data[data.index(b",") + 1 :]):
        with pytest.raises(ManifestError, match="no manifest_crc32c") as info:
            decode_manifest(unsealed)
        assert not isinstance(info.value, UnsupportedFormatVersionError)


@pytest.mark.parametrize("value", [-1, 2**32, "123", 1.0, None, True])
def test_a_checksum_that_is_not_a_u32_is_refused(value: Any) -> None:
    doc = {codec.CHECKSUM_FIELD: value, **base_doc()}
    with pytest.raises(ManifestError, match="manifest_crc32c: expected a u32"):
        decode_manifest(json.dumps(doc).encode())


def test_a_wrong_checksum_is_refused_wherever_the_field_stands() -> None:
    body = json.dumps(base_doc(), sort_keys=True, separators=(",", ":")).encode()
    good = crc32c(body)
    last = body[:-1] + b',"manifest_crc32c":%d}' % good  # not first: checked on the canonical form
    assert decode_manifest(last) == base_manifest()
    for wrong in (good ^ 1, good ^ (1 << 31)):
        with pytest.raises(ManifestError, match="checksum mismatch"):
            decode_manifest(body[:-1] + b',"manifest_crc32c":%d}' % wrong)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"{",
        b"[]",
        b"null",
        b"42",
        b'"x"',
        b"\xff\xfe",
        b'{"format_version": 3}',
        b'{"format_version": 3, "step": NaN, "leaves": []}',
        b'{"format_version": 3, "step": 1, "leaves": [], "created_unix": Infinity}',
        b'{"format_version": 3, "step": 1, "leaves": [], "metadata": {"x": -Infinity}}',
        b"[" * 100_000 + b"]" * 100_000,
        b'{"format_version": 3, "step": ' + b"[" * 5000 + b"]" * 5000 + b', "leaves": []}',
    ],
    ids=lambda d: repr(d[:24]),
)
def test_non_manifest_bytes(data: bytes) -> None:
    with pytest.raises(ManifestError):
        decode_manifest(data)


def test_oversized_manifest_refused_before_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    data = seal(base_doc())
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
    st.sampled_from(
        ["../x", "/abs", "", "nan", "inf", "raw", "zstd", "prng_key", "value", "array", "float32"]
    ),
    st.lists(st.lists(st.integers(-3, 10), max_size=3), max_size=3),
)


def _check_decode(data: bytes) -> bool:
    """Decode ``data``: only ManifestError may escape, and whatever is accepted is a valid
    manifest (it re-encodes and decodes to itself). Whether it was accepted."""
    try:
        m = decode_manifest(data)
    except ManifestError:
        return False
    assert norm(decode_manifest(encode_manifest(m))) == norm(m)
    return True


@settings(max_examples=250, deadline=None)
@given(data=st.data())
def test_fuzz_field_mutations(data: st.DataObject) -> None:
    """Edited documents, sealed again (so that the structural checks are what decides)."""
    doc = base_doc()
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
    _check_decode(seal(doc))


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_fuzz_bytes(data: st.DataObject) -> None:
    """Bytes changed in a manifest: refused (by the checksum, or before it); and the same
    bytes sealed again, when they are still a JSON object, pass the structural checks or
    fail them with ManifestError only. A changed manifest is never accepted as it is."""
    original = seal(base_doc())
    raw = bytearray(original)
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
    if bytes(raw) != original and _check_decode(bytes(raw)):
        assert (
            decode_manifest(bytes(raw)) == base_manifest()
        )  # only a change JSON ignores (whitespace)
    try:
        doc = json.loads(bytes(raw))
    except (ValueError, RecursionError):
        return
    _check_decode(seal(doc))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=manifests(max_leaves=3), data=st.data())
def test_fuzz_random_manifest_mutations(m: Manifest, data: st.DataObject) -> None:
    doc = json.loads(encode_manifest(m))
    locs = _locations(doc)[1:]
    if locs:
        loc = data.draw(st.sampled_from(locs))
        parent = doc
        for p in loc[:-1]:
            parent = parent[p]
        parent[loc[-1]] = data.draw(_NASTY)
    _check_decode(seal(doc))


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


@given(
    st.integers(0, 10**12 - 1),
    st.text("0123456789abcdef", min_size=1, max_size=12),
    st.integers(0, 99999),
    st.integers(0, 99999),
)
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


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=manifests(max_leaves=4))
def test_chunk_ids_of_a_leaf_are_each_chunks_id_in_order(m: Manifest) -> None:
    """The grid shortcut (cut intervals formatted once, joined per cell) and the listed boxes
    give exactly chunk_id of every chunk, in the leaf's order."""
    from fastckpt.format.manifest import chunk_id, chunk_ids

    decoded = decode_manifest(encode_manifest(m))
    for a in decoded.arrays():
        assert chunk_ids(a) == [chunk_id(a.path, c.box) for c in a.chunks]
