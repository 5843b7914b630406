"""The background write (``writer.pipeline.write_chunks``): small chunks reach the encoder
threads in batches, and every chunk is stored exactly, in order, whatever the batching."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import zstandard

from fastckpt._checksum import crc32c
from fastckpt._tree import flatten
from fastckpt.options import SaveOptions
from fastckpt.storage import MemoryStore
from fastckpt.writer.merge import merge_chunks
from fastckpt.writer.pipeline import WriteStats, write_chunks
from fastckpt.writer.stage import stage_state


class _CountingExecutor(ThreadPoolExecutor):
    def __init__(self) -> None:
        super().__init__(max_workers=2)
        self.jobs = 0

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        self.jobs += 1
        return super().submit(fn, *args, **kwargs)


def _staged(arrays: int, nbytes: int, max_chunk_bytes: int) -> Any:
    rng = np.random.default_rng(7)
    state = {
        f"a{i}": (
            rng.integers(0, 4, nbytes, dtype=np.uint8)
            if i % 2
            else rng.integers(0, 256, nbytes, dtype=np.uint8)
        )
        for i in range(arrays)
    }  # even leaves incompressible (stored raw), odd ones zstd
    return stage_state(
        flatten(state)[0],
        process_index=0,
        max_chunk_bytes=max_chunk_bytes,
        allocate=lambda n: np.zeros(n, np.uint8),
        executor=None,
    )


@pytest.mark.parametrize(("inflight", "jobs"), [(96 << 20, 3), (64 << 10, 75)])
def test_small_chunks_are_encoded_in_batches_and_stored_exactly(inflight: int, jobs: int) -> None:
    staged = _staged(arrays=10, nbytes=60 << 10, max_chunk_bytes=1 << 10)  # 600 chunks of 1 KiB
    store, stats = MemoryStore(), WriteStats()
    options = SaveOptions(compression="zstd", max_inflight_bytes=inflight, object_bytes=128 << 10)
    with _CountingExecutor() as ex:
        chunks = asyncio.run(
            write_chunks(
                store,
                staged,
                step=1,
                save_id="s",
                process_index=0,
                options=options,
                executor=ex,
                stats=stats,
            )
        )
        # 256 chunks a job by default (3 jobs for 600); under a 64 KiB budget 8 KiB a job (75)
        assert ex.jobs == jobs
    tables = merge_chunks([chunks], staged)  # what the commit makes of them (C order)
    assert stats.raw_bytes == 600 << 10 and stats.objects == len(chunks.objects)
    codecs = set()
    for arr in staged.arrays:
        assert [c.box for c in tables[arr.path]] == [
            it.box for it in arr.items
        ]  # every chunk, once
        for i, c in enumerate(tables[arr.path]):
            stored = bytearray(c.length)
            asyncio.run(store.get_into(c.key, c.offset, [memoryview(stored)]))
            assert crc32c(stored) == c.crc32c
            raw = (
                zstandard.ZstdDecompressor().decompress(bytes(stored), max_output_size=c.raw_length)
                if c.codec == "zstd"
                else bytes(stored)
            )
            assert raw == bytes(staged.chunk_view(arr, i)) and crc32c(raw) == c.raw_crc32c
            codecs.add(c.codec)
    assert codecs == {"raw", "zstd"}
