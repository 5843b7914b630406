"""Format 2's chunk table: one array leaf's chunks as columns, their boxes as a grid.

A pod-scale manifest lists millions of chunks (3000 leaves x 512 devices). Format 1 wrote an
object per chunk (~180 bytes, ~19 us to decode); the table writes each field as one list per
leaf, names object keys by an index into the manifest's ``"objects"`` list, and, when the
boxes are the cells of a grid in C order (how fastckpt sorts the chunks of every sharding it
saves), writes the grid's cuts instead of one box per chunk. JSON (an array leaf's
``"chunks"``)::

    {"grid": [[0, 4096, 8192], [0, 512, 1024]],   # cuts per dimension: 2 x 2 cells, C order
     "object": [0, 0, 1, 1],                       # index into the manifest's "objects"
     "offset": [0, 2097152, 0, 2097152],
     "length": [2097152, 2097152, 2097152, 2097152],
     "codec": "raw",                               # one for all chunks, or a list
     "crc32c": [...], "raw_crc32c": [...]}

``"boxes": [[start0, stop0, start1, stop1, ...], ...]`` (one flat list per chunk, any order)
replaces ``"grid"`` when the boxes are not such a grid. ``raw_length`` is not written: it is
the box volume times the itemsize. Checksums are u32.

Format 3 writes the same table with its five numeric columns (``"object"``, ``"offset"``,
``"length"``, ``"crc32c"``, ``"raw_crc32c"``) as *binary columns*: a string
``"<kind>:<base64>"``, the base64 of the values as little-endian unsigned integers of
``kind`` (``u1``, ``u2``, ``u4`` or ``u8``; the writer picks the narrowest that holds them),
e.g. ``"object": "u1:AAABAQ=="``. A reader decodes a column with one base64 call and
``np.frombuffer`` instead of parsing and range-checking a JSON int per chunk.

Decoding validates what format 1 validates (boxes inside the array and tiling it, keys safe,
numbers in range, raw chunks' lengths) column by column, with numpy where it can, and returns
a :class:`~fastckpt.format.manifest.ChunkTable`: the columns, whose
:class:`~fastckpt.format.manifest.ChunkEntry` objects are built on access. No I/O.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import itertools
import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fastckpt.format._checks import MAX_INT, check_tiling, fail, json_dict, json_list
from fastckpt.format.manifest import Box, ChunkEntry, ChunkTable, box_volume
from fastckpt.storage._protocol import validate_key

__all__ = [
    "CODECS", "NUMERIC_COLUMNS", "U32", "binary_array", "checked_uint", "codec_column", "decode_chunk_table", "decode_object_keys",
    "encode_chunk_table", "encode_column", "grid_cuts", "narrow_uint", "table_json", "uint_array",
]

#: The codec names, in the order of their codes in a commit fragment's numpy column.
CODECS = ("raw", "zstd")
U32 = 0xFFFFFFFF
_COLUMNS = ("object", "offset", "length", "codec", "crc32c", "raw_crc32c")
#: The columns format 3 writes as binary columns.
NUMERIC_COLUMNS = ("object", "offset", "length", "crc32c", "raw_crc32c")
_KINDS = {f"u{n}": np.dtype(f"<u{n}") for n in (1, 2, 4, 8)}
_STRUCT_CODES = (("u1", "B", 1 << 8), ("u2", "H", 1 << 16), ("u4", "I", 1 << 32), ("u8", "Q", 1 << 64))


def grid_cuts(boxes: Sequence[Box], shape: tuple[int, ...]) -> list[list[int]] | None:
    """The cuts per dimension of the grid whose cells, in C order, are exactly ``boxes``;
    ``None`` if there is no such grid (or the cells would not start at 0 and end at the
    array's edge)."""
    if not boxes:
        return None
    cuts = []
    for d, n in enumerate(shape):
        starts = sorted({b[d][0] for b in boxes})
        if starts[0] != 0:
            return None
        cuts.append([*starts, n])
    if math.prod(len(c) - 1 for c in cuts) != len(boxes):
        return None
    cells = itertools.product(*[list(zip(c[:-1], c[1:])) for c in cuts])
    if any(cell != box for cell, box in zip(cells, boxes)):
        return None
    return cuts


def encode_chunk_table(
    chunks: Sequence[ChunkEntry], *, shape: tuple[int, ...], itemsize: int, objects: dict[str, int],
    binary: bool = False,
) -> dict[str, Any]:
    """JSON object of a leaf's chunks (``binary``: format 3's binary columns). ``objects``
    maps object keys to their index in the manifest's ``"objects"`` list; keys not in it
    yet are appended (insertion order is the list's order). ``ManifestError`` if a chunk's
    ``raw_length`` is not its box volume x ``itemsize`` (the table does not store it, so it
    could not come back)."""
    for c in chunks:
        if c.raw_length != box_volume(c.box) * itemsize:
            fail(f"chunk {list(c.box)}: raw_length {c.raw_length} != box volume x itemsize {itemsize}")
    cuts = grid_cuts([c.box for c in chunks], shape)
    table: dict[str, Any] = (
        {"grid": cuts} if cuts is not None else {"boxes": [[v for iv in c.box for v in iv] for c in chunks]}
    )
    codecs = {c.codec for c in chunks}
    table["object"] = [objects.setdefault(c.key, len(objects)) for c in chunks]
    table["offset"] = [c.offset for c in chunks]
    table["length"] = [c.length for c in chunks]
    table["codec"] = next(iter(codecs)) if len(codecs) == 1 else [c.codec for c in chunks]
    table["crc32c"] = [c.crc32c for c in chunks]
    table["raw_crc32c"] = [c.raw_crc32c for c in chunks]
    if binary:
        for k in NUMERIC_COLUMNS:
            table[k] = encode_column(table[k])
    return table


def narrow_uint(values: np.ndarray | Sequence[int]) -> np.ndarray:
    """``values`` (ints in ``[0, 2**64)``) as little-endian unsigned ints of the narrowest of
    ``u1 u2 u4 u8`` that holds them (``u1`` when empty): format 3's binary columns and the
    commit fragments' columns."""
    arr = np.asarray(values, np.uint64) if not isinstance(values, np.ndarray) else values
    kind = "u1" if not arr.size else f"u{np.min_scalar_type(int(arr.max())).itemsize}"
    return arr.astype(_KINDS[kind], copy=False)


def encode_column(values: np.ndarray | Sequence[int]) -> str:
    """Format 3's binary column of ``values`` (ints in ``[0, 2**64)``): ``"<kind>:<base64>"``
    in the narrowest kind that holds them."""
    if not isinstance(values, np.ndarray) and values and 0 <= min(values):
        top = max(values)  # a list of a few ints (a leaf's chunks): struct is ~4x numpy's cost
        for kind, code, limit in _STRUCT_CODES:
            if top < limit:
                return f"{kind}:" + base64.b64encode(struct.pack(f"<{len(values)}{code}", *values)).decode("ascii")
    arr = narrow_uint(values)
    return f"u{arr.itemsize}:" + base64.b64encode(arr.tobytes()).decode("ascii")


def table_json(table: Mapping[str, Any], *, binary: bool) -> dict[str, Any]:
    """A ready chunk table (what the commit merge builds: the numeric columns as numpy
    arrays) in format 2's JSON form (lists) or format 3's (``binary`` columns)."""
    return {k: (encode_column(v) if binary else v.tolist()) if isinstance(v, np.ndarray) else v
            for k, v in table.items()}


def codec_column(obj: Any, n: int, what: str) -> list[str]:
    """A codec column: one codec name for all ``n`` chunks, or a list of ``n`` of them."""
    if type(obj) is list:
        if len(obj) != n or any(c not in CODECS for c in obj):
            fail(f"{what}: expected {n} of {list(CODECS)}, got {obj!r:.80}")
        return obj
    if obj not in CODECS:
        fail(f"{what}: unknown codec {obj!r:.40}")
    return [obj] * n


def _grid(obj: Any, shape: tuple[int, ...], what: str) -> list[list[int]]:
    cuts = json_list(obj, what)
    if len(cuts) != len(shape):
        fail(f"{what}: {len(cuts)} dimensions for an array of rank {len(shape)}")
    for d, (c, n) in enumerate(zip(cuts, shape)):
        c = json_list(c, f"{what}[{d}]")
        if len(c) < 2 or any(type(v) is not int for v in c) or c[0] != 0 or c[-1] != n:
            fail(f"{what}[{d}]: expected ints from 0 to {n}, got {c!r:.80}")
        if any(a > b for a, b in zip(c, c[1:])):
            fail(f"{what}[{d}]: cuts must not decrease, got {c!r:.80}")
    return cuts


def decode_object_keys(obj: Any, what: str) -> list[str]:
    """A list of object keys (a manifest's ``"objects"``), each checked to be a safe relative key."""
    keys = json_list(obj, what)
    for i, key in enumerate(keys):
        if type(key) is not str:
            fail(f"{what}[{i}]: expected a string, got {key!r:.80}")
        try:
            validate_key(key)
        except ValueError as e:
            fail(f"{what}[{i}]: {e}")
    return keys


def _listed_boxes(obj: Any, shape: tuple[int, ...], what: str, tiling: bool) -> list[Box]:
    rows = json_list(obj, what)
    ndim = len(shape)
    out: list[Box] = []
    for i, row in enumerate(rows):
        if type(row) is not list or len(row) != 2 * ndim or any(type(v) is not int for v in row):
            fail(f"{what}[{i}]: expected {2 * ndim} ints (start, stop per dimension), got {row!r:.80}")
        box = tuple(zip(row[::2], row[1::2]))
        for d, ((a, b), n) in enumerate(zip(box, shape)):
            if not 0 <= a <= b <= n:
                fail(f"{what}[{i}]: dimension {d}: [{a}, {b}) outside [0, {n})")
        out.append(box)
    if not tiling:
        return out
    check_tiling(out, shape, what)
    return out


def uint_array(obj: Any, n: int, what: str, hi: int, dtype: type[np.integer[Any]] = np.int64) -> np.ndarray:
    """A JSON list of ``n`` ints in ``[0, hi]`` as a numpy array of ``dtype`` (which must hold
    ``hi``): one type pass in Python, the range checks in numpy; the first bad value is named
    (bools, floats and ints beyond int64 included, none is cast)."""
    col = json_list(obj, what)
    if len(col) != n:
        fail(f"{what}: {len(col)} entries for {n} chunks")
    if not col:
        return np.zeros(0, dtype)
    arr = None
    if set(map(type, col)) == {int}:
        with contextlib.suppress(OverflowError):
            arr = np.array(col, np.int64)
    if arr is None or int(arr.min()) < 0 or int(arr.max()) > hi:
        i, bad = next((i, v) for i, v in enumerate(col) if type(v) is not int or not 0 <= v <= hi)
        fail(f"{what}[{i}]: expected an int in [0, {hi}], got {bad!r:.80}")
    return arr.astype(dtype, copy=False)


def binary_array(obj: Any, n: int, what: str, hi: int, dtype: type[np.integer[Any]] = np.int64) -> np.ndarray:
    """A format-3 binary column of ``n`` ints in ``[0, hi]`` as a numpy array of ``dtype``
    (which must hold ``hi``); the first value out of range is named. The string's length is
    checked before it is decoded."""
    kind, sep, text = obj.partition(":") if type(obj) is str else ("", "", "")
    if not sep or kind not in _KINDS:
        fail(f"{what}: expected a binary column '<u1|u2|u4|u8>:<base64>', got {obj!r:.60}")
    nbytes = n * _KINDS[kind].itemsize
    if len(text) != 4 * -(-nbytes // 3):
        fail(f"{what}: {len(text)} base64 characters for {n} values of {kind} ({nbytes} bytes)")
    try:
        raw = binascii.a2b_base64(text, strict_mode=True)
    except (binascii.Error, ValueError) as e:
        fail(f"{what}: not base64: {e}")
    if len(raw) != nbytes:
        fail(f"{what}: {len(raw)} bytes for {n} values of {kind}")
    return checked_uint(np.frombuffer(raw, _KINDS[kind]), n, what, hi, dtype)


def checked_uint(col: np.ndarray, n: int, what: str, hi: int, dtype: type[np.integer[Any]] = np.int64) -> np.ndarray:
    """An unsigned numpy column (format 3's, a commit fragment's) as ``dtype`` (which must
    hold ``hi``) after checking it has ``n`` values in ``[0, hi]``; the first bad one named."""
    if len(col) != n:
        fail(f"{what}: {len(col)} values, expected {n}")
    if n and int(col.max()) > hi:
        i = int(np.argmax(col > hi))
        fail(f"{what}[{i}]: expected an int in [0, {hi}], got {int(col[i])}")
    return col.astype(dtype)


def decode_chunk_table(
    obj: Any, *, shape: tuple[int, ...], itemsize: int, objects: Sequence[str], what: str, tiling: bool = True,
    binary: bool = False,
) -> ChunkTable:
    """Validate a leaf's chunk table and return it as a :class:`ChunkTable` (entries are
    built on access); ``ManifestError`` on any flaw. ``objects`` is the (validated,
    :func:`decode_object_keys`) object key list. With ``tiling=False`` (one process's part of
    a leaf) listed boxes need not tile the array nor be disjoint; a grid always tiles it.
    ``binary``: the numeric columns are format 3's binary columns, else JSON lists."""
    d: Mapping[str, Any] = json_dict(obj, what, _COLUMNS)
    if ("grid" in d) == ("boxes" in d):
        fail(f"{what}: expected exactly one of 'grid' and 'boxes'")
    cuts: list[list[int]] | None = None
    listed: list[Box] | None = None
    if "grid" in d:
        cuts = _grid(d["grid"], shape, f"{what}.grid")
        n = math.prod(len(c) - 1 for c in cuts)  # checked against the columns before building
    else:
        listed = _listed_boxes(d["boxes"], shape, f"{what}.boxes", tiling)
        n = len(listed)
    column = binary_array if binary else uint_array
    index = column(d["object"], n, f"{what}.object", len(objects) - 1, np.int32)
    offsets = column(d["offset"], n, f"{what}.offset", MAX_INT)
    lengths = column(d["length"], n, f"{what}.length", MAX_INT)
    crcs = column(d["crc32c"], n, f"{what}.crc32c", U32, np.uint32)
    raw_crcs = column(d["raw_crc32c"], n, f"{what}.raw_crc32c", U32, np.uint32)
    codec = d["codec"]
    codecs = codec_column(codec, n, f"{what}.codec")
    if math.prod(shape) * itemsize > MAX_INT:  # (any codec: a chunk's raw_length is bounded by it)
        fail(f"{what}: an array of {math.prod(shape)} x {itemsize} bytes is too large")
    if codec == "raw" or type(codec) is list and "raw" in codec:
        if cuts is not None:  # the cells' volumes, C order
            raw_lengths = functools.reduce(np.multiply.outer, [np.diff(np.asarray(c, np.int64)) for c in cuts],
                                           np.int64(itemsize)).reshape(-1)
        else:
            raw_lengths = np.array([box_volume(b) * itemsize for b in listed or ()], np.int64)
        bad = lengths != raw_lengths
        if type(codec) is list:
            bad &= np.array([c == "raw" for c in codecs], bool)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            fail(f"{what}.length[{i}]: raw chunk length {int(lengths[i])} != box volume x itemsize "
                 f"{int(raw_lengths[i])}")
    return ChunkTable(cuts=cuts, boxes=listed, keys=objects, object_index=index, offsets=offsets, lengths=lengths,
                      codec=codec if type(codec) is str else tuple(codecs), crc32c=crcs, raw_crc32c=raw_crcs,
                      itemsize=itemsize)
