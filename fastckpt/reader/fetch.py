"""Fill destination host buffers from stored chunks: ranged reads, verify, decode, copy.

One *unit* is one distinct destination box of one array on this process (replicated
device shards share a unit). For each unit the reader plans :class:`ReadItem` s, asks the
optional RAM-tier ``ChunkSource`` for each needed chunk first, and reads the rest from
persistent storage with coalesced ranged reads. Every chunk is verified (crc32c) before
its bytes are used; a chunk that fails verification on the persistent path is re-read once
and then reported as :class:`~fastckpt.errors.ChecksumMismatchError` naming the array,
box and object. Storage reads are scatter reads (``Store.get_into``): a raw chunk that maps
onto one contiguous destination span is received straight into the destination buffer (no
intermediate buffer, no copy); compressed or scattered chunks go through a per-read scratch
buffer, and a compressed chunk whose span is contiguous decodes straight into it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from concurrent.futures import Executor
from typing import Any, Protocol

import numpy as np
import zstandard

from fastckpt._aio import ByteBudget
from fastckpt._checksum import crc32c
from fastckpt._hostmem import BufferCache, alloc_aligned, balanced_groups
from fastckpt.errors import CheckpointNotFoundError, ChecksumMismatchError, CorruptionError, NotFoundError
from fastckpt.format.dtypes import dtype_from_name
from fastckpt.format.manifest import ArrayLeaf, Box, ChunkEntry, box_shape, box_volume, chunk_id, keypath_str
from fastckpt.options import RestoreOptions
from fastckpt.planning import FetchRange, ReadItem, box_to_slices, coalesce_fetches, contiguous_span, plan_leaf_reads
from fastckpt.storage._protocol import Store

__all__ = ["ChunkSource", "RestoreStats", "Unit", "fill_units"]

_GROUP_BYTES = 64 << 20  # RAM-tier fetches of one group: scratch held at once (resharding)
_GROUP_CHUNKS = 64  # chunks per RAM-tier fetch group (one pipelined stream per peer)
_SCRATCH_GRAIN = 4 << 20
_PREPARE_JOBS_PER_THREAD = 4  # a few jobs per thread: a slow leaf does not leave a thread idle


class ChunkSource(Protocol):
    """A fast tier consulted before persistent storage (own RAM, peers).

    ``fetch`` runs on a worker thread. It writes the chunk's verified raw bytes into
    ``into`` and returns the tier's name, or returns None when no tier it knows holds a
    good copy (misses, corruption and timeouts are handled inside, per tier). A source may
    also offer ``fetch_many(step, [(chunk_id, raw_length, raw_crc32c, into), ...])`` (a
    tier name or None per item), which the reader then prefers: one call per group of a
    leaf's chunks, so a peer can stream them.
    """

    def fetch(self, step: int, chunk_id: str, *, raw_length: int, raw_crc32c: int, into: memoryview) -> str | None: ...


class LendingChunkSource(ChunkSource, Protocol):
    """A source that can also hand out verified read-only views of its own memory (zero copy).

    ``lend`` gets ``(chunk_id, raw_length, raw_crc32c)`` of chunks that together tile one
    destination buffer, in order; it returns one view of all their bytes, verified, which
    the caller may keep indefinitely, or None (then ``fetch`` is used per chunk).
    """

    def lend(self, step: int, chunks: Sequence[tuple[str, int, int]]) -> memoryview | None: ...


@dataclasses.dataclass
class RestoreStats:
    """Per-process restore figures."""

    step: int | None = None
    """The step that was restored (useful with ``step=None``: the newest complete step)."""
    bytes_by_tier: dict[str, int] = dataclasses.field(default_factory=dict)
    chunks_by_tier: dict[str, int] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    fetch_s: float = 0.0
    device_put_s: float = 0.0
    bytes_read_storage: int = 0
    """Bytes fetched from persistent storage (stored size, including coalescing gaps)."""
    reads_storage: int = 0
    """Ranged reads issued to persistent storage (re-reads included)."""
    bytes_in_place: int = 0
    """Stored bytes received straight into destination buffers (no scratch, no copy)."""
    restored_bytes: int = 0
    """Logical bytes placed into this process's destination buffers."""
    retries: int = 0
    fallbacks: dict[str, int] = dataclasses.field(default_factory=dict)
    """RAM-tier fallbacks by reason (``corrupt``, ``miss``, ``unavailable``, ...)."""

    def add(self, tier: str, nbytes: int) -> None:
        self.bytes_by_tier[tier] = self.bytes_by_tier.get(tier, 0) + nbytes
        self.chunks_by_tier[tier] = self.chunks_by_tier.get(tier, 0) + 1


@dataclasses.dataclass
class Unit:
    """One destination box of one array on this process."""

    leaf: ArrayLeaf
    box: Box
    buffer: np.ndarray | None = None
    """Filled host buffer (shape of ``box``, dtype of ``leaf``) once done."""
    lendable: bool = True
    """May ``buffer`` be a read-only view lent by a RAM tier (zero copy)? False for leaves
    returned to the caller as numpy arrays, which must be writable."""


class _Decoder:
    def __init__(self) -> None:
        self._local = threading.local()

    def dctx(self) -> zstandard.ZstdDecompressor:
        d = getattr(self._local, "d", None)
        if d is None:
            d = self._local.d = zstandard.ZstdDecompressor()
        return d


def _where(leaf: ArrayLeaf, chunk: ChunkEntry) -> str:
    return f"array {keypath_str(leaf.path)} chunk {list(chunk.box)} (object {chunk.key} @ {chunk.offset})"


def _allocate(nbytes: int, what: Callable[[], str], *, aligned: bool = True,
              cache: BufferCache | None = None) -> np.ndarray:
    """A host buffer of ``nbytes`` (page-aligned ones from ``cache`` when given); an
    allocation the host refuses (a manifest may declare any size) raises ``MemoryError``
    naming what it was for, not a bare ``OSError``."""
    try:
        if aligned and cache is not None:
            return cache.alloc(nbytes)
        return alloc_aligned(nbytes) if aligned else np.empty(nbytes, np.uint8)
    except (OSError, MemoryError, ValueError, OverflowError) as e:
        raise MemoryError(f"restore cannot allocate {nbytes} bytes of host memory for {what()}: {e}") from e


def _place(dst: np.ndarray, chunk_arr: np.ndarray, items: Sequence[ReadItem]) -> None:
    for it in items:
        dst[box_to_slices(it.dst_box)] = chunk_arr[box_to_slices(it.src_box)]


class _LeafFiller:
    """Fills every unit of one array leaf; a chunk shared by several units is read once."""

    def __init__(self, units: Sequence[Unit], step: int, decoder: _Decoder, source: ChunkSource | None,
                 stats: RestoreStats, verify: bool, lock: threading.Lock, buffers: BufferCache | None = None) -> None:
        self.leaf = units[0].leaf
        self.units = units
        self.step = step
        self.dtype = dtype_from_name(self.leaf.dtype)
        self.decoder = decoder
        self.source = source
        self.stats = stats
        self.verify = verify
        self.lock = lock
        self.flats: list[np.ndarray] = []
        self.dsts: list[np.ndarray] = []
        #: chunk -> [(unit position, read item)]
        self.items: dict[ChunkEntry, list[tuple[int, ReadItem]]] = {}
        for pos, unit in enumerate(units):
            for it in plan_leaf_reads(self.leaf, unit.box):
                self.items.setdefault(it.chunk, []).append((pos, it))
        lent = self._lend_units() if source is not None and hasattr(source, "lend") else {}
        for pos, unit in enumerate(units):
            flat = lent.get(pos)
            if flat is None:
                nbytes = box_volume(unit.box) * self.dtype.itemsize
                flat = _allocate(nbytes, lambda: f"array {keypath_str(self.leaf.path)} box {list(unit.box)}",
                                 cache=buffers if unit.lendable else None)
            self.flats.append(flat)
            self.dsts.append(flat.view(self.dtype).reshape(box_shape(unit.box)))

    def _lend_units(self) -> dict[int, np.ndarray]:
        """Units whose bytes a RAM tier lends as one verified view (their chunks are then done).

        A unit qualifies when its chunks feed no other unit, each whole and onto one
        contiguous span, and the spans tile it in order (a same-mesh restore's usual case).
        """
        by_unit: dict[int, list[tuple[int, ChunkEntry]]] = {}
        shared: set[int] = set()
        for chunk, its in self.items.items():
            pos, item = its[0]
            span = contiguous_span(item.dst_box, box_shape(self.units[pos].box))
            if len(its) != 1 or span is None or box_shape(item.src_box) != box_shape(chunk.box):
                shared.update(p for p, _ in its)
                continue
            by_unit.setdefault(pos, []).append((span[0], chunk))
        lent: dict[int, np.ndarray] = {}
        for pos, spans in by_unit.items():
            unit = self.units[pos]
            if pos in shared or not unit.lendable:
                continue
            spans.sort(key=lambda sc: sc[0])
            expect = 0
            for start, chunk in spans:
                if start != expect:
                    break
                expect += box_volume(chunk.box)
            else:
                if expect != box_volume(unit.box):
                    continue
                chunks = [c for _, c in spans]
                view = self.source.lend(  # type: ignore[union-attr]
                    self.step, [(chunk_id(self.leaf.path, c.box), c.raw_length, c.raw_crc32c) for c in chunks])
                if view is None:
                    continue
                lent[pos] = np.frombuffer(view, np.uint8)
                for c in chunks:
                    del self.items[c]
                with self.lock:
                    for c in chunks:
                        self.stats.add("ram", c.raw_length)
        return lent

    def _direct_span(self, chunk: ChunkEntry) -> memoryview | None:
        """The destination bytes a whole chunk maps onto, if it feeds one contiguous span."""
        its = self.items[chunk]
        if len(its) != 1 or box_shape(its[0][1].src_box) != box_shape(chunk.box):
            return None
        pos, item = its[0]
        span = contiguous_span(item.dst_box, self.dsts[pos].shape)
        if span is None:
            return None
        start, n = span
        isz = self.dtype.itemsize
        return memoryview(self.flats[pos][start * isz : (start + n) * isz])

    def _target(self, chunk: ChunkEntry) -> tuple[memoryview, np.ndarray | None]:
        direct = self._direct_span(chunk)
        if direct is not None:
            return direct, None
        scratch = _allocate(chunk.raw_length, lambda: _where(self.leaf, chunk), aligned=False)
        return memoryview(scratch), scratch

    def _finish(self, chunk: ChunkEntry, scratch: np.ndarray | None) -> None:
        if scratch is None:
            return  # decoded in place
        arr = scratch.view(self.dtype).reshape(box_shape(chunk.box))
        for pos, it in self.items[chunk]:
            self.dsts[pos][box_to_slices(it.dst_box)] = arr[box_to_slices(it.src_box)]

    def try_source(self, chunk: ChunkEntry) -> bool:
        """Ask the RAM tiers; True if the chunk was placed."""
        if self.source is None:
            return False
        into, scratch = self._target(chunk)
        tier = self.source.fetch(self.step, chunk_id(self.leaf.path, chunk.box),
                                 raw_length=chunk.raw_length, raw_crc32c=chunk.raw_crc32c, into=into)
        if tier is None:
            return False
        self._finish(chunk, scratch)
        with self.lock:
            self.stats.add(tier, chunk.raw_length)
        return True

    def from_fetched(self, chunk: ChunkEntry, stored: memoryview, in_place: bool) -> None:
        """Verify the stored bytes of ``chunk`` a scatter read received (see ``_scatter``), and
        decode/place them unless they were received in place; raise CorruptionError if bad."""
        if self.verify and crc32c(stored) != chunk.crc32c:
            raise ChecksumMismatchError(f"{_where(self.leaf, chunk)}: crc32c mismatch")
        if not in_place:
            if chunk.codec == "raw":
                if stored.nbytes != chunk.raw_length:
                    raise CorruptionError(f"{_where(self.leaf, chunk)}: raw chunk of {stored.nbytes} bytes, "
                                          f"expected {chunk.raw_length}")
                arr = np.frombuffer(stored, np.uint8).view(self.dtype).reshape(box_shape(chunk.box))
                for pos, it in self.items[chunk]:
                    self.dsts[pos][box_to_slices(it.dst_box)] = arr[box_to_slices(it.src_box)]
            else:
                into, scratch = self._target(chunk)
                try:
                    n = self.decoder.dctx().stream_reader(stored).readinto(into)
                except zstandard.ZstdError as e:
                    raise CorruptionError(f"{_where(self.leaf, chunk)}: zstd: {e}") from e
                if n != chunk.raw_length:
                    raise CorruptionError(f"{_where(self.leaf, chunk)}: decoded {n} of {chunk.raw_length} bytes")
                self._finish(chunk, scratch)
        with self.lock:
            self.stats.add("storage", chunk.raw_length)

    def done(self) -> None:
        for unit, dst in zip(self.units, self.dsts):
            unit.buffer = dst
        with self.lock:
            self.stats.restored_bytes += sum(f.nbytes for f in self.flats)


def _fetch_many_from_source(pairs: Sequence[tuple[_LeafFiller, ChunkEntry]], source: Any,
                            step: int) -> list[tuple[_LeafFiller, ChunkEntry]]:
    """Ask the RAM tiers (``source.fetch_many``) for chunks of any number of leaves, in
    groups: one pipelined stream per peer and group, so that small leaves do not drain the
    stream at every leaf boundary. Returns the pairs no tier placed. Scratch buffers of a
    group stay under ``_GROUP_BYTES``."""
    left: list[tuple[_LeafFiller, ChunkEntry]] = []
    group: list[tuple[_LeafFiller, ChunkEntry, memoryview, np.ndarray | None]] = []
    scratch_bytes = 0

    def flush() -> None:
        tiers = source.fetch_many(
            step, [(chunk_id(f.leaf.path, c.box), c.raw_length, c.raw_crc32c, into) for f, c, into, _ in group])
        for (f, c, _, scratch), tier in zip(group, tiers):
            if tier is None:
                left.append((f, c))
                continue
            f._finish(c, scratch)
            with f.lock:
                f.stats.add(tier, c.raw_length)
        group.clear()

    for filler, chunk in pairs:
        into, scratch = filler._target(chunk)
        group.append((filler, chunk, into, scratch))
        scratch_bytes += 0 if scratch is None else scratch.nbytes
        if scratch_bytes >= _GROUP_BYTES or len(group) >= _GROUP_CHUNKS:
            flush()
            scratch_bytes = 0
    if group:
        flush()
    return left


#: One chunk of one leaf, with the stored bytes a scatter read received for it and whether
#: they landed in place (in the leaf's destination buffer).
_Received = tuple[_LeafFiller, ChunkEntry, memoryview, bool]


def _lands_in_place(filler: _LeafFiller, c: ChunkEntry) -> bool:
    span = filler._direct_span(c)
    return span is not None and span.nbytes == c.length


def _placement(pairs: Sequence[tuple[_LeafFiller, ChunkEntry]], start: int, length: int
               ) -> tuple[list[tuple[_LeafFiller, ChunkEntry]], list[memoryview | None] | None, int]:
    """Chunks of a stored range ``[start, start + length)`` in offset order, the destination
    span each is received into (None: via scratch) and the scratch bytes the read needs.

    A raw chunk that feeds one contiguous destination span is received straight into the
    destination buffer; other chunks (compressed, or scattered over several destination
    rows or units) and the gaps between chunks go to scratch. Overlapping chunks (only a
    malformed manifest has them) put the whole range in scratch (spans None).
    """
    ordered = sorted(pairs, key=lambda fc: fc[1].offset)
    direct: list[memoryview | None] = []
    pos = start
    for filler, c in ordered:
        if c.offset < pos or c.offset + c.length > start + length:
            return ordered, None, length
        span = filler._direct_span(c) if c.codec == "raw" else None
        direct.append(span if span is not None and span.nbytes == c.length else None)
        pos = c.offset + c.length
    return ordered, direct, length - sum(v.nbytes for v in direct if v is not None)


def _scatter(ordered: Sequence[tuple[_LeafFiller, ChunkEntry]], direct: Sequence[memoryview | None] | None,
             start: int, length: int, scratch_bytes: int,
             cache: BufferCache | None = None) -> tuple[list[memoryview], list[_Received]]:
    """The buffers to read the range into, back to back, and what each chunk receives.

    Scratch comes from ``cache`` when given, in sizes rounded up to ``_SCRATCH_GRAIN`` so
    that later reads reuse it (fresh memory costs page faults on every read otherwise)."""
    where = lambda: f"a read of {length} bytes of object {ordered[0][1].key}"  # noqa: E731
    if cache is not None and scratch_bytes:
        grain = -(-scratch_bytes // _SCRATCH_GRAIN) * _SCRATCH_GRAIN
        scratch = memoryview(_allocate(grain, where, cache=cache))[:scratch_bytes]
    else:
        scratch = memoryview(_allocate(scratch_bytes, where, aligned=False))
    if direct is None:
        return [scratch], [(f, c, scratch[c.offset - start : c.offset - start + c.length], False) for f, c in ordered]
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
    """Fill every unit's host buffer (``unit.buffer``) with verified data.

    ``buffers`` (optional) supplies the destination buffers of device-bound units, reusing
    the memory of earlier restores' arrays once those are gone.

    With ``storage_holds_step=False`` (a RAM-only step) a chunk no RAM source has raises
    :class:`CheckpointNotFoundError` naming it, instead of reading storage.
    """
    loop = asyncio.get_running_loop()
    decoder = _Decoder()
    lock = threading.Lock()
    reads = asyncio.Semaphore(options.read_concurrency)
    scratch_budget = ByteBudget(options.max_scratch_bytes)
    t0 = time.perf_counter()

    def prepare(group: Sequence[Sequence[Unit]]) -> list[tuple[_LeafFiller, list[ChunkEntry]]]:
        # One worker job per group of leaves (plan, allocate, every RAM-tier fetch), not one
        # per leaf or chunk: a loop-to-thread hop cost as much as preparing a small leaf.
        fillers = [_LeafFiller(us, step, decoder, source, stats, options.verify_checksums, lock, buffers)
                   for us in group]
        pairs = [(f, c) for f in fillers for c in f.items]
        if source is None:
            left = pairs
        elif hasattr(source, "fetch_many"):
            left = _fetch_many_from_source(pairs, source, step)
        else:
            left = [(f, c) for f, c in pairs if not f.try_source(c)]
        need: dict[int, list[ChunkEntry]] = {id(f): [] for f in fillers}
        for f, c in left:
            if not storage_holds_step:
                raise CheckpointNotFoundError(
                    f"RAM-only step {step}: {_where(f.leaf, c)} is held by no reachable RAM tier"
                )
            need[id(f)].append(c)
        return [(f, need[id(f)]) for f in fillers]

    async def do_range(r: FetchRange, pairs: Sequence[tuple[_LeafFiller, ChunkEntry]]) -> None:
        # Raw chunks that map onto contiguous destination spans are received in place; the
        # rest needs scratch, held until its chunks are decoded and placed and bounded by
        # options.max_scratch_bytes over all concurrent reads.
        ordered, direct, need = _placement(pairs, r.start, r.length)
        charged = await scratch_budget.acquire(need)
        try:
            async with reads:
                await read_range(r, ordered, direct, need)
        finally:
            await scratch_budget.release(charged)

    async def read_range(r: FetchRange, ordered: Sequence[tuple[_LeafFiller, ChunkEntry]],
                         direct: Sequence[memoryview | None] | None, need: int) -> None:
        parts, got = _scatter(ordered, direct, r.start, r.length, need, buffers)
        try:
            await store.get_into(r.key, r.start, parts)
        except NotFoundError as e:  # a committed step lost an object: say whose data it was
            raise NotFoundError(f"{_where(ordered[0][0].leaf, ordered[0][1])}: {e}") from e
        except CorruptionError as e:  # the object is shorter than the manifest says
            raise CorruptionError(f"{_where(ordered[0][0].leaf, ordered[0][1])}: {e}") from e
        stats.reads_storage += 1
        stats.bytes_read_storage += r.length
        stats.bytes_in_place += sum(view.nbytes for _, _, view, in_place in got if in_place)
        bad = await loop.run_in_executor(executor, _verify_all, got)
        for filler, c, view, in_place in bad:
            stats.retries += 1  # re-read once: the corruption may have been on the wire
            await store.get_into(c.key, c.offset, [view])
            stats.reads_storage += 1
            stats.bytes_read_storage += c.length
            await loop.run_in_executor(executor, filler.from_fetched, c, view, in_place)

    by_leaf: dict[int, list[Unit]] = {}
    for u in units:
        by_leaf.setdefault(id(u.leaf), []).append(u)
    leaf_units = list(by_leaf.values())
    prepared: list[tuple[_LeafFiller, list[ChunkEntry]]] = []

    async def prep(group: Sequence[int]) -> None:
        prepared.extend(await loop.run_in_executor(executor, prepare, [leaf_units[i] for i in group]))

    sizes = [sum(box_volume(u.box) for u in us) * dtype_from_name(us[0].leaf.dtype).itemsize for us in leaf_units]
    await _all_or_nothing(prep(g) for g in balanced_groups(sizes, _PREPARE_JOBS_PER_THREAD * options.decode_threads))
    # Coalesce across leaves: small leaves packed next to each other in one object are read
    # with one request instead of one each (per-request cost dominates small reads). A stored
    # location named by several chunks (only a malformed manifest does that) is read once
    # per chunk, in later rounds.
    owners: dict[tuple[str, int], list[tuple[_LeafFiller, ChunkEntry]]] = {}
    for filler, need in prepared:
        for c in need:
            owners.setdefault((c.key, c.offset), []).append((filler, c))
    pending = list(owners.values())
    # Chunks that need scratch are read in smaller ranges, so that read_concurrency of them
    # fit in the scratch budget at once (one 64 MiB range would hold all of it, one at a time).
    scratch_read = max(1 << 20, options.max_scratch_bytes // options.read_concurrency)
    while pending:
        first = {(c.key, c.offset): (f, c) for f, c in (p[0] for p in pending)}
        lands = {k for k, (f, c) in first.items() if c.codec == "raw" and _lands_in_place(f, c)}
        ranges = coalesce_fetches((first[k][1] for k in lands), max_gap=options.max_gap_bytes,
                                  max_bytes=options.max_request_bytes)
        ranges += coalesce_fetches((c for k, (_, c) in first.items() if k not in lands), max_gap=options.max_gap_bytes,
                                   max_bytes=min(options.max_request_bytes, scratch_read))
        await _all_or_nothing(do_range(r, [first[(c.key, c.offset)] for c in r.chunks]) for r in ranges)
        pending = [p[1:] for p in pending if len(p) > 1]
    for filler, _ in prepared:
        filler.done()
    stats.fetch_s += time.perf_counter() - t0
