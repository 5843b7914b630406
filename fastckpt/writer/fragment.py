"""One process's chunks of a save, as columns, and the fragment that carries them to process 0.

Each process builds the chunks it stored (or staged) as columns (:class:`ProcessChunks`, via
:class:`ChunkRows`); process 0 merges them into the manifest's tables (``writer.merge``). A
single process merges its own directly; with several, each sends a *fragment* (a storage
object, or a coordinator entry for a RAM step): the chunk table encoding
(:mod:`fastckpt.format.chunk_table`) of its chunks of all leaves, in a small JSON document::

    {"format_version": 3, "process": 3,
     "paths": [<key path of every array leaf, staged order>],
     "objects": ["steps/.../p00003-00000.fck"],
     "chunks": {"array": "u1:...", "boxes": "u2:...", "object": "u1:...", "offset": "u4:...",
                "length": "u4:...", "codec": "zstd", "crc32c": "u4:...", "raw_crc32c": "u4:..."}}

``array`` names each chunk's leaf (an index into ``paths``); ``boxes`` lists every chunk's box
flat (start and stop per dimension, in chunk order: leaves of any rank share the column);
``object`` indexes ``objects``; ``codec`` is one codec for all chunks or a list of one per
chunk; every other column is the manifest table's. A fragment never outlives its save and is
never read by a restore. No pickle: every field is validated on decode.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from fastckpt._pygc import paused_gc
from fastckpt.format.checks import MAX_INT, fail, json_dict, json_int, json_list
from fastckpt.format.chunk_table import (
    CODECS,
    U32,
    binary_array,
    codec_column,
    decode_object_keys,
    encode_column,
)
from fastckpt.format.manifest import FORMAT_VERSION, Box, Codec
from fastckpt.writer.stage import StagedSave

__all__ = [
    "CODE",
    "ChunkRows",
    "ProcessChunks",
    "decode_fragments",
    "encode_fragment",
    "fragment_paths",
]

#: Codec name -> its code in :attr:`ProcessChunks.codec`.
CODE = {name: i for i, name in enumerate(CODECS)}
_COLUMNS = ("array", "boxes", "object", "offset", "length", "codec", "crc32c", "raw_crc32c")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ProcessChunks:
    """One process's chunks of a save, in any order: every column an int64 numpy array with
    one value per chunk, but ``boxes`` (``2 x rank`` values per chunk, in chunk order)."""

    objects: list[str]
    """The object keys ``object`` indexes."""
    array: np.ndarray
    """Index of each chunk's leaf in ``StagedSave.arrays``."""
    boxes: np.ndarray
    """Every chunk's box flat: start and stop per dimension."""
    object: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    codec: np.ndarray
    """Codes of :data:`CODE`."""
    crc32c: np.ndarray
    raw_crc32c: np.ndarray


class ChunkRows:
    """Builds a :class:`ProcessChunks` one chunk at a time (the writer adds an object's chunks
    once its upload completed). Not thread-safe."""

    def __init__(self) -> None:
        self._objects: dict[str, int] = {}
        self._boxes: list[int] = []
        self._cols: tuple[list[int], ...] = ([], [], [], [], [], [], [])

    def add(
        self,
        array: int,
        box: Box,
        key: str,
        offset: int,
        length: int,
        codec: Codec,
        crc32c: int,
        raw_crc32c: int,
    ) -> None:
        """One chunk of staged array ``array``, stored at ``key[offset:offset + length]``."""
        for a, b in box:
            self._boxes += (a, b)
        obj = self._objects.setdefault(key, len(self._objects))
        values = (array, obj, offset, length, CODE[codec], crc32c, raw_crc32c)
        for col, v in zip(self._cols, values):
            col.append(v)

    def build(self) -> ProcessChunks:
        """The chunks added so far."""
        names = ("array", "object", "offset", "length", "codec", "crc32c", "raw_crc32c")
        cols = {k: np.array(c, np.int64) for k, c in zip(names, self._cols)}
        boxes = np.array(self._boxes, np.int64)
        return ProcessChunks(objects=list(self._objects), boxes=boxes, **cols)


def fragment_paths(staged: StagedSave) -> list[list[list[Any]]]:
    """A fragment's ``"paths"`` for ``staged``: each array's key path, as JSON decodes it."""
    return [[list(e) for e in a.path] for a in staged.arrays]


def encode_fragment(chunks: ProcessChunks, staged: StagedSave, process_index: int) -> bytes:
    """The fragment of ``chunks`` (``staged``'s, written by process ``process_index``)."""
    codes = np.unique(chunks.codec).tolist()
    codec: str | list[str] = (
        CODECS[codes[0]] if len(codes) == 1 else [CODECS[c] for c in chunks.codec.tolist()]
    )
    columns = {k: encode_column(getattr(chunks, k)) for k in _COLUMNS if k != "codec"}
    doc = {
        "format_version": FORMAT_VERSION,
        "process": process_index,
        "paths": fragment_paths(staged),
        "objects": chunks.objects,
        "chunks": {**columns, "codec": codec},
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_fragments(
    fragments: Sequence[bytes | memoryview], staged: StagedSave
) -> list[ProcessChunks]:
    """Every process's fragment's validated chunks, ``array`` as indices into
    ``staged.arrays``, decoded with the cyclic garbage collector paused
    (``fastckpt._pygc.paused_gc``). ``ManifestError`` (naming the fragment) on any flaw: not
    JSON, another format version, a missing field or column, a column of the wrong length,
    an index out of range, a path this tree lacks, a value beyond its field's range (crc32c
    > 2**32 - 1, offsets and box bounds > 2**63 - 1)."""
    paths = fragment_paths(staged)
    ranks = np.asarray([len(a.shape) for a in staged.arrays], np.int64)
    with paused_gc():
        return [_decode(f, staged, paths, ranks, f"fragment {i}") for i, f in enumerate(fragments)]


def _decode(
    data: bytes | memoryview,
    staged: StagedSave,
    paths: list[list[list[Any]]],
    ranks: np.ndarray,
    what: str,
) -> ProcessChunks:
    try:
        doc = json.loads(bytes(data))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        fail(f"{what}: not a fragment (not JSON: {e})")
    d = json_dict(doc, what, ("format_version", "process", "paths", "objects", "chunks"))
    if d["format_version"] != FORMAT_VERSION or type(d["format_version"]) is not int:
        fail(f"{what}: format_version {d['format_version']!r:.40}, expected {FORMAT_VERSION}")
    json_int(d["process"], f"{what}.process")
    listed = json_list(d["paths"], f"{what}.paths")
    if listed == paths:
        to_local = np.arange(len(listed), dtype=np.int64)  # staged alike: the usual case
    else:
        local = {a.path: i for i, a in enumerate(staged.arrays)}
        to_local = np.empty(len(listed), np.int64)
        for j, p in enumerate(listed):
            try:
                to_local[j] = local[tuple((k, v) for k, v in p)]
            except (TypeError, ValueError, KeyError):
                fail(f"{what}.paths[{j}]: not an array of this tree: {p!r:.120}")
    objects = decode_object_keys(d["objects"], f"{what}.objects")
    c = json_dict(d["chunks"], f"{what}.chunks", _COLUMNS)
    array = binary_array(c["array"], None, f"{what}.chunks.array", len(listed) - 1)
    n = len(array)
    cols = {
        name: binary_array(c[name], n, f"{what}.chunks.{name}", hi)
        for name, hi in (
            ("object", len(objects) - 1),
            ("offset", MAX_INT),
            ("length", MAX_INT),
            ("crc32c", U32),
            ("raw_crc32c", U32),
        )
    }
    codec = c["codec"]
    if type(codec) is str and codec in CODE:
        codes = np.full(n, CODE[codec], np.int64)
    else:
        names = codec_column(codec, n, f"{what}.chunks.codec")
        codes = np.array([CODE[x] for x in names], np.int64)
    array = to_local[array]
    boxes = binary_array(c["boxes"], int(2 * ranks[array].sum()), f"{what}.chunks.boxes", MAX_INT)
    return ProcessChunks(objects=objects, array=array, boxes=boxes, codec=codes, **cols)
