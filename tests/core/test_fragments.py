"""Per-process fragments (the commit protocol's chunk lists): exact round trips of partial
chunk tables, a merged manifest with a grid, and typed errors for malformed fragments."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from fastckpt.errors import ManifestError
from fastckpt.format.codec import decode_manifest
from fastckpt.format.layout import data_key
from fastckpt.format.manifest import ChunkEntry, KeyPath, box_volume
from fastckpt.writer.commit import build_manifest, decode_fragment, encode_fragment
from fastckpt.writer.stage import StagedArray, StagedSave

W: KeyPath = (("d", "params"), ("d", "w"))
B: KeyPath = (("d", "params"), ("d", "b"))


def _staged() -> StagedSave:
    arrays = (
        StagedArray(path=W, shape=(8, 6), dtype="float32", kind="jax", sharding=None, key_impl=None, items=(),
                    item_offsets=()),
        StagedArray(path=B, shape=(6,), dtype="bfloat16", kind="numpy", sharding=None, key_impl=None, items=(),
                    item_offsets=()),
    )
    return StagedSave(arrays=arrays, values=(), buffer=np.zeros(0, np.uint8), nbytes=0, order=(W, B))


def _part(process: int, *, codec: str = "zstd") -> dict[int, list[ChunkEntry]]:
    """Process ``process`` of 4 holds rows [2p, 2p + 2) of ``w`` in two column halves; process
    0 also holds all of ``b``."""
    key = data_key(5, "c0ffee", process, 0)
    w = []
    for j in range(2):
        box = ((2 * process, 2 * process + 2), (3 * j, 3 * j + 3))
        raw = box_volume(box) * 4
        w.append(ChunkEntry(box, key, 100 * j, raw if codec == "raw" else 7 + j, raw, codec, 11 * process + j,
                            2**32 - 1 - process))
    b = [ChunkEntry(((0, 6),), key, 900, 12, 12, "raw", 3, 3)] if process == 0 else []
    return {0: w, 1: b}


def test_each_part_round_trips_exactly_and_the_merge_is_a_grid() -> None:
    staged = _staged()
    merged: dict[KeyPath, list[ChunkEntry]] = {}
    for p in range(4):
        part = _part(p, codec="raw" if p % 2 else "zstd")
        data = encode_fragment(staged, part, p)
        doc = json.loads(data)
        assert doc["objects"] == [data_key(5, "c0ffee", p, 0)] and "boxes" in doc["arrays"][0]["chunks"]
        back = decode_fragment(data, staged)
        assert back == {W: part[0], B: part[1]}
        for path, cs in back.items():
            merged.setdefault(path, []).extend(cs)
    data = build_manifest(step=5, staged=staged, chunks_by_path=merged, num_processes=4, metadata={},
                          writer_version="test")
    doc = json.loads(data)
    assert doc["leaves"][0]["chunks"]["grid"] == [[0, 2, 4, 6, 8], [0, 3, 6]]
    assert doc["leaves"][0]["chunks"]["codec"] == ["zstd", "zstd", "raw", "raw", "zstd", "zstd", "raw", "raw"]
    m = decode_manifest(data)
    every = [c for p in range(4) for c in _part(p, codec="raw" if p % 2 else "zstd")[0]]
    assert list(m.arrays()[0].chunks) == sorted(every, key=lambda c: c.box)  # C order: the grid's


def test_overlapping_parts_fail_at_the_merge() -> None:
    staged = _staged()
    parts = [decode_fragment(encode_fragment(staged, _part(p), p), staged) for p in (0, 1, 1, 3)]
    merged: dict[KeyPath, list[ChunkEntry]] = {}
    for part in parts:
        for path, cs in part.items():
            merged.setdefault(path, []).extend(cs)
    with pytest.raises(ManifestError, match="tile|overlap"):
        build_manifest(step=5, staged=staged, chunks_by_path=merged, num_processes=4, metadata={}, writer_version="")


def _edit(change: Any) -> bytes:
    doc = json.loads(encode_fragment(_staged(), _part(1), 1))
    change(doc)
    return json.dumps(doc).encode()


@pytest.mark.parametrize("data", [
    b"", b"{", b"[]", b'{"arrays": []}', b'{"objects": []}',
    _edit(lambda d: d.update(objects=["../escape"])),
    _edit(lambda d: d.update(objects="steps/x")),
    _edit(lambda d: d["arrays"][0].update(path=[["d", "params"], ["d", "v"]])),
    _edit(lambda d: d["arrays"][0].update(path=[["d"]])),
    _edit(lambda d: d["arrays"][0].update(path=[[["d"], "params"]])),
    _edit(lambda d: d["arrays"].append(7)),
    _edit(lambda d: d["arrays"][0]["chunks"].update(boxes=[[2, 4, 0, 3], [2, 4, 3, 7]])),
    _edit(lambda d: d["arrays"][0]["chunks"].update(object=[0, 1])),
    _edit(lambda d: d["arrays"][0]["chunks"].update(offset=[0])),
    _edit(lambda d: d["arrays"][0]["chunks"].update(codec="lz4")),
    _edit(lambda d: d["arrays"][0].update(chunks=[{"box": [[2, 4], [0, 3]]}])),
], ids=lambda d: repr(d[:60]))
def test_malformed_fragments_raise_manifest_error(data: bytes) -> None:
    with pytest.raises(ManifestError):
        decode_fragment(data, _staged())
