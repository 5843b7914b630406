"""``SaveOptions.max_inflight_bytes`` bounds the host memory a save holds beyond its staged
copy: the encoded (zstd) bytes not yet uploaded. A slow store and compressible data make
the encoder run ahead of the uploads as far as the budget lets it; Python's allocation
tracer (which numpy and zstandard allocations report to) measures the peak. Without the
budget the same save holds every encoded byte at once (32 MiB here against 4)."""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from fastckpt._tree import flatten
from fastckpt.options import SaveOptions
from fastckpt.storage import MemoryStore
from fastckpt.writer.pipeline import WriteStats, write_chunks
from fastckpt.writer.stage import stage_state
from tests.support.wrapping import ForwardingStore

MiB = 1 << 20
THREADS = 2
CHUNK = 1 * MiB
SLACK = THREADS * CHUNK + 1 * MiB
"""Beyond the budget: each encoding thread's zstd output buffer (a chunk's worth, before it
shrinks to the compressed size) and the tracer's own bookkeeping."""


class _SlowSink(ForwardingStore):
    """Takes 50 ms a put and keeps only the byte count (the store must not hold the data:
    it would count as the save's memory)."""

    def __init__(self) -> None:
        super().__init__(MemoryStore())
        self.stored = 0

    async def put(self, key: str, data: Any, *, mode: Any = "overwrite") -> None:
        await asyncio.sleep(0.05)
        parts: Sequence[Any] = data if isinstance(data, (list, tuple)) else [data]
        self.stored += sum(memoryview(p).nbytes for p in parts)


@pytest.mark.parametrize("budget_mib", [2, 4, 8])
def test_a_save_holds_at_most_max_inflight_bytes_of_encoded_data(budget_mib: int) -> None:
    rng = np.random.default_rng(0)
    state = {f"a{i}": rng.integers(0, 64, 8 * MiB, dtype=np.uint8) for i in range(4)}  # zstd: ~75%
    staged = stage_state(
        flatten(state)[0],
        process_index=0,
        max_chunk_bytes=CHUNK,
        allocate=lambda n: np.zeros(n, np.uint8),
        executor=None,
    )
    store = _SlowSink()
    options = SaveOptions(max_inflight_bytes=budget_mib * MiB, object_bytes=1 * MiB)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        with ThreadPoolExecutor(THREADS) as ex:
            asyncio.run(
                write_chunks(
                    store,
                    staged,
                    step=1,
                    save_id="s",
                    process_index=0,
                    options=options,
                    executor=ex,
                    stats=WriteStats(),
                )
            )
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert 20 * MiB < store.stored < 28 * MiB  # compressed, so the budget is what bounds memory
    assert peak <= budget_mib * MiB + SLACK, (peak / MiB, budget_mib)
