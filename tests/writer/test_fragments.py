"""Each process's chunks, its fragment and process 0's column-wise merge: the merged manifest is
exactly the one built entry by entry, whatever the split among processes, through fragments or
not; a fragment is the manifest's chunk-table encoding; a single process encodes none; every
flaw is a ManifestError."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastckpt.errors import DistributedError, ManifestError, NotFoundError
from fastckpt.format.chunk_table import encode_column, table_from_entries
from fastckpt.format.codec import decode_manifest
from fastckpt.format.layout import data_key, fragment_key
from fastckpt.format.manifest import (
    ArrayLeaf,
    ChunkEntry,
    ChunkTable,
    KeyPath,
    Manifest,
    box_volume,
)
from fastckpt.storage import MemoryStore
from fastckpt.testing.strategies import manifests
from fastckpt.writer import commit, fragment, merge
from fastckpt.writer.commit import (
    CommitRound,
    CoordinatorFragments,
    build_manifest,
    publish_and_commit,
)
from fastckpt.writer.fragment import ChunkRows, ProcessChunks, decode_fragments, encode_fragment
from fastckpt.writer.merge import merge_chunks
from fastckpt.writer.stage import StagedArray, StagedSave
from tests.support.threaded_job import ThreadedJob
from tests.support.wrapping import ForwardingStore

W: KeyPath = (("d", "params"), ("d", "w"))
B: KeyPath = (("d", "params"), ("d", "b"))


def _staged_of(arrays: list[ArrayLeaf]) -> StagedSave:
    staged = tuple(
        StagedArray(
            path=a.path,
            shape=a.shape,
            dtype=a.dtype,
            kind=a.kind,
            sharding=a.sharding,
            key_impl=a.key_impl,
            items=(),
            item_offsets=(),
        )
        for a in arrays
    )
    return StagedSave(
        arrays=staged,
        values=(),
        buffer=np.zeros(0, np.uint8),
        nbytes=0,
        order=tuple(a.path for a in arrays),
    )


def _part(chunks: dict[int, list[ChunkEntry]]) -> ProcessChunks:
    """One process's chunks (``chunks[i]``: of staged array ``i``), as the writer builds them."""
    rows = ChunkRows()
    for i, entries in chunks.items():
        for c in entries:
            rows.add(i, c.box, c.key, c.offset, c.length, c.codec, c.crc32c, c.raw_crc32c)
    return rows.build()


def _round(coord: Any, staged: StagedSave) -> CommitRound:
    return CommitRound(
        coord=coord, ns="ns", step=5, staged=staged, timeout_s=30, writer_version="test"
    )


def _via_coordinator(
    coord: Any,
    staged: StagedSave,
    chunks: ProcessChunks,
    publish: Callable[[bytes], None],
    share: bool = False,
) -> bytes | None:
    """A fast tier's commit round: fragments through the coordinator, no codec round trip."""
    rnd = _round(coord, staged)
    return rnd.commit(
        chunks,
        route=CoordinatorFragments(round=rnd),
        publish=publish,
        metadata={},
        validate=False,
        share=share,
    )


def _build(staged: StagedSave, parts: list[ProcessChunks]) -> Manifest:
    return decode_manifest(
        build_manifest(
            step=5,
            staged=staged,
            parts=parts,
            num_processes=len(parts),
            metadata={},
            writer_version="test",
        )
    )


def _merge(fragments: list[bytes], staged: StagedSave) -> dict[KeyPath, ChunkTable]:
    return merge_chunks(decode_fragments(fragments, staged), staged)


def _full(c: ChunkEntry) -> tuple[Any, ...]:
    return (c.box, c.key, c.offset, c.length, c.codec, c.crc32c, c.raw_crc32c)


@pytest.mark.parametrize("small", [merge._SMALL, 0])  # grids recognised on tuples / with numpy
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=manifests(max_leaves=4), data=st.data())
def test_any_split_among_processes_merges_to_the_entry_by_entry_manifest(
    small: int, m: Manifest, data: st.DataObject
) -> None:
    """Each leaf's chunks, dealt to 1-4 processes in any order: merged directly or through
    every process's fragment, the manifest holds each leaf's chunks sorted by box."""
    arrays = list(m.arrays())
    staged = _staged_of(arrays)
    nproc = data.draw(st.integers(1, 4))
    split: list[dict[int, list[ChunkEntry]]] = [{} for _ in range(nproc)]
    for i, a in enumerate(arrays):
        for c in data.draw(st.permutations(list(a.chunks))):
            split[data.draw(st.integers(0, nproc - 1))].setdefault(i, []).append(c)
    parts = [_part(s) for s in split]
    fragments = [encode_fragment(part, staged, p) for p, part in enumerate(parts)]
    with mock.patch.object(merge, "_SMALL", small):
        direct = _build(staged, parts).arrays()
        through = _build(staged, decode_fragments(fragments, staged)).arrays()
    assert direct == through
    want = [sorted(a.chunks, key=lambda c: c.box) for a in arrays]
    assert [[c.box for c in a.chunks] for a in direct] == [[c.box for c in w] for w in want]
    # Equal boxes (empty ones: allowed) may come in either order; the entries are the same.
    assert [sorted(a.chunks, key=_full) for a in direct] == [
        sorted(a.chunks, key=_full) for a in arrays
    ]
    assert [(a.path, a.shape, a.dtype, a.kind, a.sharding, a.key_impl) for a in direct] == [
        (a.path, a.shape, a.dtype, a.kind, a.sharding, a.key_impl) for a in arrays
    ]


def _entries(rows: int, cols: int) -> list[ChunkEntry]:
    """w (8 x 6 f32) saved by ``rows`` x ``cols`` devices; process ``i`` writes grid row ``i``."""
    chunks = []
    for i in range(rows):
        for j in range(cols):
            box = ((i * 8 // rows, (i + 1) * 8 // rows), (j * 6 // cols, (j + 1) * 6 // cols))
            n = box_volume(box) * 4
            chunks.append(
                ChunkEntry(
                    box, data_key(5, "c0ffee", i, 0), n * j, n, n, "raw", 7 * i + j, 7 * i + j
                )
            )
    return chunks


def _leaf(rows: int, cols: int) -> ArrayLeaf:
    return ArrayLeaf(
        path=W,
        shape=(8, 6),
        dtype="float32",
        chunks=table_from_entries(_entries(rows, cols), shape=(8, 6), itemsize=4),
    )


def _parts(rows: int, cols: int) -> list[ProcessChunks]:
    """Process ``i``'s part of :func:`_leaf`, processes in reverse order."""
    entries = _entries(rows, cols)
    return [_part({0: entries[i * cols : (i + 1) * cols]}) for i in reversed(range(rows))]


def _fragments(staged: StagedSave, rows: int, cols: int) -> list[bytes]:
    return [encode_fragment(p, staged, i) for i, p in enumerate(_parts(rows, cols))]


def test_a_sharded_leaf_becomes_a_grid_and_a_zero_d_leaf_one_cell() -> None:
    w = _leaf(4, 2)
    b_entry = ChunkEntry((), "steps/x/p0.fck", 96, 2, 2, "raw", 1, 1)
    b = ArrayLeaf(
        path=B,
        shape=(),
        dtype="bfloat16",
        chunks=table_from_entries([b_entry], shape=(), itemsize=2),
    )
    staged = _staged_of([w, b])
    fragments = _fragments(staged, 4, 2)
    fragments[-1] = encode_fragment(_part({0: _entries(4, 2)[:2], 1: [b_entry]}), staged, 0)
    tables = _merge(fragments, staged)
    assert tables[W].grid == ((0, 2, 4, 6, 8), (0, 3, 6)) and tables[B].grid == ()
    assert list(tables[W]) == _entries(4, 2)  # C order, whoever wrote it
    assert _build(staged, decode_fragments(fragments, staged)).arrays() == (w, b)


@pytest.mark.parametrize(
    "change, match",
    [
        (
            lambda parts: parts.append(parts[1]),
            "tile",
        ),  # a process's chunks twice (volumes too large)
        (lambda parts: parts.pop(2), "tile"),  # a process's chunks missing
    ],
)
def test_overlapping_or_missing_parts_fail(change: Callable[[list[Any]], Any], match: str) -> None:
    staged = _staged_of([_leaf(4, 2)])
    for parts in (_parts(4, 2), _fragments(staged, 4, 2)):
        change(parts)
        if isinstance(parts[0], bytes):
            parts = decode_fragments(parts, staged)
        with pytest.raises(ManifestError, match=match):
            build_manifest(
                step=5, staged=staged, parts=parts, num_processes=4, metadata={}, writer_version=""
            )


def _good_part() -> bytes:
    """Process 1's half of a 2 x 2-chunk leaf (its two chunks), as its fragment."""
    return encode_fragment(_part({0: _entries(2, 2)[2:]}), _staged_of([_leaf(2, 2)]), 1)


def _edit(change: Callable[[dict[str, Any]], Any]) -> bytes:
    """``_good_part()`` with its JSON document edited."""
    doc = json.loads(_good_part())
    change(doc)
    return json.dumps(doc).encode()


def _col(name: str, values: Any) -> bytes:
    """``_good_part()`` with column ``name`` set: a list of ints is encoded as a binary column."""
    value = encode_column(values) if isinstance(values, list) and name != "codec" else values
    return _edit(lambda d: d["chunks"].__setitem__(name, value))


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"{",
        b"[]",
        b"null",
        b"\xff\xfe",
        b"FCKFRAG\x01" + bytes(8) + b"{}",
        _good_part()[:-1],  # cut short
        _good_part() + b"\0",
        _edit(lambda d: d.pop("objects")),
        _edit(lambda d: d.pop("format_version")),
        _edit(lambda d: d.update(format_version=2)),
        _edit(lambda d: d.update(format_version="3")),
        _edit(lambda d: d.update(format_version=True)),
        _edit(lambda d: d.update(process=-1)),
        _edit(lambda d: d.update(objects=["../escape"])),
        _edit(lambda d: d.update(objects="steps/x")),
        _edit(lambda d: d.update(paths=[[["d", "params"], ["d", "v"]]])),
        _edit(lambda d: d.update(paths=[[["d"]]])),
        _edit(lambda d: d.update(paths=[[[["d"], "params"]]])),
        _edit(lambda d: d.update(paths=7)),
        _edit(lambda d: d.update(chunks=[])),
        _edit(lambda d: d["chunks"].pop("crc32c")),  # a column missing
        _col("array", [0, 1]),  # an array index past "paths"
        _col("array", [0]),  # fewer array indices than chunks
        _col("codec", "lz4"),
        _col("codec", ["raw"]),  # a codec list of the wrong length
        _col("codec", ["raw", "lz4"]),
        _col("codec", None),
        _col("boxes", [4, 8, 0, 3, 4, 8, 3]),  # one bound short
        _col("boxes", [4, 8, 0, 3, 4, 8, 3, 7]),  # past the edge
        _col("boxes", [8, 4, 0, 3, 4, 8, 3, 6]),  # reversed
        _col("object", [0, 1]),  # past "objects"
        _col("offset", [0]),
        _col("offset", [0, 2**63]),  # beyond int64
        _col("length", [48, 47]),  # a raw chunk's length is its box's bytes
        _col("crc32c", [0, 2**32]),
        _col("offset", "[0, 48]"),  # not a binary column
        _col("offset", "i8:" + encode_column([0, 48]).split(":")[1]),  # a signed kind
        _col("offset", "u1:A!A="),  # not base64
        _col("offset", "u2:AAAA"),  # 3 bytes: not a whole number of u2 values
    ],
    ids=lambda d: repr(d[:60]),
)
def test_malformed_fragments_raise_manifest_error(data: bytes) -> None:
    staged = _staged_of([_leaf(2, 2)])
    good = _fragments(staged, 2, 2)[1]  # process 0's half
    _merge([good, _good_part()], staged)  # the unedited part merges
    with pytest.raises(ManifestError):
        _merge([good, data], staged)


@settings(max_examples=200, deadline=None)
@given(cut=st.integers(0, 10_000), junk=st.binary(max_size=64), at=st.integers(0, 10_000))
def test_truncated_or_overwritten_fragments_raise_only_manifest_error(
    cut: int, junk: bytes, at: int
) -> None:
    """No byte string, however broken, gets past the decoder as anything but ManifestError:
    every prefix is refused; junk written over any part is refused or decodes to columns the
    merge then checks (a changed crc is a valid fragment)."""
    staged = _staged_of([_leaf(2, 2)])
    first, good = _fragments(staged, 2, 2)[1], _good_part()
    with pytest.raises(ManifestError):
        _merge([first, good[: cut % len(good)]], staged)
    at %= len(good)
    bad = good[:at] + junk + good[at + len(junk) :]
    try:
        _merge([first, bad], staged)
    except ManifestError:
        pass


def test_a_fragment_is_the_chunk_table_encoding() -> None:
    """The document the module docstring describes: the manifest table's binary columns
    (narrowest kind: one byte for these values) and codec, listed boxes in one column."""
    doc = json.loads(_good_part())
    assert (
        doc["format_version"] == 3
        and doc["process"] == 1
        and doc["paths"] == [[["d", "params"], ["d", "w"]]]
    )
    assert doc["objects"] == [data_key(5, "c0ffee", 1, 0)]
    assert doc["chunks"] == {
        "array": encode_column([0, 0]),
        "boxes": encode_column([4, 8, 0, 3, 4, 8, 3, 6]),
        "object": encode_column([0, 0]),
        "offset": encode_column([0, 48]),
        "length": encode_column([48, 48]),
        "codec": "raw",
        "crc32c": encode_column([7, 8]),
        "raw_crc32c": encode_column([7, 8]),
    }
    assert all(v.startswith("u1:") for k, v in doc["chunks"].items() if k != "codec")
    mixed = _part(
        {
            0: [
                ChunkEntry(((0, 4),), "k/a", 0, 4, 16, "zstd", 1, 2),
                ChunkEntry(((4, 8),), "k/a", 4, 16, 16, "raw", 3, 3),
            ]
        }
    )
    leaf = ArrayLeaf(
        path=W, shape=(8,), dtype="float32", chunks=table_from_entries([], shape=(8,), itemsize=4)
    )
    assert json.loads(encode_fragment(mixed, _staged_of([leaf]), 0))["chunks"]["codec"] == [
        "zstd",
        "raw",
    ]


def test_overlapping_boxes_of_the_same_total_volume_fail() -> None:
    staged = _staged_of([_leaf(2, 2)])
    shifted = _col("boxes", [3, 7, 0, 3, 3, 7, 3, 6])  # rows 3-7, not 4-8
    with pytest.raises(ManifestError, match="overlap"):
        _merge([_fragments(staged, 2, 2)[1], shifted], staged)


def test_a_fragment_of_arrays_staged_in_another_order_maps_them_by_path() -> None:
    w, b = (
        _leaf(1, 1),
        ArrayLeaf(
            path=B,
            shape=(2,),
            dtype="uint8",
            chunks=table_from_entries(
                [ChunkEntry(((0, 2),), "k/b", 0, 2, 2, "raw", 5, 5)], shape=(2,), itemsize=1
            ),
        ),
    )
    ours, theirs = _staged_of([w, b]), _staged_of([b, w])
    frag = encode_fragment(_part({0: list(b.chunks), 1: list(w.chunks)}), theirs, 1)
    [part] = decode_fragments([frag], ours)
    assert part.array.tolist() == [1, 0]
    assert _build(ours, [part]).arrays() == (w, b)


@pytest.mark.parametrize("broadcast", [True, False])
def test_a_coordinator_round_publishes_before_announcing_and_shares_only_when_asked(
    broadcast: bool,
) -> None:
    """Process 0 merges the fragments, publishes the manifest (a RAM tier stores it) before
    the others learn of it, and sends it through the coordinator only with ``share``;
    otherwise the record is ``ok`` and the others get None (they fetch it from a peer later)."""
    w = _leaf(4, 2)
    staged = _staged_of([w])
    coords = ThreadedJob.of(4)
    held: list[tuple[int, bytes, bool]] = []
    parts = _parts(4, 2)[::-1]

    def process(i: int) -> bytes | None:
        return _via_coordinator(
            coords[i],
            staged,
            parts[i],
            share=broadcast,
            publish=lambda data: held.append((i, data, "ns/commit" in coords[0].keys())),
        )

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(process, range(4)))
    [(who, data, announced)] = held
    assert who == 0 and not announced and got[0] == data
    assert decode_manifest(data).arrays() == (w,)
    if broadcast:
        assert (
            got[1:] == [data] * 3
            and coords[0].get("ns/commit", timeout_s=1) == "ok " + data.decode()
        )
    else:
        assert got[1:] == [None] * 3 and coords[0].get("ns/commit", timeout_s=1) == "ok"


def _persistent_commit(
    parts: list[ProcessChunks], staged: StagedSave, store: MemoryStore
) -> list[bytes | None]:
    """Steps 1-3 of the commit protocol, each process in a thread (its chunks already stored)."""
    coords = ThreadedJob.of(len(parts))

    def process(i: int) -> bytes | None:
        return publish_and_commit(
            _round(coords[i], staged),
            store_run=asyncio.run,
            store=store,
            save_id="c0ffee",
            chunks=parts[i],
            error=None,
            metadata={},
        )

    with ThreadPoolExecutor(len(parts)) as pool:
        return list(pool.map(process, range(len(parts))))


def test_a_failure_reported_through_the_coordinator_stops_the_round_at_once() -> None:
    """A process that failed its part of a coordinator round (a fast tier's) says so: process 0
    raises DistributedError naming it instead of waiting out the timeout, nothing is published."""
    staged = _staged_of([_leaf(2, 2)])
    coords = ThreadedJob.of(2)
    parts = _parts(2, 2)
    published: list[bytes] = []

    def process(i: int) -> BaseException | None:
        rnd = CommitRound(
            coord=coords[i], ns="ns", step=5, staged=staged, timeout_s=60, writer_version="test"
        )
        try:
            rnd.commit(
                parts[i],
                route=CoordinatorFragments(round=rnd),
                publish=published.append,
                metadata={},
                error=OSError("disk gone") if i == 1 else None,
            )
        except BaseException as e:
            return e
        return None

    t0 = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        errors = list(pool.map(process, range(2)))
    assert time.monotonic() - t0 < 30 and not published
    assert (
        isinstance(errors[0], DistributedError)
        and "process 1" in str(errors[0])
        and "disk gone" in str(errors[0])
    )
    assert isinstance(errors[1], OSError)


def test_persistent_and_ram_fragments_decode_to_the_same_tables() -> None:
    """The same processes' chunks reach process 0 as fragments in storage (a persistent
    step) or through the coordinator (a RAM step), or are merged with no fragment: the same
    chunk tables every way."""
    w = _leaf(4, 2)
    staged = _staged_of([w])
    parts = _parts(4, 2)[::-1]
    store = MemoryStore()
    persistent = _persistent_commit(parts, staged, store)
    keys = asyncio.run(store.list(""))
    assert sorted(keys) == sorted(
        [fragment_key(5, "c0ffee", i) for i in range(4)] + ["manifests/000000000005.json"]
    )
    frags = [bytes(asyncio.run(store.get(fragment_key(5, "c0ffee", i)))) for i in range(4)]
    coords = ThreadedJob.of(4)

    def ram(i: int) -> bytes | None:
        return _via_coordinator(coords[i], staged, parts[i], publish=lambda data: None)

    with ThreadPoolExecutor(4) as pool:
        ram_manifests = list(pool.map(ram, range(4)))
    assert [coords[0].get_bytes(f"ns/frag/{i}", timeout_s=1) for i in range(4)] == [
        b"ok " + f for f in frags
    ]
    tables = [decode_manifest(m).arrays()[0].chunks for m in (persistent[0], ram_manifests[0])]  # type: ignore[arg-type]
    assert tables[0] == tables[1] == merge_chunks(parts, staged)[W] == w.chunks
    assert persistent[1:] == [None] * 3


def test_a_single_process_save_encodes_no_fragment(monkeypatch: pytest.MonkeyPatch) -> None:
    """One process merges its own chunks: no fragment is encoded, decoded or stored, for a
    persistent step (only the manifest is put) and for a RAM step (nothing goes through
    the coordinator)."""
    from fastckpt.coordination.distributed import LocalCoordinator

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a single process encoded or decoded a fragment")

    for module in (commit, fragment):
        monkeypatch.setattr(module, "encode_fragment", refuse)
        monkeypatch.setattr(module, "decode_fragments", refuse)
    w = _leaf(1, 2)
    staged = _staged_of([w])
    [part] = _parts(1, 2)
    store = _CountingPuts(MemoryStore())
    manifest = publish_and_commit(
        _round(LocalCoordinator(), staged),
        store_run=asyncio.run,
        store=store,
        save_id="c0ffee",
        chunks=part,
        error=None,
        metadata={},
    )
    assert store.puts == ["manifests/000000000005.json"] and decode_manifest(manifest).arrays() == (
        w,
    )  # type: ignore[arg-type]
    coord = LocalCoordinator()
    coord.set_bytes = refuse  # type: ignore[method-assign]
    held: list[bytes] = []
    data = _via_coordinator(coord, staged, part, publish=held.append)
    assert held == [data] and decode_manifest(data).arrays() == (w,)  # type: ignore[arg-type]


def test_a_single_process_manager_save_stores_no_fragment(tmp_path: Path, shm_dir: Path) -> None:
    """Through the manager: a persistent and a RAM step of one process put data objects and
    the manifest, and no fragment is encoded."""
    import jax

    from fastckpt import CheckpointManager, ManagerOptions, RetentionOptions
    from fastckpt.options import RamOptions

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a single process encoded a fragment")

    store = _CountingPuts(MemoryStore())
    state = {"w": jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8)), "n": 3}
    options = ManagerOptions(
        save_interval_steps=2,
        retention=RetentionOptions(keep_last=None),
        ram=RamOptions(
            root=str(shm_dir / "h0"), interval_steps=1, replicas=0, budget_bytes=64 << 20
        ),
    )
    with (
        mock.patch.object(commit, "encode_fragment", refuse),
        CheckpointManager(store, options=options) as mgr,
    ):
        for step in (1, 2):  # 1: RAM only; 2: RAM and storage
            mgr.save(step, state)
            mgr.wait()
        assert mgr.steps_by_tier()[2] == {"ram", "storage"} and mgr.persistent_steps() == [2]
        np.testing.assert_array_equal(np.asarray(mgr.restore(2)["w"]), np.asarray(state["w"]))
    assert store.puts[-1] == "manifests/000000000002.json"
    assert all(k.endswith(".fck") for k in store.puts[:-1]) and store.puts[:-1]


class _CountingPuts(ForwardingStore):
    """Records the key of every put."""

    def __init__(self, inner: MemoryStore) -> None:
        super().__init__(inner)
        self.puts: list[str] = []

    async def put(self, key: str, data: Any, *, mode: Any = "overwrite") -> None:
        self.puts.append(key)
        await self.inner.put(key, data, mode=mode)


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


def test_process_0_reads_fragments_concurrently_in_order_raises_a_failed_read_as_itself() -> None:
    store = _CountingReads(MemoryStore(), delay_s=0.01)
    keys = [fragment_key(5, "c0ffee", i) for i in range(100)]

    async def put_all() -> None:
        for i, k in enumerate(keys):
            await store.put(k, b"fragment %d" % i)

    asyncio.run(put_all())
    assert asyncio.run(commit._read_all(store, keys)) == [b"fragment %d" % i for i in range(100)]
    assert store.peak == commit._FRAGMENT_READS  # not one at a time, and bounded
    with pytest.raises(NotFoundError):
        asyncio.run(
            commit._read_all(store, [*keys[:50], fragment_key(5, "c0ffee", 999), *keys[50:]])
        )
