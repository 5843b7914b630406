"""Host memory helpers: page-aligned (huge-page) buffers and parallel copies.

Page-aligned buffers matter twice on the CPU backend: the first touch of fresh memory is
bounded by page faults (huge pages cut their number 512x), and ``jax.device_put`` of a
page-aligned numpy array aliases it instead of copying. Callers must therefore never write
into a buffer after handing it to ``device_put``.
"""

from __future__ import annotations

import mmap
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import Executor

import numpy as np

from fastckpt._checksum import crc32c

__all__ = ["BufferCache", "alloc_aligned", "as_bytes", "copy_and_checksum"]

_HUGE = 2 << 20
_CRC_WINDOW = 1 << 20  # fits in L2: checksummed straight after the copy


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
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return m


class BufferCache:
    """Page-aligned host buffers whose memory is kept for reuse once the caller drops them.

    :meth:`alloc` works like :func:`alloc_aligned`; when the returned array and every view
    of it (e.g. a ``jax`` array aliasing it) are gone, its mapping goes back here instead of
    to the OS, and the next ``alloc`` of the same size reuses it with its pages already
    faulted in (fresh memory costs page faults; on VMs that return freed memory to the host,
    a lot of them). At most ``max_bytes`` are kept, the most recently freed first; :meth:`clear`
    releases them. A reused buffer is *not* zeroed. Thread-safe.
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


def copy_and_checksum(pairs: Sequence[tuple[np.ndarray, np.ndarray]], executor: Executor | None) -> list[int]:
    """Copy each ``src`` into ``dst`` (flat uint8 views of equal size); return each pair's crc32c.

    Each pair is one job (run in parallel on ``executor``; numpy and crc32c release the GIL);
    within it, a window is checksummed right after it is copied, while still in cache, so the
    checksum costs no second pass over memory. Without an executor the jobs run inline.
    """
    for dst, src in pairs:
        if dst.nbytes != src.nbytes:
            raise ValueError(f"copy size mismatch {dst.nbytes} != {src.nbytes}")

    def job(dst: np.ndarray, src: np.ndarray) -> int:
        crc = 0
        for off in range(0, dst.nbytes, _CRC_WINDOW):
            d = dst[off : off + _CRC_WINDOW]
            np.copyto(d, src[off : off + _CRC_WINDOW])
            crc = crc32c(d, crc)
        return crc

    if executor is None or len(pairs) < 2:
        return [job(d, s) for d, s in pairs]
    return [f.result() for f in [executor.submit(job, d, s) for d, s in pairs]]


def as_bytes(a: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a C-contiguous array (no copy)."""
    a = np.ascontiguousarray(a)
    return a.reshape(-1).view(np.uint8) if a.ndim else a.reshape(1).view(np.uint8)
