"""Shared-memory segment files and their mappings behind :class:`~fastckpt.replicas._ram.RamTier`
(internal).

A :class:`Segment` is written through a writable mapping until sealed; a :class:`Sealed`
segment is read through a lazily created read-only one, lent out or detached for reuse; a
:class:`SparePool` keeps freed files (and mappings) for the next allocation. Nothing here
takes the tier's lock (callers do); a sealed segment guards its mapping with its own.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Protocol

import numpy as np

from fastckpt.errors import ConfigError, RamBudgetError
from fastckpt.replicas._tier_dir import unlink

__all__ = ["Sealed", "Segment", "SparePool", "close_map", "create_segment_file"]

_log = logging.getLogger(__name__)


def close_map(mm: mmap.mmap | None) -> None:
    """Close ``mm`` unless views of it are still exported (then the GC closes it later)."""
    if mm is not None:
        with contextlib.suppress(BufferError):
            mm.close()


class _Discarding(Protocol):
    def discard(self, seg: Segment) -> None: ...


class Segment:
    """A writable region of the tier, invisible until sealed. Returned by
    :meth:`~fastckpt.replicas._ram.RamTier.allocate`.

    Use as a context manager to discard it if the block raises before
    :meth:`~fastckpt.replicas._ram.RamTier.seal`.
    """

    def __init__(
        self,
        tier: _Discarding,
        step: int,
        path: Path,
        mm: mmap.mmap | None,
        nbytes: int,
        *,
        reserved: bool,
    ) -> None:
        self._tier = tier
        self.step = step
        self.nbytes = nbytes
        self.reserved = reserved
        """Whether its pages are reserved (see :meth:`reserve`)."""
        self._path = path
        self._mm = mm
        self._buffer: np.ndarray | None = (
            np.frombuffer(mm, np.uint8) if mm is not None else np.empty(0, np.uint8)
        )
        self.state = "open"
        """``"open"``, ``"sealed"`` or ``"discarded"``."""

    @property
    def buffer(self) -> np.ndarray:
        """The writable uint8 array over the whole segment (shared memory; pre-faulted once
        reserved: a segment allocated with ``reserve=False`` must get :meth:`reserve` first)."""
        if self._buffer is None:
            raise ConfigError(f"segment is {self.state}; its buffer is no longer writable")
        return self._buffer

    def reserve(self) -> None:
        """Reserve the pages of a segment allocated with ``reserve=False``; call it before the
        first write (a full tmpfs then fails here, not with SIGBUS on that write). Idempotent.

        Raises:
            RamBudgetError: tmpfs has no room.
        """
        if not self.reserved:
            fd = os.open(self._path, os.O_RDWR)
            try:
                reserve_pages(fd, self.nbytes, self._path)
            finally:
                os.close(fd)
            if self._mm is not None:
                populate_writable(self._mm)
            self.reserved = True

    def __enter__(self) -> Segment:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.state == "open":
            self._tier.discard(self)


class Sealed:
    """A sealed segment file and its lazily created read mapping."""

    def __init__(
        self, path: Path, index_path: Path, nbytes: int, mm: mmap.mmap | None = None
    ) -> None:
        self.path = path
        self.index_path = index_path
        self.nbytes = nbytes
        self.mm = mm
        self.view: memoryview | None = memoryview(mm).toreadonly() if mm is not None else None
        self.dropped = False
        self.lent = False
        self.writable = mm is not None
        """``mm`` is the writable mapping the segment was filled through (reusable)."""
        self.lock = threading.Lock()

    def slice(self, offset: int, length: int) -> memoryview | None:
        """A read-only view of ``[offset, offset + length)``; None once the segment is dropped."""
        with self.lock:
            view = self._view()
            return None if view is None else view[offset : offset + length]

    def lend(self, spans: Sequence[tuple[int, int]]) -> list[memoryview] | None:
        """Read-only views of ``(offset, length)`` spans that may live indefinitely (the file is
        marked lent: never rewritten), under one lock acquisition; None once dropped."""
        with self.lock:
            view = self._view()
            if view is None:
                return None
            if not self.lent:  # the mark is the file's mode: a tier reopened here sees it too
                self.lent = True
                with contextlib.suppress(OSError):
                    os.chmod(self.path, 0o400)
            return [view[o : o + n] for o, n in spans]

    def _view(self) -> memoryview | None:
        """The whole segment's read view, mapped on first use; None once dropped (hold ``lock``)."""
        if self.dropped:
            return None
        if self.view is None:
            if self.nbytes == 0:
                self.view = memoryview(b"")
            else:
                flags = mmap.MAP_SHARED | mmap.MAP_POPULATE
                try:
                    fd = os.open(self.path, os.O_RDONLY)
                    try:
                        if (size := os.fstat(fd).st_size) != self.nbytes:
                            raise ValueError(f"{size} bytes, its index says {self.nbytes}")
                        self.mm = mmap.mmap(fd, self.nbytes, flags=flags, prot=mmap.PROT_READ)
                    finally:
                        os.close(fd)
                except (OSError, ValueError) as e:  # deleted or truncated behind the tier's back
                    _log.warning(
                        "fastckpt: RAM segment %s is unreadable (%s); its chunks are no longer "
                        "served",
                        self.path,
                        e,
                    )
                    self.dropped = True
                    return None
                self.view = memoryview(self.mm)
        return self.view

    def is_lent(self) -> bool:
        """Whether the file was lent (by this object, or by an earlier tier over the same file)."""
        if self.lent:
            return True
        try:
            return not os.stat(self.path).st_mode & 0o200
        except OSError:
            return True  # cannot tell: do not reuse it

    def detach_writable(self) -> mmap.mmap | None:
        """Take the writable mapping away for reuse, if no view of it is alive; else None.
        On success the segment counts as dropped and the caller owns the mapping."""
        with self.lock:
            if not self.writable or self.mm is None or self.lent or not self._release_view():
                return None
            try:  # a no-op resize fails while any buffer exported from the mapping is alive
                self.mm.resize(len(self.mm))
            except (BufferError, OSError, ValueError, SystemError):
                return None
            mm, self.mm = self.mm, None
            self.dropped = True
            return mm

    def unmap(self) -> bool:
        """Drop the segment and release its mapping; False if views handed out are still alive
        (they keep it)."""
        with self.lock:
            self.dropped = True
            if not self._release_view():  # someone exported our base view itself: keep all
                return False
            mm, self.mm = self.mm, None
            if mm is None:
                return True
            try:
                mm.close()
            except BufferError:
                return False  # exported views keep the mapping alive until collected
            return True

    def _release_view(self) -> bool:
        """Release the base view (hold ``lock``); False while it is exported."""
        if self.view is not None:
            try:
                self.view.release()
            except BufferError:
                return False
            self.view = None
        return True


class SparePool:
    """Freed segment files kept for reuse (their pages stay allocated), with the writable
    mapping of each when it was kept. Not thread-safe: the tier's lock guards it."""

    def __init__(self, files: dict[Path, int] | None = None) -> None:
        self.sizes: dict[Path, int] = dict(files or {})
        """Spare file -> its bytes."""
        self._maps: dict[Path, mmap.mmap] = {}

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def nbytes(self) -> int:
        return sum(self.sizes.values())

    def pick(self, nbytes: int) -> Path | None:
        """The spare closest in size to ``nbytes`` within a factor of 2, of those equally close
        one whose mapping is kept (None if there is none)."""
        fits = [
            (abs(size - nbytes), p not in self._maps, p)
            for p, size in self.sizes.items()
            if nbytes <= 2 * size and size <= 2 * nbytes
        ]
        return min(fits)[2] if fits and nbytes else None

    def ready(self, path: Path, nbytes: int) -> bool:
        """Whether spare ``path`` is of ``nbytes`` and its writable mapping is kept."""
        mm = self._maps.get(path)
        return self.sizes.get(path) == nbytes and mm is not None and len(mm) == nbytes

    def take(self, path: Path) -> mmap.mmap | None:
        """Remove ``path`` from the pool (the caller reuses the file); its kept mapping, if any."""
        del self.sizes[path]
        return self._maps.pop(path, None)

    def add(self, path: Path, nbytes: int, mm: mmap.mmap | None) -> None:
        self.sizes[path] = nbytes
        if mm is not None:
            self._maps[path] = mm

    def free(self, path: Path) -> None:
        """Delete a spare file and its mapping."""
        unlink(path)
        close_map(self.take(path))

    def close(self) -> None:
        """Unmap the kept mappings (the files stay for a tier reopened over the directory)."""
        for mm in self._maps.values():
            close_map(mm)
        self._maps.clear()


_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14


def populate_writable(mm: mmap.mmap) -> bool:
    """Pre-fault a writable shared mapping (``MADV_POPULATE_WRITE``) so that filling it runs at
    memcpy speed (no page faults during the copy); False (nothing done) where the kernel
    lacks it."""
    try:
        mm.madvise(_MADV_POPULATE_WRITE)
    except (OSError, ValueError):
        return False
    return True


def reserve_pages(fd: int, nbytes: int, path: Path) -> None:
    """Allocate the tmpfs pages of an open file now, so that a full tmpfs fails here
    (RamBudgetError) instead of with SIGBUS on a write through a mapping."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise RamBudgetError(
                f"no room on {path.parent.parent} for {nbytes} bytes (tmpfs full)"
            ) from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise


def create_segment_file(
    path: Path, nbytes: int, *, spare: Path | None, reserve: bool = True
) -> mmap.mmap | None:
    """Create (or take over ``spare``) ``path`` of ``nbytes``, reserve its pages, map it writable.

    With ``reserve=False`` the pages are neither reserved nor pre-faulted: the caller must
    :func:`reserve_pages` (through :meth:`Segment.reserve`) before writing.

    Raises:
        RamBudgetError: tmpfs has no room for ``nbytes``.
    """
    if spare is not None:
        os.rename(spare, path)
        fd = os.open(path, os.O_RDWR)
    else:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)  # shrinks a larger spare (frees its tail)
        if nbytes == 0:
            return None
        if reserve:
            reserve_pages(fd, nbytes, path)
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=prot)
        if reserve and not populate_writable(mm):  # older kernels: MAP_POPULATE
            mm.close()
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=prot)
        return mm
    except BaseException:
        unlink(path)
        raise
    finally:
        os.close(fd)
