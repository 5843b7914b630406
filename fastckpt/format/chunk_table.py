"""The chunk table: one array leaf's chunks as columns, their boxes as a grid.

An array leaf's ``"chunks"`` is a table (layout and an example: ``docs/format.md``): one
column per field, object keys as indices into the manifest's ``"objects"``, and the grid's
cuts when the boxes are a grid's cells in C order (as fastckpt sorts every sharding), else
``"boxes"`` (``[start0, stop0, start1, stop1, ...]`` per chunk). Numeric columns are *binary
columns*: ``"<kind>:<base64>"`` of little-endian unsigned ints of the narrowest ``kind`` of
``u1 u2 u4 u8`` that holds them. ``raw_length`` is not written (box volume x itemsize);
checksums are u32.

Decoding validates every column (boxes inside the array and tiling it, keys safe, numbers in
range, raw chunks' lengths) and returns a :class:`~fastckpt.format.manifest.ChunkTable`.
The column codec (:func:`encode_column`, :func:`binary_array`) is also the commit
fragments' (``writer.fragment``). No I/O.
"""

from __future__ import annotations

import base64
import binascii
import functools
import itertools
import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np

from fastckpt.format.checks import MAX_INT, check_tiling, fail, json_dict, json_list
from fastckpt.format.manifest import Box, ChunkEntry, ChunkTable, Codec, box_volume
from fastckpt.storage import validate_key

__all__ = [
    "CODECS",
    "U32",
    "binary_array",
    "codec_column",
    "decode_chunk_table",
    "decode_object_keys",
    "encode_column",
    "encode_table",
    "grid_cuts",
    "table_from_entries",
]

#: The codec names, in the order of their codes in a commit's numpy codec column.
CODECS: tuple[Codec, ...] = ("raw", "zstd")
U32 = 0xFFFFFFFF
_COLUMNS = ("object", "offset", "length", "codec", "crc32c", "raw_crc32c")
_KINDS = {f"u{n}": np.dtype(f"<u{n}") for n in (1, 2, 4, 8)}
_STRUCT_CODES = [(f"u{n}", c, 1 << 8 * n) for n, c in ((1, "B"), (2, "H"), (4, "I"), (8, "Q"))]


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
    cells = itertools.product(*[list(itertools.pairwise(c)) for c in cuts])
    if any(cell != box for cell, box in zip(cells, boxes)):
        return None
    return cuts


def table_from_entries(
    chunks: Sequence[ChunkEntry], *, shape: tuple[int, ...], itemsize: int
) -> ChunkTable:
    """The :class:`ChunkTable` of ``chunks``, in their order: a grid when their boxes are a
    grid's cells in C order, else listed boxes. ``ManifestError`` if a chunk's ``raw_length``
    is not its box volume x ``itemsize`` (a table does not store it, so it could not come
    back). Checks nothing else: the manifest codec validates a table when it decodes one."""
    for c in chunks:
        if c.raw_length != box_volume(c.box) * itemsize:
            fail(
                f"chunk {list(c.box)}: raw_length {c.raw_length} != box volume x itemsize "
                f"{itemsize}"
            )
    boxes = [c.box for c in chunks]
    cuts = grid_cuts(boxes, shape)
    keys: dict[str, int] = {}
    index = np.array([keys.setdefault(c.key, len(keys)) for c in chunks], np.int32)
    codecs = {c.codec for c in chunks}
    return ChunkTable(
        cuts=cuts,
        boxes=None if cuts is not None else boxes,
        keys=list(keys),
        object_index=index,
        offsets=np.array([c.offset for c in chunks], np.int64),
        lengths=np.array([c.length for c in chunks], np.int64),
        codec=next(iter(codecs)) if len(codecs) == 1 else tuple(c.codec for c in chunks),
        crc32c=np.array([c.crc32c for c in chunks], np.uint32),
        raw_crc32c=np.array([c.raw_crc32c for c in chunks], np.uint32),
        itemsize=itemsize,
    )


def encode_table(
    table: ChunkTable, *, shape: tuple[int, ...], remap: np.ndarray | None = None
) -> dict[str, Any]:
    """JSON object of a leaf's chunk table (of an array of ``shape``): its boxes as a grid
    whenever they are one. ``remap[i]`` is the index in the manifest's ``"objects"`` of the
    table's object key ``i``; None when the table's keys are that list."""
    cols = table.columns()
    cuts = cols.cuts if cols.cuts is not None else grid_cuts(cols.boxes or (), shape)
    out: dict[str, Any] = (
        {"grid": [list(c) for c in cuts]}
        if cuts is not None
        else {"boxes": [[v for iv in box for v in iv] for box in cols.boxes or ()]}
    )
    out["object"] = encode_column(cols.object_index if remap is None else remap[cols.object_index])
    out["offset"] = encode_column(cols.offsets)
    out["length"] = encode_column(cols.lengths)
    out["codec"] = cols.codec if type(cols.codec) is str else list(cols.codec)
    out["crc32c"] = encode_column(cols.crc32c)
    out["raw_crc32c"] = encode_column(cols.raw_crc32c)
    return out


def encode_column(values: np.ndarray | Sequence[int]) -> str:
    """The binary column of ``values`` (ints in ``[0, 2**64)``): ``"<kind>:<base64>"``
    in the narrowest kind that holds them (``u1`` when empty)."""
    if not isinstance(values, np.ndarray) and values and 0 <= min(values):
        top = max(values)  # a few ints (a leaf's chunks): struct, not numpy's per-call cost
        for kind, code, limit in _STRUCT_CODES:
            if top < limit:
                return f"{kind}:" + base64.b64encode(
                    struct.pack(f"<{len(values)}{code}", *values)
                ).decode("ascii")
    arr = np.asarray(values, np.uint64) if not isinstance(values, np.ndarray) else values
    kind = "u1" if not arr.size else f"u{np.min_scalar_type(int(arr.max())).itemsize}"
    data = arr.astype(_KINDS[kind], copy=False).tobytes()
    return f"{kind}:" + base64.b64encode(data).decode("ascii")


def codec_column(obj: Any, n: int, what: str) -> list[Codec]:
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
        if any(a > b for a, b in itertools.pairwise(c)):
            fail(f"{what}[{d}]: cuts must not decrease, got {c!r:.80}")
    return cuts


def decode_object_keys(obj: Any, what: str) -> list[str]:
    """A list of object keys (a manifest's ``"objects"``), each checked to be a safe relative
    key."""
    keys = json_list(obj, what)
    for i, key in enumerate(keys):
        if type(key) is not str:
            fail(f"{what}[{i}]: expected a string, got {key!r:.80}")
        try:
            validate_key(key)
        except ValueError as e:
            fail(f"{what}[{i}]: {e}")
    return keys


def _listed_boxes(obj: Any, shape: tuple[int, ...], what: str) -> list[Box]:
    rows = json_list(obj, what)
    ndim = len(shape)
    out: list[Box] = []
    for i, row in enumerate(rows):
        if type(row) is not list or len(row) != 2 * ndim or any(type(v) is not int for v in row):
            fail(
                f"{what}[{i}]: expected {2 * ndim} ints (start, stop per dimension), got "
                f"{row!r:.80}"
            )
        box = tuple(zip(row[::2], row[1::2]))
        for d, ((a, b), n) in enumerate(zip(box, shape)):
            if not 0 <= a <= b <= n:
                fail(f"{what}[{i}]: dimension {d}: [{a}, {b}) outside [0, {n})")
        out.append(box)
    check_tiling(out, shape, what)
    return out


def binary_array(
    obj: Any, n: int | None, what: str, hi: int, dtype: type[np.integer[Any]] = np.int64
) -> np.ndarray:
    """A binary column of ``n`` ints (as many as it holds when ``n`` is None) in ``[0, hi]``
    as a numpy array of ``dtype`` (which must hold ``hi``); the first value out of range is
    named. With ``n`` given, the string's length is checked before it is decoded."""
    kind, sep, text = obj.partition(":") if type(obj) is str else ("", "", "")
    if not sep or kind not in _KINDS:
        fail(f"{what}: expected a binary column '<u1|u2|u4|u8>:<base64>', got {obj!r:.60}")
    size = _KINDS[kind].itemsize
    if n is not None and len(text) != 4 * -(-(n * size) // 3):
        fail(f"{what}: {len(text)} base64 characters for {n} values of {kind} ({n * size} bytes)")
    try:
        raw = binascii.a2b_base64(text, strict_mode=True)
    except (binascii.Error, ValueError) as e:
        fail(f"{what}: not base64: {e}")
    if n is None and len(raw) % size:
        fail(f"{what}: {len(raw)} bytes is not a whole number of {kind} values")
    n = len(raw) // size if n is None else n
    if len(raw) != n * size:
        fail(f"{what}: {len(raw)} bytes for {n} values of {kind}")
    col = np.frombuffer(raw, _KINDS[kind])
    if n and int(col.max()) > hi:
        i = int(np.argmax(col > hi))
        fail(f"{what}[{i}]: expected an int in [0, {hi}], got {int(col[i])}")
    return col.astype(dtype)


def decode_chunk_table(
    obj: Any,
    *,
    shape: tuple[int, ...],
    itemsize: int,
    objects: Sequence[str],
    what: str,
) -> ChunkTable:
    """Validate a leaf's chunk table and return it as a :class:`ChunkTable` (entries are
    built on access); ``ManifestError`` on any flaw. ``objects`` is the (validated,
    :func:`decode_object_keys`) object key list. The boxes must tile the array exactly (a
    grid always does)."""
    d: Mapping[str, Any] = json_dict(obj, what, _COLUMNS)
    if ("grid" in d) == ("boxes" in d):
        fail(f"{what}: expected exactly one of 'grid' and 'boxes'")
    cuts: list[list[int]] | None = None
    listed: list[Box] | None = None
    if "grid" in d:
        cuts = _grid(d["grid"], shape, f"{what}.grid")
        n = math.prod(len(c) - 1 for c in cuts)  # checked against the columns before building
    else:
        listed = _listed_boxes(d["boxes"], shape, f"{what}.boxes")
        n = len(listed)
    index = binary_array(d["object"], n, f"{what}.object", len(objects) - 1, np.int32)
    offsets = binary_array(d["offset"], n, f"{what}.offset", MAX_INT)
    lengths = binary_array(d["length"], n, f"{what}.length", MAX_INT)
    crcs = binary_array(d["crc32c"], n, f"{what}.crc32c", U32, np.uint32)
    raw_crcs = binary_array(d["raw_crc32c"], n, f"{what}.raw_crc32c", U32, np.uint32)
    codec = d["codec"]
    codecs = codec_column(codec, n, f"{what}.codec")
    if math.prod(shape) * itemsize > MAX_INT:  # (any codec: a chunk's raw_length is bounded by it)
        fail(f"{what}: an array of {math.prod(shape)} x {itemsize} bytes is too large")
    if codec == "raw" or (type(codec) is list and "raw" in codec):
        if cuts is not None:  # the cells' volumes, C order
            raw_lengths = functools.reduce(
                cast(Any, np.multiply.outer),
                [np.diff(np.asarray(c, np.int64)) for c in cuts],
                np.int64(itemsize),
            ).reshape(-1)
        else:
            raw_lengths = np.array([box_volume(b) * itemsize for b in listed or ()], np.int64)
        bad = lengths != raw_lengths
        if type(codec) is list:
            bad &= np.array([c == "raw" for c in codecs], bool)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            fail(
                f"{what}.length[{i}]: raw chunk length {int(lengths[i])} != box volume x itemsize "
                f"{int(raw_lengths[i])}"
            )
    return ChunkTable(
        cuts=cuts,
        boxes=listed,
        keys=objects,
        object_index=index,
        offsets=offsets,
        lengths=lengths,
        codec=cast(Codec, codec) if type(codec) is str else tuple(codecs),
        crc32c=crcs,
        raw_crc32c=raw_crcs,
        itemsize=itemsize,
    )
