"""Step selection asks every peer at once: one slow or dead peer costs one round trip, and a
job of many hosts does not query them one after another."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from fastckpt.coordination.distributed import default_coordinator
from fastckpt.errors import PeerUnavailableError
from fastckpt.options import RamOptions
from fastckpt.replicas import RamReplication
from fastckpt.replicas._client import StepLists
from fastckpt.storage import MemoryStore


class _Peer:
    """Answers only once every peer has been asked (a barrier): sequential queries would
    break the barrier (after its timeout) instead of answering."""

    def __init__(
        self, name: str, barrier: threading.Barrier, steps: list[int], *, dead: bool = False
    ) -> None:
        self.name, self.barrier, self.steps, self.dead = name, barrier, steps, dead

    def step_lists(self) -> StepLists:
        self.barrier.wait(timeout=10)
        if self.dead:
            raise PeerUnavailableError("connect timed out")
        return StepLists(steps=self.steps, committed=self.steps, manifests=[])

    def list_chunks(self, step: int) -> list[str]:
        return []


def test_peers_are_asked_concurrently_and_failures_left_out(tmp_path: Path) -> None:
    rr = RamReplication(
        RamOptions(root=str(tmp_path / "tier"), replicas=0),
        coordinator=default_coordinator(),
        store=MemoryStore(),
        namespace="t",
        run=lambda c: None,
    )
    try:
        n = 12
        barrier = threading.Barrier(n)
        peers: dict[str, Any] = {
            f"h{i}": _Peer(f"h{i}", barrier, [i, 100], dead=i % 5 == 0) for i in range(n)
        }
        rr._peers = lambda: peers  # type: ignore[method-assign]
        got = rr.steps_by_tier()
        assert not barrier.broken
        assert got == {100: {"peer"}, **{i: {"peer"} for i in range(n) if i % 5}}
    finally:
        rr.close()


def test_a_refused_seal_leaves_the_segment_to_abort(tmp_path: Path) -> None:
    """``RamReplication.seal`` refused by the tier (here: a segment never reserved): ``abort``
    still discards it, so its budget and file are freed for the next save."""
    import numpy as np

    from fastckpt.errors import ConfigError
    from fastckpt.writer.stage import StagedSave

    mib = 1 << 20
    rr = RamReplication(
        RamOptions(root=str(tmp_path / "tier"), replicas=0, budget_bytes=8 * mib),
        coordinator=default_coordinator(),
        store=MemoryStore(),
        namespace="t",
        run=lambda c: None,
    )
    try:
        buffer, _reserve = rr.allocate_unreserved(3, 4 * mib)
        assert buffer.nbytes == 4 * mib
        with pytest.raises(ConfigError, match="reserve"):
            rr.seal(3, StagedSave((), (), np.zeros(0, np.uint8), 0, ()), {})
        rr.abort()
        assert rr.tier.nbytes() == 0 and not list((tmp_path / "tier" / "tmp").iterdir())
        rr.allocate(4, 7 * mib)  # fits: nothing was left charged
    finally:
        rr.close()


def test_a_save_drops_the_steps_of_an_abandoned_timeline(tmp_path: Path) -> None:
    """Saving step S after the job went back to an older step: the tier's steps >= S (committed
    on the abandoned timeline, with their kept manifests) are dropped before the new S is
    staged, so neither their copies nor their retention floor outlive the rollback."""
    import numpy as np

    mib = 1 << 20
    rr = RamReplication(
        RamOptions(root=str(tmp_path / "tier"), replicas=0, budget_bytes=64 * mib, keep_steps=3),
        coordinator=default_coordinator(),
        store=MemoryStore(),
        namespace="t",
        run=lambda c: None,
    )
    try:
        for step in (10, 20, 30):
            with rr.tier.allocate(step, 8) as seg:
                seg.buffer[:] = step
                rr.tier.seal(step, seg, {})
            rr.tier.put_manifest(step, b"m")
        buffer = rr.allocate(20, 8)  # the job restored 10 and trains again
        assert rr.tier.steps() == [10] and buffer.nbytes == 8
        rr.abort()
        assert np.asarray(rr.tier.committed_steps()).tolist() == [10]
    finally:
        rr.close()
