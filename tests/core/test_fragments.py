"""Fragments and their column-wise merge on process 0: the merged manifest is exactly the one
built entry by entry, whatever the split among processes; every flaw is a ManifestError."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastckpt.errors import ManifestError, NotFoundError
from fastckpt.format.codec import decode_manifest, encode_manifest
from fastckpt.format.layout import data_key, fragment_key
from fastckpt.format.manifest import ArrayLeaf, ChunkEntry, KeyPath, Manifest, box_volume
from fastckpt.testing.strategies import manifests
from fastckpt.testing.threaded_job import ThreadedJob
from fastckpt.writer.commit import build_manifest, exchange_ram_manifest
from fastckpt.storage import MemoryStore
from fastckpt.testing.wrapping import ForwardingStore
from fastckpt.writer import commit, merge
from fastckpt.writer.fragment import encode_fragment, pack_fragment, unpack_fragment
from fastckpt.writer.merge import merge_fragments
from fastckpt.writer.stage import StagedArray, StagedSave

W: KeyPath = (("d", "params"), ("d", "w"))
B: KeyPath = (("d", "params"), ("d", "b"))


def _staged_of(arrays: list[ArrayLeaf]) -> StagedSave:
    staged = tuple(StagedArray(path=a.path, shape=a.shape, dtype=a.dtype, kind=a.kind, sharding=a.sharding,
                               key_impl=a.key_impl, items=(), item_offsets=()) for a in arrays)
    return StagedSave(arrays=staged, values=(), buffer=np.zeros(0, np.uint8), nbytes=0,
                      order=tuple(a.path for a in arrays))


def _build(staged: StagedSave, fragments: list[bytes], **kw: Any) -> Manifest:
    data = build_manifest(step=5, staged=staged, fragments=fragments, num_processes=len(fragments), metadata={},
                          writer_version="test", **kw)
    return decode_manifest(data)


def _entry_by_entry(arrays: list[ArrayLeaf]) -> tuple[ArrayLeaf, ...]:
    """The oracle: each leaf's chunks sorted by box, as the commit did before the merge."""
    return tuple(dataclasses.replace(a, chunks=tuple(sorted(a.chunks, key=lambda c: c.box))) for a in arrays)


@pytest.mark.parametrize("small", [merge._SMALL, 0])  # grids recognised on tuples / with numpy
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=manifests(max_leaves=4), data=st.data())
def test_any_split_among_processes_merges_to_the_entry_by_entry_manifest(small: int, m: Manifest,
                                                                          data: st.DataObject) -> None:
    arrays = list(m.arrays())
    staged = _staged_of(arrays)
    nproc = data.draw(st.integers(1, 4))
    parts: list[dict[int, list[ChunkEntry]]] = [{} for _ in range(nproc)]
    for i, a in enumerate(arrays):
        for c in data.draw(st.permutations(a.chunks)):
            parts[data.draw(st.integers(0, nproc - 1))].setdefault(i, []).append(c)
    fragments = [encode_fragment(staged, part, p) for p, part in enumerate(parts)]
    for version in (2, 1):
        with mock.patch.object(merge, "_SMALL", small):
            got = _build(staged, fragments, format_version=version).arrays()
        assert [[c.box for c in a.chunks] for a in got] == [[c.box for c in a.chunks] for a in _entry_by_entry(arrays)]
        # Equal boxes (empty ones: allowed) may come in either order; the entries are the same.
        assert [sorted(a.chunks, key=_full) for a in got] == [sorted(a.chunks, key=_full) for a in arrays]
        assert [dataclasses.replace(a, chunks=()) for a in got] == [dataclasses.replace(a, chunks=()) for a in arrays]


def _full(c: ChunkEntry) -> tuple[Any, ...]:
    return (c.box, c.key, c.offset, c.length, c.codec, c.crc32c, c.raw_crc32c)


def _leaf(rows: int, cols: int) -> ArrayLeaf:
    """w (8 x 6 f32) saved by ``rows`` x ``cols`` devices; process ``i`` writes grid row ``i``."""
    chunks = []
    for i in range(rows):
        for j in range(cols):
            box = ((i * 8 // rows, (i + 1) * 8 // rows), (j * 6 // cols, (j + 1) * 6 // cols))
            n = box_volume(box) * 4
            chunks.append(ChunkEntry(box, data_key(5, "c0ffee", i, 0), n * j, n, n, "raw", 7 * i + j, 7 * i + j))
    return ArrayLeaf(path=W, shape=(8, 6), dtype="float32", chunks=tuple(chunks))


def _fragments(leaf: ArrayLeaf, staged: StagedSave, rows: int) -> list[bytes]:
    per = len(leaf.chunks) // rows
    return [encode_fragment(staged, {0: list(leaf.chunks[i * per:(i + 1) * per])}, i) for i in reversed(range(rows))]


def test_a_sharded_leaf_becomes_a_grid_and_a_zero_d_leaf_one_cell() -> None:
    w = _leaf(4, 2)
    b = ArrayLeaf(path=B, shape=(), dtype="bfloat16", chunks=(ChunkEntry((), "steps/x/p0.fck", 96, 2, 2, "raw", 1, 1),))
    staged = _staged_of([w, b])
    fragments = _fragments(w, staged, 4)
    fragments[-1] = encode_fragment(staged, {0: list(w.chunks[:2]), 1: list(b.chunks)}, 0)
    objects, tables = merge_fragments(fragments, staged)
    assert tables[W]["grid"] == [[0, 2, 4, 6, 8], [0, 3, 6]] and tables[B]["grid"] == []
    assert [objects[i] for i in tables[W]["object"]] == [c.key for c in w.chunks]  # C order, whoever wrote it
    assert _build(staged, fragments).arrays() == (w, b)


@pytest.mark.parametrize("change, match", [
    (lambda parts: parts.append(parts[1]), "tile"),  # a process's chunks twice (volumes too large)
    (lambda parts: parts.pop(2), "tile"),  # a process's chunks missing
])
def test_overlapping_or_missing_parts_fail(change: Callable[[list[bytes]], Any], match: str) -> None:
    w = _leaf(4, 2)
    staged = _staged_of([w])
    fragments = _fragments(w, staged, 4)
    change(fragments)
    with pytest.raises(ManifestError, match=match):
        build_manifest(step=5, staged=staged, fragments=fragments, num_processes=4, metadata={}, writer_version="")


def _good_part() -> bytes:
    """Process 1's half of a 2 x 2-chunk leaf (its two chunks)."""
    w = _leaf(2, 2)
    return encode_fragment(_staged_of([w]), {0: list(w.chunks[2:])}, 1)


def _edit(change: Callable[[dict[str, Any]], Any] = lambda d: None,
          header: Callable[[dict[str, Any]], Any] = lambda h: None) -> bytes:
    """``_good_part()`` with its columns (as int lists) and its header fields edited."""
    head, cols = unpack_fragment(_good_part(), "good")
    doc = {k: v.tolist() for k, v in cols.items()}
    fields = {k: v for k, v in head.items() if k != "columns"}
    change(doc)
    header(fields)
    return pack_fragment(fields, {k: np.asarray(v, np.uint64) for k, v in doc.items()})


def _with_column(name: str, values: np.ndarray) -> bytes:
    """``_good_part()`` with column ``name`` stored as ``values`` (their dtype as given)."""
    header, cols = unpack_fragment(_good_part(), "good")
    return pack_fragment({k: v for k, v in header.items() if k != "columns"}, {**cols, name: values})


def _spliced(change: Callable[[bytes], bytes]) -> bytes:
    return change(_good_part())


_HEAD = 16  # magic + header length


@pytest.mark.parametrize("data", [
    b"", b"{", b"[]", b"FCKFRAG\x01", b"FCKFRAG\x02" + bytes(8) + b"{}",
    _spliced(lambda b: b"JSONFRAG" + b[8:]),  # not our magic
    _spliced(lambda b: b[:8] + (2**40).to_bytes(8, "little") + b[16:]),  # header length past the end
    _spliced(lambda b: b[:_HEAD] + b"[" + b[_HEAD + 1:]),  # header not JSON
    _spliced(lambda b: b[:-1]),  # the last column cut short
    _spliced(lambda b: b + b"\0"),  # a byte after the last column
    _edit(header=lambda h: h.pop("objects")),
    _edit(header=lambda h: h.update(process=-1)),
    _edit(header=lambda h: h.update(objects=["../escape"])),
    _edit(header=lambda h: h.update(objects="steps/x")),
    _edit(header=lambda h: h.update(paths=[[["d", "params"], ["d", "v"]]])),
    _edit(header=lambda h: h.update(paths=[[["d"]]])),
    _edit(header=lambda h: h.update(paths=[[[["d"], "params"]]])),
    _edit(header=lambda h: h.update(paths=7)),
    _edit(lambda d: d.update(array=[0, 1])),  # an array index past "paths"
    _edit(lambda d: d.update(array=[0])),  # fewer array indices than chunks
    _edit(lambda d: d.pop("crc32c")),  # a column missing
    _edit(lambda d: d.update(codec=[0, 1])),  # a codec column beside a single codec
    _edit(header=lambda h: h.update(codec=None)),  # mixed codecs without the column
    _edit(lambda d: d.update(codec=[0, 2]), header=lambda h: h.update(codec=None)),  # an unknown codec code
    _edit(lambda d: d.update(boxes=d["boxes"][:-1])),
    _edit(lambda d: d.update(boxes=[4, 8, 0, 3, 4, 8, 3, 7])),  # past the edge
    _edit(lambda d: d.update(boxes=[8, 4, 0, 3, 4, 8, 3, 6])),  # reversed
    _edit(lambda d: d.update(object=[0, 1])),
    _edit(lambda d: d.update(offset=[0])),
    _edit(lambda d: d.update(offset=[0, 2**63])),  # beyond int64
    _edit(lambda d: d.update(length=[48, 47])),  # a raw chunk's length is its box's bytes
    _edit(lambda d: d.update(crc32c=[0, 2**32])),
    _edit(header=lambda h: h.update(codec="lz4")),
    _edit(header=lambda h: h.update(codec=["raw"])),
    _with_column("offset", np.zeros(2, "<i8")),  # signed
    _with_column("offset", np.zeros(2, "<f8")),  # float
    _with_column("offset", np.zeros(2, ">u8")),  # big-endian
], ids=lambda d: repr(d[:60]))
def test_malformed_fragments_raise_manifest_error(data: bytes) -> None:
    w = _leaf(2, 2)
    staged = _staged_of([w])
    good = _fragments(w, staged, 2)[1]  # process 0's half
    merge_fragments([good, _good_part()], staged)  # the unedited part merges
    with pytest.raises(ManifestError):
        merge_fragments([good, data], staged)


@settings(max_examples=200, deadline=None)
@given(cut=st.integers(0, 10_000), junk=st.binary(max_size=64), at=st.integers(0, 10_000))
def test_truncated_or_overwritten_fragments_raise_only_manifest_error(cut: int, junk: bytes, at: int) -> None:
    """No byte string, however broken, gets past the decoder as anything but ManifestError:
    every prefix is refused; junk written over any part is refused or decodes to columns the
    merge then checks (a changed crc is a valid fragment)."""
    w = _leaf(2, 2)
    staged = _staged_of([w])
    good = _good_part()
    with pytest.raises(ManifestError):
        merge_fragments([_fragments(w, staged, 2)[1], good[:cut % len(good)]], staged)
    at %= len(good)
    bad = good[:at] + junk + good[at + len(junk):]
    try:
        merge_fragments([_fragments(w, staged, 2)[1], bad], staged)
    except ManifestError:
        pass


def test_fragment_columns_are_narrow_binary() -> None:
    """Values small enough for one byte take one byte; the layout is what the docstring says."""
    header, cols = unpack_fragment(_good_part(), "good")
    assert header["codec"] == "raw" and "codec" not in cols
    assert {k: v.dtype.str for k, v in cols.items()} == {
        "array": "|u1", "boxes": "|u1", "object": "|u1", "offset": "|u1", "length": "|u1", "crc32c": "|u1",
        "raw_crc32c": "|u1"}
    assert cols["boxes"].tolist() == [4, 8, 0, 3, 4, 8, 3, 6] and cols["crc32c"].tolist() == [7, 8]


def test_ready_tables_need_format_2_and_empty_leaves() -> None:
    w = _leaf(1, 1)
    with pytest.raises(ManifestError, match="ready chunk tables"):
        encode_manifest(Manifest(step=1, leaves=(w,)), tables=([], {W: {}}))


def test_overlapping_boxes_of_the_same_total_volume_fail() -> None:
    w = _leaf(2, 2)
    staged = _staged_of([w])
    shifted = _edit(lambda d: d.update(boxes=[3, 7, 0, 3, 3, 7, 3, 6]))  # rows 3-7, not 4-8
    with pytest.raises(ManifestError, match="overlap"):
        merge_fragments([_fragments(w, staged, 2)[1], shifted], staged)


@pytest.mark.parametrize("broadcast", [True, False])
def test_ram_manifest_exchange_holds_before_announcing_and_broadcasts_only_when_asked(broadcast: bool) -> None:
    """Process 0 merges the fragments, holds the manifest (stores it) before the others
    learn of it, and sends it through the coordinator only with ``broadcast``; otherwise
    the record is a few bytes and the others get None (they fetch it from a peer later)."""
    w = _leaf(4, 2)
    staged = _staged_of([w])
    coords = ThreadedJob.of(4)
    held: list[tuple[int, bytes, bool]] = []

    def process(i: int) -> bytes | None:
        per = len(w.chunks) // 4
        return exchange_ram_manifest(
            coord=coords[i], ns="ns", step=5, staged=staged,
            chunks={0: list(w.chunks[i * per:(i + 1) * per])},
            timeout_s=30, metadata={}, writer_version="test", broadcast=broadcast,
            hold=lambda data: held.append((i, data, "ns/rammanifest" in coords[0].keys())))

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(process, range(4)))
    [(who, data, announced)] = held
    assert who == 0 and not announced and got[0] == data
    assert decode_manifest(data).arrays() == (w,)
    if broadcast:
        assert got[1:] == [data] * 3 and coords[0].get("ns/rammanifest", timeout_s=1) == data.decode()
    else:
        assert got[1:] == [None] * 3 and len(coords[0].get("ns/rammanifest", timeout_s=1)) < 32


class _CountingReads(ForwardingStore):
    """Counts the reads in flight at once (each takes ``delay_s``)."""

    def __init__(self, inner: MemoryStore, delay_s: float) -> None:
        super().__init__(inner)
        self.delay_s, self.now, self.peak = delay_s, 0, 0

    async def get(self, key: str, *, byte_range: Any = None) -> Any:
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            await asyncio.sleep(self.delay_s)
            return await self.inner.get(key, byte_range=byte_range)
        finally:
            self.now -= 1


def test_process_0_reads_the_fragments_concurrently_in_order_and_raises_a_failed_read_as_itself() -> None:
    store = _CountingReads(MemoryStore(), delay_s=0.01)
    keys = [fragment_key(5, "c0ffee", i) for i in range(100)]

    async def put_all() -> None:
        for i, k in enumerate(keys):
            await store.put(k, b"fragment %d" % i)

    asyncio.run(put_all())
    assert asyncio.run(commit._read_all(store, keys)) == [b"fragment %d" % i for i in range(100)]
    assert store.peak == commit._FRAGMENT_READS  # not one at a time, and bounded
    with pytest.raises(NotFoundError):
        asyncio.run(commit._read_all(store, [*keys[:50], fragment_key(5, "c0ffee", 999), *keys[50:]]))
