"""The write-side protocol of a fast checkpoint tier (a RAM tier) beside persistent storage.

The manager holds at most one :class:`Tier` and knows nothing else of it. Call order of a
save the tier takes (``due(step)``, or a persistent step): ``wait_pushed`` -> ``allocate``
or ``allocate_unreserved`` (the staging buffer is the tier's) -> stage -> ``commit``
(through ``writer.commit.CommitRound``) -> ``prepare_next``; ``abort`` on any failure before
the commit returns. A restore asks it for steps (``steps_by_tier``, ``select_step``),
manifests and a :class:`~fastckpt.reader.units.ChunkSource`; ``holds_alone`` says storage
lacks a step (nothing is then read from storage, and an incomplete step is given up for an
older one on every process).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from fastckpt.coordination.restore_agreement import StepSelector
from fastckpt.format.manifest import Manifest
from fastckpt.reader.units import ChunkSource
from fastckpt.writer.commit import CommitRound

__all__ = ["Tier"]


class Tier(StepSelector, Protocol):
    """A fast tier the manager saves to and restores from before storage."""

    @property
    def name(self) -> str:
        """Its name in ``SaveStats.tiers`` and as the commit round's namespace."""

    def due(self, step: int) -> bool:
        """Whether ``step`` is one of its checkpoint steps (beside every persistent step)."""

    def pushing(self) -> bool:
        """Whether copies of an earlier step are still being pushed (``wait_pushed`` would wait)."""

    def wait_pushed(self) -> float:
        """Block until copies of earlier steps are pushed (backpressure); the seconds waited."""

    def allocate(self, step: int, nbytes: int) -> np.ndarray:
        """The writable staging buffer of ``step``, of ``nbytes``: it becomes the tier's copy."""

    def allocate_unreserved(self, step: int, nbytes: int) -> tuple[np.ndarray, Callable[[], None]]:
        """:meth:`allocate`, and the function reserving its memory, to call before writing it."""

    def commit(
        self, commit_round: CommitRound, raw_crcs: dict[int, list[int]], metadata: dict[str, object]
    ) -> None:
        """Seal this process's staged chunks (``raw_crcs[i][j]``: crc32c of item ``j`` of
        array ``i``) and commit the step through ``commit_round.commit``; raises on failure."""

    def abort(self) -> None:
        """Discard the buffer of a save that failed before its commit returned."""

    def prepare_next(self, nbytes: int) -> None:
        """Get ready for a save of ``nbytes`` staged bytes, so that its ``allocate`` finds its
        memory ready: after a committed step, and before the first save once the state's size
        is known (``CheckpointManager.prepare``). Runs off the training thread; best effort,
        never raises."""

    def wait_replication(self, timeout_s: float | None = None) -> list[Any]:
        """The reports of pushes finished since the last call, after waiting for them."""

    def steps_by_tier(self) -> dict[int, set[str]]:
        """Its committed steps, each with the names of the tiers holding its manifest."""

    def manifest(self, step: int) -> Manifest | None:
        """The manifest of a step it committed, or None."""

    def holds_alone(self, manifest: Manifest) -> bool:
        """Whether ``manifest`` is of a step it committed without storage."""

    def source(self) -> ChunkSource:
        """The chunk source of a restore (after ``select_step``)."""

    def close(self) -> None:
        """Stop its background work; its committed copies may outlive the process."""
