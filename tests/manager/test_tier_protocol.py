"""``writer.tier.Tier`` is the manager's one seam to a fast tier: a tier that is not the RAM
tier (a dict of chunk copies in this process, defined here) gets tier-only steps, steps it
shares with storage, restores that read it and not storage, and the fall back from a
tier-only step it lost to an older step — with no change to the manager."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fastckpt import CheckpointManager, ManagerOptions, RetentionOptions
from fastckpt.format.codec import decode_manifest
from fastckpt.format.manifest import Manifest, chunk_id
from fastckpt.writer.commit import CommitRound, CoordinatorFragments
from fastckpt.writer.fragment import ChunkRows
from fastckpt.writer.tier import Tier


@dataclasses.dataclass(frozen=True)
class _Counters:
    fallbacks: Mapping[str, int]


@dataclasses.dataclass(frozen=True)
class _Choice:
    manifest: Manifest | None


class DictTier:
    """Chunk copies in a dict, committed through the one commit path."""

    name = "dict"

    def __init__(self) -> None:
        self.chunks: dict[int, dict[str, bytes]] = {}
        self.manifests: dict[int, bytes] = {}
        self.staging: dict[int, np.ndarray] = {}
        self.aborts = self.closed = 0

    def due(self, step: int) -> bool:
        return True

    def pushing(self) -> bool:
        return False

    def wait_pushed(self) -> float:
        return 0.0

    def allocate(self, step: int, nbytes: int) -> np.ndarray:
        self.staging[step] = np.empty(nbytes, np.uint8)
        return self.staging[step]

    def allocate_unreserved(self, step: int, nbytes: int) -> tuple[np.ndarray, Callable[[], None]]:
        return self.allocate(step, nbytes), lambda: None

    def commit(
        self, commit_round: CommitRound, raw_crcs: dict[int, list[int]], metadata: dict[str, object]
    ) -> None:
        step, staged = commit_round.step, commit_round.staged
        buf, rows, copies = self.staging.pop(step), ChunkRows(), {}
        for ai, arr in enumerate(staged.arrays):
            for off, item, crc in zip(arr.item_offsets, arr.items, raw_crcs[ai]):
                copies[chunk_id(arr.path, item.box)] = bytes(buf[off : off + item.nbytes])
                rows.add(ai, item.box, f"dict/{step}", off, item.nbytes, "raw", crc, crc)
        self.chunks[step] = copies
        commit_round.commit(
            rows.build(),
            route=CoordinatorFragments(round=commit_round),
            validate=False,
            publish=lambda data: self.manifests.__setitem__(step, data),
            metadata={**metadata, "dict_only": True},
        )

    def abort(self) -> None:
        self.aborts += 1
        self.staging.clear()

    def prepare_next(self, nbytes: int) -> None:
        pass

    def wait_replication(self, timeout_s: float | None = None) -> list[Any]:
        return []

    def steps_by_tier(self) -> dict[int, set[str]]:
        return {s: {self.name} for s in self.manifests}

    def manifest(self, step: int) -> Manifest | None:
        return decode_manifest(self.manifests[step]) if step in self.manifests else None

    def holds_alone(self, manifest: Manifest) -> bool:
        return manifest.metadata.get("dict_only") is True

    def select_step(
        self,
        persistent_latest: Callable[[], int | None],
        *,
        key: str,
        timeout_s: float,
        older_than: int | None,
        wanted: Callable[[Manifest], Mapping[str, str]],
    ) -> _Choice | None:
        latest = persistent_latest()
        for s in sorted(self.manifests, reverse=True):  # one process: no agreement to reach
            if (older_than is None or s < older_than) and (latest is None or s > latest):
                return _Choice(self.manifest(s))
        return None

    def source(self) -> DictTier:
        return self

    def fetch_many(
        self,
        step: int,
        items: Sequence[tuple[str, int, int, memoryview | np.ndarray]],
        *,
        runs: Sequence[Sequence[tuple[int, int]] | None] | None = None,
    ) -> list[str | None]:
        out: list[str | None] = []
        for cid, n, _, into in items:
            data = self.chunks.get(step, {}).get(cid)
            if data is not None:
                np.asarray(into).reshape(-1).view(np.uint8)[:n] = np.frombuffer(data, np.uint8)
            out.append(None if data is None else self.name)
        return out

    def lend_many(
        self, step: int, groups: Sequence[Sequence[tuple[str, int, int]]], *, verify: bool = True
    ) -> list[memoryview | None]:
        return [None] * len(groups)

    def stats(self) -> _Counters:
        return _Counters({})

    def close(self) -> None:
        self.closed += 1


def test_the_manager_saves_to_and_restores_from_any_tier(tmp_path: Path) -> None:
    import jax

    tier = DictTier()
    checked: Tier = tier  # the protocol, statically
    options = ManagerOptions(save_interval_steps=2, retention=RetentionOptions(keep_last=None))
    mgr = CheckpointManager(str(tmp_path / "ck"), options=options)
    mgr._tier = checked
    states = {
        s: {"w": jax.device_put(np.arange(64, dtype=np.float32) * s), "n": s} for s in (1, 2, 3)
    }
    with mgr:
        for s, state in states.items():  # 1, 3: the tier's only; 2: the tier's and storage's
            assert mgr.save(s, state)
            mgr.wait()
            assert mgr.last_save_stats is not None
            assert mgr.last_save_stats.tiers == (("dict",) if s % 2 else ("dict", "storage"))
        assert mgr.steps_by_tier() == {1: {"dict"}, 2: {"dict", "storage"}, 3: {"dict"}}
        assert mgr.persistent_steps() == [2] and mgr.latest_step() == 3
        restored = mgr.restore()
        assert restored["n"] == 3 and mgr.last_restore_stats is not None
        np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(states[3]["w"]))
        assert mgr.last_restore_stats.bytes_by_tier == {"dict": 256}
        assert mgr.restore(1)["n"] == 1 and mgr.manifest(1).metadata["dict_only"] is True
        del tier.chunks[3]  # the tier lost step 3's chunks: the newest complete step is storage's 2
        restored = mgr.restore()
        assert restored["n"] == 2 and mgr.last_restore_stats.step == 2
        np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(states[2]["w"]))
    assert tier.closed == 1 and not tier.staging
