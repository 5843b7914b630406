"""Restore planning: what each destination shard needs from which stored chunk.

Pure data (like torch DCP's ``ReadItem``): for a destination box (one device shard of the
target sharding) the plan lists, per overlapping chunk, the region to copy in chunk-local
coordinates and where it goes in destination-local coordinates. The fetch plan then groups
the needed chunks by object and coalesces nearby byte ranges into few large ranged reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from fastckpt.errors import CorruptionError
from fastckpt.format.manifest import ArrayLeaf, Box, ChunkEntry, box_volume, keypath_str
from fastckpt.planning.boxes import intersect, relative_to

__all__ = ["FetchRange", "ReadItem", "coalesce_fetches", "plan_leaf_reads"]


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


def plan_leaf_reads(leaf: ArrayLeaf, dst_box: Box) -> tuple[ReadItem, ...]:
    """Read items that fill ``dst_box`` (global coordinates) of ``leaf``.

    Raises:
        CorruptionError: the stored chunks do not cover ``dst_box`` exactly once.
    """
    items = []
    covered = 0
    for chunk in leaf.chunks:
        overlap = intersect(chunk.box, dst_box)
        if overlap is None:
            continue
        covered += box_volume(overlap)
        items.append(ReadItem(chunk, relative_to(overlap, chunk.box), relative_to(overlap, dst_box)))
    if covered != box_volume(dst_box):
        raise CorruptionError(
            f"{keypath_str(leaf.path)}: stored chunks cover {covered} of {box_volume(dst_box)} "
            f"elements of box {dst_box}"
        )
    return tuple(items)


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
