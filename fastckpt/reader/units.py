"""What the reader fills and reports: destination units, restore statistics, and the
protocol of the fast tiers (own RAM, peers) consulted before persistent storage."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from fastckpt.format.manifest import ArrayLeaf, Box

__all__ = ["ChunkSource", "RestoreStats", "SourceCounters", "Unit"]


class SourceCounters(Protocol):
    """What the manager reads of a source's counters."""

    @property
    def fallbacks(self) -> Mapping[Any, int]:
        """Fallbacks to the next tier so far, by reason (a str)."""


class ChunkSource(Protocol):
    """The fast tiers consulted before persistent storage (own RAM, peers).

    Every method runs on worker threads and returns, per chunk, the name of the tier that
    supplied its verified raw bytes, or None when no tier it knows holds a good copy
    (misses, corruption and timeouts are handled inside, per tier); the reader then reads
    storage. Call order per restore: :meth:`lend_many` (zero-copy views of the own tier)
    for whole destination buffers, then :meth:`fetch_many` for the rest.
    """

    def fetch_many(
        self,
        step: int,
        items: Sequence[tuple[str, int, int, memoryview | np.ndarray]],
        *,
        runs: Sequence[Sequence[tuple[int, int]] | None] | None = None,
    ) -> list[str | None]:
        """Several chunks, ``(chunk_id, raw_length, raw_crc32c, into)`` each, in one call
        (of several leaves, so a peer can stream them). Where ``runs[i]`` is not None, only
        those byte ranges ``(start, n)`` of chunk ``i`` are filled into its ``into`` (a
        resharding restore asks for the parts of a chunk it uses)."""

    def lend_many(
        self, step: int, groups: Sequence[Sequence[tuple[str, int, int]]], *, verify: bool = True
    ) -> list[memoryview | None]:
        """Per destination buffer, given the ``(chunk_id, raw_length, raw_crc32c)`` of the
        chunks that tile it in order, one read-only view of all their bytes in the source's
        own memory (the caller may keep it indefinitely), or None (then the chunks are
        fetched). With ``verify=False`` the caller checks each chunk's crc32c itself and
        fetches the chunks of a view that fails."""

    def stats(self) -> SourceCounters:
        """The source's counters so far."""


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
