"""Fill destination host buffers from stored chunks: ranged reads, verify, decode, copy.

One *unit* is one distinct destination box of one array on this process (replicated device
shards share a unit). Each leaf's chunks are asked of the optional fast-tier ``ChunkSource``
first (``reader.leaf_filler``; units the own RAM tier holds whole are borrowed and verified
after planning), the rest read from storage with coalesced scatter reads
(``Store.get_into``): a raw chunk that maps onto one contiguous destination span lands in
place, others go through scratch. Every chunk is verified (crc32c) before use; one that fails
on the storage path is re-read once, then raises
:class:`~fastckpt.errors.ChecksumMismatchError` naming the array, box and object.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

from fastckpt._aio import ByteBudget
from fastckpt._hostmem import BufferCache, balanced_groups
from fastckpt.errors import CheckpointNotFoundError, CorruptionError, NotFoundError
from fastckpt.format.dtypes import dtype_from_name
from fastckpt.format.manifest import ChunkEntry, box_volume
from fastckpt.options import RestoreOptions
from fastckpt.planning import FetchRange, coalesce_fetches
from fastckpt.reader.leaf_filler import LeafFiller, allocate, fetch_many_from_source, where
from fastckpt.reader.units import ChunkSource, RestoreStats, SourceCounters, Unit
from fastckpt.storage import Store

__all__ = ["ChunkSource", "RestoreStats", "SourceCounters", "Unit", "fill_units"]

_T = TypeVar("_T")
_SCRATCH_GRAIN = 4 << 20
_ONE_PLANNER_UNIT_BYTES = 1 << 20  # units smaller than this on average: plan on one thread
_PREPARE_JOBS_PER_THREAD = 4  # a few jobs per thread: a slow leaf does not leave a thread idle


#: One chunk of one leaf, with the stored bytes a scatter read received for it and whether
#: they landed in place (in the leaf's destination buffer).
_Received = tuple[LeafFiller, ChunkEntry, memoryview, bool]
_Pair = tuple[LeafFiller, ChunkEntry]


def _lands_in_place(filler: LeafFiller, c: ChunkEntry) -> bool:
    span = filler.direct_span(c)
    return span is not None and span.nbytes == c.length


def _placement(
    pairs: Sequence[tuple[LeafFiller, ChunkEntry]], start: int, length: int
) -> tuple[list[tuple[LeafFiller, ChunkEntry]], list[memoryview | None] | None, int]:
    """Chunks of a stored range ``[start, start + length)`` in offset order, the destination
    span each is received into (None: via scratch) and the scratch bytes the read needs.
    Only a raw chunk that feeds one contiguous destination span is received in place; gaps
    go to scratch, and overlapping chunks (a malformed manifest) put the whole range there.
    """
    ordered = sorted(pairs, key=lambda fc: fc[1].offset)
    direct: list[memoryview | None] = []
    pos = start
    for filler, c in ordered:
        if c.offset < pos or c.offset + c.length > start + length:
            return ordered, None, length
        span = filler.direct_span(c) if c.codec == "raw" else None
        direct.append(span if span is not None and span.nbytes == c.length else None)
        pos = c.offset + c.length
    return ordered, direct, length - sum(v.nbytes for v in direct if v is not None)


def _scatter(
    ordered: Sequence[tuple[LeafFiller, ChunkEntry]],
    direct: Sequence[memoryview | None] | None,
    start: int,
    length: int,
    scratch_bytes: int,
    cache: BufferCache | None = None,
) -> tuple[list[memoryview], list[_Received]]:
    """The buffers to read the range into, back to back, and what each chunk receives.

    Scratch comes from ``cache`` when given, in sizes rounded up to ``_SCRATCH_GRAIN`` so
    that later reads reuse it (fresh memory costs page faults on every read otherwise)."""
    where = lambda: f"a read of {length} bytes of object {ordered[0][1].key}"  # noqa: E731
    if cache is not None and scratch_bytes:
        grain = -(-scratch_bytes // _SCRATCH_GRAIN) * _SCRATCH_GRAIN
        scratch = allocate(grain, where, cache=cache).data[:scratch_bytes]
    else:
        scratch = allocate(scratch_bytes, where, aligned=False).data
    if direct is None:
        return [scratch], [
            (f, c, scratch[c.offset - start : c.offset - start + c.length], False)
            for f, c in ordered
        ]
    parts: list[memoryview] = []
    got: list[_Received] = []
    used = 0
    pos = start
    for (filler, c), span in zip(ordered, direct):
        if c.offset > pos:  # gap bytes between chunks: read and dropped
            parts.append(scratch[used : used + c.offset - pos])
            used += c.offset - pos
        in_place = span is not None
        if span is None:
            span = scratch[used : used + c.length]
            used += c.length
        parts.append(span)
        got.append((filler, c, span, in_place))
        pos = c.offset + c.length
    if pos < start + length:
        parts.append(scratch[used:])
    return parts, got


def _verify_all(got: Sequence[_Received]) -> list[_Received]:
    """Verify and place every received chunk; return those that failed verification."""
    bad = []
    for rec in got:
        filler, c, view, in_place = rec
        try:
            filler.from_fetched(c, view, in_place)
        except CorruptionError:
            bad.append(rec)
    return bad


async def _in_thread(executor: Executor, fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` on ``executor``; if the awaiting task is cancelled while ``fn`` runs, the
    cancellation waits for it to finish (a job of a failed restore never outlives it)."""
    job = executor.submit(fn, *args)
    try:
        return await asyncio.wrap_future(job)
    except asyncio.CancelledError:
        if not job.cancel():
            await asyncio.wait([asyncio.wrap_future(job)])
        raise


async def _all_or_nothing(coros: Iterable[Coroutine[Any, Any, None]]) -> None:
    """Run ``coros`` concurrently; on the first failure cancel the rest and wait for them, so
    nothing of a failed restore keeps reading (or touches the loop) after this returns."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def fill_units(
    store: Store,
    step: int,
    units: Sequence[Unit],
    *,
    options: RestoreOptions,
    executor: Executor,
    stats: RestoreStats,
    source: ChunkSource | None = None,
    storage_holds_step: bool = True,
    buffers: BufferCache | None = None,
) -> None:
    """Fill every unit's host buffer (``unit.buffer``) with verified data. ``buffers``
    supplies the destination buffers of device-bound units (reusing earlier restores' memory).
    With ``storage_holds_step=False`` (a RAM-only step) a chunk no RAM source has raises
    :class:`CheckpointNotFoundError` naming it, instead of reading storage.
    """
    lock = threading.Lock()
    reads = asyncio.Semaphore(options.read_concurrency)
    scratch_budget = ByteBudget(options.max_scratch_bytes)
    t0 = time.perf_counter()

    def plan(group: Sequence[Sequence[Unit]]) -> list[LeafFiller]:
        # Plan, borrow (own RAM, unverified) and allocate a group of leaves.
        return [
            LeafFiller(us, step, source, stats, options.verify_checksums, lock, buffers)
            for us in group
        ]

    def fetch(fillers: Sequence[LeafFiller]) -> list[_Pair]:
        # The fast tiers' fetch of what was not borrowed.
        return from_sources([(f, c) for f in fillers for c in f.items])

    def from_sources(pairs: list[_Pair]) -> list[_Pair]:
        # The chunks no fast tier placed: what storage must still deliver.
        if source is None:
            left = pairs
        else:
            left = fetch_many_from_source(
                pairs, source, step, min_range_saving=options.min_range_saving_bytes
            )
        if left and not storage_holds_step:
            f, c = left[0]
            raise CheckpointNotFoundError(
                f"RAM-only step {step}: {where(f.leaf, c)} is held by no reachable RAM tier"
            )
        return left

    def verify_lent(fillers: Sequence[LeafFiller]) -> list[_Pair]:
        # Checksums of borrowed units (GIL released); a unit that fails goes to the next tier.
        return from_sources([(f, c) for f in fillers for c in f.verify_lent()])

    async def do_range(r: FetchRange, pairs: Sequence[tuple[LeafFiller, ChunkEntry]]) -> None:
        # What is not received in place needs scratch, held until its chunks are placed and
        # bounded by options.max_scratch_bytes over all concurrent reads.
        ordered, direct, need = _placement(pairs, r.start, r.length)
        charged = await scratch_budget.acquire(need)
        try:
            async with reads:
                await read_range(r, ordered, direct, need)
        finally:
            await scratch_budget.release(charged)

    async def read_range(
        r: FetchRange,
        ordered: Sequence[tuple[LeafFiller, ChunkEntry]],
        direct: Sequence[memoryview | None] | None,
        need: int,
    ) -> None:
        parts, got = _scatter(ordered, direct, r.start, r.length, need, buffers)
        try:
            await store.get_into(r.key, r.start, parts)
        except NotFoundError as e:  # a committed step lost an object: say whose data it was
            raise NotFoundError(f"{where(ordered[0][0].leaf, ordered[0][1])}: {e}") from e
        except CorruptionError as e:  # the object is shorter than the manifest says
            raise CorruptionError(f"{where(ordered[0][0].leaf, ordered[0][1])}: {e}") from e
        stats.reads_storage += 1
        stats.bytes_read_storage += r.length
        stats.bytes_in_place += sum(view.nbytes for _, _, view, in_place in got if in_place)
        bad = await _in_thread(executor, _verify_all, got)
        for filler, c, view, in_place in bad:
            stats.retries += 1  # re-read once: the corruption may have been on the wire
            await store.get_into(c.key, c.offset, [view])
            stats.reads_storage += 1
            stats.bytes_read_storage += c.length
            await _in_thread(executor, filler.from_fetched, c, view, in_place)

    by_leaf: dict[int, list[Unit]] = {}
    for u in units:
        by_leaf.setdefault(id(u.leaf), []).append(u)
    leaf_units = list(by_leaf.values())
    fillers: list[LeafFiller] = []
    left: list[_Pair] = []  # for storage

    async def prepare_all(groups: Sequence[Sequence[int]], *, one_planner: bool) -> None:
        # Small units (one_planner): one job plans the groups in turn (Python: threads would
        # queue on the GIL), handing each group's fetch to the executor. Large units: every
        # group is planned and fetched in parallel.
        def planned(group: Sequence[int]) -> list[LeafFiller]:
            out = plan([leaf_units[i] for i in group])
            fillers.extend(out)
            return out

        if not one_planner:

            async def both(group: Sequence[int]) -> None:  # one worker job: plan, then fetch
                left.extend(await _in_thread(executor, lambda: fetch(planned(group))))

            await _all_or_nothing(both(g) for g in groups)
            return
        fetching: list[Future[list[_Pair]]] = []

        def plan_all() -> None:  # no loop round trip between groups
            for group in groups:
                fetching.append(executor.submit(fetch, planned(group)))

        try:
            await _in_thread(executor, plan_all)
            for job in fetching:
                done = await asyncio.wrap_future(job)
                left.extend(done)
        except BaseException:  # wait for the fetches already running: none outlives the restore
            for job in fetching:
                job.cancel()
            await asyncio.gather(
                *(asyncio.wrap_future(j) for j in fetching), return_exceptions=True
            )
            raise

    sizes = [
        sum(box_volume(u.box) for u in us) * dtype_from_name(us[0].leaf.dtype).itemsize
        for us in leaf_units
    ]
    await prepare_all(
        balanced_groups(sizes, _PREPARE_JOBS_PER_THREAD * options.decode_threads),
        one_planner=sum(sizes) < _ONE_PLANNER_UNIT_BYTES * len(units),
    )
    # The borrowed units' checksums, once all planning is done (see LeafFiller): a job per thread.
    lent = [f for f in fillers if f.lent]
    if lent:

        async def check(group: Sequence[int]) -> None:
            left.extend(await _in_thread(executor, verify_lent, [lent[i] for i in group]))

        await _all_or_nothing(
            check(g) for g in balanced_groups([f.lent_bytes for f in lent], options.decode_threads)
        )
    # Coalesce across leaves (small leaves packed together are read with one request). A
    # location named by several chunks (a malformed manifest) is read once each, in rounds.
    owners: dict[tuple[str, int], list[_Pair]] = {}
    for filler, c in left:
        owners.setdefault((c.key, c.offset), []).append((filler, c))
    pending = list(owners.values())
    # Chunks that need scratch are read in smaller ranges: read_concurrency of them fit in the
    # scratch budget at once.
    scratch_read = max(1 << 20, options.max_scratch_bytes // options.read_concurrency)
    while pending:
        first = {(c.key, c.offset): (f, c) for f, c in (p[0] for p in pending)}
        lands = {k for k, (f, c) in first.items() if c.codec == "raw" and _lands_in_place(f, c)}
        ranges = coalesce_fetches(
            (first[k][1] for k in lands),
            max_gap=options.max_gap_bytes,
            max_bytes=options.max_request_bytes,
        )
        ranges += coalesce_fetches(
            (c for k, (_, c) in first.items() if k not in lands),
            max_gap=options.max_gap_bytes,
            max_bytes=min(options.max_request_bytes, scratch_read),
        )
        await _all_or_nothing(
            do_range(r, [first[(c.key, c.offset)] for c in r.chunks]) for r in ranges
        )
        pending = [p[1:] for p in pending if len(p) > 1]
    for filler in fillers:
        filler.done()
    stats.fetch_s += time.perf_counter() - t0
