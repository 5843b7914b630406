"""The save flow: decide where a save goes, stage it, and commit it in the background.

Call order per save: :meth:`Saver.target` says whether and where ``step`` is saved (the
persistent interval, the fast tier's own schedule, ``if_busy="skip"``); the caller joins
the previous save (:meth:`Saver.join`); :meth:`Saver.start` stages device shards to host
(the only blocking part) and hands the rest to one background thread: the fast tier's
commit, encode + upload on the I/O loop, then the commit protocol (``writer.commit``),
then ``retain`` (retention, on process 0).

:meth:`Saver.prepare` (any time, e.g. once the state's shapes are known) provisions the
staging memory of the next save on the same background thread — the fast tier's segment
(``Tier.prepare_next``), else a pre-faulted staging buffer — so that the first save of a
process does not create and fault in that memory while the step waits; the next
:meth:`Saver.start` waits for it to finish (counted in ``blocked_s``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, TypeVar

from fastckpt._aio import LoopThread
from fastckpt._hostmem import StagingPool
from fastckpt._pygc import paused_gc
from fastckpt._tree import flatten
from fastckpt._version import __version__
from fastckpt.coordination.distributed import Coordinator
from fastckpt.errors import FastckptError, SaveError, StepAlreadyCommittedError
from fastckpt.options import ManagerOptions
from fastckpt.storage import Store
from fastckpt.writer.commit import CommitRound, publish_and_commit
from fastckpt.writer.pipeline import WriteStats, write_chunks
from fastckpt.writer.stage import (
    StagedSave,
    StagePlans,
    stage_state,
    staged_crc32c,
    staging_nbytes,
    warm_plans,
)
from fastckpt.writer.stats import SaveStats
from fastckpt.writer.tier import Tier

__all__ = ["SaveTarget", "Saver"]

log = logging.getLogger("fastckpt")
_B = TypeVar("_B")


@dataclasses.dataclass(frozen=True)
class SaveTarget:
    """Where a save of ``step`` goes: storage if ``persist``, and ``tier`` unless None."""

    step: int
    persist: bool
    tier: Tier | None


class Saver:
    """Saves to one root; every process must save in the same order (SPMD)."""

    def __init__(
        self,
        *,
        store: Store,
        coordinator: Coordinator,
        options: ManagerOptions,
        io: LoopThread,
        workers: Executor,
        threads: int,
        namespace: str,
        retain: Callable[[], None],
    ) -> None:
        self._store = store
        self._coordinator = coordinator
        self._options = options
        self._io = io
        self._workers = workers
        self._threads = threads
        self._ns = namespace
        self._retain = retain
        self._background = ThreadPoolExecutor(1, thread_name_prefix="fastckpt-save")
        self._copiers: ThreadPoolExecutor | None = None
        """Threads of the deferred copies out of pinned host memory (made on first use)."""
        self.pending: Future[SaveStats] | None = None
        """The background part of the newest save, until joined."""
        self.pool = StagingPool()
        self.plans = StagePlans()
        self._attempts: collections.Counter[int] = collections.Counter()
        """Saves begun per step: a commit round is named by step and attempt, so processes whose
        earlier saves failed differently (one raised in ``wait()``, another did not) still meet
        in the same round for the same step."""
        self._decisions = 0
        self._preparing: Future[None] | None = None
        """The provisioning :meth:`prepare` started, until the next :meth:`start`."""

    def prepare(self, state: Any, tier: Tier | None) -> None:
        """Provision, on the background thread, the staging memory a save of a state shaped
        like ``state`` needs (arrays concrete or ``jax.ShapeDtypeStruct`` with their sharding):
        ``tier.prepare_next`` with its size, or without a tier a pre-faulted staging buffer.
        Concrete arrays are also planned here, on the calling (saving) thread, into the plan
        cache (``warm_plans``: pure, what the first save would do). Best effort (a state it
        cannot size, or a failure, is logged)."""
        try:
            with paused_gc(self._options.pause_gc):
                leaves, _ = flatten(state)
                warm_plans(
                    leaves,
                    process_index=self._coordinator.process_index,
                    max_chunk_bytes=self._options.save.max_chunk_bytes,
                    plans=self.plans,
                    device_copy=self._options.save.device_copy,
                )
            nbytes = staging_nbytes(
                leaves,
                process_index=self._coordinator.process_index,
                max_chunk_bytes=self._options.save.max_chunk_bytes,
            )
        except Exception as e:
            log.warning("fastckpt: cannot size the state to prepare its save: %s", e)
            return
        self._preparing = self._background.submit(self._provision, nbytes, tier)

    def _provision(self, nbytes: int, tier: Tier | None) -> None:
        try:
            if tier is not None:
                tier.prepare_next(nbytes)
            else:
                self.pool.provision(nbytes)
        except Exception as e:
            log.warning("fastckpt: could not provision %d bytes of staging memory: %s", nbytes, e)

    def target(self, step: int, *, force: bool, tier: Tier | None) -> SaveTarget | None:
        """Where a save of ``step`` goes, or None to skip it (interval not reached, or another
        save in flight with ``if_busy="skip"``)."""
        persist = force or step % self._options.save_interval_steps == 0
        tier = tier if tier is not None and (persist or tier.due(step)) else None
        if not persist and tier is None:
            return None
        if self._options.save.if_busy == "skip" and self._busy_agreed(tier):
            return None
        return SaveTarget(step, persist, tier)

    def _busy_agreed(self, tier: Tier | None) -> bool:
        """Whether a save is in flight (or ``tier`` still pushes an earlier step); with several
        processes, process 0's view decides for all (every process asks on every
        ``if_busy="skip"`` save, so their counters agree)."""
        busy = (self.pending is not None and not self.pending.done()) or (
            tier is not None and tier.pushing()
        )
        coord = self._coordinator
        if coord.process_count == 1:
            return busy
        key = f"{self._ns}/busy/{self._decisions}"
        self._decisions += 1
        if coord.process_index == 0:
            coord.set(key, "busy" if busy else "free")
            return busy
        return coord.get(key, timeout_s=self._options.distributed.barrier_timeout_s) == "busy"

    def start(self, target: SaveTarget, state: Any, metadata: Mapping[str, object] | None) -> None:
        """Stage ``state`` for ``target`` and commit it in the background (after :meth:`join`)."""
        step, tier = target.step, target.tier
        push_wait_s = tier.wait_pushed() if tier is not None else 0.0
        t0 = time.perf_counter()
        preparing, self._preparing = self._preparing, None
        if preparing is not None:  # its memory is what this save allocates
            preparing.result()
        allocated = [time.perf_counter() - t0]

        def timed(get: Callable[[int], _B]) -> Callable[[int], _B]:
            def run(n: int) -> _B:
                t = time.perf_counter()
                try:
                    return get(n)
                finally:
                    allocated.append(time.perf_counter() - t)

            return run

        with paused_gc(self._options.pause_gc):  # thousands of leaves: no full collections
            leaves, _ = flatten(state)
            try:
                staged = stage_state(
                    leaves,
                    process_index=self._coordinator.process_index,
                    max_chunk_bytes=self._options.save.max_chunk_bytes,
                    allocate=timed(lambda n: tier.allocate(step, n))
                    if tier is not None
                    else timed(self.pool.take),
                    executor=self._workers,
                    copy_threads=self._threads,
                    plans=self.plans,
                    device_copy=self._options.save.device_copy,
                    defer_host_copies=True,
                    allocate_unreserved=timed(lambda n: tier.allocate_unreserved(step, n))
                    if tier is not None
                    else None,
                )
            except BaseException:
                if tier is not None:
                    tier.abort()
                raise
        stats = SaveStats(
            step=step,
            blocked_s=time.perf_counter() - t0,
            staged_bytes=staged.nbytes,
            allocate_s=sum(allocated),
            push_wait_s=push_wait_s,
        )
        seq = f"s{step}.{self._attempts[step]}"
        self._attempts[step] += 1
        self.pending = self._background.submit(
            self._finish, seq, step, staged, dict(metadata or {}), stats, t0, target.persist, tier
        )

    def _finish_copies(self, staged: StagedSave, *, checksum: bool = False) -> float:
        """``staged.finish_copies`` on ``SaveOptions.pinned_copy_threads`` threads (the seconds
        they took; a no-op once made)."""
        if staged.deferred is None:
            return 0.0
        jobs = self._options.save.pinned_copy_threads
        if self._copiers is None:
            self._copiers = ThreadPoolExecutor(jobs, thread_name_prefix="fastckpt-copy")
        return staged.finish_copies(self._copiers, jobs=jobs, checksum=checksum)

    def _round(self, ns: str, step: int, staged: StagedSave) -> CommitRound:
        return CommitRound(
            coord=self._coordinator,
            ns=ns,
            step=step,
            staged=staged,
            timeout_s=self._options.distributed.barrier_timeout_s,
            writer_version=__version__,
        )

    def _commit_tier(
        self, tier: Tier, seq: str, step: int, staged: StagedSave, metadata: dict[str, object]
    ) -> dict[int, list[int]]:
        """Checksum the staged chunks and commit them to ``tier`` (``Tier.commit``). Returns
        their crc32c (``staged_crc32c``), which a persistent write reuses."""
        try:
            self._finish_copies(staged, checksum=True)  # before reading the buffer
            raw_crcs = staged_crc32c(staged, self._workers, jobs=self._threads)
            tier.commit(
                self._round(f"{self._ns}/{seq}/{tier.name}", step, staged), raw_crcs, metadata
            )
        except BaseException:
            tier.abort()
            raise
        return raw_crcs

    def _finish(
        self,
        seq: str,
        step: int,
        staged: StagedSave,
        metadata: dict[str, object],
        stats: SaveStats,
        t0: float,
        persist: bool,
        tier: Tier | None,
    ) -> SaveStats:
        raw_crcs = None  # a persistent-only save checksums while encoding
        if tier is not None:
            raw_crcs = self._commit_tier(tier, seq, step, staged, metadata)
            stats.ram_commit_s = time.perf_counter() - t0
            stats.deferred_copy_s = self._finish_copies(staged)  # made already: their time
            stats.tiers += (tier.name,)
            if not persist:
                stats.total_s = stats.ram_commit_s
                tier.prepare_next(staged.buffer.nbytes)
                return stats
        wstats = WriteStats()
        save_id = secrets.token_hex(6)
        chunks = None
        error: BaseException | None = None
        try:
            stats.deferred_copy_s = self._finish_copies(staged)  # no-op after a tier's
            chunks = self._io.run(
                write_chunks(
                    self._store,
                    staged,
                    step=step,
                    save_id=save_id,
                    process_index=self._coordinator.process_index,
                    options=self._options.save,
                    executor=self._workers,
                    stats=wstats,
                    raw_crcs=raw_crcs,
                )
            )
        except BaseException as e:  # reported to the other processes before re-raising
            error = e
        t_commit = time.perf_counter()
        try:
            publish_and_commit(
                self._round(f"{self._ns}/{seq}", step, staged),
                store_run=self._io.run,
                store=self._store,
                save_id=save_id,
                chunks=chunks,
                error=error,
                metadata=metadata,
            )
        finally:
            # (after a failed write, puts in threads may still read it)
            if tier is None and error is None:
                self.pool.give(staged.buffer)
        stats.tiers += ("storage",)
        stats.raw_bytes, stats.stored_bytes, stats.objects = (
            wstats.raw_bytes,
            wstats.stored_bytes,
            wstats.objects,
        )
        stats.encode_s, stats.upload_s = wstats.encode_s, wstats.upload_s
        stats.commit_s = time.perf_counter() - t_commit
        stats.total_s = time.perf_counter() - t0
        log.info(
            "fastckpt: committed step %d (%d bytes stored, %.2fs)",
            step,
            stats.stored_bytes,
            stats.total_s,
        )
        if self._coordinator.process_index == 0:
            try:
                self._retain()
            except Exception as e:
                log.warning("fastckpt: retention after step %d failed: %s", step, e)
        if tier is not None:
            tier.prepare_next(staged.buffer.nbytes)
        return stats

    def join(self) -> SaveStats | None:
        """Wait for the in-flight save (if any): its figures, or its error as :class:`SaveError`."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        try:
            return pending.result()
        except FastckptError as e:
            if isinstance(e, (SaveError, StepAlreadyCommittedError)):
                raise
            raise SaveError(f"background save failed: {e}") from e
        except Exception as e:
            raise SaveError(f"background save failed: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        """Stop the background threads (after :meth:`join`)."""
        self._background.shutdown(wait=True)
        if self._copiers is not None:
            self._copiers.shutdown(wait=True)
