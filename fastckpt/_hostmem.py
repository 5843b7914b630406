"""Host memory helpers: page-aligned (huge-page) buffers and parallel copies.

Page-aligned buffers matter twice on the CPU backend: the first touch of fresh memory is
bounded by page faults (huge pages cut their number 512x), and ``jax.device_put`` of a
page-aligned numpy array aliases it instead of copying. Callers must therefore never write
into a buffer after handing it to ``device_put``.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from concurrent.futures import Executor

import numpy as np

from fastckpt._checksum import crc32c

__all__ = ["alloc_aligned", "as_bytes", "copy_and_checksum"]

_HUGE = 2 << 20
_CRC_WINDOW = 1 << 20  # fits in L2: checksummed straight after the copy


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
