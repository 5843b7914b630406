"""CheckpointManager: async sharded save, committed-step listing, resharding restore.

Call order per save: ``save()`` stages device shards to host (the only blocking part) and
hands the rest to one background thread: encode + upload on the I/O loop, then the commit
protocol (``writer.commit``), then retention. ``wait()`` joins it and re-raises its error;
the next ``save()`` does the same first. All processes of a multi-process job must call
``save``/``restore`` in the same order (SPMD), like any JAX collective.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import secrets
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from fastckpt._aio import LoopThread
from fastckpt.coordination.distributed import Coordinator, default_coordinator
from fastckpt._hostmem import BufferCache, StagingPool
from fastckpt._tree import flatten
from fastckpt.errors import (
    CheckpointNotFoundError,
    ConfigError,
    DistributedError,
    FastckptError,
    NoCheckpointError,
    SaveError,
    StepAlreadyCommittedError,
)
from fastckpt.format.codec import decode_manifest
from fastckpt.format.layout import MANIFEST_PREFIX, check_step, manifest_key, step_data_prefix, step_from_manifest_key
from fastckpt.maintenance import collect_garbage_async, steps_to_delete
from fastckpt.format.dtypes import dtype_from_name
from fastckpt.format.manifest import Manifest, box_volume
from fastckpt.options import ManagerOptions
from fastckpt.planning import needed_chunks
from fastckpt.reader.assemble import RestorePlan, build_leaves, resolve_target
from fastckpt._pygc import paused_gc
from fastckpt.coordination.restore_agreement import agree_on_outcome, agreed_storage_latest, choose_latest
from fastckpt._version import __version__
from fastckpt.reader.fetch import ChunkSource, RestoreStats, Unit, fill_units
from fastckpt.storage import Store
from fastckpt.writer.commit import CommitRound, publish_and_commit
from fastckpt.writer.pipeline import WriteStats, write_chunks
from fastckpt.writer.stage import StagedSave, StagePlans, stage_state, staged_crc32c
from fastckpt.writer.stats import SaveStats
from fastckpt.writer.tier import Tier

if TYPE_CHECKING:
    from fastckpt.replicas import ReplicationReport

__all__ = ["CheckpointManager", "SaveStats"]

log = logging.getLogger("fastckpt")


def _open(root: str | Store) -> Store:
    if isinstance(root, Store):
        return root
    if not isinstance(root, str):
        raise ConfigError(f"root must be a URL/path string or a Store, got {type(root).__name__}")
    from fastckpt.storage import open_store

    return open_store(root)


class CheckpointManager:
    """Saves and restores pytrees of ``jax.Array`` s under one root (``gs://``, path, ``mem://``).

    Example::

        with fastckpt.CheckpointManager("/tmp/run1") as mgr:
            mgr.save(step, state)          # returns after the device->host copy
            ...
            state = mgr.restore(target=abstract_state)   # or mgr.restore(step, target=...)
            print(mgr.last_restore_stats)

    Guarantees: a step is listed and restorable only once its manifest is committed (written
    last, create-only); committed steps are never overwritten; a failed or killed save leaves
    earlier steps intact.
    """

    def __init__(
        self,
        root: str | Store,
        *,
        options: ManagerOptions | None = None,
        coordinator: Coordinator | None = None,
        chunk_source: ChunkSource | None = None,
    ) -> None:
        self.options = options or ManagerOptions()
        self.store = _open(root)
        self.coordinator = coordinator or default_coordinator(timeout_s=self.options.distributed.barrier_timeout_s)
        self._chunk_source = chunk_source
        self._io = LoopThread()
        threads = max(self.options.save.encode_threads, self.options.restore.decode_threads)
        self._workers = ThreadPoolExecutor(threads, thread_name_prefix="fastckpt-work")
        self._threads = threads
        self._background = ThreadPoolExecutor(1, thread_name_prefix="fastckpt-save")
        self._pending: Future[SaveStats] | None = None
        self._pool = StagingPool()
        self._restore_buffers = BufferCache(max_bytes=0)  # grows to the largest restore
        self._attempts: collections.Counter[int] = collections.Counter()
        """Saves begun per step: a commit round is named by step and attempt, so processes whose
        earlier saves failed differently (one raised in ``wait()``, another did not) still meet
        in the same round for the same step."""
        self._reading: collections.Counter[int] = collections.Counter()
        """Steps this manager's restores are reading (retention leaves them alone)."""
        self._retention_lock = threading.Lock()
        """Held while retention decides on and deletes a step, and while a restore marks one."""
        # Unique per manager within a job: every process creates managers in the same order.
        self._ns = self.coordinator.namespace(f"fastckpt/{zlib.crc32(self.store.url.encode()):08x}")
        self._rseq = 0
        self._decisions = 0
        self._closed = False
        self._tier: Tier | None = None
        """The fast tier saved to and restored from before storage (the one ``options`` configure)."""
        if self.options.ram is not None:
            from fastckpt.replicas import RamReplication

            try:
                self._tier = RamReplication(self.options.ram, coordinator=self.coordinator, store=self.store,
                                            namespace=self._ns, run=self._io.run)
            except BaseException:  # nothing of a manager that was never made keeps running
                self._background.shutdown(wait=True)
                self._workers.shutdown(wait=True)
                with contextlib.suppress(Exception):
                    self._io.run(self.store.close())
                self._io.close()
                raise
        self.last_save_stats: SaveStats | None = None
        """This process's figures of the newest save joined here (by :meth:`wait`, :meth:`close`
        or the next :meth:`save`); None before the first. The one way to get save figures."""
        self.last_restore_stats: RestoreStats | None = None
        """This process's figures of the newest :meth:`restore` that returned; None before the
        first. The one way to get restore figures."""
        self._plans = StagePlans()

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: Any, *, metadata: Mapping[str, object] | None = None, force: bool = False) -> bool:
        """Stage ``state`` for ``step`` and commit it in the background.

        Waits first for the previous save's background work and, for a step of the fast tier
        (the RAM tier), for this host's push of its previous step to its peers (backpressure
        that keeps a complete RAM step across any single host loss; ``SaveStats.push_wait_s``).

        Returns True if a save started, False if skipped (interval not reached, or another
        save in flight with ``if_busy="skip"``). Raises the previous save's error
        (:class:`SaveError`) if it failed, :class:`StepAlreadyCommittedError` for a step
        that is already committed, :class:`ConfigError` for unsupported leaves.
        """
        self._check_open()
        step = check_step(step)
        persist = force or step % self.options.save_interval_steps == 0
        tier = self._tier if self._tier is not None and (persist or self._tier.due(step)) else None
        if not persist and tier is None:
            return False
        if self.options.save.if_busy == "skip" and self._busy_agreed(tier):
            return False
        self.wait()
        push_wait_s = tier.wait_pushed() if tier is not None else 0.0
        t0 = time.perf_counter()
        with paused_gc(self.options.pause_gc):  # thousands of leaves: no full collections
            leaves, _ = flatten(state)
            try:
                staged = stage_state(
                    leaves,
                    process_index=self.coordinator.process_index,
                    max_chunk_bytes=self.options.save.max_chunk_bytes,
                    allocate=(lambda n: tier.allocate(step, n)) if tier is not None else self._pool.take,
                    executor=self._workers,
                    copy_threads=self._threads,
                    plans=self._plans,
                    device_copy=self.options.save.device_copy,
                    defer_host_copies=True,
                    allocate_unreserved=(lambda n: tier.allocate_unreserved(step, n)) if tier is not None else None,
                )
            except BaseException:
                if tier is not None:
                    tier.abort()
                raise
        stats = SaveStats(step=step, blocked_s=time.perf_counter() - t0, staged_bytes=staged.nbytes,
                          push_wait_s=push_wait_s)
        seq = f"s{step}.{self._attempts[step]}"
        self._attempts[step] += 1
        self._pending = self._background.submit(
            self._finish_save, seq, step, staged, dict(metadata or {}), stats, t0, persist, tier
        )
        return True

    def _busy_agreed(self, tier: Tier | None) -> bool:
        """Whether a save is in flight (or ``tier`` still pushes an earlier step); with several
        processes, process 0's view decides for all (every process asks on every
        ``if_busy="skip"`` save, so their counters agree)."""
        busy = (self._pending is not None and not self._pending.done()) or (tier is not None and tier.pushing())
        coord = self.coordinator
        if coord.process_count == 1:
            return busy
        key = f"{self._ns}/busy/{self._decisions}"
        self._decisions += 1
        if coord.process_index == 0:
            coord.set(key, "busy" if busy else "free")
            return busy
        return coord.get(key, timeout_s=self.options.distributed.barrier_timeout_s) == "busy"

    def _round(self, ns: str, step: int, staged: StagedSave) -> CommitRound:
        return CommitRound(coord=self.coordinator, ns=ns, step=step, staged=staged,
                           timeout_s=self.options.distributed.barrier_timeout_s, writer_version=__version__)

    def _commit_tier(self, tier: Tier, seq: str, step: int, staged: StagedSave,
                     metadata: dict[str, object]) -> dict[int, list[int]]:
        """Checksum the staged chunks and commit them to ``tier`` (``Tier.commit``). Returns
        their crc32c (``staged_crc32c``), which a persistent write reuses."""
        try:
            staged.finish_copies(self._workers, jobs=self._threads)  # before reading the buffer
            raw_crcs = staged_crc32c(staged, self._workers, jobs=self._threads)
            tier.commit(self._round(f"{self._ns}/{seq}/{tier.name}", step, staged), raw_crcs, metadata)
        except BaseException:
            tier.abort()
            raise
        return raw_crcs

    def _finish_save(self, seq: str, step: int, staged: StagedSave, metadata: dict[str, object],
                     stats: SaveStats, t0: float, persist: bool, tier: Tier | None) -> SaveStats:
        raw_crcs = None  # a persistent-only save checksums while encoding
        if tier is not None:
            raw_crcs = self._commit_tier(tier, seq, step, staged, metadata)
            stats.ram_commit_s = time.perf_counter() - t0
            stats.deferred_copy_s = staged.finish_copies(self._workers, jobs=self._threads)  # made already: their time
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
            stats.deferred_copy_s = staged.finish_copies(self._workers, jobs=self._threads)  # no-op after a tier's
            chunks = self._io.run(write_chunks(
                self.store, staged, step=step, save_id=save_id, process_index=self.coordinator.process_index,
                options=self.options.save, executor=self._workers, stats=wstats, raw_crcs=raw_crcs,
            ))
        except BaseException as e:  # reported to the other processes before re-raising
            error = e
        t_commit = time.perf_counter()
        try:
            publish_and_commit(self._round(f"{self._ns}/{seq}", step, staged), store_run=self._io.run,
                               store=self.store, save_id=save_id, chunks=chunks, error=error, metadata=metadata)
        finally:
            if tier is None and error is None:  # (after a failed write, puts in threads may still read it)
                self._pool.give(staged.buffer)
        stats.tiers += ("storage",)
        stats.raw_bytes, stats.stored_bytes, stats.objects = wstats.raw_bytes, wstats.stored_bytes, wstats.objects
        stats.encode_s, stats.upload_s = wstats.encode_s, wstats.upload_s
        stats.commit_s = time.perf_counter() - t_commit
        stats.total_s = time.perf_counter() - t0
        log.info("fastckpt: committed step %d (%d bytes stored, %.2fs)", step, stats.stored_bytes, stats.total_s)
        if self.coordinator.process_index == 0:
            try:
                self._apply_retention()
            except Exception as e:  # noqa: BLE001 - the step is committed: the next save retries retention
                log.warning("fastckpt: retention after step %d failed: %s", step, e)
        if tier is not None:
            tier.prepare_next(staged.buffer.nbytes)
        return stats

    def wait(self) -> None:
        """Block until the in-flight save (if any) is committed; re-raise its error as SaveError."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            stats = pending.result()
        except FastckptError as e:
            if isinstance(e, (SaveError, StepAlreadyCommittedError)):
                raise
            raise SaveError(f"background save failed: {e}") from e
        except Exception as e:
            raise SaveError(f"background save failed: {type(e).__name__}: {e}") from e
        self.last_save_stats = stats

    def wait_replication(self, timeout_s: float | None = None) -> list[ReplicationReport]:
        """Block until this process's RAM-tier pushes to its peers finished, and return the
        reports of the pushes that finished since the last call, oldest first (empty without
        a RAM tier; of many unread ones, the newest are kept). A failed push is not raised:
        its report says so (``ok`` False, ``errors`` per peer) and it is logged, while
        storage and the other replicas still hold the data.

        Raises:
            ReplicationTimeoutError: pushes still running after ``timeout_s``.
        """
        return self._tier.wait_replication(timeout_s) if self._tier is not None else []

    # ------------------------------------------------------------------ listing
    def persistent_steps(self) -> list[int]:
        """Steps committed to persistent storage, ascending."""
        self._check_open()
        keys = self._io.run(self._list_manifests())
        return sorted(s for s in (step_from_manifest_key(k) for k in keys) if s is not None)

    async def _list_manifests(self) -> list[str]:
        """The committed manifests' keys: one storage listing (the only one a restore makes)."""
        return await self.store.list(MANIFEST_PREFIX)

    def steps_by_tier(self) -> dict[int, set[str]]:
        """Every committed step and the tiers holding its manifest: ``"storage"``, ``"ram"``
        (this host's RAM tier), ``"peer"`` (some peer's RAM tier)."""
        out: dict[int, set[str]] = {s: {"storage"} for s in self.persistent_steps()}
        if self._tier is not None:
            for s, tiers in self._tier.steps_by_tier().items():
                out.setdefault(s, set()).update(tiers)
        return dict(sorted(out.items()))

    def all_steps(self) -> list[int]:
        """Committed steps in any tier, ascending (RAM steps only with a RAM tier configured)."""
        if self._tier is None:
            return self.persistent_steps()
        return sorted(self.steps_by_tier())

    def latest_step(self) -> int | None:
        """The newest committed step in any tier, or None. (``restore()`` with no step also
        checks that a RAM step's chunks are all reachable and may fall back to an older one.)"""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def manifest(self, step: int | None = None) -> Manifest:
        """The manifest of ``step`` (default: latest). ``CheckpointNotFoundError`` if absent."""
        from fastckpt.errors import NotFoundError

        self._check_open()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise NoCheckpointError(f"no committed checkpoint in {self.store.url}")
        try:
            data = self._io.run(self.store.get(manifest_key(step)))
        except NotFoundError:
            held = self._tier.manifest(step) if self._tier is not None else None
            if held is None:
                raise CheckpointNotFoundError(f"step {step} is not committed in {self.store.url}") from None
            return held
        return decode_manifest(data)

    def metadata(self, step: int | None = None) -> dict[str, object]:
        """The user metadata saved with ``step``."""
        return dict(self.manifest(step).metadata)

    # ------------------------------------------------------------------ restore
    def restore(self, step: int | None = None, *, target: Any = None, partial: bool = False) -> Any:
        """Restore ``step`` (default: latest) laid out as ``target`` says.

        ``target`` is a pytree of ``jax.ShapeDtypeStruct`` (with ``.sharding``) or concrete
        arrays; any mesh or device count works; None restores the saved tree with its saved
        shardings. ``partial=True`` restores only the target's leaves (a subtree). This
        process's figures are in :attr:`last_restore_stats` afterwards.

        With ``step=None`` only process 0 lists storage and every process restores the step
        it found (collective: every process must call it). With a RAM tier, a RAM-only step
        that turns out incomplete while it is read (a chunk corrupt in every copy, or a peer
        lost mid-restore with no other copy) is abandoned by every process together, and the
        next older complete step is restored instead (an older RAM step, else storage's
        latest). An explicit ``step`` never falls back.

        Raises:
            NoCheckpointError: ``step=None`` and nothing is committed in any tier (on every
                process alike: initialise instead).
            CheckpointNotFoundError, TreeStructureError, ShapeMismatchError,
            DtypeMismatchError, ChecksumMismatchError, DistributedError.
        """
        step = None if step is None else check_step(step)
        reading = self._reading_step(step) if step is not None else contextlib.nullcontext()
        with paused_gc(self.options.pause_gc), reading:  # thousands of leaves: no full collections
            return self._restore(step, target, partial=partial)

    @contextlib.contextmanager
    def _reading_step(self, step: int) -> Iterator[None]:
        """Mark ``step`` as read by a restore for the block: retention does not delete it (a
        deletion already under way finishes first; the restore then finds no such step)."""
        with self._retention_lock:
            self._reading[step] += 1
        try:
            yield
        finally:
            with self._retention_lock:
                self._reading[step] -= 1

    def _restore(self, step: int | None, target: Any, *, partial: bool) -> Any:
        import jax

        t0 = time.perf_counter()
        self._check_open()
        rseq, self._rseq = self._rseq, self._rseq + 1
        source: ChunkSource | None = None  # made after the first step choice: it orders peers by the lists fetched
        fallbacks_before: dict[str, int] = {}
        older_than: int | None = None
        failure: BaseException | None = None
        plans: dict[int, tuple[Manifest, RestorePlan]] = {}

        def wanted(m: Manifest) -> dict[str, str]:  # the chunks this process's restore of m reads
            plans[m.step] = (m, resolve_target(m, target, partial=partial))
            return needed_chunks((u.leaf, u.box) for u in plans[m.step][1].units())

        for attempt in itertools.count():
            tag = f"{self._ns}/restore/{rseq}/{attempt}"
            t_select = time.perf_counter()
            try:
                manifest = self._choose_manifest(step, key=tag, older_than=older_than, wanted=wanted)
            except CheckpointNotFoundError:
                if failure is not None:  # nothing older to fall back to: the last failure says why
                    raise failure from None
                raise
            if source is None:
                source = self._tier.source() if self._tier is not None else self._chunk_source
                fallbacks_before = dict(source.stats().fallbacks) if source is not None else {}
            tier_only = self._tier is not None and self._tier.holds_alone(manifest)
            known = plans.get(manifest.step)
            plan = known[1] if known is not None and known[0] is manifest else resolve_target(manifest, target,
                                                                                               partial=partial)
            stats = RestoreStats(step=manifest.step, select_s=time.perf_counter() - t_select)
            failure = None
            try:  # CheckpointNotFoundError here: a tier-only step's chunk is in no reachable tier
                with self._reading_step(manifest.step):
                    self._fill(manifest, plan.units(), stats, source, storage_holds_step=not tier_only)
            except BaseException as e:  # reported to the other processes before re-raising
                failure = e
            retry = agree_on_outcome(self.coordinator if self._tier is not None else None, tag, failure,
                                     may_retry=step is None and tier_only,
                                     timeout_s=self.options.distributed.barrier_timeout_s)
            if not retry:
                break
            log.warning("fastckpt: step %d of the fast tier is incomplete (%s); restoring an older step",
                        manifest.step, failure or "on another process")
            older_than = manifest.step
            failure = failure or DistributedError(f"step {manifest.step} of the fast tier is incomplete on another "
                                                  "process")
        if source is not None:  # this restore's: a long-lived source counts since it was made
            stats.fallbacks = {str(k): int(v) - fallbacks_before.get(k, 0)
                               for k, v in source.stats().fallbacks.items() if int(v) > fallbacks_before.get(k, 0)}
        leaves = build_leaves(plan, stats)
        stats.seconds = time.perf_counter() - t0
        self.last_restore_stats = stats
        log.info("fastckpt: restored step %d (%s)", manifest.step, stats.bytes_by_tier)
        return jax.tree_util.tree_unflatten(plan.treedef, leaves)

    def _choose_manifest(self, step: int | None, *, key: str, older_than: int | None,
                         wanted: Callable[[Manifest], dict[str, str]]) -> Manifest:
        """The manifest to restore: ``step``'s, or (None) the newest step every process can
        restore (``coordination.restore_agreement.choose_latest`` with a fast tier, else storage's
        latest as process 0 lists it: ``agreed_storage_latest``)."""
        if step is not None:
            return self.manifest(step)
        list_manifests = lambda: self._io.submit(self._list_manifests())  # noqa: E731
        timeout_s = self.options.distributed.barrier_timeout_s
        if self._tier is not None:
            return choose_latest(self._tier, self.coordinator, key=key, older_than=older_than, wanted=wanted,
                                 timeout_s=timeout_s, list_manifests=list_manifests, load=self.manifest,
                                 url=self.store.url)
        if self.coordinator.process_count == 1:
            return self.manifest(None)
        latest = agreed_storage_latest(self.coordinator, key=key, list_manifests=list_manifests, timeout_s=timeout_s)
        if latest is None:
            raise NoCheckpointError(f"no committed checkpoint in {self.store.url}")
        return self.manifest(latest)

    def _fill(self, manifest: Manifest, units: Sequence[Unit], stats: RestoreStats, source: ChunkSource | None, *,
              storage_holds_step: bool) -> None:
        buffers = None
        if self.options.restore.reuse_host_buffers:
            buffers = self._restore_buffers
            need = sum(box_volume(u.box) * dtype_from_name(u.leaf.dtype).itemsize for u in units)
            buffers.max_bytes = max(buffers.max_bytes, need + self.options.restore.max_scratch_bytes)
        self._io.run(fill_units(self.store, manifest.step, units, options=self.options.restore,
                                executor=self._workers, stats=stats, source=source,
                                storage_holds_step=storage_holds_step, buffers=buffers))

    # ------------------------------------------------------------------ retention / gc
    def _apply_retention(self) -> None:
        for step in steps_to_delete(self.persistent_steps(), self.options.retention):
            with self._retention_lock:
                if not self._reading[step]:  # a restore of it is running: a later save deletes it
                    self.delete_step(step)

    def gc(self, *, grace_s: float = 3600.0, dry_run: bool = False) -> Any:
        """Remove uncommitted leftovers older than ``grace_s`` (see ``fastckpt gc``).

        Returns the :class:`fastckpt.maintenance.GcReport`. Safe while saves run elsewhere:
        uncommitted data younger than the grace period is kept.
        """
        self._check_open()
        return self._io.run(collect_garbage_async(self.store, grace_s=grace_s, dry_run=dry_run))

    def delete_step(self, step: int) -> None:
        """Delete a committed step: the manifest first (un-commit), then its data."""
        self._io.run(self.store.delete(manifest_key(step)))
        for key in self._io.run(self.store.list(step_data_prefix(step))):
            self._io.run(self.store.delete(key))

    # ------------------------------------------------------------------ lifecycle
    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("CheckpointManager is closed")

    def close(self) -> None:
        """Wait for the in-flight save, then release threads and connections. Idempotent."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._restore_buffers.clear()
            self._background.shutdown(wait=True)
            if self._tier is not None:
                self._tier.close()
            try:
                self._io.run(self.store.close())
            finally:
                self._io.close()
                self._workers.shutdown(wait=True)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
