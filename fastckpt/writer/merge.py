"""Process 0's merge of every process's fragment (``writer.fragment``) into the manifest's
chunk tables.

Process 0 merges at every checkpoint, RAM checkpoints included (every few steps). A
pod-scale step has millions of chunks, so the merge works on columns with numpy and never
builds a Python object per chunk: it groups the chunks by leaf, sorts each leaf's chunks
into C order, recognises the grid (format 2's ``"grid"``), and checks ranges, raw lengths
and tiling on the arrays.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from fastckpt._pygc import paused_gc
from fastckpt.format._checks import check_tiling, fail
from fastckpt.format.chunk_table import CODECS, grid_cuts
from fastckpt.format.dtypes import dtype_from_name
from fastckpt.format.manifest import KeyPath, keypath_str
from fastckpt.writer.fragment import CODE, decode_fragment
from fastckpt.writer.stage import StagedSave

__all__ = ["merge_fragments"]


def merge_fragments(fragments: Sequence[bytes | memoryview], staged: StagedSave
                    ) -> tuple[list[str], dict[KeyPath, dict[str, Any]]]:
    """Merge the processes' fragments into ready chunk tables: ``(objects, table by array
    path)``, each leaf's chunks in C order of their boxes (a grid when they form one), the
    numeric columns as numpy arrays (``chunk_table.table_json`` writes them as format 2's
    or 3's JSON).

    Raises ``ManifestError`` if a fragment is malformed or names an array this tree lacks, a
    box lies outside its array, a raw chunk's length is not its box's bytes, or a leaf's
    chunks do not tile it exactly (missing, overlapping or repeated boxes).

    The checks and the sort run once over all chunks of all leaves of one rank (numpy); per
    leaf only the grid is recognised and the lists are sliced.
    """
    with paused_gc():
        return _merge(fragments, staged)


def _merge(fragments: Sequence[bytes | memoryview], staged: StagedSave
           ) -> tuple[list[str], dict[KeyPath, dict[str, Any]]]:
    local = {a.path: i for i, a in enumerate(staged.arrays)}
    ranks = np.asarray([len(a.shape) for a in staged.arrays], np.int64)
    parts = [decode_fragment(f, local, ranks, f"fragment {i}") for i, f in enumerate(fragments)]
    objects: dict[str, int] = {}
    for part in parts:  # fragment object indices -> manifest object indices
        remap = np.asarray([objects.setdefault(k, len(objects)) for k in part["objects"]] or [0], np.int64)
        part["object"] = remap[part["object"]]
    names = ("array", "object", "offset", "length", "crc32c", "raw_crc32c", "codec")
    col = {k: np.concatenate([p[k] for p in parts]) if parts else np.zeros(0, np.int64) for k in names}
    # Every chunk's box: where it starts in the concatenation of all fragments' flat lists.
    flat = np.concatenate([p["boxes"] for p in parts]) if parts else np.zeros(0, np.int64)
    box_at = np.zeros(len(col["array"]), np.int64)
    widths = 2 * ranks[col["array"]]
    if len(widths):
        box_at[1:] = np.cumsum(widths)[:-1]
    tables: dict[KeyPath, dict[str, Any]] = {}
    for r in sorted(set(ranks.tolist())):
        tables.update(_rank_group(staged, r, col, flat, box_at))
    return list(objects), tables


def _rank_group(staged: StagedSave, r: int, col: dict[str, np.ndarray], flat: np.ndarray, box_at: np.ndarray
                ) -> dict[KeyPath, dict[str, Any]]:
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
    shapes = np.asarray([staged.arrays[i].shape for i in members], np.int64).reshape(len(members), r)
    shape_of = np.zeros((len(staged.arrays), r), np.int64)
    shape_of[members] = shapes
    itemsize = np.asarray([dtype_from_name(a.dtype).itemsize for a in staged.arrays], np.int64)
    bad = ((starts > stops) | (stops > shape_of[array])).any(axis=1)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        fail(f"array {keypath_str(staged.arrays[array[i]].path)}: chunk box {boxes[i].tolist()} outside the "
             f"array's shape {list(staged.arrays[array[i]].shape)}")
    nbytes = np.prod(stops - starts, axis=1) * itemsize[array]
    length, codec = col["length"][mine], col["codec"][mine]
    bad = (codec == CODE["raw"]) & (length != nbytes)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        fail(f"array {keypath_str(staged.arrays[array[i]].path)}: raw chunk {boxes[i].tolist()} has length "
             f"{int(length[i])}, not box volume x itemsize")
    cols = {k: col[k][mine] for k in ("object", "offset", "crc32c", "raw_crc32c")}
    cols["length"], codes = length, codec.tolist()
    bounds = np.searchsorted(array, np.asarray(members + [len(staged.arrays)], np.int64)).tolist()
    out: dict[KeyPath, dict[str, Any]] = {}
    for j, ai in enumerate(members):
        a, b = bounds[j], bounds[j + 1]
        arr = staged.arrays[ai]
        cuts = _grid(boxes[a:b], arr.shape)
        if cuts is None:  # not a grid: prove the tiling the slow way (never the case for a sharding)
            check_tiling([tuple(zip(row[0::2], row[1::2])) for row in boxes[a:b].tolist()], arr.shape,
                         f"array {keypath_str(arr.path)}")
        leaf_codes = codes[a:b]
        table: dict[str, Any] = {"grid": cuts} if cuts is not None else {"boxes": boxes[a:b].tolist()}
        table.update({k: v[a:b] for k, v in cols.items()},
                     codec=CODECS[leaf_codes[0]] if len(set(leaf_codes)) == 1 else [CODECS[c] for c in leaf_codes])
        out[arr.path] = table
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
