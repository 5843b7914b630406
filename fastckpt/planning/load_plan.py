"""Restore planning: what each destination shard needs from which stored chunk (pure data:
per overlapping chunk, the region to copy in chunk-local coordinates and where it goes in
destination-local ones), and the coalesced ranged reads that fetch the chunks.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Iterable, Sequence

from fastckpt.errors import ConfigError, CorruptionError
from fastckpt.format.manifest import (
    ArrayLeaf,
    Box,
    ChunkEntry,
    ChunkTable,
    box_volume,
    chunk_id,
    chunk_id_prefix,
    keypath_str,
)
from fastckpt.planning.boxes import intersect, relative_to

__all__ = [
    "ChunkIndex",
    "FetchRange",
    "GridIndex",
    "ReadItem",
    "coalesce_fetches",
    "leaf_index",
    "needed_chunks",
    "plan_leaf_reads",
]


@dataclasses.dataclass(frozen=True, slots=True)
class ReadItem:
    """Copy ``src_box`` of ``chunk`` (chunk-local) into ``dst_box`` (destination-local)."""

    chunk: ChunkEntry
    src_box: Box
    dst_box: Box


@dataclasses.dataclass(frozen=True, slots=True)
class FetchRange:
    """One ranged read of an object, covering whole chunks."""

    key: str
    start: int
    length: int
    chunks: tuple[ChunkEntry, ...]
    """Chunks inside the range; chunk ``c`` is at ``c.offset - start`` in the fetched bytes."""


class ChunkIndex:
    """The chunks of one leaf, indexed to find those overlapping a box without a full scan.

    Chunks are sorted along the dimension with the most distinct starts, with a running
    maximum of their ends; a query bisects both and tests only the chunks in that band.
    Exact for any set of boxes (overlapping ones of a malformed manifest too).
    """

    __slots__ = ("_by_box", "_chunks", "_dim", "_ends", "_order", "_starts")

    def __init__(self, chunks: Sequence[ChunkEntry], *, disjoint: bool = False) -> None:
        """``disjoint``: the caller guarantees that no two chunks overlap (true of every leaf
        of a decoded manifest: the codec refuses overlaps); a box equal to a chunk's box is
        then answered by a lookup (the same-mesh restore's case)."""
        self._chunks = tuple(chunks)
        self._by_box = {c.box: c for c in self._chunks if box_volume(c.box)} if disjoint else None
        rank = len(self._chunks[0].box) if self._chunks else 0
        self._dim: int | None = None
        if rank and all(len(c.box) == rank for c in self._chunks):
            self._dim = max(range(rank), key=lambda d: len({c.box[d][0] for c in self._chunks}))
        self._order: list[int] = []
        self._starts: list[int] = []
        self._ends: list[int] = []
        if self._dim is None:
            return  # 0-d or mixed ranks (a malformed manifest): overlapping() scans
        d = self._dim
        self._order = sorted(range(len(self._chunks)), key=lambda i: self._chunks[i].box[d][0])
        self._starts = [self._chunks[i].box[d][0] for i in self._order]
        reach = -1
        for i in self._order:
            reach = max(reach, self._chunks[i].box[d][1])
            self._ends.append(reach)  # non-decreasing: bisectable

    def overlapping(self, box: Box) -> list[tuple[ChunkEntry, Box]]:
        """``(chunk, overlap)`` for every chunk that overlaps ``box``, in the chunks' order."""
        exact = self._by_box.get(box) if self._by_box is not None else None
        if exact is not None:
            return [(exact, box)]
        if self._dim is None or len(box) != len(self._chunks[0].box):  # (intersect raises then)
            hits = [(i, intersect(c.box, box)) for i, c in enumerate(self._chunks)]
        else:
            lo, hi = box[self._dim]
            first = bisect.bisect_right(self._ends, lo)  # earlier chunks end at or before lo
            stop = bisect.bisect_left(self._starts, hi)  # later chunks start at or after hi
            hits = sorted((i, intersect(self._chunks[i].box, box)) for i in self._order[first:stop])
        return [(self._chunks[i], o) for i, o in hits if o is not None]


class GridIndex:
    """The chunks of a :class:`ChunkTable` whose boxes are a grid's cells (``table.grid``),
    found by bisecting each dimension's cuts (only their entries are built). Same answers as
    :class:`ChunkIndex`; nothing to build."""

    __slots__ = ("_counts", "_cuts", "_table")

    def __init__(self, table: ChunkTable) -> None:
        if table.grid is None:
            raise ConfigError("GridIndex needs a chunk table with a grid")
        self._table = table
        self._cuts = table.grid
        self._counts = [len(c) - 1 for c in self._cuts]

    def overlapping(self, box: Box) -> list[tuple[ChunkEntry, Box]]:
        """``(chunk, overlap)`` for every chunk that overlaps ``box``, in the chunks' order."""
        if len(box) != len(self._cuts):
            raise ConfigError(f"rank mismatch: box {box} for a rank-{len(self._cuts)} grid")
        i = 0
        for (lo, hi), cuts, count in zip(box, self._cuts, self._counts):  # one whole cell?
            k = bisect.bisect_left(cuts, lo)
            if hi <= lo or k >= count or cuts[k] != lo or cuts[k + 1] != hi:
                break
            i = i * count + k
        else:
            return [(self._table[i], box)]
        ranges = []
        single = True
        for (lo, hi), cuts, count in zip(box, self._cuts, self._counts):
            # cells k with cuts[k] < hi and cuts[k + 1] > lo (empty ones drop out below)
            first = max(bisect.bisect_right(cuts, lo) - 1, 0)
            stop = min(bisect.bisect_left(cuts, hi), count)
            ranges.append(range(first, stop))
            single = single and stop - first == 1
        cells = (tuple(r.start for r in ranges),) if single else itertools.product(*ranges)
        out = []
        for cell in cells:  # C order = the table's order
            i = 0
            for k, count in zip(cell, self._counts):
                i = i * count + k
            chunk = self._table[i]
            overlap = box if chunk.box == box else intersect(chunk.box, box)
            if overlap is not None:
                out.append((chunk, overlap))
        return out


def leaf_index(leaf: ArrayLeaf, *, disjoint: bool = True) -> GridIndex | ChunkIndex:
    """The cheapest overlap index of ``leaf.chunks``: a :class:`GridIndex` when the table has
    a grid (as fastckpt writes every sharding), else a :class:`ChunkIndex` (``disjoint`` as
    there)."""
    chunks = leaf.chunks
    if chunks.grid is not None:
        return GridIndex(chunks)
    return ChunkIndex(chunks, disjoint=disjoint)


def plan_leaf_reads(
    leaf: ArrayLeaf, dst_box: Box, *, index: ChunkIndex | GridIndex | None = None
) -> tuple[ReadItem, ...]:
    """Read items that fill ``dst_box`` (global coordinates) of ``leaf``; ``CorruptionError``
    if the stored chunks do not cover it exactly once. ``index`` (:func:`leaf_index`, or a
    :class:`ChunkIndex` of ``leaf.chunks``) makes planning many boxes of one leaf cheap; the
    items are the same without it."""
    items = []
    covered = 0
    if index is None and leaf.chunks.grid is not None:
        index = GridIndex(leaf.chunks)
    pairs = (
        index.overlapping(dst_box)
        if index is not None
        else [(c, intersect(c.box, dst_box)) for c in leaf.chunks]
    )
    if len(pairs) == 1 and pairs[0][1] == pairs[0][0].box == dst_box and box_volume(dst_box):
        whole = tuple([(0, b - a) for a, b in dst_box])  # the chunk is the box (same mesh)
        return (ReadItem(pairs[0][0], whole, whole),)
    for chunk, overlap in pairs:
        if overlap is None:
            continue
        covered += box_volume(overlap)
        items.append(
            ReadItem(chunk, relative_to(overlap, chunk.box), relative_to(overlap, dst_box))
        )
    if covered != box_volume(dst_box):
        raise CorruptionError(
            f"{keypath_str(leaf.path)}: stored chunks cover {covered} of {box_volume(dst_box)} "
            f"elements of box {dst_box}"
        )
    return tuple(items)


def needed_chunks(wants: Iterable[tuple[ArrayLeaf, Box]]) -> dict[str, str]:
    """The chunks that filling each ``(leaf, box)`` reads, as ``chunk id -> object key``
    (``format.chunk_id``; a RAM step's object key names the member that wrote the chunk):
    what one process's restore needs from the tiers (one index per leaf)."""
    out: dict[str, str] = {}
    indexes: dict[int, tuple[ArrayLeaf, GridIndex | ChunkIndex]] = {}
    for leaf, box in wants:
        hit = indexes.get(id(leaf))
        if hit is None:  # (the leaf is kept: its id stays unique)
            hit = indexes[id(leaf)] = (leaf, leaf_index(leaf))
        prefix = chunk_id_prefix(leaf.path)  # the overlaps alone: no read items, no coverage check
        out.update(
            [(chunk_id(leaf.path, c.box, prefix=prefix), c.key) for c, _ in hit[1].overlapping(box)]
        )
    return out


def coalesce_fetches(
    chunks: Iterable[ChunkEntry], *, max_gap: int, max_bytes: int
) -> list[FetchRange]:
    """Group chunks by object and merge byte ranges closer than ``max_gap`` bytes.

    Each chunk appears in exactly one range; a merged range never exceeds ``max_bytes``
    unless a single chunk alone does. Duplicate chunks (same key and offset) are fetched once.
    """
    by_key: dict[str, dict[int, ChunkEntry]] = {}
    for c in chunks:
        by_key.setdefault(c.key, {})[c.offset] = c
    out: list[FetchRange] = []
    for key in sorted(by_key):
        ordered: Sequence[ChunkEntry] = sorted(by_key[key].values(), key=lambda c: c.offset)
        group: list[ChunkEntry] = []
        start = end = 0
        for c in ordered:
            c_end = c.offset + c.length
            if group and c.offset - end <= max_gap and max(end, c_end) - start <= max_bytes:
                group.append(c)
                end = max(end, c_end)
                continue
            if group:
                out.append(FetchRange(key, start, end - start, tuple(group)))
            group, start, end = [c], c.offset, c_end
        if group:
            out.append(FetchRange(key, start, end - start, tuple(group)))
    return out
