"""The checkpoint manifest: frozen dataclasses describing one committed step.

A manifest is the single source of truth for a step. It lists every pytree leaf by its key
path; array leaves carry their global shape, dtype, the sharding they were saved with, and
the chunks that tile them. Each chunk names the object that holds it, its byte range there,
its codec and the crc32c of both the stored and the raw bytes. The JSON encoding lives in
:mod:`fastckpt.format.codec`; these classes are plain data with no I/O.

Guarantees (enforced by ``codec.decode_manifest``): chunk boxes lie inside the array and
their volumes add up to the array's size; object keys are safe relative keys; every number
is a non-negative int where one is expected.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from collections.abc import Iterator, Sequence
from typing import Any, Literal, overload

import numpy as np

__all__ = [
    "FORMAT_VERSION",
    "ArrayLeaf",
    "Box",
    "ChunkEntry",
    "ChunkTable",
    "Codec",
    "KeyEntry",
    "KeyPath",
    "Leaf",
    "Manifest",
    "ShardingSpec",
    "TableColumns",
    "ValueLeaf",
    "box_shape",
    "box_volume",
    "chunk_id",
    "chunk_ids",
    "keypath_str",
]

#: The on-disk format version: the only one this fastckpt writes and reads.
FORMAT_VERSION = 3

#: A box: per dimension a half-open ``(start, stop)`` interval of global indices.
Box = tuple[tuple[int, int], ...]

#: One step of a pytree key path: ``("d", key)`` dict key, ``("i", n)`` sequence index,
#: ``("a", name)`` attribute, ``("f", n)`` flattened index of a custom node.
KeyEntry = tuple[Literal["d", "i", "a", "f"], str | int]
KeyPath = tuple[KeyEntry, ...]

Codec = Literal["raw", "zstd"]
ArrayKind = Literal["jax", "numpy", "prng_key"]
ValueType = Literal["none", "bool", "int", "float", "complex", "str"]


def box_shape(box: Box) -> tuple[int, ...]:
    """Extent of a box per dimension."""
    return tuple([stop - start for start, stop in box])  # hot: a list, not a generator


def box_volume(box: Box) -> int:
    """Number of elements in a box (1 for a 0-d box)."""
    n = 1
    for start, stop in box:  # no intermediate tuple: planning calls this per chunk and unit
        n *= stop - start
    return n


def keypath_str(path: KeyPath) -> str:
    """Human-readable path, e.g. ``params.dense['kernel'][0]``; stable, used in chunk ids."""
    out: list[str] = []
    for kind, key in path:
        if kind == "d":
            out.append(f"[{key!r}]")
        elif kind == "a":
            out.append(f".{key}")
        else:
            out.append(f"[{key}]")
    return "".join(out) or "<root>"


def chunk_id(path: KeyPath, box: Box, *, prefix: str | None = None) -> str:
    """Content key of a chunk: array path + box. Independent of which process wrote it.

    ``prefix`` (``chunk_id_prefix(path)``) saves formatting the path again for each chunk."""
    return (prefix if prefix is not None else chunk_id_prefix(path)) + ",".join(
        [f"{a}:{b}" for a, b in box]
    )


def chunk_id_prefix(path: KeyPath) -> str:
    """The part of :func:`chunk_id` that depends on the path only."""
    return keypath_str(path) + "@"


def chunk_ids(leaf: ArrayLeaf) -> list[str]:
    """:func:`chunk_id` of each of ``leaf``'s chunks, in order (a grid's intervals are
    formatted once)."""
    prefix = chunk_id_prefix(leaf.path)
    grid = leaf.chunks.grid
    if grid is None:
        return [chunk_id(leaf.path, box, prefix=prefix) for box in leaf.chunks.boxes()]
    dims = [[f"{a}:{b}" for a, b in itertools.pairwise(cuts)] for cuts in grid]
    return [prefix + ",".join(cell) for cell in itertools.product(*dims)]


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkEntry:
    """One stored chunk: a box of an array, stored contiguously (C order) in one object.

    A row of a :class:`ChunkTable`, built when a reader asks for it."""

    box: Box
    """Global index box this chunk covers."""
    key: str
    """Object key, relative to the checkpoint root."""
    offset: int
    """Byte offset of the stored bytes within the object."""
    length: int
    """Number of stored (possibly compressed) bytes."""
    raw_length: int
    """Uncompressed length: ``box_volume(box) * itemsize``."""
    codec: Codec
    """``"raw"`` or ``"zstd"``."""
    crc32c: int
    """crc32c of the stored bytes."""
    raw_crc32c: int
    """crc32c of the raw (uncompressed) bytes; RAM tiers and peers verify against this."""


_MAX_BUILT = 1 << 16  # entries a table keeps once built (a host's share of a leaf is far fewer)


class ChunkTable(Sequence[ChunkEntry]):
    """One leaf's chunks as columns (how the manifest stores them); a :class:`ChunkEntry` is
    built only when asked for (a host restoring 8 of a leaf's 512 chunks builds 8).

    Immutable and thread-safe to read; two tables are equal (and hash alike) when their
    entries are. Entries asked for by index are kept; iterating builds every entry afresh
    (callers that iterate often keep ``tuple(table)``). Built by the manifest codec from
    validated columns, by the commit's merge, or by
    :func:`fastckpt.format.chunk_table.table_from_entries`; one built by hand is unchecked.
    """

    __slots__ = (
        "_boxes",
        "_built",
        "_cells",
        "_codec",
        "_crc",
        "_cuts",
        "_itemsize",
        "_keys",
        "_length",
        "_n",
        "_object",
        "_offset",
        "_raw_crc",
    )

    def __init__(
        self,
        *,
        cuts: Sequence[Sequence[int]] | None,
        boxes: Sequence[Box] | None,
        keys: Sequence[str],
        object_index: np.ndarray,
        offsets: np.ndarray,
        lengths: np.ndarray,
        codec: Codec | Sequence[Codec],
        crc32c: np.ndarray,
        raw_crc32c: np.ndarray,
        itemsize: int,
    ) -> None:
        """``cuts`` xor ``boxes`` gives the boxes; ``keys[object_index[i]]`` is chunk i's
        object; ``codec`` is one codec for all chunks or one per chunk."""
        if (cuts is None) == (boxes is None):
            raise ValueError("ChunkTable needs exactly one of cuts and boxes")
        self._cuts = None if cuts is None else tuple([tuple(map(int, c)) for c in cuts])
        self._cells = (
            None if self._cuts is None else tuple(tuple(itertools.pairwise(c)) for c in self._cuts)
        )
        self._boxes = None if boxes is None else tuple(boxes)
        cells = self._cells
        self._n = math.prod(len(c) for c in cells) if cells is not None else len(self._boxes or ())
        self._keys, self._object, self._offset, self._length = keys, object_index, offsets, lengths
        self._codec, self._crc, self._raw_crc, self._itemsize = codec, crc32c, raw_crc32c, itemsize
        self._built: dict[int, ChunkEntry] = {}  # handed out by index, kept for the next restore
        if not all(
            len(col) == self._n for col in (object_index, offsets, lengths, crc32c, raw_crc32c)
        ) or (type(codec) is not str and len(codec) != self._n):
            raise ValueError(f"ChunkTable columns must have {self._n} entries")

    @property
    def grid(self) -> tuple[tuple[int, ...], ...] | None:
        """Cuts per dimension if the chunks are a grid's cells in C order (entry ``i`` is cell
        ``numpy.unravel_index(i, cells)``), else None."""
        return self._cuts

    def box(self, i: int) -> Box:
        """Chunk ``i``'s box (``0 <= i < len(self)``), without building its entry."""
        if self._cells is None:
            return self._boxes[i]  # type: ignore[index]
        out = []
        for cells in reversed(self._cells):
            i, k = divmod(i, len(cells))
            out.append(cells[k])
        return tuple(reversed(out))

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> ChunkEntry: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[ChunkEntry, ...]: ...
    def __getitem__(self, i: int | slice) -> ChunkEntry | tuple[ChunkEntry, ...]:
        hit = self._built.get(i) if type(i) is int else None
        if hit is not None:
            return hit
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(self._n)))
        i = operator.index(i)
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"chunk {i} of {self._n}")
        box = self.box(i)
        codec: Codec = self._codec if isinstance(self._codec, str) else self._codec[i]
        entry = ChunkEntry(
            box,
            self._keys[self._object.item(i)],
            self._offset.item(i),
            self._length.item(i),
            box_volume(box) * self._itemsize,
            codec,
            self._crc.item(i),
            self._raw_crc.item(i),
        )
        if len(self._built) < _MAX_BUILT:
            self._built[i] = entry
        return entry

    def boxes(self) -> Sequence[Box]:
        """Every chunk's box, in order, without building entries."""
        return list(itertools.product(*self._cells)) if self._cells is not None else self._boxes  # type: ignore[return-value]

    def __iter__(self) -> Iterator[ChunkEntry]:
        boxes = self.boxes()
        keys, isz = self._keys, self._itemsize
        codecs: Any = (
            itertools.repeat(self._codec, self._n) if type(self._codec) is str else self._codec
        )
        return map(
            ChunkEntry,
            boxes,
            [keys[k] for k in self._object.tolist()],
            self._offset.tolist(),
            self._length.tolist(),
            [box_volume(b) * isz for b in boxes],
            codecs,
            self._crc.tolist(),
            self._raw_crc.tolist(),
        )

    @property
    def stored_bytes(self) -> int:
        """Sum of the chunks' stored lengths."""
        return int(self._length.sum(dtype=np.int64)) if self._n else 0

    @property
    def raw_bytes(self) -> int:
        """Sum of the chunks' raw lengths."""
        if self._cuts is not None:
            return math.prod([c[-1] - c[0] for c in self._cuts]) * self._itemsize
        assert self._boxes is not None
        return sum(box_volume(b) for b in self._boxes) * self._itemsize

    def object_keys(self) -> set[str]:
        """The object keys the chunks name."""
        return {self._keys[k] for k in np.unique(self._object).tolist()}

    def columns(self) -> TableColumns:
        """The table's columns as stored (read-only; what the manifest encoder writes)."""
        return TableColumns(
            cuts=self._cuts,
            boxes=self._boxes,
            keys=self._keys,
            object_index=self._object,
            offsets=self._offset,
            lengths=self._length,
            codec=self._codec,
            crc32c=self._crc,
            raw_crc32c=self._raw_crc,
        )

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ChunkTable):
            return len(other) == self._n and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        boxes = f"grid {self._cuts!r}" if self._cuts is not None else "listed boxes"
        return f"ChunkTable({self._n} chunks, {boxes})"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TableColumns:
    """A :class:`ChunkTable`'s stored columns (:meth:`ChunkTable.columns`); no copies."""

    cuts: tuple[tuple[int, ...], ...] | None
    """The grid's cuts per dimension, or None when ``boxes`` lists the boxes."""
    boxes: tuple[Box, ...] | None
    keys: Sequence[str]
    """Object keys; ``object_index`` indexes them (it may name only some)."""
    object_index: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    codec: Codec | Sequence[Codec]
    """One codec for every chunk, or one per chunk."""
    crc32c: np.ndarray
    raw_crc32c: np.ndarray


@dataclasses.dataclass(frozen=True, slots=True)
class ShardingSpec:
    """The sharding an array was saved with (informational; restore may use any other)."""

    mesh_axis_names: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    partition_spec: tuple[str | tuple[str, ...] | None, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class ArrayLeaf:
    """An array leaf (jax.Array, numpy array or typed PRNG key array)."""

    path: KeyPath
    shape: tuple[int, ...]
    dtype: str
    """Manifest dtype name (``fastckpt.format.dtypes``). For PRNG keys: the key data dtype."""
    chunks: ChunkTable
    """The chunks tiling the array."""
    kind: ArrayKind = "jax"
    sharding: ShardingSpec | None = None
    key_impl: str | None = None
    """For ``kind="prng_key"``: the PRNG implementation name (``shape`` is the key data's)."""

    def __post_init__(self) -> None:
        if not isinstance(self.chunks, ChunkTable):
            raise TypeError(
                f"ArrayLeaf.chunks must be a ChunkTable, got {type(self.chunks).__name__}"
            )

    @property
    def nbytes(self) -> int:
        """Logical (raw) size in bytes."""
        return self.chunks.raw_bytes

    @property
    def stored_bytes(self) -> int:
        """Stored (compressed) size in bytes."""
        return self.chunks.stored_bytes


@dataclasses.dataclass(frozen=True, slots=True)
class ValueLeaf:
    """A non-array leaf stored inline: None, bool, int, float, complex or str."""

    path: KeyPath
    vtype: ValueType
    value: bool | int | float | str | tuple[float, float] | None


Leaf = ArrayLeaf | ValueLeaf


@dataclasses.dataclass(frozen=True, slots=True)
class Manifest:
    """Everything needed to restore one step. Written last; its existence is the commit."""

    step: int
    leaves: tuple[Leaf, ...]
    num_processes: int = 1
    created_unix: float = 0.0
    writer_version: str = ""
    metadata: dict[str, object] = dataclasses.field(default_factory=dict)
    """User JSON metadata (e.g. the data-loader position)."""

    def arrays(self) -> tuple[ArrayLeaf, ...]:
        """The array leaves, in manifest order."""
        return tuple(leaf for leaf in self.leaves if isinstance(leaf, ArrayLeaf))

    def by_path(self) -> dict[KeyPath, Leaf]:
        """Leaves indexed by key path."""
        return {leaf.path: leaf for leaf in self.leaves}

    @property
    def nbytes(self) -> int:
        """Logical bytes of all arrays."""
        return sum(a.nbytes for a in self.arrays())

    @property
    def stored_bytes(self) -> int:
        """Stored bytes of all arrays."""
        return sum(a.stored_bytes for a in self.arrays())

    def object_keys(self) -> frozenset[str]:
        """Every object key this manifest references."""
        return frozenset[str]().union(*(a.chunks.object_keys() for a in self.arrays()))
