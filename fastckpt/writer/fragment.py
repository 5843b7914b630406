"""Fragments: one process's chunk list, as binary columns, for process 0's merge.

Process 0 reads every process's fragment at every checkpoint, RAM checkpoints included
(every few steps), so a fragment is made to be read without a Python object per chunk: a
small JSON header, then each column as raw little-endian unsigned integers, read by
``np.frombuffer``. (JSON columns cost process 0 ~1.6 µs per chunk to parse: ~2.5 s per
checkpoint of a 1.5 M-chunk pod step.) A fragment is internal to one job — every process
runs the same fastckpt — and never outlives its save; it is not part of the checkpoint
format. No pickle: the layout is fixed and every field is validated on decode.

Layout::

    b"FCKFRAG" + version byte (1)   8 bytes
    header length H                  uint64, little-endian
    header                           H bytes of JSON:
        {"process": 3, "paths": [<key path of every array leaf, staged order>],
         "objects": ["steps/.../p00003-00000.fck"], "codec": "raw" | null,
         "columns": [[name, dtype, count], ...]}     # in _COLUMNS order
    columns                          back to back, each count x dtype bytes

Columns (one value per chunk unless noted): ``array`` (index into ``paths``), ``boxes``
(every chunk's box flat, start and stop per dimension, in chunk order), ``object`` (index
into ``objects``), ``offset``, ``length``, ``crc32c``, ``raw_crc32c``, and ``codec`` (codes
of ``CODECS``) only when the header's ``codec`` is null (chunks of mixed codecs). Each
column is stored in the narrowest of ``<u1 <u2 <u4 <u8`` holding its values.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

from fastckpt.format._checks import MAX_INT, fail, json_dict, json_int, json_list
from fastckpt.format.chunk_table import CODECS, U32, checked_uint, decode_object_keys, narrow_uint
from fastckpt.format.manifest import ChunkEntry, KeyPath
from fastckpt.writer.stage import StagedSave

__all__ = ["CODE", "decode_fragment", "encode_fragment", "pack_fragment", "unpack_fragment"]

MAGIC = b"FCKFRAG\x01"
_PREFIX = struct.Struct("<8sQ")
_MAX_HEADER = 1 << 30
_COLUMNS = ("array", "boxes", "object", "offset", "length", "crc32c", "raw_crc32c", "codec")
_DTYPES = {np.dtype(t).str: np.dtype(t) for t in ("<u1", "<u2", "<u4", "<u8")}
#: Codec name -> its code in the ``codec`` column.
CODE = {name: i for i, name in enumerate(CODECS)}


def encode_fragment(staged: StagedSave, chunks: dict[int, list[ChunkEntry]], process_index: int) -> bytes:
    """This process's chunks (``chunks[i]``: those of ``staged.arrays[i]``) as a fragment."""
    objects: dict[str, int] = {}
    array: list[int] = []
    boxes: list[int] = []
    cols: tuple[list[Any], ...] = ([], [], [], [], [], [])
    for i in range(len(staged.arrays)):
        for c in chunks.get(i, ()):
            array.append(i)
            for a, b in c.box:
                boxes += (a, b)
            for col, v in zip(cols, (objects.setdefault(c.key, len(objects)), c.offset, c.length, CODE[c.codec],
                                     c.crc32c, c.raw_crc32c)):
                col.append(v)
    codes = set(cols[3])
    columns = dict(zip(_COLUMNS, (array, boxes, cols[0], cols[1], cols[2], cols[4], cols[5])))
    if len(codes) > 1:
        columns["codec"] = cols[3]
    header = {"process": process_index, "paths": [[list(e) for e in a.path] for a in staged.arrays],
              "objects": list(objects), "codec": CODECS[codes.pop()] if len(codes) == 1 else (None if codes else "raw")}
    return pack_fragment(header, {k: narrow_uint(v) for k, v in columns.items()})


def pack_fragment(header: Mapping[str, Any], columns: Mapping[str, np.ndarray]) -> bytes:
    """The fragment bytes of ``header`` (without ``"columns"``) and the ``columns`` given
    (names of ``_COLUMNS``, in any order; written in ``_COLUMNS`` order, dtypes as given).
    The low-level half of :func:`encode_fragment`; tests use it to build malformed ones."""
    cols = [(k, np.ascontiguousarray(columns[k])) for k in _COLUMNS if k in columns]
    head = json.dumps({**header, "columns": [[k, v.dtype.str, len(v)] for k, v in cols]},
                      separators=(",", ":")).encode()
    return b"".join([_PREFIX.pack(MAGIC, len(head)), head, *(v.tobytes() for _, v in cols)])


def unpack_fragment(data: bytes | memoryview, what: str) -> tuple[Mapping[str, Any], dict[str, np.ndarray]]:
    """The header and the columns (read-only views into ``data``, in their stored dtypes)
    of a fragment; ``ManifestError`` if the layout is broken. Values are not checked."""
    buf = memoryview(data).cast("B")
    if len(buf) < _PREFIX.size:
        fail(f"{what}: {len(buf)} bytes, too short for a fragment")
    magic, hlen = _PREFIX.unpack_from(buf)
    if magic != MAGIC:
        fail(f"{what}: not a fragment of this fastckpt (starts {bytes(magic)!r})")
    if hlen > min(_MAX_HEADER, len(buf) - _PREFIX.size):
        fail(f"{what}: header length {hlen} exceeds the fragment")
    try:
        header = json.loads(bytes(buf[_PREFIX.size:_PREFIX.size + hlen]))
    except (ValueError, RecursionError) as e:
        fail(f"{what}: header is not JSON: {e}")
    d = json_dict(header, what, ("process", "paths", "objects", "codec", "columns"))
    listed = json_list(d["columns"], f"{what}.columns")
    at = _PREFIX.size + hlen
    columns: dict[str, np.ndarray] = {}
    for j, spec in enumerate(listed):
        if (type(spec) is not list or len(spec) != 3 or spec[0] not in _COLUMNS or spec[0] in columns
                or spec[1] not in _DTYPES):
            fail(f"{what}.columns[{j}]: expected [name, dtype, count] with a name of {list(_COLUMNS)} "
                 f"(each once) and a dtype of {list(_DTYPES)}, got {spec!r:.120}")
        dtype, count = _DTYPES[spec[1]], json_int(spec[2], f"{what}.columns[{j}][2]")
        if count > (len(buf) - at) // dtype.itemsize:
            fail(f"{what}: column {spec[0]!r} ({count} x {dtype.str}) runs past the fragment's end")
        columns[spec[0]] = np.frombuffer(buf, dtype, count, at)
        at += count * dtype.itemsize
    if at != len(buf):
        fail(f"{what}: {len(buf) - at} bytes after the last column")
    return d, columns


def decode_fragment(data: bytes | memoryview, local: dict[KeyPath, int], ranks: np.ndarray, what: str
                    ) -> dict[str, Any]:
    """One fragment's validated columns as int64 numpy arrays: ``array`` as indices into the
    staged arrays (``local``: path -> index; ``ranks``: each staged array's rank), the rest
    as stored (``object`` still indexing the fragment's own ``objects``), ``codec`` as codes.
    ``ManifestError`` on any flaw: a broken layout, a missing or surplus column, a column of
    the wrong length, an index out of range, a path this tree lacks, a value beyond its
    field's range (crc32c > 2**32 - 1, offsets and box bounds > 2**63 - 1)."""
    d, raw = unpack_fragment(data, what)
    json_int(d["process"], f"{what}.process")
    paths = json_list(d["paths"], f"{what}.paths")
    to_local = np.empty(len(paths), np.int64)
    for j, p in enumerate(paths):
        try:
            path = tuple((k, v) for k, v in p)
            to_local[j] = local[path]
        except (TypeError, ValueError, KeyError):
            fail(f"{what}.paths[{j}]: not an array of this tree: {p!r:.120}")
    objects = decode_object_keys(d["objects"], f"{what}.objects")
    codec = d["codec"]
    if codec is not None and codec not in CODECS:
        fail(f"{what}.codec: expected one of {list(CODECS)} or null, got {codec!r:.40}")
    want = [k for k in _COLUMNS if k != "codec" or codec is None]
    if sorted(raw) != sorted(want):
        fail(f"{what}: columns {sorted(raw)}, expected {sorted(want)}")
    n = len(raw["array"])
    out: dict[str, Any] = {"objects": objects}
    for name, hi in (("array", len(paths) - 1), ("object", len(objects) - 1), ("offset", MAX_INT),
                     ("length", MAX_INT), ("crc32c", U32), ("raw_crc32c", U32), ("codec", len(CODECS) - 1)):
        if name in raw:
            out[name] = checked_uint(raw[name], n, f"{what}.{name}", hi)
    out["array"] = to_local[out["array"]]
    if codec is not None:
        out["codec"] = np.full(n, CODE[codec], np.int64)
    want_boxes = int(2 * ranks[out["array"]].sum())
    out["boxes"] = checked_uint(raw["boxes"], want_boxes, f"{what}.boxes", MAX_INT)
    return out
