"""Parity groups and striping (pure): groups across failure domains, every byte of every member
recoverable from its group's parity and the other members' streams."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastckpt.errors import ConfigError
from fastckpt.replicas._parity_layout import (
    ParityRecord,
    others,
    parity_chunk_id,
    parity_groups,
    parse_parity_id,
    part_index,
    part_size,
    part_span,
    rebuild_pieces,
    xor_into,
)
from fastckpt.replicas._placement import host_domain


def test_groups_are_near_equal_consecutive_ring_members() -> None:
    members = [f"m{i}" for i in range(6)]
    assert parity_groups(members, 4) == [["m0", "m1", "m2"], ["m3", "m4", "m5"]]
    assert [len(g) for g in parity_groups([f"m{i:02d}" for i in range(10)], 4)] == [4, 3, 3]
    assert parity_groups(["a"], 4) == [["a"]]  # unprotected
    assert parity_groups([], 4) == []
    with pytest.raises(ConfigError):
        parity_groups(members, 1)


def test_groups_span_distinct_domains() -> None:
    # 4 hosts x 2 slots: the ring interleaves hosts, so each group of 4 has one slot per host
    members = [f"h{h}/{s}" for h in range(4) for s in range(2)]
    groups = parity_groups(members, 4, domain_of=host_domain)
    assert len(groups) == 2
    for g in groups:
        assert len({host_domain(m) for m in g}) == len(g)
    assert sorted(m for g in groups for m in g) == sorted(members)


def test_record_id_round_trip_and_never_a_manifest_id() -> None:
    rec = ParityRecord(("a@x", "b", "c"), "b", {"a@x": (10, 5), "c": (0, 0)})
    cid = parity_chunk_id(rec)
    assert "@" not in cid
    assert parse_parity_id(cid) == rec
    assert rec.complete() and max(s for _, s in rec.contributors.values()) == 5
    assert parse_parity_id("tree.w@0:4") is None
    assert parse_parity_id("parity#{bad json") is None


def _parities(streams: list[np.ndarray]) -> list[np.ndarray]:
    """Each member's parity, as the receivers build it."""
    s = len(streams)
    group = [str(i) for i in range(s)]
    out = []
    for j in range(s):
        parts = []
        for x in range(s):
            if x == j:
                continue
            n = streams[x].nbytes
            a, b = part_span(n, part_size(n, s), part_index(group, str(x), str(j)))
            parts.append(streams[x][a:b])
        p = np.zeros(max((len(q) for q in parts), default=0), np.uint8)
        for q in parts:
            xor_into(p, q)
        out.append(p)
    return out


def _rebuild(streams: list[np.ndarray], parities: list[np.ndarray], lost: int) -> np.ndarray:
    """Every byte of ``lost``'s stream from the parities and the other streams only."""
    s = len(streams)
    group = [str(i) for i in range(s)]
    n = streams[lost].nbytes
    out = np.zeros(n, np.uint8)
    for piece in rebuild_pieces(group, str(lost), n, 0, n):
        j = int(piece.holder)
        buf = np.zeros(piece.n, np.uint8)
        p = parities[j][piece.u : piece.u + piece.n]
        xor_into(buf, p)
        for x in others(group, str(j)):
            if x == str(lost):
                continue
            xn = streams[int(x)].nbytes
            a, b = part_span(xn, part_size(xn, s), part_index(group, x, str(j)))
            q = streams[int(x)][min(a + piece.u, b) : min(a + piece.u + piece.n, b)]
            xor_into(buf, q)
        out[piece.at : piece.at + piece.n] = buf
    return out


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 300), min_size=2, max_size=6),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_byte_of_every_member_is_recoverable(lengths: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    streams = [rng.integers(0, 256, n, dtype=np.uint8) for n in lengths]
    parities = _parities(streams)
    s = len(streams)
    for j, p in enumerate(parities):  # RAM per member: about its share / (s - 1)
        assert p.nbytes <= max(part_size(n, s) for i, n in enumerate(lengths) if i != j)
    for lost in range(s):
        assert _rebuild(streams, parities, lost).tobytes() == streams[lost].tobytes()


def test_pieces_cover_a_range_once_per_part() -> None:
    group = ["a", "b", "c", "d"]
    pieces = list(rebuild_pieces(group, "b", 10, 2, 6))  # S = 4: parts [0,4) [4,8) [8,10)
    assert [(p.holder, p.k, p.u, p.n, p.at) for p in pieces] == [
        ("a", 0, 2, 2, 0),
        ("c", 1, 0, 4, 2),
    ]
    with pytest.raises(ConfigError):
        list(rebuild_pieces(group, "b", 10, 8, 3))


def test_xor_into_unaligned_and_tail() -> None:
    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, 37, dtype=np.uint8)
    b = rng.integers(0, 256, 30, dtype=np.uint8)
    dst = a.copy()
    xor_into(dst[1:], b[:29])  # unaligned views
    expect = a.copy()
    expect[1:30] ^= b[:29]
    assert dst.tobytes() == expect.tobytes()
    with pytest.raises(ConfigError):
        xor_into(np.zeros(3, np.uint8), b)


def test_ram_options_validate_parity() -> None:
    from fastckpt.options import RamOptions

    opts = RamOptions(root="/dev/shm/x", redundancy="parity", group_size=3)
    assert opts.redundancy == "parity" and opts.group_size == 3 and opts.replicas == 1
    with pytest.raises(ConfigError, match="group_size"):
        RamOptions(root="/dev/shm/x", redundancy="parity", group_size=1)
    with pytest.raises(ConfigError, match="replicas >= 1"):
        RamOptions(root="/dev/shm/x", redundancy="parity", replicas=0)
    with pytest.raises(ConfigError, match="redundancy"):
        RamOptions(root="/dev/shm/x", redundancy="copies")  # type: ignore[arg-type]
