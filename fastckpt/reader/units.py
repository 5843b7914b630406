"""What the reader fills and reports: destination units, restore statistics, and the
protocol of the fast tiers (own RAM, peers) consulted before persistent storage."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from fastckpt.format.manifest import ArrayLeaf, Box

__all__ = ["ChunkSource", "LendingChunkSource", "RestoreStats", "Unit"]


class ChunkSource(Protocol):
    """A fast tier consulted before persistent storage (own RAM, peers).

    ``fetch`` runs on a worker thread. It writes the chunk's verified raw bytes into
    ``into`` and returns the tier's name, or returns None when no tier it knows holds a
    good copy (misses, corruption and timeouts are handled inside, per tier). A source may
    also offer ``fetch_many(step, [(chunk_id, raw_length, raw_crc32c, into), ...])`` (a
    tier name or None per item), which the reader then prefers: one call per group of
    chunks (of several leaves), so a peer can stream them. A source whose
    ``fetches_ranges`` is True also takes ``fetch_many(..., runs=[...])``: where ``runs[i]``
    is not None, only those byte ranges ``(start, n)`` of chunk ``i`` are filled into its
    ``into`` (a resharding restore asks for the parts of a chunk it uses).
    """

    def fetch(self, step: int, chunk_id: str, *, raw_length: int, raw_crc32c: int, into: memoryview) -> str | None: ...


class LendingChunkSource(ChunkSource, Protocol):
    """A source that can also hand out verified read-only views of its own memory (zero copy).

    ``lend_many`` gets, per destination buffer, the ``(chunk_id, raw_length, raw_crc32c)``
    of chunks that together tile it, in order; it returns per buffer one view of all their
    bytes, which the caller may keep indefinitely, or None (then ``fetch`` is used per
    chunk). The views are verified unless ``verify=False``: then the caller checks each
    chunk's crc32c itself and fetches the chunks of a view that fails.
    """

    def lend_many(self, step: int, groups: Sequence[Sequence[tuple[str, int, int]]], *,
                  verify: bool = True) -> list[memoryview | None]: ...


@dataclasses.dataclass
class RestoreStats:
    """Per-process restore figures."""

    step: int | None = None
    """The step that was restored (useful with ``step=None``: the newest complete step)."""
    bytes_by_tier: dict[str, int] = dataclasses.field(default_factory=dict)
    chunks_by_tier: dict[str, int] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    select_s: float = 0.0
    """Choosing the step and planning: storage listing, RAM-step agreement, target checks."""
    fetch_s: float = 0.0
    device_put_s: float = 0.0
    bytes_read_storage: int = 0
    """Bytes fetched from persistent storage (stored size, including coalescing gaps)."""
    reads_storage: int = 0
    """Ranged reads issued to persistent storage (re-reads included)."""
    bytes_in_place: int = 0
    """Stored bytes received straight into destination buffers (no scratch, no copy)."""
    restored_bytes: int = 0
    """Logical bytes placed into this process's destination buffers."""
    retries: int = 0
    fallbacks: dict[str, int] = dataclasses.field(default_factory=dict)
    """RAM-tier fallbacks by reason (``corrupt``, ``miss``, ``unavailable``, ...)."""

    def add(self, tier: str, nbytes: int, chunks: int = 1) -> None:
        self.bytes_by_tier[tier] = self.bytes_by_tier.get(tier, 0) + nbytes
        self.chunks_by_tier[tier] = self.chunks_by_tier.get(tier, 0) + chunks


@dataclasses.dataclass
class Unit:
    """One destination box of one array on this process."""

    leaf: ArrayLeaf
    box: Box
    buffer: np.ndarray | None = None
    """Filled host buffer (shape of ``box``, dtype of ``leaf``) once done."""
    lendable: bool = True
    """May ``buffer`` be a read-only view lent by a RAM tier (zero copy)? False for leaves
    returned to the caller as numpy arrays, which must be writable."""
