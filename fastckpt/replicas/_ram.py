"""The RAM tier's write side: raw chunk bytes of recent steps in shared-memory files on tmpfs,
one directory per process (they outlive the process, not the host; layout: ``_tier_dir``;
read side: ``_step_table.StepTable``).

Guarantees (``docs/replicas.md``, "Retention and budget"): only sealed data is visible (a
segment's index is renamed in after its data file: a process killed at any point leaves
nothing half-visible); bytes held (sealed segments, manifests, unsealed allocations, spares)
never exceed ``budget_bytes``; the newest ``keep_steps`` committed steps (with a manifest or a
commit record) are kept, one more with ``replicated=True``, and every newer step; an
allocation for step S frees spares, then whole steps older than S, oldest first.

Call sequence for a save: ``seg = allocate(step, n)`` → fill ``seg.buffer`` →
``seal(step, seg, index)`` (or ``discard(seg)``) → ``put_manifest(step, manifest)`` (or
``mark_committed(step)``).

Hazard: a budget below ``(keep_steps + 2) *`` one step's footprint (own chunks plus replicas
held for peers; ``keep_steps + 1`` without ``replicated``) makes a new save evict a committed
step before it is sealed itself.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import shutil
import threading
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

from fastckpt.errors import ConfigError, RamBudgetError, StaleStepError
from fastckpt.replicas._shm import Sealed, Segment, SparePool, close_map, create_segment_file
from fastckpt.replicas._step_table import StepState, StepTable, scan_root
from fastckpt.replicas._tier_dir import (
    COMMIT,
    DATA_SUFFIX,
    INDEX_SUFFIX,
    MANIFEST,
    ChunkLocation,
    atomic_write,
    claim_tier_dir,
    index_document,
    new_name,
    unlink,
)

__all__ = ["ChunkLocation", "RamTier", "Segment", "room_to_free"]

_MIN_RECYCLE_BYTES = 1 << 20
_MAX_SPARES = 1024


class RamTier(StepTable):
    """Per-process store of raw chunk bytes per step in shared-memory files. Thread-safe.

    Opening takes an exclusive ``flock`` on the directory (released when the process dies),
    cleans a crashed owner's leftovers and loads every sealed index; data is mapped lazily.

    Args:
        root: Tier directory (created if missing); should be on tmpfs (``/dev/shm``).
        budget_bytes, keep_steps, replicated: See the module docstring.
        recycle: Keep freed segment files as spares for new allocations of similar size.

    Raises:
        ConfigError: bad arguments, another live process owns ``root``, or ``root`` is not
            this user's alone (``_tier_dir.claim_tier_dir``).
    """

    def __init__(
        self,
        root: str | Path,
        *,
        budget_bytes: int,
        keep_steps: int = 1,
        replicated: bool = False,
        recycle: bool = True,
    ) -> None:
        if budget_bytes <= 0 or keep_steps <= 0:
            raise ConfigError(
                f"budget_bytes and keep_steps must be > 0, got {budget_bytes}, {keep_steps}"
            )
        self.root = claim_tier_dir(root)
        self.budget_bytes = budget_bytes
        self._held_steps = keep_steps + (1 if replicated else 0)
        self._recycle = recycle
        self._lock = threading.RLock()
        self._steps: dict[int, StepState] = {}
        self._spares = SparePool()
        self._reserved = 0
        self.allocated_ready = 0
        """Allocations that found a ready spare (:meth:`provision`): nothing created or faulted."""
        self._closed = False
        self._lock_fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise ConfigError(f"RAM tier {self.root} is in use by another live process") from None
        try:
            spares, self._steps = scan_root(self.root, recycle=self._recycle)
            self._spares = SparePool(spares)
            with self._lock:
                self._apply_retention()
                self._make_room(0, for_step=None)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Unmap everything and release the directory lock. Data stays on tmpfs. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for st in self._steps.values():
                for seg in st.segments.values():
                    seg.unmap()
            self._steps.clear()
            self._spares.close()
            os.close(self._lock_fd)

    def __enter__(self) -> RamTier:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def allocate(self, step: int, nbytes: int, *, reserve: bool = True) -> Segment:
        """Reserve a new writable segment of ``nbytes`` for ``step`` (invisible until sealed).

        May free spares and older steps to make room. With ``reserve=False`` a new file's
        pages are left for :meth:`Segment.reserve`, which the caller must call before
        writing; the budget is charged either way.

        Raises:
            RamBudgetError: ``nbytes`` cannot fit even after freeing older steps, or tmpfs
                has no room.
            StaleStepError: ``step`` is older than the retained committed steps.
        """
        if nbytes < 0 or step < 0:
            raise ConfigError(f"step and nbytes must be >= 0, got {step}, {nbytes}")
        with self._lock:
            self._check_fresh(step)
            spare = self._spares.pick(nbytes)
            self._make_room(
                nbytes - (self._spares.sizes[spare] if spare else 0),
                for_step=step,
                keep_spare=spare,
            )
            spare_mm = self._spares.take(spare) if spare is not None else None
            self._reserved += nbytes
        path = self.root / "tmp" / new_name()
        try:
            if spare is not None and spare_mm is not None and len(spare_mm) == nbytes:
                os.rename(spare, path)  # same size: reuse the mapping and its page tables as is
                mm: mmap.mmap | None = spare_mm
                reserve = True  # its pages are allocated already
                self.allocated_ready += 1
            else:
                close_map(spare_mm)
                mm = create_segment_file(path, nbytes, spare=spare, reserve=reserve)
        except BaseException:
            with self._lock:
                self._reserved -= nbytes
            raise
        return Segment(self, step, path, mm, nbytes, reserved=reserve)

    def provision(self, nbytes: int) -> bool:
        """Make a spare of exactly ``nbytes`` ready (reserved, mapped, pre-faulted) for the next
        :meth:`allocate` of that size, off the training thread: the closest spare within 2x is
        resized and mapped, else a new one made; nothing unless one is ready already, spares
        are off, or it would not fit the budget without freeing anything. Returns whether it
        made one ready."""
        with self._lock:
            self._check_open()
            spare = self._spares.pick(nbytes)
            if spare is not None and self._spares.ready(spare, nbytes):
                return False
            grow = nbytes - (self._spares.sizes[spare] if spare is not None else 0)
            if (
                not self._recycle
                or nbytes < _MIN_RECYCLE_BYTES
                or (spare is None and len(self._spares) >= _MAX_SPARES)
                or self._used() + grow > self.budget_bytes
            ):
                return False
            old_mm = self._spares.take(spare) if spare is not None else None
            self._reserved += nbytes
        path = self.root / "spare" / new_name()
        try:
            close_map(old_mm)
            mm = create_segment_file(path, nbytes, spare=spare)
        except BaseException as e:
            with self._lock:
                self._reserved -= nbytes
            if isinstance(e, RamBudgetError):  # tmpfs full: no spare, nothing lost
                return False
            raise
        with self._lock:  # the charge moves from reserved to the spare pool at once: always counted
            self._reserved -= nbytes
            if not self._closed:
                self._spares.add(path, nbytes, mm)
                return True
        close_map(mm)
        unlink(path)
        return False

    def seal(self, step: int, seg: Segment, index: Mapping[str, ChunkLocation]) -> None:
        """Make ``seg``'s chunks visible under ``step`` (data file moved in, index written
        last); a chunk id already in the step is replaced. Retention runs afterwards (and
        drops ``step`` itself if it is already stale).

        Args:
            step: Must equal ``seg.step``.
            seg: An open segment from :meth:`allocate`.
            index: chunk id → location in the segment; locations must lie inside it.

        Raises:
            ConfigError: bad index or segment state.
        """
        if seg.state != "open" or seg._tier is not self or seg.step != step:
            raise ConfigError(
                f"cannot seal a {seg.state} segment of step {seg.step} as step {step}"
            )
        if not seg.reserved:
            raise ConfigError(
                f"segment of step {step} was never reserved (Segment.reserve before writing)"
            )
        for cid, loc in index.items():
            if not isinstance(cid, str) or not cid:
                raise ConfigError(f"chunk ids must be non-empty str, got {cid!r}")
            if loc.offset < 0 or loc.length < 0 or loc.offset + loc.length > seg.nbytes:
                raise ConfigError(
                    f"chunk {cid!r} at {loc} lies outside the {seg.nbytes}-byte segment"
                )
        with self._lock:
            self._check_open()
            d = self.root / f"step-{step}"
            d.mkdir(exist_ok=True, mode=0o700)
            name = new_name()
            data_path, index_path = d / name, d / (name[: -len(DATA_SUFFIX)] + INDEX_SUFFIX)
            os.rename(seg._path, data_path)
            try:
                atomic_write(index_path, index_document(step, name, seg.nbytes, dict(index)))
            except BaseException:  # not sealed: the segment stays open (discard frees it)
                unlink(index_path)
                os.rename(data_path, seg._path)
                raise
            sealed = Sealed(data_path, index_path, seg.nbytes, seg._mm)
            st = self._steps.setdefault(step, StepState())
            st.segments[name] = sealed
            st.chunks.update({cid: (sealed, loc) for cid, loc in index.items()})
            self._reserved -= seg.nbytes
            seg.state, seg._buffer, seg._mm = "sealed", None, None
            self._apply_retention()

    def discard(self, seg: Segment) -> None:
        """Abandon an open segment: its file and reservation are freed. No-op unless open."""
        with self._lock:
            if seg.state != "open" or seg._tier is not self:
                return
            seg.state, seg._buffer = "discarded", None
            self._reserved -= seg.nbytes
            mm, seg._mm = seg._mm, None
        close_map(mm)
        unlink(seg._path)

    def put_manifest(self, step: int, data: bytes | memoryview) -> None:
        """Store the global manifest of ``step`` (atomic), which marks it committed; retention
        runs afterwards."""
        self._commit(step, MANIFEST, bytes(data))

    def mark_committed(self, step: int) -> None:
        """Mark ``step`` committed without its manifest (atomic; retention as
        :meth:`put_manifest`): a multi-host step whose manifest other hosts hold.
        :meth:`get_manifest` stays None unless the manifest arrives later."""
        self._commit(step, COMMIT, b'{"committed": true}')

    def _commit(self, step: int, name: str, data: bytes) -> None:
        with self._lock:
            self._check_fresh(step)
            st = self._steps.get(step)
            is_manifest = name == MANIFEST
            if st is not None and st.committed and not is_manifest:
                return  # committed already (a manifest, or the record, is there)
            old = (st.manifest_bytes or 0) if st else 0
            self._make_room((len(data) - old) if is_manifest else 0, for_step=step)
            d = self.root / f"step-{step}"
            d.mkdir(exist_ok=True, mode=0o700)
            atomic_write(d / name, data)
            st = self._steps.setdefault(step, StepState())
            st.committed = True
            if is_manifest:
                st.manifest_bytes = len(data)
                unlink(d / COMMIT)  # the manifest marks it now
            self._apply_retention()

    def drop_step(self, step: int) -> None:
        """Remove a step (indexes first, so it turns invisible before data goes). No-op if absent.
        Views returned earlier by :meth:`get_chunk` stay valid until collected."""
        self._drop(step, recycle=self._recycle)

    def _drop(self, step: int, *, recycle: bool) -> None:
        with self._lock:
            st = self._steps.pop(step, None)
            if st is None:
                return
            for seg in st.segments.values():
                unlink(seg.index_path)
            unlink(self.root / f"step-{step}" / MANIFEST)
            unlink(self.root / f"step-{step}" / COMMIT)
            for seg in st.segments.values():
                keep = (
                    recycle and seg.nbytes >= _MIN_RECYCLE_BYTES and len(self._spares) < _MAX_SPARES
                )
                mm = seg.detach_writable() if keep else None
                unmapped = seg.unmap()
                if keep and unmapped and not seg.is_lent():
                    spare = self.root / "spare" / new_name()
                    os.rename(seg.path, spare)
                    self._spares.add(spare, seg.nbytes, mm)
                else:
                    close_map(mm)
                    unlink(seg.path)
            shutil.rmtree(self.root / f"step-{step}", ignore_errors=True)

    def nbytes(self) -> int:
        """Bytes held: sealed segments, manifests, unsealed allocations and spares."""
        with self._lock:
            return self._used()

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError(f"RAM tier {self.root} is closed")

    def _check_fresh(self, step: int) -> None:
        """Raise unless the tier is open and ``step`` is not older than the retention floor."""
        self._check_open()
        floor = self._retention_floor()
        if floor is not None and step < floor:
            raise StaleStepError(f"step {step} is older than the retained committed step {floor}")

    def _used(self) -> int:
        return sum(st.nbytes for st in self._steps.values()) + self._reserved + self._spares.nbytes

    def _retention_floor(self) -> int | None:
        committed = sorted(s for s, st in self._steps.items() if st.committed)
        return committed[-self._held_steps] if len(committed) >= self._held_steps else None

    def _apply_retention(self) -> None:
        floor = self._retention_floor()
        if floor is not None:
            for s in [s for s in self._steps if s < floor]:
                self._drop(s, recycle=self._recycle)

    def _make_room(
        self, extra: int, *, for_step: int | None, keep_spare: Path | None = None
    ) -> None:
        """Free spares, then steps older than ``for_step``, until ``extra`` more bytes fit
        (:func:`room_to_free`; raises ``RamBudgetError`` if they cannot)."""
        spares, steps = room_to_free(
            used=self._used(),
            extra=extra,
            budget=self.budget_bytes,
            spares=self._spares.sizes,
            steps={s: st.nbytes for s, st in self._steps.items()},
            for_step=for_step,
            keep_spare=keep_spare,
        )
        for p in spares:
            self._spares.free(p)
        for s in steps:
            self._drop(s, recycle=False)  # freed for room: not kept as a spare


def room_to_free(
    *,
    used: int,
    extra: int,
    budget: int,
    spares: Mapping[Path, int],
    steps: Mapping[int, int],
    for_step: int | None,
    keep_spare: Path | None = None,
) -> tuple[list[Path], list[int]]:
    """What a tier holding ``used`` bytes of ``budget`` frees so that ``extra`` more fit:
    spares (all but ``keep_spare``, in the pool's order) first, then whole steps older than
    ``for_step`` (any step when None), oldest first, stopping as soon as they fit. Pure.

    Raises:
        RamBudgetError: freeing all of them would not be enough (nothing is to be freed then).
    """
    spare_paths = [p for p in spares if p != keep_spare]
    older = sorted(s for s in steps if for_step is None or s < for_step)
    freeable = sum(spares[p] for p in spare_paths) + sum(steps[s] for s in older)
    if used + extra - freeable > budget:
        raise RamBudgetError(
            f"{extra} more bytes do not fit the RAM tier budget of {budget} "
            f"({used} held, {freeable} freeable)"
        )
    free_spares: list[Path] = []
    free_steps: list[int] = []
    for p in spare_paths:
        if used + extra <= budget:
            break
        free_spares.append(p)
        used -= spares[p]
    for s in older:
        if used + extra <= budget:
            break
        free_steps.append(s)
        used -= steps[s]
    return free_spares, free_steps
