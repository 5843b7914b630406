"""Host memory helpers: page-aligned (huge-page) buffers and parallel copies.

Page-aligned buffers matter twice on the CPU backend: the first touch of fresh memory is
bounded by page faults (huge pages cut their number 512x), and ``jax.device_put`` of a
page-aligned numpy array aliases it instead of copying. Callers must therefore never write
into a buffer after handing it to ``device_put``.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Sequence
from concurrent.futures import Executor

import numpy as np

__all__ = ["alloc_aligned", "parallel_copy"]

_HUGE = 2 << 20
_COPY_PIECE = 32 << 20


def alloc_aligned(nbytes: int, *, hugepages: bool = True) -> np.ndarray:
    """A zero-filled, page-aligned uint8 array of ``nbytes`` backed by anonymous memory.

    The memory is returned to the OS when the array (and every view of it) is collected.
    """
    if nbytes == 0:
        return np.empty(0, np.uint8)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hugepages and nbytes >= _HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return np.frombuffer(m, np.uint8)


def parallel_copy(pairs: Sequence[tuple[np.ndarray, np.ndarray]], executor: Executor | None) -> None:
    """Copy each ``src`` into ``dst`` (flat uint8 views of equal size), in parallel pieces.

    numpy releases the GIL during large copies, so two threads fill memory (and take page
    faults) concurrently. Without an executor the copies run inline.
    """
    jobs: list[Callable[[], None]] = []
    for dst, src in pairs:
        n = dst.nbytes
        if n != src.nbytes:
            raise ValueError(f"copy size mismatch {dst.nbytes} != {src.nbytes}")
        for off in range(0, n, _COPY_PIECE):
            end = min(n, off + _COPY_PIECE)
            jobs.append(lambda d=dst, s=src, a=off, b=end: np.copyto(d[a:b], s[a:b]))
    if executor is None or len(jobs) < 2:
        for job in jobs:
            job()
        return
    for fut in [executor.submit(job) for job in jobs]:
        fut.result()


def as_bytes(a: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a C-contiguous array (no copy)."""
    a = np.ascontiguousarray(a)
    return a.reshape(-1).view(np.uint8) if a.ndim else a.reshape(1).view(np.uint8)
