"""What a :class:`~fastckpt.replicas._sources.TieredChunkSource` needs of its peers and of a
parity rebuilder (Protocols), and its statistics."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal, Protocol

import numpy as np

__all__ = ["ChunkPeer", "ChunkRebuilder", "Fallback", "FallbackReason", "SourceStats", "TierStats"]

FallbackReason = Literal["miss", "corrupt", "unavailable", "protocol", "error"]


class ChunkPeer(Protocol):
    """What a source needs of a peer (``PeerClient`` is one)."""

    name: str

    def get_chunks(
        self, step: int, items: Sequence[tuple[str, memoryview | np.ndarray, int | None]]
    ) -> list[Any]:
        """Several whole chunks in one stream: per item ``"ok"``, ``"missing"`` or ``"corrupt"``."""
        ...

    def get_ranges(
        self,
        step: int,
        items: Sequence[tuple[str, memoryview | np.ndarray, int, Sequence[tuple[int, int]]]],
    ) -> list[Any]:
        """Byte ranges of several chunks, each checked against the whole chunk's crc32c."""
        ...

    def list_chunks(self, step: int) -> list[str]: ...


class ChunkRebuilder(Protocol):
    """Rebuilds a chunk of a RAM step from parity (``_parity_rebuild.ParityRebuilds``): True
    once ``dst`` holds it verified; False when it cannot; ``ChecksumMismatchError`` when the
    rebuilt bytes fail the crc32c; ``PeerError`` when a holder fails."""

    def rebuild(
        self, step: int, chunk_id: str, raw_length: int, raw_crc32c: int, dst: np.ndarray
    ) -> bool: ...

    def order(self, step: int, chunk_ids: Sequence[str]) -> list[int]:
        """The positions of ``chunk_ids`` in the order to rebuild them (spread over the
        hosts that do the work)."""
        ...


@dataclasses.dataclass
class TierStats:
    """Successful fetches from one tier."""

    chunks: int = 0
    bytes: int = 0
    seconds: float = 0.0

    @property
    def gbps(self) -> float:
        """Throughput in GB/s while fetching (0 if nothing was fetched)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class Fallback:
    """One source that could not provide a chunk."""

    tier: str
    chunk_id: str
    reason: FallbackReason
    detail: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class SourceStats:
    """A snapshot of a :class:`TieredChunkSource`'s counters."""

    tiers: dict[str, TierStats]
    """``"ram"`` and ``"peer:<name>"`` → successful fetches."""
    fallbacks: dict[FallbackReason, int]
    """How often a source failed, by reason."""
    recent_fallbacks: list[Fallback]
    """The latest fallbacks (bounded log)."""
    not_found: int
    """Chunks no RAM source could provide (left to persistent storage)."""
    dead_peers: list[str]
    """Peers no longer asked."""
    listed_peers: list[str] = dataclasses.field(default_factory=list)
    """Peers whose chunk list was fetched, in the order they were asked (a replacement host
    asks its ring successors first: usually one list for its own chunks)."""
