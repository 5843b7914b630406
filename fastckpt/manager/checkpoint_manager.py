"""CheckpointManager: async sharded save, committed-step listing, resharding restore.

The manager owns the resources (store, coordinator namespace, I/O loop, worker threads, the
fast tier, reused host buffers) and hands them to the flows: ``saving.Saver``,
``restoring.Restorer`` and ``listing``. All processes of a multi-process job must call
``save``/``restore`` in the same order (SPMD), like any JAX collective.
"""

from __future__ import annotations

import contextlib
import logging
import zlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from fastckpt._aio import LoopThread
from fastckpt._hostmem import BufferCache
from fastckpt.coordination.distributed import Coordinator, default_coordinator
from fastckpt.errors import ConfigError, NoCheckpointError
from fastckpt.format.layout import check_step
from fastckpt.format.manifest import Manifest
from fastckpt.maintenance import collect_garbage_async, steps_to_delete
from fastckpt.manager import listing
from fastckpt.manager.restoring import ReadingSteps, Restorer
from fastckpt.manager.saving import Saver
from fastckpt.options import ManagerOptions
from fastckpt.reader.fetch import ChunkSource, RestoreStats
from fastckpt.storage import Store
from fastckpt.writer.stats import SaveStats
from fastckpt.writer.tier import Tier

if TYPE_CHECKING:
    from fastckpt.replicas import ReplicationReport

__all__ = ["CheckpointManager"]

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
        self.coordinator = coordinator or default_coordinator(
            timeout_s=self.options.distributed.barrier_timeout_s
        )
        self._io = LoopThread()
        threads = max(self.options.save.encode_threads, self.options.restore.decode_threads)
        self._workers = ThreadPoolExecutor(threads, thread_name_prefix="fastckpt-work")
        self._restore_buffers = BufferCache(max_bytes=0)  # grows to the largest restore
        self._reading = ReadingSteps()  # steps restores are reading (retention spares them)
        # Unique per manager within a job: every process creates managers in the same order.
        self._ns = self.coordinator.namespace(f"fastckpt/{zlib.crc32(self.store.url.encode()):08x}")
        self._closed = False
        self._tier: Tier | None = None  # the fast tier ``options.ram`` configures
        if self.options.ram is not None:
            from fastckpt.replicas import RamReplication

            try:
                self._tier = RamReplication(
                    self.options.ram,
                    coordinator=self.coordinator,
                    store=self.store,
                    namespace=self._ns,
                    run=self._io.run,
                )
            except BaseException:  # nothing of a manager that was never made keeps running
                self._workers.shutdown(wait=True)
                with contextlib.suppress(Exception):
                    self._io.run(self.store.close())
                self._io.close()
                raise
        self._saver = Saver(
            store=self.store,
            coordinator=self.coordinator,
            options=self.options,
            io=self._io,
            workers=self._workers,
            threads=threads,
            namespace=self._ns,
            retain=self._apply_retention,
        )
        self._restorer = Restorer(
            store=self.store,
            coordinator=self.coordinator,
            options=self.options,
            io=self._io,
            workers=self._workers,
            namespace=self._ns,
            reading=self._reading,
            buffers=self._restore_buffers,
            chunk_source=chunk_source,
        )
        self.last_save_stats: SaveStats | None = None
        """This process's figures of the newest save joined here (by :meth:`wait`, :meth:`close`
        or the next :meth:`save`); None before the first. The one way to get save figures."""
        self.last_restore_stats: RestoreStats | None = None
        """This process's figures of the newest :meth:`restore` that returned; None before the
        first. The one way to get restore figures."""

    def save(
        self,
        step: int,
        state: Any,
        *,
        metadata: Mapping[str, object] | None = None,
        force: bool = False,
    ) -> bool:
        """Stage ``state`` for ``step`` and commit it in the background.

        Waits first for the previous save's background work and, for a RAM-tier step, for
        this host's push of its previous step to its peers (so that a complete RAM step
        survives any single host loss; ``SaveStats.push_wait_s``).

        Returns True if a save started, False if skipped (interval not reached, or another
        save in flight with ``if_busy="skip"``). Raises the previous save's error
        (:class:`SaveError`) if it failed, :class:`StepAlreadyCommittedError` for a step
        that is already committed, :class:`ConfigError` for unsupported leaves.
        """
        self._check_open()
        target = self._saver.target(check_step(step), force=force, tier=self._tier)
        if target is None:
            return False
        self.wait()
        self._saver.start(target, state, metadata)
        return True

    def prepare(self, state: Any) -> None:
        """Provision in the background the staging memory of the next save of states shaped
        like ``state`` (arrays, concrete or ``jax.ShapeDtypeStruct`` with their sharding; the
        values are not read): the RAM tier's segment, else a pre-faulted staging buffer, so
        that the first save blocks for the copy alone. Returns at once; best effort (a state
        it cannot size is logged, never raised); not collective. :meth:`restore` calls it when
        there is a RAM tier; otherwise call it once the state is known, before training. The
        next :meth:`save` waits for it (in ``SaveStats.blocked_s`` and ``allocate_s``)."""
        self._check_open()
        self._saver.prepare(state, self._tier)

    def wait(self) -> None:
        """Block until the in-flight save (if any) is committed; re-raise its error as SaveError."""
        stats = self._saver.join()
        if stats is not None:
            self.last_save_stats = stats

    def wait_replication(self, timeout_s: float | None = None) -> list[ReplicationReport]:
        """Block until this process's RAM-tier pushes to its peers finished, and return the
        reports of the pushes that finished since the last call, oldest first (empty without
        a RAM tier; of many unread ones, the newest are kept). A failed push is not raised
        (storage and the other replicas hold the data): its report says so (``ok`` False,
        ``errors`` per peer) and it is logged.
        ``ReplicationTimeoutError`` if pushes are still running after ``timeout_s``.
        """
        return self._tier.wait_replication(timeout_s) if self._tier is not None else []

    def persistent_steps(self) -> list[int]:
        """Steps committed to persistent storage, ascending."""
        self._check_open()
        return listing.persistent_steps(self.store, self._io.run)

    def steps_by_tier(self) -> dict[int, set[str]]:
        """Every committed step and the tiers holding its manifest: ``"storage"``, ``"ram"``
        (this host's RAM tier), ``"peer"`` (some peer's RAM tier)."""
        self._check_open()
        return listing.steps_by_tier(self.store, self._io.run, self._tier)

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
        self._check_open()
        return listing.load_manifest(self.store, self._io.run, self._tier, step)

    def metadata(self, step: int | None = None) -> dict[str, object]:
        """The user metadata saved with ``step``."""
        return dict(self.manifest(step).metadata)

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

        With a RAM tier and not ``partial``, :meth:`prepare` then runs with the restored tree
        (or ``target`` when nothing is committed); without one, call it before training.

        Raises:
            NoCheckpointError: ``step=None`` and nothing is committed in any tier (on every
                process alike: initialise instead).
            CheckpointNotFoundError, TreeStructureError, ShapeMismatchError,
            DtypeMismatchError, ChecksumMismatchError, DistributedError.
        """
        step = None if step is None else check_step(step)
        self._check_open()
        try:
            tree, self.last_restore_stats = self._restorer.restore(
                step, target, partial=partial, tier=self._tier
            )
        except NoCheckpointError:
            if self._tier is not None and target is not None and not partial:
                self.prepare(target)  # a fresh start saves states like it
            raise
        if self._tier is not None and not partial:
            self.prepare(tree)
        return tree

    def _apply_retention(self) -> None:
        self._reading.delete_unread(
            steps_to_delete(self.persistent_steps(), self.options.retention), self.delete_step
        )

    def gc(self, *, grace_s: float = 3600.0, dry_run: bool = False) -> Any:
        """Remove uncommitted leftovers older than ``grace_s`` (see ``fastckpt gc``).

        Returns the :class:`fastckpt.maintenance.GcReport`. Safe while saves run elsewhere:
        uncommitted data younger than the grace period is kept.
        """
        self._check_open()
        return self._io.run(collect_garbage_async(self.store, grace_s=grace_s, dry_run=dry_run))

    def delete_step(self, step: int) -> None:
        """Delete a committed step: the manifest first (un-commit), then its data."""
        listing.delete_step(self.store, self._io.run, step)

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
            self._saver.close()
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
