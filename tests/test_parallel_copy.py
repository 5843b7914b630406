"""Grouped parallel copies and checksums of staging (``fastckpt._hostmem``)."""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fastckpt._checksum import crc32c
from fastckpt._hostmem import (
    alloc_aligned,
    balanced_groups,
    carve,
    parallel_copy,
    parallel_copy_crc32c,
    parallel_crc32c,
    slab_bytes,
)


@given(st.lists(st.integers(0, 1 << 30), max_size=60), st.integers(1, 9))
def testbalanced_groups_cover_every_index_once(sizes: list[int], groups: int) -> None:
    out = balanced_groups(sizes, groups)
    assert len(out) <= groups
    assert sorted(i for g in out for i in g) == list(range(len(sizes)))
    assert all(g == sorted(g) and g for g in out)
    if sizes:  # greedy bound: no group exceeds the ideal share by more than the largest item
        loads = [sum(sizes[i] for i in g) for g in out]
        assert max(loads) <= sum(sizes) / min(groups, len(sizes)) + max(sizes)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 300_000), min_size=1, max_size=20), st.integers(1, 4))
def test_parallel_copy_and_crc_match_serial(lengths: list[int], jobs: int) -> None:
    rng = np.random.default_rng(len(lengths) * 31 + jobs)
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in lengths]
    dst = np.zeros(sum(lengths), np.uint8)
    offs = np.cumsum([0, *lengths])
    views = [dst[a:b] for a, b in itertools.pairwise(offs)]
    with ThreadPoolExecutor(jobs) as ex:
        parallel_copy(list(zip(views, srcs)), ex, jobs=jobs)
        np.testing.assert_array_equal(dst, np.concatenate(srcs))
        assert parallel_crc32c(views, ex, jobs=jobs) == [crc32c(s) for s in srcs]
    assert parallel_crc32c(views, None, jobs=jobs) == [crc32c(s) for s in srcs]


@settings(max_examples=10, deadline=None)
@given(st.lists(st.integers(0, 3 << 20), min_size=1, max_size=6), st.integers(1, 4))
def test_copy_and_checksum_in_one_pass_matches_copy_then_checksum(
    lengths: list[int], jobs: int
) -> None:
    """Chunks over several 1 MiB blocks too: the blockwise crc continues across blocks."""
    rng = np.random.default_rng(sum(lengths) + jobs)
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in lengths]
    dsts = [np.zeros(n, np.uint8) for n in lengths]
    with ThreadPoolExecutor(jobs) as ex:
        crcs = parallel_copy_crc32c(list(zip(dsts, srcs)), ex, jobs=jobs)
    assert crcs == [crc32c(s) for s in srcs]
    for d, s in zip(dsts, srcs):
        np.testing.assert_array_equal(d, s)


def test_parallel_copy_rejects_size_mismatch() -> None:
    try:
        parallel_copy([(np.zeros(3, np.uint8), np.zeros(4, np.uint8))], None, jobs=1)
    except ValueError as e:
        assert "mismatch" in str(e)
    else:
        raise AssertionError("a size mismatch was copied")


@given(st.lists(st.integers(0, 5000), max_size=40))
@example([1, 0])
@example([0, 0, 5])
@example([])
def test_carved_views_are_disjoint_exact_and_64_byte_aligned_inside_the_slab(
    sizes: list[int],
) -> None:
    total = slab_bytes(sizes)
    assert sum(sizes) <= total < sum(sizes) + 64 * max(1, len(sizes))
    slab = alloc_aligned(max(total, 1))
    views = carve(slab, sizes)
    assert [v.nbytes for v in views] == sizes
    base = slab.ctypes.data
    held = [
        (v.ctypes.data - base, v.nbytes) for v in views if v.nbytes
    ]  # (an empty view has no place)
    assert all(s % 64 == 0 and s + n <= total for s, n in held)
    assert all(a + n <= b for (a, n), (b, _) in itertools.pairwise(held))  # in order, no overlap
    for i, v in enumerate(views):  # writes through one view land in no other
        v[:] = i % 251
    assert all((v == i % 251).all() for i, v in enumerate(views))
