"""Pure n-d box arithmetic. No I/O, no devices, no jax.

A box is a tuple of half-open ``(start, stop)`` intervals, one per dimension (see
:data:`fastckpt.format.manifest.Box`). A 0-d array has the empty box ``()``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from fastckpt.errors import ConfigError
from fastckpt.format.manifest import Box, box_shape, box_volume

__all__ = [
    "Box",
    "box_from_index",
    "box_shape",
    "box_to_slices",
    "box_volume",
    "contiguous_span",
    "element_runs",
    "full_box",
    "intersect",
    "is_inside",
    "relative_to",
    "split_box",
]


def full_box(shape: Sequence[int]) -> Box:
    """The box covering a whole array of ``shape``."""
    return tuple((0, int(n)) for n in shape)


def box_from_index(index: Sequence[slice] | None, shape: Sequence[int]) -> Box:
    """Convert a tuple of unit-step slices (as in ``devices_indices_map``; None: the whole
    array) into a box."""
    if index is None:
        index = (slice(None),) * len(shape)
    if len(index) != len(shape):
        raise ConfigError(f"index rank {len(index)} != shape rank {len(shape)}")
    out = []
    for s, n in zip(index, shape):
        start, stop, step = s.indices(int(n))
        if step != 1:
            raise ConfigError(f"strided shard index {s!r} is not supported")
        out.append((start, max(start, stop)))
    return tuple(out)


def box_to_slices(box: Box) -> tuple[slice, ...]:
    """Slices selecting ``box`` from an array whose origin is the global origin."""
    return tuple(slice(a, b) for a, b in box)


def intersect(a: Box, b: Box) -> Box | None:
    """The intersection of two boxes of equal rank, or None if it is empty.

    Two 0-d boxes intersect in the 0-d box ``()``.
    """
    if len(a) != len(b):
        raise ConfigError(f"rank mismatch: {a} vs {b}")
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def is_inside(inner: Box, outer: Box) -> bool:
    """Whether ``inner`` lies within ``outer``."""
    return len(inner) == len(outer) and all(
        o0 <= i0 <= i1 <= o1 for (i0, i1), (o0, o1) in zip(inner, outer)
    )


def relative_to(box: Box, origin: Box) -> Box:
    """Express ``box`` in the local coordinates of ``origin`` (which must contain it)."""
    if not is_inside(box, origin):
        raise ConfigError(f"{box} is not inside {origin}")
    return tuple((a - o, b - o) for (a, b), (o, _) in zip(box, origin))


def split_box(box: Box, *, itemsize: int, max_bytes: int) -> list[Box]:
    """Split ``box`` into sub-boxes of at most ``max_bytes``, each one contiguous byte range
    of the box's C-order buffer, in buffer order: trailing dimensions are kept whole while
    they fit, the next one is cut into runs (a row too large is split along the last
    dimension), the ones before it to extent 1. An empty box yields ``[box]``.
    """
    if max_bytes < itemsize or itemsize <= 0:
        raise ConfigError(f"max_bytes={max_bytes} must be >= itemsize={itemsize} > 0")
    shape = box_shape(box)
    if box_volume(box) * itemsize <= max_bytes or 0 in shape:
        return [box]
    max_elems = max_bytes // itemsize
    # Find the split dimension d: product of shape[d+1:] fits, product of shape[d:] does not.
    inner = 1
    d = len(shape) - 1
    while d >= 0 and inner * shape[d] <= max_elems:
        inner *= shape[d]
        d -= 1
    run = max(1, max_elems // inner)  # extent of dimension d per sub-box
    out: list[Box] = []
    for idx in itertools.product(*map(range, shape[:d])):  # the leading dimensions, C order
        lead = tuple((box[k][0] + i, box[k][0] + i + 1) for k, i in enumerate(idx))
        start_d, stop_d = box[d]
        for s in range(start_d, stop_d, run):
            out.append(lead + ((s, min(s + run, stop_d)),) + tuple(box[d + 1 :]))
    return out


def contiguous_span(region: Box, shape: Sequence[int]) -> tuple[int, int] | None:
    """If ``region`` (local coordinates) is one contiguous run of a C-order array of
    ``shape``, return ``(first_element, n_elements)``; else None."""
    if len(region) != len(shape):
        raise ConfigError(f"rank mismatch: {region} vs {tuple(shape)}")
    ext = [b - a for a, b in region]
    if 0 in ext:
        return (0, 0)
    k = len(shape)
    while k > 0 and region[k - 1] == (0, shape[k - 1]):
        k -= 1
    # dims >= k are full; dim k-1 (if any) may be partial; dims < k-1 must have extent 1.
    if any(e != 1 for e in ext[: max(0, k - 1)]):
        return None
    start = 0
    for (a, _), n in zip(region, shape):
        start = start * n + a
    return (start, math.prod(ext))


def element_runs(
    regions: Sequence[Box], shape: Sequence[int], *, min_gap: int = 0, max_runs: int | None = None
) -> list[tuple[int, int]]:
    """The runs ``(first_element, n_elements)`` of a C-order array of ``shape`` that hold
    every element of ``regions`` (local coordinates), ascending and disjoint: what a ranged
    read of a stored chunk fetches to fill them.

    Runs less than ``min_gap`` elements apart are merged. When more than ``max_runs`` runs
    remain, the single shortest run holding them all is returned instead. Regions without
    elements add nothing (``[]`` when none has any).
    """
    runs: list[tuple[int, int]] = []
    for region in regions:
        if len(region) != len(shape):
            raise ConfigError(f"rank mismatch: {region} vs {tuple(shape)}")
        runs.extend(_region_runs(region, shape, min_gap, max_runs))
    runs.sort()
    merged: list[tuple[int, int]] = []
    for first, n in runs:
        if merged and first - (merged[-1][0] + merged[-1][1]) < max(min_gap, 1):
            last_first, last_n = merged[-1]
            merged[-1] = (last_first, max(last_first + last_n, first + n) - last_first)
        else:
            merged.append((first, n))
    if max_runs is not None and len(merged) > max_runs:
        return [(merged[0][0], merged[-1][0] + merged[-1][1] - merged[0][0])]
    return merged


def _region_runs(
    region: Box, shape: Sequence[int], min_gap: int, max_runs: int | None
) -> list[tuple[int, int]]:
    """:func:`element_runs` of one region: at most ``max_runs`` runs, or else the one run
    bounding the region (the caller then falls back to a bounding run anyway)."""
    ext = [b - a for a, b in region]
    if any(e <= 0 for e in ext):
        return []
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    base = sum(a * st for (a, _), st in zip(region, strides))
    # From the innermost dimension outwards: one run spans a dimension's extent while the
    # gap to its next repeat (the dimension's stride minus the run) is under min_gap.
    d, run = len(shape), 1
    while d > 0 and strides[d - 1] - run < max(min_gap, 1):
        d -= 1
        run = (ext[d] - 1) * strides[d] + run
    count = math.prod(ext[:d])
    if max_runs is not None and count > max_runs:
        last = base + sum((e - 1) * st for e, st in zip(ext, strides))
        return [(base, last + 1 - base)]
    starts = [base]
    for k in range(d):
        starts = [s + i * strides[k] for s in starts for i in range(ext[k])]
    return [(s, run) for s in starts]
