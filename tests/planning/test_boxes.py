"""Box arithmetic against numpy brute force: intersect, relative_to, split_box, contiguous_span."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastckpt.errors import ConfigError
from fastckpt.format.manifest import Box, box_shape, box_volume
from fastckpt.planning import (
    box_from_index,
    box_to_slices,
    contiguous_span,
    element_runs,
    full_box,
    intersect,
    is_inside,
    relative_to,
    split_box,
)
from fastckpt.testing.strategies import boxes_in, shapes

SETTINGS = settings(max_examples=150, deadline=None)


def mask(box: Box, shape: tuple[int, ...]) -> np.ndarray:
    m = np.zeros(shape, bool)
    m[box_to_slices(box)] = True
    return m


@st.composite
def shape_and_two_boxes(draw: st.DrawFn) -> tuple[tuple[int, ...], Box, Box]:
    shape = draw(shapes(min_side=1))
    return shape, draw(boxes_in(shape)), draw(boxes_in(shape))


@SETTINGS
@given(shape_and_two_boxes())
def test_intersect_matches_mask_and(case: tuple[tuple[int, ...], Box, Box]) -> None:
    shape, a, b = case
    got = intersect(a, b)
    expected = mask(a, shape) & mask(b, shape)
    if got is None:
        assert not expected.any()
    else:
        assert box_volume(got) > 0 or not shape
        np.testing.assert_array_equal(mask(got, shape), expected)
        assert is_inside(got, a) and is_inside(got, b)
    assert intersect(b, a) == got


def test_intersect_zero_d_and_rank_mismatch() -> None:
    assert intersect((), ()) == ()
    with pytest.raises(ConfigError):
        intersect(((0, 1),), ())


@SETTINGS
@given(shape_and_two_boxes())
def test_relative_to_selects_same_elements(case: tuple[tuple[int, ...], Box, Box]) -> None:
    shape, outer, other = case
    inner = intersect(outer, other)
    if inner is not None:
        g = np.arange(math.prod(shape)).reshape(shape)
        local = relative_to(inner, outer)
        np.testing.assert_array_equal(
            g[box_to_slices(outer)][box_to_slices(local)], g[box_to_slices(inner)]
        )
    if not is_inside(other, outer):
        with pytest.raises(ConfigError):
            relative_to(other, outer)


@SETTINGS
@given(st.data())
def test_box_from_index_round_trip(data: st.DataObject) -> None:
    shape = data.draw(shapes())
    box = data.draw(boxes_in(shape, allow_empty=True))
    assert box_from_index(box_to_slices(box), shape) == box
    assert box_from_index(tuple(slice(None) for _ in shape), shape) == full_box(shape)


def test_box_from_index_rejects_strides_and_rank() -> None:
    with pytest.raises(ConfigError):
        box_from_index((slice(0, 4, 2),), (4,))
    with pytest.raises(ConfigError):
        box_from_index((slice(None),), (4, 4))


def flat_indices(region: Box, shape: tuple[int, ...]) -> np.ndarray:
    """C-order flat indices (in C order of the region) of ``region`` inside ``shape``."""
    return np.arange(math.prod(shape)).reshape(shape)[box_to_slices(region)].reshape(-1)


@st.composite
def split_cases(draw: st.DrawFn) -> tuple[tuple[int, ...], Box, int, int]:
    shape = draw(shapes(max_rank=4, max_side=6))
    box = draw(boxes_in(shape, allow_empty=True))
    itemsize = draw(st.sampled_from([1, 2, 4, 8, 16]))
    total = box_volume(box) * itemsize
    max_bytes = draw(st.integers(itemsize, max(itemsize, 2 * total)))
    return shape, box, itemsize, max_bytes


@settings(max_examples=200, deadline=None)
@given(split_cases())
def test_split_box_tiles_contiguously_in_byte_order(
    case: tuple[tuple[int, ...], Box, int, int],
) -> None:
    shape, box, itemsize, max_bytes = case
    subs = split_box(box, itemsize=itemsize, max_bytes=max_bytes)
    assert subs, "at least one sub-box"
    if box_volume(box) == 0:
        assert subs == [box]
        return
    if box_volume(box) * itemsize <= max_bytes:
        assert subs == [box]
    # Exact tiling: every element of the box is covered exactly once, nothing outside it.
    count = np.zeros(shape, np.int64)
    for sub in subs:
        assert is_inside(sub, box)
        assert box_volume(sub) > 0
        assert box_volume(sub) * itemsize <= max_bytes  # every sub-box fits (max_bytes >= itemsize)
        count[box_to_slices(sub)] += 1
    np.testing.assert_array_equal(count, mask(box, shape).astype(np.int64))
    # Each sub-box is one contiguous run of the box's C-order buffer, in increasing order,
    # and consecutive runs abut (byte offsets increase with no gaps).
    local_shape = box_shape(box)
    offset = 0
    for sub in subs:
        idx = flat_indices(relative_to(sub, box), local_shape)
        np.testing.assert_array_equal(idx, np.arange(offset, offset + idx.size))
        offset += idx.size
    assert offset == box_volume(box)


def test_split_box_one_huge_row_splits_last_dim() -> None:
    subs = split_box(((0, 2), (0, 10)), itemsize=4, max_bytes=12)
    assert subs == [
        ((0, 1), (0, 3)),
        ((0, 1), (3, 6)),
        ((0, 1), (6, 9)),
        ((0, 1), (9, 10)),
        ((1, 2), (0, 3)),
        ((1, 2), (3, 6)),
        ((1, 2), (6, 9)),
        ((1, 2), (9, 10)),
    ]


def test_split_box_rejects_bad_sizes() -> None:
    with pytest.raises(ConfigError):
        split_box(((0, 4),), itemsize=8, max_bytes=4)
    with pytest.raises(ConfigError):
        split_box(((0, 4),), itemsize=0, max_bytes=4)


def brute_span(region: Box, shape: tuple[int, ...]) -> tuple[int, int] | None:
    idx = np.sort(flat_indices(region, shape))
    if idx.size == 0:
        return (0, 0)
    if idx[-1] - idx[0] + 1 == idx.size:
        return (int(idx[0]), int(idx.size))
    return None


@st.composite
def span_cases(draw: st.DrawFn) -> tuple[Box, tuple[int, ...]]:
    shape = draw(shapes(max_rank=4, max_side=5))
    # Bias towards contiguous regions: full trailing dims, unit leading dims.
    if shape and draw(st.booleans()):
        k = draw(st.integers(0, len(shape)))
        region = []
        for d, n in enumerate(shape):
            if d < k - 1 and n:
                a = draw(st.integers(0, n - 1))
                region.append((a, a + 1))
            elif d == k - 1:
                a = draw(st.integers(0, n))
                region.append((a, draw(st.integers(a, n))))
            else:
                region.append((0, n))
        return tuple(region), shape
    return draw(boxes_in(shape, allow_empty=True)), shape


@settings(max_examples=250, deadline=None)
@given(span_cases())
def test_contiguous_span_matches_brute_force(case: tuple[Box, tuple[int, ...]]) -> None:
    region, shape = case
    assert contiguous_span(region, shape) == brute_span(region, shape)


def test_contiguous_span_rank_mismatch() -> None:
    with pytest.raises(ConfigError):
        contiguous_span(((0, 1),), (2, 2))


@st.composite
def regions_in_one_shape(draw: st.DrawFn) -> tuple[list[Box], tuple[int, ...]]:
    shape = draw(shapes(max_rank=4, max_side=6))
    return draw(st.lists(boxes_in(shape, allow_empty=True), max_size=3)), shape


@settings(max_examples=300, deadline=None)
@given(regions_in_one_shape(), st.integers(0, 12), st.none() | st.integers(1, 6))
def test_element_runs_cover_the_regions_sparingly(
    case: tuple[list[Box], tuple[int, ...]], min_gap: int, max_runs: int | None
) -> None:
    regions, shape = case
    runs = element_runs(regions, shape, min_gap=min_gap, max_runs=max_runs)
    wanted = np.zeros(math.prod(shape), bool)
    for r in regions:
        wanted[flat_indices(r, shape)] = True
    covered = np.zeros_like(wanted)
    for first, n in runs:
        assert n > 0 and 0 <= first and first + n <= wanted.size
        covered[first : first + n] = True
    assert not (wanted & ~covered).any()  # every element wanted is read
    if not wanted.any():
        assert runs == []
        return
    idx = np.flatnonzero(wanted)
    bounding = (int(idx[0]), int(idx[-1] - idx[0] + 1))
    if max_runs is not None and len(runs) == 1:
        assert runs[0][0] == bounding[0]
    assert (
        runs[0][0] == idx[0] and runs[-1][0] + runs[-1][1] == idx[-1] + 1
    )  # no run starts or ends idle
    for (a, n), (b, _) in itertools.pairwise(runs):
        assert b - (a + n) >= max(min_gap, 1)  # ascending, disjoint, gaps at least min_gap
    assert max_runs is None or len(runs) <= max_runs
    if max_runs is None and min_gap <= 1:
        assert covered.sum() == wanted.sum()  # nothing idle read: exactly the wanted elements
    assert element_runs(regions, shape, max_runs=1) == [bounding]


def test_element_runs_of_stacked_layers() -> None:
    """Rows 4..6 of every layer of an (L, rows, cols) chunk: one run per layer."""
    assert element_runs([((0, 3), (4, 6), (0, 8))], (3, 10, 8)) == [(32, 16), (112, 16), (192, 16)]
    assert element_runs([((0, 3), (4, 6), (0, 8))], (3, 10, 8), min_gap=65) == [(32, 176)]
    assert element_runs([((0, 3), (4, 6), (0, 8))], (3, 10, 8), max_runs=2) == [(32, 176)]


def test_element_runs_rank_mismatch() -> None:
    with pytest.raises(ConfigError):
        element_runs([((0, 1),)], (2, 2))
