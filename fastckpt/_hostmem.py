"""Host memory helpers: page-aligned (huge-page) buffers and parallel copies.

``jax.device_put`` of a page-aligned numpy array on the CPU backend aliases it instead of
copying: callers must never write into a buffer after handing it to ``device_put``.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import TypeVar

import numpy as np

from fastckpt._checksum import crc32c

_T = TypeVar("_T")

__all__ = [
    "BufferCache",
    "StagingPool",
    "aligned_offsets",
    "alloc_aligned",
    "as_bytes",
    "balanced_groups",
    "carve",
    "parallel_copy",
    "parallel_copy_crc32c",
    "parallel_crc32c",
    "slab_bytes",
]

_HUGE = 2 << 20
_SLAB_ALIGN = 64


def alloc_aligned(nbytes: int, *, hugepages: bool = True) -> np.ndarray:
    """A zero-filled, page-aligned uint8 array of ``nbytes`` backed by anonymous memory.

    The memory is returned to the OS when the array (and every view of it) is collected.
    """
    if nbytes == 0:
        return np.empty(0, np.uint8)
    return np.frombuffer(_mapping(nbytes, hugepages), np.uint8)


def _mapping(nbytes: int, hugepages: bool = True) -> mmap.mmap:
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hugepages and nbytes >= _HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            m.madvise(mmap.MADV_HUGEPAGE)
    return m


def aligned_offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of buffers of ``sizes`` laid back to back in one, each start 64-byte aligned
    (enough for ``jax.device_put`` on the CPU backend to alias a view instead of copying
    it), and the total bytes that layout takes."""
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // _SLAB_ALIGN) * _SLAB_ALIGN
    return offsets, total


def slab_bytes(sizes: Sequence[int]) -> int:
    """Bytes of one buffer holding ``sizes`` as :func:`aligned_offsets` lays them out."""
    return aligned_offsets(sizes)[1]


def carve(slab: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
    """Views of ``slab`` (at least :func:`slab_bytes` of ``sizes``), one per size, at the
    :func:`aligned_offsets` (64-byte aligned when ``slab`` is)."""
    return [slab[off : off + n] for off, n in zip(aligned_offsets(sizes)[0], sizes)]


class BufferCache:
    """Page-aligned host buffers whose memory is kept for reuse once the caller drops them.

    :meth:`alloc` works like :func:`alloc_aligned`; when the returned array and every view
    of it (e.g. a ``jax`` array aliasing it) are gone, its mapping comes back here, and the
    next ``alloc`` of the same size reuses it with its pages faulted in. At most
    ``max_bytes`` are kept, the most recently freed; :meth:`clear` releases them. A reused
    buffer is *not* zeroed. Thread-safe.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._free: list[mmap.mmap] = []  # oldest first
        self._held = 0
        self.reused = 0
        """Allocations served from kept memory (for tests and stats)."""

    def alloc(self, nbytes: int) -> np.ndarray:
        if nbytes == 0:
            return np.empty(0, np.uint8)
        m = None
        with self._lock:
            for i in range(len(self._free) - 1, -1, -1):  # newest first
                if len(self._free[i]) == nbytes:
                    m = self._free.pop(i)
                    self._held -= nbytes
                    self.reused += 1
                    break
        if m is None:
            m = _mapping(nbytes)
        arr = np.frombuffer(m, np.uint8)
        weakref.finalize(arr, self._give_back, m)
        return arr

    def _give_back(self, m: mmap.mmap) -> None:
        # Runs when the array is collected; its export of ``m`` may still be live, so ``m``
        # is never closed here: dropping the last reference unmaps it.
        with self._lock:
            if len(m) > self.max_bytes:
                return
            self._free.append(m)
            self._held += len(m)
            while self._held > self.max_bytes:  # keep the most recently freed buffers
                self._held -= len(self._free.pop(0))

    def held_bytes(self) -> int:
        """Bytes kept for reuse right now."""
        with self._lock:
            return self._held

    def clear(self) -> None:
        """Release every kept mapping (buffers in use are unaffected)."""
        with self._lock:
            self._free.clear()
            self._held = 0


def balanced_groups(sizes: Sequence[int], groups: int) -> list[list[int]]:
    """Indices of ``sizes`` split into at most ``groups`` lists of similar total size
    (greedy: largest first onto the lightest group); each list in ascending index order."""
    loads = [0] * max(1, groups)
    out: list[list[int]] = [[] for _ in loads]
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        g = loads.index(min(loads))
        loads[g] += sizes[i]
        out[g].append(i)
    return [sorted(g) for g in out if g]


def _run_grouped(
    sizes: Sequence[int], job: Callable[[int], _T], executor: Executor | None, jobs: int
) -> list[_T]:
    """``[job(i) for i in range(len(sizes))]``, run as at most ``jobs`` tasks of similar size
    on ``executor`` (one task per thread, not one per item)."""
    if executor is None or jobs < 2 or len(sizes) < 2:
        return [job(i) for i in range(len(sizes))]
    out: list[_T | None] = [None] * len(sizes)

    def run(group: list[int]) -> None:
        for i in group:
            out[i] = job(i)

    for f in [executor.submit(run, g) for g in balanced_groups(sizes, jobs)]:
        f.result()
    return out  # type: ignore[return-value]


def parallel_copy(
    pairs: Sequence[tuple[np.ndarray, np.ndarray]], executor: Executor | None, *, jobs: int
) -> None:
    """Copy each ``src`` into ``dst`` (flat uint8 views of equal size), in ``jobs`` parallel
    tasks of similar byte counts on ``executor`` (numpy releases the GIL while copying)."""
    _check_sizes(pairs)
    _run_grouped(
        [d.nbytes for d, _ in pairs], lambda i: np.copyto(pairs[i][0], pairs[i][1]), executor, jobs
    )


def _check_sizes(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    for dst, src in pairs:
        if dst.nbytes != src.nbytes:
            raise ValueError(f"copy size mismatch {dst.nbytes} != {src.nbytes}")


_COPY_CRC_BLOCK = 1 << 20


def parallel_copy_crc32c(
    pairs: Sequence[tuple[np.ndarray, np.ndarray]], executor: Executor | None, *, jobs: int
) -> list[int]:
    """:func:`parallel_copy`, and the crc32c of each ``dst``'s bytes after the copy (copied
    and checksummed block by block, while the block is in cache)."""
    _check_sizes(pairs)

    def job(i: int) -> int:
        dst, src = pairs[i]
        crc = 0
        for off in range(0, dst.nbytes, _COPY_CRC_BLOCK):
            d = dst[off : off + _COPY_CRC_BLOCK]
            np.copyto(d, src[off : off + _COPY_CRC_BLOCK])
            crc = crc32c(d, crc)
        return crc

    return _run_grouped([d.nbytes for d, _ in pairs], job, executor, jobs)


def parallel_crc32c(
    views: Sequence[np.ndarray | memoryview], executor: Executor | None, *, jobs: int
) -> list[int]:
    """crc32c of each buffer, in ``jobs`` parallel tasks of similar byte counts (GIL released)."""
    return _run_grouped([v.nbytes for v in views], lambda i: crc32c(views[i]), executor, jobs)


def as_bytes(a: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a C-contiguous array (no copy)."""
    a = np.ascontiguousarray(a)
    return a.reshape(-1).view(np.uint8) if a.ndim else a.reshape(1).view(np.uint8)


class StagingPool:
    """Keeps the last staging buffer for reuse (saves after the first skip page faults).

    ``take`` hands out a page-aligned buffer of at least ``nbytes`` (the kept one if it fits
    and is not more than about twice too big); ``give`` returns it once no longer used.
    Buffers are of base pages (a transparent huge page's first touch can cost far more on a
    VM, and provisioning does that touch)."""

    def __init__(self) -> None:
        self._free: np.ndarray | None = None
        self.reused = 0
        """Takes served by the kept buffer (given back, or provisioned)."""

    def take(self, nbytes: int) -> np.ndarray:
        buf, self._free = self._free, None
        if buf is None or buf.nbytes < nbytes or buf.nbytes > 2 * nbytes + (64 << 20):
            buf = alloc_aligned(nbytes, hugepages=False)
        else:
            self.reused += 1
        return buf[:nbytes]

    def give(self, buf: np.ndarray) -> None:
        base = buf.base if isinstance(buf.base, np.ndarray) else buf
        self._free = base

    def provision(self, nbytes: int) -> bool:
        """Keep a buffer of ``nbytes`` ready for the next :meth:`take` of that size, its pages
        faulted in now, unless a kept one fits; whether it made one. For a background thread,
        never concurrently with ``take``."""
        free = self._free
        if nbytes == 0 or (free is not None and nbytes <= free.nbytes <= 2 * nbytes + (64 << 20)):
            return False
        buf = alloc_aligned(nbytes, hugepages=False)
        buf[:: mmap.PAGESIZE] = 0  # one write per page faults it in
        self._free = buf
        return True
