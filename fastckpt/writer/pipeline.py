"""The background half of a save: encode (zstd + crc32c) and upload, under a memory bound.

:func:`write_chunks` runs on the fastckpt event loop after staging. Encoding runs on a
thread pool (small chunks in batches of about 1 MiB); encoded chunks are packed into objects
of about ``object_bytes`` and uploaded with bounded concurrency. Host memory beyond the
staged copy is bounded by ``max_inflight_bytes``: a chunk's budget is taken before it is
encoded and returned once its object is uploaded. Chunks that save less than
``SaveOptions.min_compression_gain`` (big ones judged by a 1 MiB trial) are stored raw,
straight from the staging buffer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from concurrent.futures import Executor

import zstandard

from fastckpt._aio import ByteBudget
from fastckpt._checksum import crc32c
from fastckpt.format.layout import data_key
from fastckpt.format.manifest import Codec
from fastckpt.options import SaveOptions
from fastckpt.storage import Store
from fastckpt.writer.fragment import ChunkRows, ProcessChunks
from fastckpt.writer.stage import StagedSave

__all__ = ["EncodedChunk", "WriteStats", "write_chunks"]

_TRIAL_BYTES = 1 << 20
_BATCH_BYTES = 1 << 20
"""Chunks are handed to the encoder threads in batches of about this many bytes..."""
_BATCH_CHUNKS = 256
"""...or of at most this many chunks."""


@dataclasses.dataclass(frozen=True, slots=True)
class EncodedChunk:
    """One chunk ready to be packed: stored bytes plus checksums."""

    array_index: int
    item_index: int
    stored: memoryview
    codec: Codec
    crc32c: int
    raw_crc32c: int
    raw_length: int


@dataclasses.dataclass
class WriteStats:
    """What the background write did (per process)."""

    raw_bytes: int = 0
    stored_bytes: int = 0
    objects: int = 0
    encode_s: float = 0.0
    upload_s: float = 0.0


class _Encoder:
    """Thread-safe encoder: one zstd compressor per thread."""

    def __init__(self, options: SaveOptions) -> None:
        self._options = options
        self._local = threading.local()

    def __call__(
        self, array_index: int, item_index: int, raw: memoryview, raw_crc: int | None = None
    ) -> EncodedChunk:
        if raw_crc is None:
            raw_crc = crc32c(raw)
        as_raw = EncodedChunk(array_index, item_index, raw, "raw", raw_crc, raw_crc, raw.nbytes)
        if self._options.compression != "zstd" or raw.nbytes == 0:
            return as_raw
        cctx = getattr(self._local, "cctx", None)
        if cctx is None:
            cctx = self._local.cctx = zstandard.ZstdCompressor(level=self._options.zstd_level)
        keep = 1.0 - self._options.min_compression_gain
        trial = raw.nbytes > 4 * _TRIAL_BYTES
        if trial and len(cctx.compress(raw[:_TRIAL_BYTES])) > keep * _TRIAL_BYTES:
            return as_raw
        packed = cctx.compress(raw)
        if len(packed) > keep * raw.nbytes:
            return as_raw
        return EncodedChunk(
            array_index, item_index, memoryview(packed), "zstd", crc32c(packed), raw_crc, raw.nbytes
        )


async def write_chunks(
    store: Store,
    staged: StagedSave,
    *,
    step: int,
    save_id: str,
    process_index: int,
    options: SaveOptions,
    executor: Executor,
    stats: WriteStats,
    raw_crcs: dict[int, list[int]] | None = None,
) -> ProcessChunks:
    """Encode and upload every staged chunk; return them (in no particular order).

    Guarantees: on return every listed chunk is durably stored (each object's ``put``
    completed). On error, nothing is committed; already-uploaded objects are unreferenced
    garbage for ``gc``. ``raw_crcs`` (from ``staged_crc32c``) skips recomputing them.
    """
    loop = asyncio.get_running_loop()
    encoder = _Encoder(options)
    budget = ByteBudget(options.max_inflight_bytes)
    upload_slots = asyncio.Semaphore(options.upload_concurrency)
    target = max(1, min(options.object_bytes, options.max_inflight_bytes // 2))
    batch_bytes = max(1, min(_BATCH_BYTES, options.max_inflight_bytes // 8))
    result = ChunkRows()
    queue: asyncio.Queue[tuple[asyncio.Future[list[EncodedChunk]], int] | None] = asyncio.Queue(
        maxsize=max(2, options.encode_threads * 2)
    )
    uploads: set[asyncio.Task[None]] = set()
    failed: list[BaseException] = []
    n_objects = 0

    def upload_done(task: asyncio.Task[None]) -> None:
        # Finished tasks leave ``uploads``: keep a failure, or it would never be raised.
        uploads.discard(task)
        if not task.cancelled() and task.exception() is not None:
            failed.append(task.exception())  # type: ignore[arg-type]

    def encode_batch(batch: list[tuple[int, int, memoryview, int | None]]) -> list[EncodedChunk]:
        return [encoder(ai, ii, raw, known) for ai, ii, raw, known in batch]

    async def submit(batch: list[tuple[int, int, memoryview, int | None]], nbytes: int) -> None:
        charged = await budget.acquire(nbytes)
        await queue.put((loop.run_in_executor(executor, encode_batch, batch), charged))

    async def produce() -> None:
        batch: list[tuple[int, int, memoryview, int | None]] = []
        nbytes = 0
        for ai, ii, raw in staged.chunk_views():
            batch.append((ai, ii, raw, raw_crcs[ai][ii] if raw_crcs is not None else None))
            nbytes += raw.nbytes
            if nbytes >= batch_bytes or len(batch) >= _BATCH_CHUNKS:
                await submit(batch, nbytes)
                batch, nbytes = [], 0
        if batch:
            await submit(batch, nbytes)
        await queue.put(None)

    async def upload(
        key: str, parts: list[memoryview], charged: int, rows: list[tuple[int, EncodedChunk]]
    ) -> None:
        try:
            async with upload_slots:
                t0 = loop.time()
                await store.put(key, parts, mode="overwrite")
                stats.upload_s += loop.time() - t0
            for offset, c in rows:  # (offset in the object, chunk)
                box = staged.arrays[c.array_index].items[c.item_index].box
                nbytes = c.stored.nbytes
                result.add(c.array_index, box, key, offset, nbytes, c.codec, c.crc32c, c.raw_crc32c)
            stats.objects += 1
        finally:
            await budget.release(charged)

    async def consume() -> None:
        parts: list[memoryview] = []
        rows: list[tuple[int, EncodedChunk]] = []
        size = charged_total = 0

        def flush() -> None:
            nonlocal parts, rows, size, charged_total, n_objects
            if not parts:
                return
            key = data_key(step, save_id, process_index, n_objects)
            n_objects += 1
            task = asyncio.ensure_future(upload(key, parts, charged_total, rows))
            uploads.add(task)
            task.add_done_callback(upload_done)
            parts, rows, size, charged_total = [], [], 0, 0

        while True:
            if failed:
                raise failed[0]
            if parts and (size >= target or budget.waiting):
                flush()
            try:
                got = await asyncio.wait_for(queue.get(), timeout=0.02)
            except TimeoutError:
                continue  # re-check: the producer may be waiting for budget we hold
            if got is None:
                break
            fut, charged = got
            t0 = loop.time()
            encoded = await fut
            stats.encode_s += loop.time() - t0
            # Raw chunks are views of the staging buffer: they cost no extra memory.
            keep = min(charged, sum(enc.stored.nbytes for enc in encoded if enc.codec != "raw"))
            if charged > keep:
                await budget.release(charged - keep)
            charged_total += keep
            for enc in encoded:
                rows.append((size, enc))
                parts.append(enc.stored)
                size += enc.stored.nbytes
                stats.raw_bytes += enc.raw_length
                stats.stored_bytes += enc.stored.nbytes
        flush()

    producer = asyncio.ensure_future(produce())
    try:
        await consume()
        await producer
        while uploads:
            await asyncio.gather(*list(uploads))
        if failed:
            raise failed[0]
    except BaseException:
        producer.cancel()
        for t in list(uploads):
            t.cancel()
        await asyncio.gather(producer, *uploads, return_exceptions=True)
        raise
    return result.build()
