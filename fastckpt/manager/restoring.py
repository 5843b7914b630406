"""The restore flow: choose a step, plan it, fill it from a chunk source, agree on the
outcome across processes, and fall back to an older step when a fast tier's turns out
incomplete. :class:`ReadingSteps` marks the steps restores are reading, so that retention
leaves them alone.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor
from typing import Any

from fastckpt._aio import LoopThread
from fastckpt._hostmem import BufferCache
from fastckpt._pygc import paused_gc
from fastckpt.coordination.distributed import Coordinator
from fastckpt.coordination.restore_agreement import (
    agree_on_outcome,
    agreed_storage_latest,
    choose_latest,
)
from fastckpt.errors import CheckpointNotFoundError, DistributedError, NoCheckpointError
from fastckpt.format.dtypes import dtype_from_name
from fastckpt.format.manifest import Manifest, box_volume
from fastckpt.manager.listing import list_manifests, load_manifest
from fastckpt.options import ManagerOptions
from fastckpt.planning import needed_chunks
from fastckpt.reader.assemble import RestorePlan, build_leaves, resolve_target
from fastckpt.reader.fetch import ChunkSource, RestoreStats, Unit, fill_units
from fastckpt.storage import Store
from fastckpt.writer.tier import Tier

__all__ = ["ReadingSteps", "Restorer"]

log = logging.getLogger("fastckpt")


class ReadingSteps:
    """The steps restores are reading, and the lock retention holds while it decides on and
    deletes a step (a deletion already under way finishes before a restore marks its step;
    the restore then finds no such step)."""

    def __init__(self) -> None:
        self._reading: collections.Counter[int] = collections.Counter()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def reading(self, step: int) -> Iterator[None]:
        """Mark ``step`` as read by a restore for the block."""
        with self._lock:
            self._reading[step] += 1
        try:
            yield
        finally:
            with self._lock:
                self._reading[step] -= 1

    def delete_unread(self, steps: Iterable[int], delete: Callable[[int], None]) -> None:
        """``delete`` each of ``steps`` that no restore is reading (a later save's retention
        deletes the others)."""
        for step in steps:
            with self._lock:
                if not self._reading[step]:
                    delete(step)


@dataclasses.dataclass(kw_only=True, eq=False)
class Restorer:
    """Restores the steps of one root; every process must restore in the same order (SPMD)."""

    store: Store
    coordinator: Coordinator
    options: ManagerOptions
    io: LoopThread
    workers: Executor
    namespace: str
    reading: ReadingSteps
    buffers: BufferCache
    chunk_source: ChunkSource | None
    """Where chunks come from without a fast tier (None: storage alone)."""
    _rseq: int = dataclasses.field(default=0, init=False)

    def restore(
        self, step: int | None, target: Any, *, partial: bool, tier: Tier | None
    ) -> tuple[Any, RestoreStats]:
        """``step`` (None: the newest every process can restore) laid out as ``target``, and
        this process's figures (``CheckpointManager.restore``)."""
        reading = self.reading.reading(step) if step is not None else contextlib.nullcontext()
        with paused_gc(self.options.pause_gc), reading:  # thousands of leaves: no full collections
            return self._restore(step, target, partial=partial, tier=tier)

    def _restore(
        self, step: int | None, target: Any, *, partial: bool, tier: Tier | None
    ) -> tuple[Any, RestoreStats]:
        import jax

        t0 = time.perf_counter()
        rseq, self._rseq = self._rseq, self._rseq + 1
        # made after the first step choice: it orders peers by the lists fetched
        source: ChunkSource | None = None
        fallbacks_before: dict[str, int] = {}
        older_than: int | None = None
        failure: BaseException | None = None
        plans: dict[int, tuple[Manifest, RestorePlan]] = {}

        def wanted(m: Manifest) -> dict[str, str]:  # the chunks this process's restore of m reads
            plans[m.step] = (m, resolve_target(m, target, partial=partial))
            return needed_chunks((u.leaf, u.box) for u in plans[m.step][1].units())

        for attempt in itertools.count():
            tag = f"{self.namespace}/restore/{rseq}/{attempt}"
            t_select = time.perf_counter()
            try:
                manifest = self._choose_manifest(
                    step, tier, key=tag, older_than=older_than, wanted=wanted
                )
            except CheckpointNotFoundError:
                if failure is not None:  # nothing older to fall back to: the last failure says why
                    raise failure from None
                raise
            if source is None:
                source = tier.source() if tier is not None else self.chunk_source
                fallbacks_before = dict(source.stats().fallbacks) if source is not None else {}
            tier_only = tier is not None and tier.holds_alone(manifest)
            known = plans.get(manifest.step)
            plan = (
                known[1]
                if known is not None and known[0] is manifest
                else resolve_target(manifest, target, partial=partial)
            )
            stats = RestoreStats(step=manifest.step, select_s=time.perf_counter() - t_select)
            failure = None
            try:  # CheckpointNotFoundError here: a tier-only step's chunk is in no reachable tier
                with self.reading.reading(manifest.step):
                    self._fill(
                        manifest, plan.units(), stats, source, storage_holds_step=not tier_only
                    )
            except BaseException as e:  # reported to the other processes before re-raising
                failure = e
            retry = agree_on_outcome(
                self.coordinator if tier is not None else None,
                tag,
                failure,
                may_retry=step is None and tier_only,
                timeout_s=self.options.distributed.barrier_timeout_s,
            )
            if not retry:
                break
            log.warning(
                "fastckpt: step %d of the fast tier is incomplete (%s); restoring an older step",
                manifest.step,
                failure or "on another process",
            )
            older_than = manifest.step
            failure = failure or DistributedError(
                f"step {manifest.step} of the fast tier is incomplete on another process"
            )
        if source is not None:  # this restore's: a long-lived source counts since it was made
            stats.fallbacks = {
                str(k): int(v) - fallbacks_before.get(k, 0)
                for k, v in source.stats().fallbacks.items()
                if int(v) > fallbacks_before.get(k, 0)
            }
        leaves = build_leaves(plan, stats)
        stats.seconds = time.perf_counter() - t0
        log.info("fastckpt: restored step %d (%s)", manifest.step, stats.bytes_by_tier)
        return jax.tree_util.tree_unflatten(plan.treedef, leaves), stats

    def _load(self, tier: Tier | None, step: int | None) -> Manifest:
        return load_manifest(self.store, self.io.run, tier, step)

    def _choose_manifest(
        self,
        step: int | None,
        tier: Tier | None,
        *,
        key: str,
        older_than: int | None,
        wanted: Callable[[Manifest], dict[str, str]],
    ) -> Manifest:
        """The manifest to restore: ``step``'s, or (None) the newest step every process can
        restore (``coordination.restore_agreement.choose_latest`` with a fast tier, else storage's
        latest as process 0 lists it: ``agreed_storage_latest``)."""
        if step is not None:
            return self._load(tier, step)
        list_keys = lambda: self.io.submit(list_manifests(self.store))  # noqa: E731
        timeout_s = self.options.distributed.barrier_timeout_s
        if tier is not None:
            return choose_latest(
                tier,
                self.coordinator,
                key=key,
                older_than=older_than,
                wanted=wanted,
                timeout_s=timeout_s,
                list_manifests=list_keys,
                load=lambda s: self._load(tier, s),
                url=self.store.url,
            )
        if self.coordinator.process_count == 1:
            return self._load(None, None)
        latest = agreed_storage_latest(
            self.coordinator, key=key, list_manifests=list_keys, timeout_s=timeout_s
        )
        if latest is None:
            raise NoCheckpointError(f"no committed checkpoint in {self.store.url}")
        return self._load(None, latest)

    def _fill(
        self,
        manifest: Manifest,
        units: Sequence[Unit],
        stats: RestoreStats,
        source: ChunkSource | None,
        *,
        storage_holds_step: bool,
    ) -> None:
        buffers = None
        if self.options.restore.reuse_host_buffers:
            buffers = self.buffers
            need = sum(box_volume(u.box) * dtype_from_name(u.leaf.dtype).itemsize for u in units)
            buffers.max_bytes = max(
                buffers.max_bytes, need + self.options.restore.max_scratch_bytes
            )
        self.io.run(
            fill_units(
                self.store,
                manifest.step,
                units,
                options=self.options.restore,
                executor=self.workers,
                stats=stats,
                source=source,
                storage_holds_step=storage_holds_step,
                buffers=buffers,
            )
        )
