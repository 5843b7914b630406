"""Save planning: which chunks a process writes. Pure data, no I/O, no jax.

Per array leaf, of the addressable shards only ``replica_id == 0`` ones are written (each
distinct box by exactly one device in the job), each split into sub-chunks
(:func:`~fastckpt.planning.boxes.split_box`) so that a resharded restore reads little more
than it needs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from fastckpt.format.manifest import Box, box_volume
from fastckpt.planning.boxes import split_box

__all__ = ["ShardInfo", "WriteItem", "plan_leaf_writes"]


@dataclasses.dataclass(frozen=True, slots=True)
class ShardInfo:
    """One addressable device shard of an array, as the writer sees it."""

    box: Box
    """Global index box of the shard."""
    replica_id: int
    """0 for the one replica that is written."""
    shard_index: int
    """Position of the shard in the writer's list (used to find its host buffer)."""


@dataclasses.dataclass(frozen=True, slots=True)
class WriteItem:
    """One chunk to write: a contiguous byte range of a staged shard buffer."""

    shard_index: int
    """Which staged shard buffer holds the chunk."""
    shard_box: Box
    box: Box
    """Global box of the chunk (inside ``shard_box``)."""
    byte_offset: int
    """Offset of the chunk within the shard's C-order buffer."""
    nbytes: int


def plan_leaf_writes(
    shards: Sequence[ShardInfo], *, itemsize: int, max_chunk_bytes: int
) -> tuple[WriteItem, ...]:
    """Chunks to write for one array leaf from this process's shards.

    Guarantees: only ``replica_id == 0`` shards are used; a box appearing twice is written
    once; chunks of one shard tile it exactly and are in increasing ``byte_offset`` order.
    """
    items: list[WriteItem] = []
    seen: set[Box] = set()
    for shard in shards:
        if shard.replica_id != 0 or shard.box in seen:
            continue
        seen.add(shard.box)
        offset = 0
        for sub in split_box(shard.box, itemsize=itemsize, max_bytes=max_chunk_bytes):
            n = box_volume(sub) * itemsize
            items.append(WriteItem(shard.shard_index, shard.box, sub, offset, n))
            offset += n
    return tuple(items)
