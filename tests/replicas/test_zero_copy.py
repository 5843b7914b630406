"""Zero-copy own-RAM restore: lent views, their safety after the step is dropped, fallbacks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from fastckpt.replicas._ram import RamTier
from fastckpt.replicas._sources import TieredChunkSource

from .conftest import fill, seal_chunks

MakeTier = Callable[..., RamTier]
MIB = 1 << 20


def test_lend_span_requires_back_to_back_chunks(make_tier: MakeTier) -> None:
    tier = make_tier()
    data = fill(1, {"a": MIB, "b": 3 * MIB, "c": 5000})
    seal_chunks(tier, 1, data)
    seal_chunks(tier, 1, fill(1, {"d": 100}, seed=1))  # a second segment
    hit = tier.lend_spans(1, [["a", "b", "c"]])[0]
    assert hit is not None
    view, locs = hit
    assert bytes(view) == b"".join(data[k].tobytes() for k in "abc")
    assert [loc.length for loc in locs] == [MIB, 3 * MIB, 5000]
    assert tier.lend_spans(1, [["b", "a"]])[0] is None  # wrong order
    assert tier.lend_spans(1, [["a", "c"]])[0] is None  # gap
    assert tier.lend_spans(1, [["c", "d"]])[0] is None  # two segments
    assert tier.lend_spans(1, [["zz"]])[0] is None
    assert tier.lend_spans(2, [["a"]])[0] is None
    assert tier.lend_spans(1, [[]])[0] is None


def test_lend_spans_answers_each_group_over_several_segments_in_one_call(
    make_tier: MakeTier, shm_dir: Path
) -> None:
    tier = make_tier()
    first = fill(1, {"a": 4096, "b": 100, "c": 7})
    second = fill(1, {"d": 300, "e": 5}, seed=1)
    seal_chunks(tier, 1, first)
    seal_chunks(tier, 1, second)
    groups = [["a", "b"], ["d"], ["b", "a"], [], ["c"], ["d", "e"], ["c", "d"], ["zz"]]
    got = tier.lend_spans(1, groups)
    data = {**first, **second}
    for ids, hit in zip(groups, got):
        ok = ids in (["a", "b"], ["d"], ["c"], ["d", "e"])
        assert (hit is not None) == ok, ids
        if hit is not None:
            assert bytes(hit[0]) == b"".join(data[k].tobytes() for k in ids)
            assert [loc.length for loc in hit[1]] == [data[k].nbytes for k in ids]
    lent = sorted(
        p for p in (shm_dir / "t0").rglob("*") if p.is_file() and not p.stat().st_mode & 0o200
    )
    assert (
        len([p for p in lent if p.suffix == ".data"]) == 2
    )  # both segments marked lent: never rewritten


def test_lent_segment_is_never_recycled_even_by_a_reopened_tier(
    make_tier: MakeTier, shm_dir: Path
) -> None:
    tier = make_tier(budget_bytes=64 * MIB)
    data = fill(1, {"a": 4 * MIB})
    seal_chunks(tier, 1, data)
    tier.put_manifest(1, b"m")
    hit = tier.lend_spans(1, [["a"]])[0]
    assert hit is not None
    lent = np.frombuffer(hit[0], np.uint8)
    del hit
    tier.close()
    # A new tier over the same directory (same process) does not know about the loan.
    again = RamTier(shm_dir / "t0", budget_bytes=64 * MIB)
    try:
        for step in range(2, 6):  # each commit drops the previous step; spares get reused
            seal_chunks(again, step, fill(step, {"a": 4 * MIB}))
            again.put_manifest(step, b"m")
        np.testing.assert_array_equal(lent, data["a"])
    finally:
        again.close()


def test_lend_falls_back_on_a_corrupt_copy(make_tier: MakeTier, shm_dir: Path) -> None:
    tier = make_tier()
    data = fill(1, {"a": 8192, "b": 8192})
    index = seal_chunks(tier, 1, data)
    src = TieredChunkSource(tier)
    chunks = [(k, index[k].length, index[k].raw_crc32c) for k in "ab"]
    view = src.lend_many(1, [chunks])[0]
    assert view is not None and bytes(view) == data["a"].tobytes() + data["b"].tobytes()
    assert src.lend_many(1, [[("a", 8192, index["a"].raw_crc32c ^ 1), chunks[1]]])[0] is None
    into = np.zeros(8192, np.uint8)
    assert (
        src.fetch_many(1, [("a", 8192, index["a"].raw_crc32c ^ 1, into)])[0] is None
    )  # records the bad copy, once
    assert src.stats().fallbacks == {"corrupt": 1}
    assert TieredChunkSource(None).lend_many(1, [chunks])[0] is None


def test_unverified_lend_leaves_the_bytes_to_the_caller_but_not_the_record(
    make_tier: MakeTier, shm_dir: Path
) -> None:
    """``verify=False`` (the reader checks the bytes itself, off its planning thread): a view
    whose bytes are corrupt is still lent, one whose tier record names other bytes (length
    or crc32c) is not."""
    tier = make_tier()
    data = fill(1, {"a": 8192, "b": 8192})
    index = seal_chunks(tier, 1, data)
    tier.close()
    (segment,) = (shm_dir / "t0" / "step-1").glob("*.data")
    with segment.open("r+b") as f:
        f.seek(index["a"].offset + 10)
        f.write(b"\xff" if data["a"][10] != 0xFF else b"\x00")
    again = make_tier()
    src = TieredChunkSource(again)
    ok = [(k, index[k].length, index[k].raw_crc32c) for k in "ab"]
    wrong_crc = [("a", 8192, index["a"].raw_crc32c ^ 1)]
    wrong_len = [("b", 4096, index["b"].raw_crc32c)]
    views = src.lend_many(1, [ok, wrong_crc, wrong_len, [ok[1]]], verify=False)
    assert [v is not None for v in views] == [True, False, False, True]
    assert (
        bytes(views[0])[8192:] == data["b"].tobytes()
        and bytes(views[0])[:8192] != data["a"].tobytes()
    )  # type: ignore[index]
    assert src.lend_many(1, [ok, [ok[1]]]) == [
        None,
        views[3],
    ]  # verified (the default): the corrupt view is refused
    again.close()


def test_lend_many_answers_each_group_on_its_own(make_tier: MakeTier) -> None:
    tier = make_tier()
    data = fill(1, {"a": 4096, "b": 4096, "c": 4096})
    index = seal_chunks(tier, 1, data)
    src = TieredChunkSource(tier)
    entry = {k: (k, index[k].length, index[k].raw_crc32c) for k in "abc"}
    bad_b = ("b", 4096, index["b"].raw_crc32c ^ 1)
    views = src.lend_many(
        1,
        [
            [entry["a"], entry["b"]],
            [entry["c"]],
            [bad_b],
            [entry["a"], entry["c"]],
            [],
            [entry["c"]],
        ],
    )
    assert [v is not None for v in views] == [True, True, False, False, False, True]
    assert bytes(views[0]) == data["a"].tobytes() + data["b"].tobytes()  # type: ignore[arg-type]
    assert bytes(views[1]) == bytes(views[5]) == data["c"].tobytes()  # type: ignore[arg-type]
    ram = src.stats().tiers["ram"]
    assert (ram.chunks, ram.bytes) == (4, 4 * 4096)  # only the groups lent
    assert src.lend_many(2, [[entry["a"]]]) == [None]  # no such step
    assert TieredChunkSource(None).lend_many(1, [[entry["a"]], [entry["b"]]]) == [None, None]
