"""The chunk table: grids chosen exactly when they fit, every flaw a ManifestError, exactly the
entries it was built from, binary columns that hold exactly the values, and a decoder that
leaves the garbage collector as it was."""

from __future__ import annotations

import base64
import dataclasses
import gc
import itertools
import json
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastckpt.errors import ManifestError, UnsupportedFormatVersionError
from fastckpt.format.chunk_table import binary_array, encode_column, grid_cuts, table_from_entries
from fastckpt.format.codec import decode_manifest, encode_manifest
from fastckpt.format.dtypes import dtype_from_name
from fastckpt.format.manifest import (
    FORMAT_VERSION,
    ArrayLeaf,
    ChunkEntry,
    ChunkTable,
    Manifest,
    box_volume,
)
from fastckpt.testing.strategies import grid_tilings, manifests, shapes, tilings
from tests.format.test_codec import (
    _DELETE,
    W_CHUNKS,
    _set,
    base_doc,
    decode_doc,
    seal,
)

T = ("leaves", 0, "chunks")


def _entries(boxes: list[Any], *, codec: str = "raw") -> list[ChunkEntry]:
    out = []
    for i, box in enumerate(boxes):
        n = box_volume(box) * 4
        out.append(
            ChunkEntry(box, f"steps/s/p{i % 3}.fck", 64 * i, n, n, codec, 1000 + i, 1000 + i)
        )
    return out


def _leaf(boxes: list[Any], shape: tuple[int, ...], *, codec: str = "raw") -> ArrayLeaf:
    chunks = table_from_entries(_entries(boxes, codec=codec), shape=shape, itemsize=4)
    return ArrayLeaf(path=(("d", "w"),), shape=shape, dtype="float32", chunks=chunks)


def _encoded_leaf(leaf: ArrayLeaf) -> dict[str, Any]:
    return json.loads(encode_manifest(Manifest(step=1, leaves=(leaf,))))["leaves"][0]["chunks"]


def test_writes_a_grid_and_binary_columns_for_a_sharded_leaf() -> None:
    boxes = [((i * 16, i * 16 + 16), (j * 4, j * 4 + 4)) for i in range(4) for j in range(2)]
    doc = json.loads(encode_manifest(Manifest(step=1, leaves=(_leaf(boxes, (64, 8)),))))
    assert FORMAT_VERSION == 3 and doc["format_version"] == 3
    assert doc["objects"] == ["steps/s/p0.fck", "steps/s/p1.fck", "steps/s/p2.fck"]
    table = doc["leaves"][0]["chunks"]
    assert (
        table["grid"] == [[0, 16, 32, 48, 64], [0, 4, 8]]
        and "boxes" not in table
        and table["codec"] == "raw"
    )
    assert table["object"] == "u1:" + base64.b64encode(bytes([0, 1, 2, 0, 1, 2, 0, 1])).decode()
    assert (
        table["offset"]
        == "u2:" + base64.b64encode(np.arange(0, 512, 64, dtype="<u2").tobytes()).decode()
    )
    assert (
        table["crc32c"]
        == "u2:" + base64.b64encode(np.arange(1000, 1008, dtype="<u2").tobytes()).decode()
    )
    shuffled = boxes[1:] + boxes[:1]  # not C order: listed, in the given order
    listed = _encoded_leaf(_leaf(shuffled, (64, 8)))
    assert (
        "grid" not in listed and listed["boxes"][-1] == [0, 16, 0, 4] and len(listed["boxes"]) == 8
    )


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.integers(0, 2**63 - 1), max_size=40), hi=st.integers(0, 2**63 - 1))
def test_a_binary_column_holds_exactly_its_values_in_the_narrowest_kind(
    values: list[int], hi: int
) -> None:
    text = encode_column(values)
    assert text == encode_column(np.asarray(values, np.uint64))  # a list's struct path = numpy's
    kind = text.split(":")[0]
    assert kind == f"u{np.min_scalar_type(max(values, default=0)).itemsize}"
    if all(v <= hi for v in values):
        assert binary_array(text, len(values), "c", hi).tolist() == values
    else:
        first = next(i for i, v in enumerate(values) if v > hi)
        with pytest.raises(ManifestError, match=rf"c\[{first}\]: expected an int in \[0, {hi}\]"):
            binary_array(text, len(values), "c", hi)
    with pytest.raises(ManifestError):
        binary_array(text, len(values) + 1, "c", 2**63 - 1)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_grid_cuts_describe_exactly_the_boxes(data: st.DataObject) -> None:
    shape = data.draw(shapes(max_rank=3, max_side=6))
    boxes = data.draw(st.one_of(grid_tilings(shape), tilings(shape, max_pieces=6)))
    if data.draw(st.booleans()):
        boxes = sorted(boxes)
    cuts = grid_cuts(boxes, shape)
    if cuts is not None:  # a grid is only ever a faithful description
        assert [
            tuple(c) for c in itertools.product(*[list(itertools.pairwise(c)) for c in cuts])
        ] == boxes
    strict = all(a < b for box in boxes for a, b in box)  # no empty cell: sorted cells are a grid
    if strict and boxes == list(
        itertools.product(*[sorted({b[d] for b in boxes}) for d in range(len(shape))])
    ):
        assert cuts is not None


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_table_built_from_entries_holds_them_in_order_through_the_codec(
    data: st.DataObject,
) -> None:
    shape = data.draw(shapes(max_rank=3, max_side=6))
    boxes = data.draw(st.one_of(grid_tilings(shape), tilings(shape, max_pieces=6)))
    codecs = data.draw(
        st.lists(st.sampled_from(["raw", "zstd"]), min_size=len(boxes), max_size=len(boxes))
    )
    entries = [dataclasses.replace(e, codec=c) for e, c in zip(_entries(boxes), codecs)]
    table = table_from_entries(entries, shape=shape, itemsize=4)
    assert list(table) == entries and (table.grid is not None) == (
        grid_cuts(boxes, shape) is not None
    )
    leaf = ArrayLeaf(path=(("d", "w"),), shape=shape, dtype="float32", chunks=table)
    [back] = decode_manifest(encode_manifest(Manifest(step=1, leaves=(leaf,)))).arrays()
    assert list(back.chunks) == entries and back == leaf


def test_a_large_grid_leaf_is_small_and_exact() -> None:
    rng = random.Random(0)
    boxes = [((i * 8, i * 8 + 8), (j * 16, j * 16 + 16)) for i in range(64) for j in range(8)]
    entries = [
        dataclasses.replace(c, length=rng.randrange(1, 512), crc32c=rng.getrandbits(32))
        for c in _entries(boxes, codec="zstd")
    ]
    leaf = ArrayLeaf(
        path=(("d", "w"),),
        shape=(512, 128),
        dtype="float32",
        chunks=table_from_entries(entries, shape=(512, 128), itemsize=4),
    )
    m = Manifest(step=3, leaves=(leaf,))
    data = encode_manifest(m)
    assert decode_manifest(data) == m and list(decode_manifest(data).arrays()[0].chunks) == entries
    assert len(data) < 512 * 20  # 512 chunks: five binary columns, ~15 base64 characters per chunk


def test_a_table_refuses_what_it_cannot_hold() -> None:
    [entry] = _entries([((0, 4),)])
    with pytest.raises(ManifestError, match="raw_length 15"):
        table_from_entries([dataclasses.replace(entry, raw_length=15)], shape=(4,), itemsize=4)


def _put(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda doc: _set(doc, path, value)


def _boxes(rows: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def edit(doc: dict[str, Any]) -> dict[str, Any]:
        doc = _set(doc, (*T, "grid"), _DELETE)
        doc["leaves"][0]["chunks"]["boxes"] = rows
        return doc

    return edit


def _b64(kind: str, values: list[int]) -> str:
    return kind + ":" + base64.b64encode(np.asarray(values, f"<{kind}").tobytes()).decode()


MALFORMED: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "objects missing": _put(("objects",), _DELETE),
    "objects not a list": _put(("objects",), "steps/a"),
    "object key unsafe": _put(("objects", 0), "../x"),
    "object key absolute": _put(("objects", 1), "/abs"),
    "object key not str": _put(("objects", 1), 5),
    "table is a list of chunk objects": _put(
        T,
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
    "table not an object": _put(T, None),
    "grid and boxes": _put((*T, "boxes"), [[0, 2, 0, 2], [2, 4, 0, 2]]),
    "neither grid nor boxes": _put((*T, "grid"), _DELETE),
    "grid rank": _put((*T, "grid"), [[0, 2, 4]]),
    "grid not a list": _put((*T, "grid"), {"0": 2}),
    "grid cuts not a list": _put((*T, "grid"), [4, [0, 2]]),
    "grid not from 0": _put((*T, "grid"), [[1, 2, 4], [0, 2]]),
    "grid not to the edge": _put((*T, "grid"), [[0, 2, 3], [0, 2]]),
    "grid past the edge": _put((*T, "grid"), [[0, 2, 5], [0, 2]]),
    "grid decreasing": _put((*T, "grid"), [[0, 3, 1, 4], [0, 2]]),
    "grid float cut": _put((*T, "grid"), [[0, 2.0, 4], [0, 2]]),
    "grid bool cut": _put((*T, "grid"), [[0, True, 4], [0, 2]]),
    "grid single cut": _put((*T, "grid"), [[4], [0, 2]]),
    "grid cells != columns": _put((*T, "grid"), [[0, 1, 2, 3, 4], [0, 2]]),
    "grid of a million cells": _put((*T, "grid"), [[0] * 1000 + [4], [0] * 1000 + [2]]),
    "codec missing": _put((*T, "codec"), _DELETE),
    "codec unknown": _put((*T, "codec"), "lz4"),
    "codec unhashable": _put((*T, "codec"), {"zstd": 1}),
    "codec list short": _put((*T, "codec"), ["raw"]),
    "codec list unknown": _put((*T, "codec"), ["raw", "lz4"]),
    "codec list unhashable": _put((*T, "codec"), [["raw"], "zstd"]),
    "all raw, one compressed length": _put((*T, "codec"), "raw"),
    "boxes overlap": _boxes([[0, 2, 0, 2], [1, 3, 0, 2]]),
    "boxes short of the volume": _boxes([[0, 2, 0, 2], [2, 3, 0, 2]]),
    "boxes outside": _boxes([[0, 2, 0, 2], [2, 5, 0, 2]]),
    "boxes reversed": _boxes([[2, 0, 0, 2], [2, 4, 0, 2]]),
    "boxes arity": _boxes([[0, 2, 0], [2, 4, 0, 2]]),
    "boxes float": _boxes([[0, 2, 0, 2.0], [2, 4, 0, 2]]),
    "boxes not a list": _boxes("0:2"),
    "boxes row not a list": _boxes([7, [2, 4, 0, 2]]),
    "boxes != columns": _boxes([[0, 4, 0, 2]]),
    # the numeric columns
    "a column as a list of ints": _put((*T, "offset"), [0, 0]),
    "a column as an int": _put((*T, "offset"), 0),
    "no kind": _put((*T, "offset"), base64.b64encode(bytes(16)).decode()),
    "signed kind": _put((*T, "offset"), "i8:" + base64.b64encode(bytes(16)).decode()),
    "odd kind": _put((*T, "offset"), "u3:" + base64.b64encode(bytes(6)).decode()),
    "one value short": _put((*T, "offset"), _b64("u8", [0])),
    "one value long": _put((*T, "offset"), _b64("u8", [0, 0, 0])),
    "a byte short, same length of text": _put((*T, "offset"), "u1:AA=="),  # 1 byte, 2 wanted: AAA=
    "not base64": _put((*T, "offset"), "u1:A!A="),
    "padding inside": _put((*T, "length"), "u4:AA==AAAAAAA="),
    "object index out of range": _put((*T, "object"), _b64("u1", [0, 2])),
    "offset beyond int64": _put((*T, "offset"), _b64("u8", [0, 2**63])),
    "crc over u32": _put((*T, "crc32c"), _b64("u8", [2**32, 2])),
    "raw chunk with another length": _put((*T, "length"), _b64("u1", [15, 9])),
    "raw_crc32c missing": _put((*T, "raw_crc32c"), _DELETE),
    "crc32c missing": _put((*T, "crc32c"), _DELETE),
    "object missing": _put((*T, "object"), _DELETE),
}


def test_base_doc_is_a_grid_with_binary_columns() -> None:
    doc = base_doc()
    assert doc["leaves"][0]["chunks"]["grid"] == [[0, 2, 4], [0, 2]]
    assert doc["leaves"][0]["chunks"]["codec"] == ["raw", "zstd"]
    assert doc["leaves"][0]["chunks"]["object"] == _b64("u1", [0, 1])
    assert doc["leaves"][0]["chunks"]["length"] == _b64("u1", [16, 9])
    assert list(decode_doc(doc).arrays()[0].chunks) == list(W_CHUNKS)


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_table_raises_manifest_error(case: str) -> None:
    """Every flaw of a table is a ManifestError (the document sealed again: the check made
    for the flaw finds it), never mistaken for an unknown format."""
    with pytest.raises(ManifestError) as info:
        decode_doc(MALFORMED[case](base_doc()))
    assert not isinstance(info.value, UnsupportedFormatVersionError)
    assert "checksum" not in str(info.value)


def test_table_errors_name_the_leaf_and_the_field() -> None:
    doc = _put((*T, "offset"), _b64("u8", [0, 2**63]))(base_doc())
    with pytest.raises(
        ManifestError, match=r"leaves\[0\]\.chunks\.offset\[1\]: expected an int in \[0, "
    ):
        decode_doc(doc)


@pytest.mark.parametrize("enabled", [True, False])
def test_decoding_leaves_the_garbage_collector_as_it_was(enabled: bool) -> None:
    good, bad = seal(base_doc()), seal({"format_version": 3, "step": -1, "leaves": []})
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        decode_manifest(good)
        assert gc.isenabled() is enabled
        with pytest.raises(ManifestError):
            decode_manifest(bad)
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


# ---------------------------------------------------------- the decoded table (lazy entries)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=manifests(), data=st.data())
def test_a_decoded_table_is_the_sequence_of_its_entries(m: Manifest, data: st.DataObject) -> None:
    """Each array leaf's chunks decode to a ChunkTable that, in everything a caller can ask
    (length, indexing, slices, iteration, equality, hash, the per-leaf and manifest sums,
    object keys), is the sequence of the entries it was encoded from."""
    back = decode_manifest(encode_manifest(m))
    for a1, a2 in zip(m.arrays(), back.arrays()):
        entries, table = tuple(a1.chunks), a2.chunks
        assert isinstance(table, ChunkTable)
        assert (
            len(table) == len(entries)
            and tuple(table) == entries
            and list(iter(table)) == list(entries)
        )
        assert table == a1.chunks and a1.chunks == table and hash(table) == hash(a1.chunks)
        assert [table[i] for i in range(len(table))] == list(entries)
        assert (
            [table.box(i) for i in range(len(table))]
            == list(table.boxes())
            == [c.box for c in entries]
        )
        if entries:
            i = data.draw(st.integers(-len(entries), len(entries) - 1))
            assert table[i] == entries[i]
            itemsize = dtype_from_name(a1.dtype).itemsize
            assert table != table_from_entries(entries[:-1], shape=a1.shape, itemsize=itemsize)
        start, stop, step = (data.draw(st.integers(-3, 6)) for _ in range(3))
        step = step or 1
        assert table[start:stop:step] == entries[start:stop:step]
        with pytest.raises(IndexError):
            table[len(entries)]
        assert (a2.nbytes, a2.stored_bytes) == (
            sum(c.raw_length for c in entries),
            sum(c.length for c in entries),
        )
        assert table.object_keys() == {c.key for c in entries}
        assert (table.grid is not None) == (
            grid_cuts([c.box for c in entries], a1.shape) is not None
        )
    assert back.object_keys() == m.object_keys() and (back.nbytes, back.stored_bytes) == (
        m.nbytes,
        m.stored_bytes,
    )


def test_a_table_checks_its_columns_and_names_its_grid() -> None:
    cols = {
        "keys": ["o"],
        "object_index": np.zeros(4, np.int32),
        "offsets": np.arange(4),
        "lengths": np.full(4, 8),
        "codec": "raw",
        "crc32c": np.zeros(4, np.uint32),
        "raw_crc32c": np.zeros(4, np.uint32),
        "itemsize": 4,
    }
    table = ChunkTable(cuts=[[0, 2, 4], [0, 1, 2]], boxes=None, **cols)
    assert (
        table.grid == ((0, 2, 4), (0, 1, 2))
        and table.box(3) == ((2, 4), (1, 2))
        and table[3].offset == 3
    )
    assert "grid" in repr(table) and table.raw_bytes == 32 and table.stored_bytes == 32
    with pytest.raises(ValueError, match="exactly one"):
        ChunkTable(cuts=None, boxes=None, **cols)
    with pytest.raises(ValueError, match="4 entries"):
        ChunkTable(cuts=None, boxes=[((0, 1),)] * 4, **{**cols, "lengths": np.full(3, 8)})
    assert ChunkTable(cuts=None, boxes=[((0, 1),)] * 4, **cols).grid is None


@pytest.mark.parametrize("value", [2**64, -(2**64), True, 1.0, None, [0, 0], {"u1": "AAA="}])
def test_a_column_that_is_not_a_binary_column_is_refused(value: Any) -> None:
    """A numeric column is a ``"<kind>:<base64>"`` string, nothing else (no JSON value numpy
    would coerce is taken)."""
    doc = _set(base_doc(), (*T, "offset"), value)
    with pytest.raises(ManifestError, match=r"offset: expected a binary column"):
        decode_doc(doc)
