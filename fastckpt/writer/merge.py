"""Process 0's merge of every process's chunks (``writer.fragment.ProcessChunks``) into the
manifest's chunk tables: on numpy columns, never a Python object per chunk (a pod-scale step
has millions), grouping by leaf, sorting into C order, recognising the grid, and checking
ranges, raw lengths and tiling.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from fastckpt._pygc import paused_gc
from fastckpt.format.checks import check_tiling, fail
from fastckpt.format.chunk_table import CODECS, grid_cuts
from fastckpt.format.dtypes import dtype_from_name
from fastckpt.format.manifest import ChunkTable, KeyPath, keypath_str
from fastckpt.writer.fragment import CODE, ProcessChunks
from fastckpt.writer.stage import StagedSave

__all__ = ["merge_chunks"]


def merge_chunks(parts: Sequence[ProcessChunks], staged: StagedSave) -> dict[KeyPath, ChunkTable]:
    """Merge the processes' chunks into each array leaf's chunk table (by path), its chunks in
    C order of their boxes (a grid when they form one), all indexing one object key list.
    ``ManifestError`` if a box lies outside its array, a raw chunk's length is not its box's
    bytes, or a leaf's chunks do not tile it exactly (missing, overlapping or repeated boxes).
    """
    with paused_gc():
        return _merge(parts, staged)


def _merge(parts: Sequence[ProcessChunks], staged: StagedSave) -> dict[KeyPath, ChunkTable]:
    ranks = np.asarray([len(a.shape) for a in staged.arrays], np.int64)
    objects: dict[str, int] = {}
    index = []
    for part in parts:  # each part's object indices -> manifest object indices
        remap = np.asarray(
            [objects.setdefault(k, len(objects)) for k in part.objects] or [0], np.int64
        )
        index.append(remap[part.object])
    names = ("array", "offset", "length", "crc32c", "raw_crc32c", "codec")
    col = {
        k: np.concatenate([getattr(p, k) for p in parts]) if parts else np.zeros(0, np.int64)
        for k in names
    }
    col["object"] = np.concatenate(index) if parts else np.zeros(0, np.int64)
    # Every chunk's box: where it starts in the concatenation of all parts' flat lists.
    flat = np.concatenate([p.boxes for p in parts]) if parts else np.zeros(0, np.int64)
    box_at = np.zeros(len(col["array"]), np.int64)
    widths = 2 * ranks[col["array"]]
    if len(widths):
        box_at[1:] = np.cumsum(widths)[:-1]
    keys = list(objects)
    tables: dict[KeyPath, ChunkTable] = {}
    for r in sorted(set(ranks.tolist())):
        tables.update(_rank_group(staged, r, col, flat, box_at, keys))
    return tables


def _rank_group(
    staged: StagedSave,
    r: int,
    col: dict[str, np.ndarray],
    flat: np.ndarray,
    box_at: np.ndarray,
    keys: list[str],
) -> dict[KeyPath, ChunkTable]:
    """Tables of the leaves of rank ``r``: checks and C-order sort over all their chunks at
    once, then per leaf the grid and list slices."""
    members = [i for i, a in enumerate(staged.arrays) if len(a.shape) == r]
    mine = np.flatnonzero(np.isin(col["array"], members))
    array = col["array"][mine]
    boxes = flat[box_at[mine][:, None] + np.arange(2 * r)]
    # Sort by leaf, then by box as tuples compare: (start0, stop0, start1, ...).
    order = np.lexsort((*boxes.T[::-1], array))
    mine, array, boxes = mine[order], array[order], boxes[order]
    starts, stops = boxes[:, 0::2], boxes[:, 1::2]
    shape_of = np.zeros((len(staged.arrays), r), np.int64)
    shape_of[members] = np.reshape([staged.arrays[i].shape for i in members], (len(members), r))
    itemsize = np.asarray([dtype_from_name(a.dtype).itemsize for a in staged.arrays], np.int64)
    bad = ((starts > stops) | (stops > shape_of[array])).any(axis=1)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        fail(
            f"array {keypath_str(staged.arrays[array[i]].path)}: chunk box {boxes[i].tolist()} "
            f"outside the array's shape {list(staged.arrays[array[i]].shape)}"
        )
    nbytes = np.prod(stops - starts, axis=1) * itemsize[array]
    length, codec = col["length"][mine], col["codec"][mine]
    bad = (codec == CODE["raw"]) & (length != nbytes)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        fail(
            f"array {keypath_str(staged.arrays[array[i]].path)}: raw chunk {boxes[i].tolist()} has "
            f"length {int(length[i])}, not box volume x itemsize"
        )
    obj, offset, crc, raw_crc = (col[k][mine] for k in ("object", "offset", "crc32c", "raw_crc32c"))
    codes = codec.tolist()
    bounds = np.searchsorted(array, np.asarray(members + [len(staged.arrays)], np.int64)).tolist()
    out: dict[KeyPath, ChunkTable] = {}
    for j, ai in enumerate(members):
        a, b = bounds[j], bounds[j + 1]
        arr = staged.arrays[ai]
        cuts = _grid(boxes[a:b], arr.shape)
        listed = None
        # not a grid: prove the tiling the slow way (never the case for a sharding)
        if cuts is None:
            listed = [tuple(zip(row[0::2], row[1::2])) for row in boxes[a:b].tolist()]
            check_tiling(listed, arr.shape, f"array {keypath_str(arr.path)}")
        leaf_codes = codes[a:b]
        one = len(set(leaf_codes)) == 1
        out[arr.path] = ChunkTable(
            cuts=cuts,
            boxes=listed,
            keys=keys,
            object_index=obj[a:b],
            offsets=offset[a:b],
            lengths=length[a:b],
            crc32c=crc[a:b],
            raw_crc32c=raw_crc[a:b],
            itemsize=int(itemsize[ai]),
            codec=CODECS[leaf_codes[0]] if one else tuple(CODECS[c] for c in leaf_codes),
        )
    return out


#: Up to this many chunks a leaf's grid is recognised on Python tuples, above it with numpy.
_SMALL = 64


def _grid(boxes: np.ndarray, shape: tuple[int, ...]) -> list[list[int]] | None:
    """The cuts of the grid whose cells, in C order, are these (C-ordered) boxes, else None."""
    n = len(boxes)
    if n <= _SMALL:  # fewer numpy calls: the per-call cost outweighs the per-chunk one
        return grid_cuts([tuple(zip(row[0::2], row[1::2])) for row in boxes.tolist()], shape)
    starts, stops = boxes[:, 0::2], boxes[:, 1::2]
    cuts = [[*sorted(set(starts[:, d].tolist())), extent] for d, extent in enumerate(shape)]
    if any(c[0] != 0 for c in cuts) or math.prod(len(c) - 1 for c in cuts) != n:
        return None
    cell, stride = np.arange(n), n
    for d, c in enumerate(cuts):
        stride //= len(c) - 1
        at = (cell // stride) % (len(c) - 1)
        edges = np.asarray(c, np.int64)
        if (starts[:, d] != edges[at]).any() or (stops[:, d] != edges[at + 1]).any():
            return None
    return cuts
