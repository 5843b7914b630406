"""Filling the destination buffers of one array leaf: plan its reads, lend or fetch its
chunks from the fast tiers, and place, verify and decode what storage delivers.

:class:`LeafFiller` is the per-leaf state of a restore (``reader/fetch.py`` drives it);
a chunk shared by several destination units is read once. Every byte is verified (crc32c)
before it is used.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np
import zstandard

from fastckpt._checksum import crc32c
from fastckpt._hostmem import BufferCache, alloc_aligned, carve, slab_bytes
from fastckpt.errors import ChecksumMismatchError, CorruptionError
from fastckpt.format.dtypes import dtype_from_name
from fastckpt.format.manifest import (
    ArrayLeaf,
    ChunkEntry,
    box_shape,
    box_volume,
    chunk_id,
    chunk_id_prefix,
    keypath_str,
)
from fastckpt.planning import (
    ReadItem,
    box_to_slices,
    contiguous_span,
    element_runs,
    leaf_index,
    plan_leaf_reads,
)
from fastckpt.reader.units import ChunkSource, RestoreStats, Unit

__all__ = ["LeafFiller", "allocate", "fetch_many_from_source", "where"]

_GROUP_BYTES = 64 << 20  # RAM-tier fetches of one group: scratch held at once (resharding)
_GROUP_CHUNKS = 64  # chunks per RAM-tier fetch group (one pipelined stream per peer)
_SCAN_CHUNKS = 4  # a leaf with more chunks (and several units) is planned through leaf_index
_RANGE_MIN_GAP = 16 << 10  # byte ranges of a chunk closer than this are read as one
_RANGE_MAX_RUNS = 64  # more ranges in one chunk: the one range holding them all


_zstd = threading.local()


def _dctx() -> zstandard.ZstdDecompressor:
    """This thread's zstd decompressor."""
    d = getattr(_zstd, "d", None)
    if d is None:
        d = _zstd.d = zstandard.ZstdDecompressor()
    return d


def where(leaf: ArrayLeaf, chunk: ChunkEntry) -> str:
    """Names a chunk in errors: array, box and stored location."""
    stored = f"(object {chunk.key} @ {chunk.offset})"
    return f"array {keypath_str(leaf.path)} chunk {list(chunk.box)} {stored}"


def allocate(
    nbytes: int, what: Callable[[], str], *, aligned: bool = True, cache: BufferCache | None = None
) -> np.ndarray:
    """A host buffer of ``nbytes`` (page-aligned ones from ``cache`` when given); an
    allocation the host refuses (a manifest may declare any size) raises ``MemoryError``
    naming what it was for, not a bare ``OSError``."""
    try:
        if aligned and cache is not None:
            return cache.alloc(nbytes)
        return alloc_aligned(nbytes) if aligned else np.empty(nbytes, np.uint8)
    except (OSError, MemoryError, ValueError, OverflowError) as e:
        raise MemoryError(
            f"restore cannot allocate {nbytes} bytes of host memory for {what()}: {e}"
        ) from e


class LeafFiller:
    """Fills every unit of one array leaf; a chunk shared by several units is read once.

    Call order: construct (plans the reads, borrows whole units from the own RAM tier
    unverified, allocates the other units' buffers), fill ``items`` from the fast tiers
    (:func:`fetch_many_from_source`), :meth:`verify_lent` (after all planning, so that its
    checksums never wait on the GIL), fill what is left from storage (:meth:`from_fetched`),
    then :meth:`done`.
    """

    def __init__(
        self,
        units: Sequence[Unit],
        step: int,
        source: ChunkSource | None,
        stats: RestoreStats,
        verify: bool,
        lock: threading.Lock,
        buffers: BufferCache | None = None,
    ) -> None:
        self.leaf = units[0].leaf
        self.units = units
        self.step = step
        self.dtype = dtype_from_name(self.leaf.dtype)
        self.source = source
        self.stats = stats
        self.verify = verify
        self.lock = lock
        self.buffers = buffers
        self.flats: list[np.ndarray] = []
        self.dsts: list[np.ndarray] = []
        #: borrowed, not yet verified: (unit position, its chunks in order)
        self.lent: list[tuple[int, list[ChunkEntry]]] = []
        #: chunk -> [(unit position, read item)]
        self.items: dict[ChunkEntry, list[tuple[int, ReadItem]]] = {}
        # A decoded manifest's chunks never overlap (the codec checks): exact boxes are looked up.
        index = (
            leaf_index(self.leaf)
            if len(units) > 1 and len(self.leaf.chunks) > _SCAN_CHUNKS
            else None
        )
        for pos, unit in enumerate(units):
            for it in plan_leaf_reads(self.leaf, unit.box, index=index):
                self.items.setdefault(it.chunk, []).append((pos, it))
        # Every unit's destination: a view the own RAM tier lends, else a fresh host buffer.
        lent = self._lend_units() if self.source is not None else {}
        fresh = iter(
            self._fresh_buffers([u for pos, u in enumerate(self.units) if pos not in lent])
        )
        for pos, unit in enumerate(self.units):
            flat = lent[pos] if pos in lent else next(fresh)
            self.flats.append(flat)
            self.dsts.append(flat.view(self.dtype).reshape(box_shape(unit.box)))

    def _fresh_buffers(self, units: Sequence[Unit]) -> list[np.ndarray]:
        """New host buffers for ``units``. Units that may be lent (device-bound) share one
        mapping, each 64-byte aligned (what lets ``device_put`` alias it): one allocation and
        one reuse record per leaf instead of one per shard; the mapping goes back to the
        cache when every unit's array is gone."""
        if len(units) < 2 or not all(u.lendable for u in units):
            return [self._fresh_buffer(u) for u in units]
        sizes = [box_volume(u.box) * self.dtype.itemsize for u in units]
        slab = allocate(
            slab_bytes(sizes),
            lambda: f"array {keypath_str(self.leaf.path)} ({len(units)} boxes)",
            cache=self.buffers,
        )
        return carve(slab, sizes)

    def _fresh_buffer(self, unit: Unit) -> np.ndarray:
        """A new host buffer for ``unit`` (from the restore's cache when it may be lent)."""
        return allocate(
            box_volume(unit.box) * self.dtype.itemsize,
            lambda: f"array {keypath_str(self.leaf.path)} box {list(unit.box)}",
            cache=self.buffers if unit.lendable else None,
        )

    @property
    def lent_bytes(self) -> int:
        """Bytes borrowed and not yet verified."""
        return sum(self.flats[pos].nbytes for pos, _ in self.lent)

    def _lend_units(self) -> dict[int, np.ndarray]:
        """Units whose bytes a RAM tier lends as one view, unverified (their chunks leave
        ``items`` for ``lent``): those whose chunks feed no other unit, each whole and onto
        one contiguous span, the spans tiling it in order (a same-mesh restore's case)."""
        by_unit: dict[int, list[tuple[int, ChunkEntry]]] = {}
        shared: set[int] = set()
        for chunk, its in self.items.items():
            pos, item = its[0]
            if len(its) == 1 and chunk.box == self.units[pos].box:  # the unit is this chunk
                by_unit.setdefault(pos, []).append((0, chunk))
                continue
            span = contiguous_span(item.dst_box, box_shape(self.units[pos].box))
            if len(its) != 1 or span is None or box_shape(item.src_box) != box_shape(chunk.box):
                shared.update(p for p, _ in its)
                continue
            by_unit.setdefault(pos, []).append((span[0], chunk))
        candidates: list[tuple[int, list[ChunkEntry]]] = []  # units whose chunks tile them in order
        for pos, spans in by_unit.items():
            if pos in shared or not self.units[pos].lendable:
                continue
            spans.sort(key=lambda sc: sc[0])
            expect = 0
            for start, chunk in spans:
                if start != expect:
                    break
                expect += box_volume(chunk.box)
            else:
                if expect == box_volume(self.units[pos].box):
                    candidates.append((pos, [c for _, c in spans]))
        lent: dict[int, np.ndarray] = {}
        if not candidates:
            return lent
        prefix = chunk_id_prefix(self.leaf.path)
        assert self.source is not None
        views = self.source.lend_many(
            self.step,
            [
                [
                    (chunk_id(self.leaf.path, c.box, prefix=prefix), c.raw_length, c.raw_crc32c)
                    for c in chunks
                ]
                for _, chunks in candidates
            ],
            verify=False,
        )
        for cand, view in zip(candidates, views):  # (few new objects: the restore is GC-bound)
            if view is None:
                continue
            lent[cand[0]] = np.frombuffer(view, np.uint8)
            for c in cand[1]:
                del self.items[c]
            self.lent.append(cand)
        return lent

    def verify_lent(self) -> list[ChunkEntry]:
        """Check every borrowed unit against its chunks' crc32c. A unit that fails gets a
        fresh buffer and its chunks back in ``items``, and they are returned (to be fetched
        from the next tier: a source's per-chunk fetch finds and records the bad copy); the
        rest count as read from RAM. Call once, after the fast tiers' fetches."""
        back: list[ChunkEntry] = []
        nbytes = nchunks = 0
        for pos, chunks in self.lent:
            flat, start = self.flats[pos], 0
            for c in chunks:
                if crc32c(flat[start : start + c.raw_length]) != c.raw_crc32c:
                    break
                start += c.raw_length
            else:
                nbytes += start
                nchunks += len(chunks)
                continue
            unit = self.units[pos]
            flat = self.flats[pos] = self._fresh_buffer(unit)
            self.dsts[pos] = flat.view(self.dtype).reshape(box_shape(unit.box))
            for it in plan_leaf_reads(self.leaf, unit.box):  # its chunks feed this unit alone
                self.items[it.chunk] = [(pos, it)]
            back.extend(chunks)
        self.lent.clear()
        if nchunks:
            with self.lock:
                self.stats.add("ram", nbytes, chunks=nchunks)
        return back

    def direct_span(self, chunk: ChunkEntry) -> memoryview | None:
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
        return self.flats[pos][start * isz : (start + n) * isz].data

    def target(self, chunk: ChunkEntry) -> tuple[memoryview, np.ndarray | None]:
        direct = self.direct_span(chunk)
        if direct is not None:
            return direct, None
        scratch = allocate(chunk.raw_length, lambda: where(self.leaf, chunk), aligned=False)
        return scratch.data, scratch

    def needed_runs(self, chunk: ChunkEntry) -> list[tuple[int, int]]:
        """The byte ranges ``(start, n)`` of ``chunk`` its read items use (a resharding
        restore uses part of a chunk; :meth:`finish` reads only these), ascending; ranges
        closer than ``_RANGE_MIN_GAP`` merged, at most ``_RANGE_MAX_RUNS`` of them."""
        isz = self.dtype.itemsize
        runs = element_runs(
            [it.src_box for _, it in self.items[chunk]],
            box_shape(chunk.box),
            min_gap=-(-_RANGE_MIN_GAP // isz),
            max_runs=_RANGE_MAX_RUNS,
        )
        return [(a * isz, n * isz) for a, n in runs]

    def finish(self, chunk: ChunkEntry, scratch: np.ndarray | None) -> None:
        if scratch is None:
            return  # decoded in place
        arr = scratch.view(self.dtype).reshape(box_shape(chunk.box))
        for pos, it in self.items[chunk]:
            self.dsts[pos][box_to_slices(it.dst_box)] = arr[box_to_slices(it.src_box)]

    def from_fetched(self, chunk: ChunkEntry, stored: memoryview, in_place: bool) -> None:
        """Verify the stored bytes of ``chunk`` a scatter read received (see ``_scatter``), and
        decode/place them unless they were received in place; raise CorruptionError if bad."""
        if self.verify and crc32c(stored) != chunk.crc32c:
            raise ChecksumMismatchError(f"{where(self.leaf, chunk)}: crc32c mismatch")
        if not in_place:
            if chunk.codec == "raw":
                if stored.nbytes != chunk.raw_length:
                    raise CorruptionError(
                        f"{where(self.leaf, chunk)}: raw chunk of {stored.nbytes} bytes, "
                        f"expected {chunk.raw_length}"
                    )
                self.finish(chunk, np.frombuffer(stored, np.uint8))
            else:
                into, scratch = self.target(chunk)
                try:
                    n = _dctx().stream_reader(stored).readinto(into)
                except zstandard.ZstdError as e:
                    raise CorruptionError(f"{where(self.leaf, chunk)}: zstd: {e}") from e
                if n != chunk.raw_length:
                    raise CorruptionError(
                        f"{where(self.leaf, chunk)}: decoded {n} of {chunk.raw_length} bytes"
                    )
                self.finish(chunk, scratch)
        with self.lock:
            self.stats.add("storage", chunk.raw_length)

    def done(self) -> None:
        for unit, dst in zip(self.units, self.dsts):
            unit.buffer = dst
        with self.lock:
            self.stats.restored_bytes += sum(f.nbytes for f in self.flats)


#: A chunk asked of the fast tiers: filler, chunk, into, scratch, runs (None: whole), bytes.
_Asked = tuple[
    LeafFiller, ChunkEntry, memoryview, np.ndarray | None, list[tuple[int, int]] | None, int
]


def fetch_many_from_source(
    pairs: Sequence[tuple[LeafFiller, ChunkEntry]],
    source: ChunkSource,
    step: int,
    *,
    min_range_saving: int,
) -> list[tuple[LeafFiller, ChunkEntry]]:
    """Ask the RAM tiers (``source.fetch_many``) for chunks of any number of leaves, in groups
    (one pipelined stream per peer and group; a group's scratch stays under ``_GROUP_BYTES``).
    A chunk the restore uses part of is asked for as those byte ranges when that spares
    ``min_range_saving`` bytes or more. Returns the pairs no tier placed."""
    left: list[tuple[LeafFiller, ChunkEntry]] = []
    group: list[_Asked] = []
    scratch_bytes = 0

    def flush() -> None:
        items = [
            (chunk_id(f.leaf.path, c.box), c.raw_length, c.raw_crc32c, into)
            for f, c, into, *_ in group
        ]
        tiers = source.fetch_many(step, items, runs=[g[4] for g in group])
        for (f, c, _, scratch, _, nbytes), tier in zip(group, tiers):
            if tier is None:
                left.append((f, c))
                continue
            f.finish(c, scratch)
            with f.lock:
                f.stats.add(tier, nbytes)
        group.clear()

    for filler, chunk in pairs:
        into, scratch = filler.target(chunk)
        runs, nbytes = None, chunk.raw_length
        if scratch is not None:  # (np.empty: the pages of bytes never received are never touched)
            runs = filler.needed_runs(chunk)
            nbytes = sum(n for _, n in runs)
            if chunk.raw_length - nbytes < max(1, min_range_saving):
                runs, nbytes = None, chunk.raw_length
        group.append((filler, chunk, into, scratch, runs, nbytes))
        scratch_bytes += 0 if scratch is None else nbytes
        if scratch_bytes >= _GROUP_BYTES or len(group) >= _GROUP_CHUNKS:
            flush()
            scratch_bytes = 0
    if group:
        flush()
    return left
