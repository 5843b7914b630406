"""Save plans (replica dedupe, sub-chunk byte layout), read plans and fetch coalescing."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastckpt.errors import CorruptionError
from fastckpt.format.manifest import ArrayLeaf, Box, ChunkEntry, ChunkTable, box_shape, box_volume
from fastckpt.planning import (
    ChunkIndex,
    ShardInfo,
    box_to_slices,
    coalesce_fetches,
    intersect,
    plan_leaf_reads,
    plan_leaf_writes,
    relative_to,
)
from fastckpt.testing.strategies import boxes_in, shapes, tilings

SETTINGS = settings(max_examples=150, deadline=None)


# ------------------------------------------------------------------ plan_leaf_writes


@st.composite
def shard_lists(draw: st.DrawFn) -> tuple[tuple[int, ...], list[ShardInfo], int, int]:
    """A tiling of an array into shard boxes, each held by 1-3 devices (replicas), shuffled.

    Some boxes get replica_id 0 on two devices (what a process sees for a replicated axis it
    owns twice); only one copy may be written.
    """
    shape = draw(shapes(max_rank=3, max_side=6, min_side=1))
    boxes = draw(tilings(shape, max_pieces=6))
    shards = []
    for box in boxes:
        replicas = draw(st.integers(1, 3))
        ids = list(range(replicas))
        if draw(st.booleans()):
            ids.append(0)  # a duplicate replica-0 copy of the same box
        for r in ids:
            shards.append((box, r))
    # Drop some non-zero replicas entirely and shuffle the device order.
    shards = draw(st.permutations(shards))
    infos = [ShardInfo(box, r, i) for i, (box, r) in enumerate(shards)]
    itemsize = draw(st.sampled_from([1, 2, 4, 8]))
    max_chunk = draw(st.integers(itemsize, 4 * itemsize * max(1, math.prod(shape))))
    return shape, infos, itemsize, max_chunk


@SETTINGS
@given(shard_lists())
def test_plan_leaf_writes_dedupes_replicas_and_tiles(
    case: tuple[tuple[int, ...], list[ShardInfo], int, int],
) -> None:
    shape, shards, itemsize, max_chunk = case
    items = plan_leaf_writes(shards, itemsize=itemsize, max_chunk_bytes=max_chunk)
    # Every element of the array is written exactly once (each box once, replicas deduped).
    count = np.zeros(shape, np.int64)
    for it in items:
        count[box_to_slices(it.box)] += 1
    np.testing.assert_array_equal(count, np.ones(shape, np.int64))
    first_zero = {}
    for s in shards:
        if s.replica_id == 0:
            first_zero.setdefault(s.box, s.shard_index)
    by_shard: dict[int, list] = {}
    for it in items:
        # Written from the first replica-0 device of its box.
        assert first_zero[it.shard_box] == it.shard_index
        assert it.nbytes == box_volume(it.box) * itemsize <= max_chunk
        by_shard.setdefault(it.shard_index, []).append(it)
    # Within a shard: sub-chunks are contiguous byte ranges of its C-order buffer, in order.
    for its in by_shard.values():
        shard_box = its[0].shard_box
        local = np.arange(box_volume(shard_box)).reshape(box_shape(shard_box))
        offset = 0
        for it in its:
            assert it.byte_offset == offset
            elems = local[box_to_slices(relative_to(it.box, shard_box))].reshape(-1)
            np.testing.assert_array_equal(
                elems, np.arange(offset // itemsize, offset // itemsize + elems.size)
            )
            offset += it.nbytes
        assert offset == box_volume(shard_box) * itemsize


def test_plan_leaf_writes_no_replica_zero_writes_nothing() -> None:
    shards = [ShardInfo(((0, 4),), 1, 0), ShardInfo(((0, 4),), 2, 1)]
    assert plan_leaf_writes(shards, itemsize=4, max_chunk_bytes=64) == ()


# ------------------------------------------------------------------ plan_leaf_reads


def listed_table(entries: list[ChunkEntry], itemsize: int) -> ChunkTable:
    """A table listing the entries' boxes (never a grid: planning scans or indexes it)."""
    keys = sorted({c.key for c in entries})
    return ChunkTable(
        cuts=None,
        boxes=[c.box for c in entries],
        keys=keys,
        object_index=np.array([keys.index(c.key) for c in entries], np.int32),
        offsets=np.array([c.offset for c in entries], np.int64),
        lengths=np.array([c.length for c in entries], np.int64),
        codec=tuple(c.codec for c in entries),
        crc32c=np.array([c.crc32c for c in entries], np.uint32),
        raw_crc32c=np.array([c.raw_crc32c for c in entries], np.uint32),
        itemsize=itemsize,
    )


def make_leaf(shape: tuple[int, ...], boxes: list[Box], itemsize: int = 8) -> ArrayLeaf:
    chunks = [
        ChunkEntry(
            box=b,
            key=f"obj/{i % 3}",
            offset=1000 * i,
            length=box_volume(b) * itemsize,
            raw_length=box_volume(b) * itemsize,
            codec="raw",
            crc32c=0,
            raw_crc32c=0,
        )
        for i, b in enumerate(boxes)
    ]
    return ArrayLeaf(
        path=(("d", "w"),), shape=shape, dtype="int64", chunks=listed_table(chunks, itemsize)
    )


@st.composite
def read_cases(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box], Box]:
    shape = draw(shapes(max_rank=3, max_side=7))
    return shape, draw(tilings(shape, max_pieces=10)), draw(boxes_in(shape, allow_empty=True))


@settings(max_examples=250, deadline=None)
@given(read_cases())
def test_plan_leaf_reads_copies_exactly_the_right_elements(
    case: tuple[tuple[int, ...], list[Box], Box],
) -> None:
    shape, boxes, dst_box = case
    leaf = make_leaf(shape, boxes)
    global_arr = np.arange(math.prod(shape), dtype=np.int64).reshape(shape)
    # Each stored chunk holds exactly its box of the global array.
    stored = {c: global_arr[box_to_slices(c.box)].copy() for c in leaf.chunks}
    items = plan_leaf_reads(leaf, dst_box)
    dst = np.full(box_shape(dst_box), -1, np.int64)
    written = np.zeros(box_shape(dst_box), np.int64)
    for it in items:
        assert box_shape(it.src_box) == box_shape(it.dst_box)
        assert box_volume(it.src_box) > 0 or not shape
        src = stored[it.chunk]
        dst[box_to_slices(it.dst_box)] = src[box_to_slices(it.src_box)]
        written[box_to_slices(it.dst_box)] += 1
    np.testing.assert_array_equal(dst, global_arr[box_to_slices(dst_box)])
    np.testing.assert_array_equal(written, np.ones_like(written))
    # Only overlapping chunks are read, each once.
    expected_chunks = {c for c in leaf.chunks if intersect(c.box, dst_box) is not None}
    assert [it.chunk for it in items] == [c for c in leaf.chunks if c in expected_chunks]


@SETTINGS
@given(st.data())
def test_plan_leaf_reads_detects_missing_chunk(data: st.DataObject) -> None:
    shape = data.draw(shapes(max_rank=3, max_side=6, min_side=1))
    boxes = data.draw(tilings(shape))
    dst_box = data.draw(boxes_in(shape))
    hit = [b for b in boxes if intersect(b, dst_box) is not None]
    drop = data.draw(st.sampled_from(hit))
    leaf = make_leaf(shape, [b for b in boxes if b != drop])
    with pytest.raises(CorruptionError, match="cover"):
        plan_leaf_reads(leaf, dst_box)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_chunk_index_finds_exactly_the_overlapping_chunks(data: st.DataObject) -> None:
    """Against the scan, for tilings (guillotine cuts: not a grid), tilings with extra
    overlapping or repeated boxes (malformed manifests), and empty query boxes."""
    shape = data.draw(shapes(max_rank=3, max_side=7))
    boxes = data.draw(tilings(shape, max_pieces=12))
    extra = data.draw(st.lists(boxes_in(shape, allow_empty=True), max_size=3))  # overlaps, repeats
    boxes += extra
    leaf = make_leaf(shape, data.draw(st.permutations(boxes)))
    index = ChunkIndex(leaf.chunks)
    tiling = make_leaf(
        shape, boxes[: len(boxes) - len(extra)]
    )  # disjoint: the exact-box lookup may answer
    disjoint = ChunkIndex(tiling.chunks, disjoint=True)
    for _ in range(4):
        box = data.draw(st.one_of(boxes_in(shape, allow_empty=True), st.sampled_from(boxes)))
        scan = [(c, o) for c in leaf.chunks if (o := intersect(c.box, box)) is not None]
        assert index.overlapping(box) == scan
        tiled = [(c, o) for c in tiling.chunks if (o := intersect(c.box, box)) is not None]
        assert disjoint.overlapping(box) == tiled
        try:
            expected = plan_leaf_reads(leaf, box)
        except CorruptionError:
            with pytest.raises(CorruptionError, match="cover"):
                plan_leaf_reads(leaf, box, index=index)
        else:
            assert plan_leaf_reads(leaf, box, index=index) == expected


def test_chunk_index_of_a_grid_tests_only_the_band_it_overlaps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 64 x 8 grid queried with one chunk's box: the band along the most-split dimension
    holds that row's 8 chunks, and only those are intersected (not all 512)."""
    import fastckpt.planning.load_plan as load_plan

    boxes = [((8 * i, 8 * i + 8), (4 * j, 4 * j + 4)) for i in range(64) for j in range(8)]
    index = ChunkIndex(make_leaf((512, 32), boxes).chunks)
    tested: list[Box] = []
    real = load_plan.intersect
    monkeypatch.setattr(load_plan, "intersect", lambda a, b: tested.append(a) or real(a, b))
    [(chunk, overlap)] = index.overlapping(boxes[77])
    assert chunk.box == overlap == boxes[77]
    assert sorted(tested) == boxes[72:80]


def test_chunk_index_of_mixed_ranks_scans_and_refuses_like_the_scan() -> None:
    from fastckpt.errors import ConfigError

    leaf = make_leaf((4, 4), [((0, 4), (0, 4))])
    odd = ChunkEntry(
        box=(), key="obj/x", offset=0, length=8, raw_length=8, codec="raw", crc32c=0, raw_crc32c=0
    )
    index = ChunkIndex((*leaf.chunks, odd))
    with pytest.raises(ConfigError, match="rank"):
        index.overlapping(((0, 2), (0, 2)))
    assert ChunkIndex(()).overlapping(((0, 2),)) == []


def test_plan_leaf_reads_zero_d() -> None:
    leaf = make_leaf((), [()])
    (item,) = plan_leaf_reads(leaf, ())
    assert item.src_box == () and item.dst_box == ()


# ------------------------------------------------------------------ coalesce_fetches


@st.composite
def fetch_cases(draw: st.DrawFn) -> tuple[list[ChunkEntry], int, int]:
    chunks = []
    for key in draw(
        st.lists(st.sampled_from(["a", "b/c", "d/e/f"]), min_size=1, max_size=3, unique=True)
    ):
        pos = 0
        for _ in range(draw(st.integers(1, 12))):
            pos += draw(st.integers(0, 50))  # gap before the chunk
            length = draw(st.integers(0, 80))
            chunks.append(
                ChunkEntry(
                    box=((0, length),),
                    key=key,
                    offset=pos,
                    length=length,
                    raw_length=length,
                    codec="raw",
                    crc32c=0,
                    raw_crc32c=0,
                )
            )
            pos += length
    # Ask for a random subset, some chunks twice, in random order.
    wanted = draw(st.lists(st.sampled_from(chunks), min_size=1, max_size=2 * len(chunks)))
    return wanted, draw(st.integers(0, 60)), draw(st.integers(1, 300))


@settings(max_examples=200, deadline=None)
@given(fetch_cases())
def test_coalesce_fetches_each_chunk_once_within_bounds(
    case: tuple[list[ChunkEntry], int, int],
) -> None:
    wanted, max_gap, max_bytes = case
    ranges = coalesce_fetches(wanted, max_gap=max_gap, max_bytes=max_bytes)
    seen = [(c.key, c.offset) for r in ranges for c in r.chunks]
    assert sorted(seen) == sorted({(c.key, c.offset) for c in wanted})  # each exactly once
    by_key: dict[str, list] = {}
    for r in ranges:
        assert r.chunks
        assert all(c.key == r.key for c in r.chunks)
        assert r.start == min(c.offset for c in r.chunks)
        assert r.start + r.length == max(c.offset + c.length for c in r.chunks)
        assert r.length <= max_bytes or len(r.chunks) == 1
        ordered = sorted(r.chunks, key=lambda c: c.offset)
        end = ordered[0].offset + ordered[0].length
        for c in ordered[1:]:
            assert c.offset - end <= max_gap  # merged only across small gaps
            end = max(end, c.offset + c.length)
        by_key.setdefault(r.key, []).append(r)
    for rs in by_key.values():
        rs.sort(key=lambda r: r.start)
        for prev, nxt in itertools.pairwise(rs):
            assert prev.start + prev.length <= nxt.start  # ranges of one object never overlap
            # Greedy maximality: the next range was not merged for a reason.
            first = min(nxt.chunks, key=lambda c: c.offset)
            assert (
                first.offset - (prev.start + prev.length) > max_gap
                or first.offset + first.length - prev.start > max_bytes
            )


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_grid_index_answers_like_the_scan(data: st.DataObject) -> None:
    """A chunk table over a grid (empty cells where cuts repeat, as a manifest from another
    writer may hold) is bisected: the same pairs as scanning its entries, for any query box
    (empty ones, ones reaching past the array, each chunk's own), and the same read plans
    with or without an index as the tuple of its entries."""
    import dataclasses

    from fastckpt.format.manifest import ChunkTable
    from fastckpt.planning import GridIndex, leaf_index

    shape = data.draw(shapes(max_rank=3, max_side=7))
    cuts = [[0, *sorted(data.draw(st.lists(st.integers(0, n), max_size=3))), n] for n in shape]
    n = math.prod(len(c) - 1 for c in cuts)
    table = ChunkTable(
        cuts=cuts,
        boxes=None,
        keys=["obj/0", "obj/1"],
        object_index=np.arange(n) % 2,
        offsets=np.arange(n) * 1000,
        lengths=np.zeros(n, np.int64),
        codec="zstd",
        crc32c=np.arange(n, dtype=np.uint32),
        raw_crc32c=np.zeros(n, np.uint32),
        itemsize=8,
    )
    entries = tuple(table)
    leaf = ArrayLeaf(path=(("d", "w"),), shape=shape, dtype="int64", chunks=table)
    index = leaf_index(leaf)
    assert isinstance(index, GridIndex)
    wide = st.tuples(*[st.tuples(st.integers(-2, n + 2), st.integers(-2, n + 2)) for n in shape])
    for _ in range(4):
        box = data.draw(
            st.one_of(
                boxes_in(shape, allow_empty=True), st.sampled_from([c.box for c in entries]), wide
            )
        )
        assert index.overlapping(box) == [
            (c, o) for c in entries if (o := intersect(c.box, box)) is not None
        ]
        if not all(0 <= a <= b <= n for (a, b), n in zip(box, shape)):
            continue
        expected = plan_leaf_reads(
            dataclasses.replace(leaf, chunks=listed_table(list(entries), 8)), box
        )
        assert plan_leaf_reads(leaf, box) == expected == plan_leaf_reads(leaf, box, index=index)


def test_grid_index_builds_only_the_entries_it_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planning one device's box of a leaf saved by 512 devices builds one entry, not 512,
    and refuses a box of another rank like the scan does."""
    from fastckpt.errors import ConfigError
    from fastckpt.format.codec import decode_manifest, encode_manifest
    from fastckpt.format.manifest import ChunkTable, Manifest
    from fastckpt.planning import GridIndex, leaf_index

    boxes = [((8 * i, 8 * i + 8), (4 * j, 4 * j + 4)) for i in range(64) for j in range(8)]
    [leaf] = decode_manifest(
        encode_manifest(Manifest(step=1, leaves=(make_leaf((512, 32), boxes),)))
    ).arrays()
    built: list[int] = []
    real = ChunkTable.__getitem__
    monkeypatch.setattr(ChunkTable, "__getitem__", lambda self, i: built.append(i) or real(self, i))
    [item] = plan_leaf_reads(leaf, boxes[77])
    assert item.chunk.box == boxes[77] and built == [77]
    assert [c.box for c, _ in leaf_index(leaf).overlapping(((4, 12), (0, 32)))] == boxes[:16]
    with pytest.raises(ConfigError, match="rank"):
        GridIndex(leaf.chunks).overlapping(((0, 2),))
    with pytest.raises(ConfigError, match="grid"):
        GridIndex(
            decode_manifest(
                encode_manifest(Manifest(step=1, leaves=(make_leaf((512, 32), boxes[::-1]),)))
            )
            .arrays()[0]
            .chunks
        )  # type: ignore[arg-type]
    assert isinstance(leaf_index(make_leaf((512, 32), boxes)), ChunkIndex)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_needed_chunks_are_the_chunks_each_box_overlaps(data: st.DataObject) -> None:
    """What a process's restore of some boxes reads, as chunk id -> object key: exactly the
    chunks overlapping a box with a non-empty intersection, of any tiling, over several
    leaves (each indexed once)."""
    from fastckpt.format.manifest import chunk_id
    from fastckpt.planning import needed_chunks

    leaves, wants, expected = [], [], set()
    for k in range(data.draw(st.integers(1, 3))):
        shape = data.draw(shapes(max_rank=3, max_side=6))
        boxes = data.draw(tilings(shape, max_pieces=6))
        leaf = ArrayLeaf(
            path=(("d", f"w{k}"),),
            shape=shape,
            dtype="uint8",
            chunks=listed_table(
                [
                    ChunkEntry(b, f"obj/{k}/{i}", 0, box_volume(b), box_volume(b), "raw", 0, 0)
                    for i, b in enumerate(boxes)
                ],
                1,
            ),
        )
        leaves.append(leaf)
        for _ in range(data.draw(st.integers(0, 3))):
            box = data.draw(boxes_in(shape, allow_empty=True))
            wants.append((leaf, box))
            expected |= {
                (chunk_id(leaf.path, c.box), c.key)
                for c in leaf.chunks
                if (o := intersect(c.box, box)) is not None and box_volume(o) > 0
            }
    assert needed_chunks(wants).items() == expected
