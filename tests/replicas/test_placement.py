"""Placement: ring successors, domain spreading, balance, holders (property tests)."""

from __future__ import annotations

import collections
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastckpt.errors import ConfigError
from fastckpt.replicas._placement import (
    host_domain,
    relay_parent,
    replica_holders,
    ring_order,
    ring_successors,
)

member_ids = st.lists(
    st.text(st.characters(codec="utf-8", exclude_characters="/"), min_size=1, max_size=6),
    min_size=1,
    max_size=12,
    unique=True,
)


@st.composite
def hosts_and_slots(draw: st.DrawFn) -> list[str]:
    n_hosts = draw(st.integers(1, 6))
    slots = draw(st.lists(st.integers(1, 4), min_size=n_hosts, max_size=n_hosts))
    return [f"h{h}/{s}" for h in range(n_hosts) for s in range(slots[h])]


def push_targets(
    members: list[str], k: int, *, domain_of: Callable[[str], str] | None = None
) -> dict[str, list[str]]:
    return {m: ring_successors(members, m, k, domain_of=domain_of) for m in set(members)}


@settings(max_examples=80, deadline=None)
@given(member_ids, st.integers(0, 5), st.randoms(use_true_random=False))
def test_successors_are_distinct_others_and_order_independent(
    members: list[str], k: int, rnd
) -> None:  # type: ignore[no-untyped-def]
    targets = push_targets(members, k)
    shuffled = list(members)
    rnd.shuffle(shuffled)
    assert push_targets(shuffled, k) == targets  # content-stable: input order is irrelevant
    for m in members:
        t = targets[m]
        assert m not in t
        assert len(t) == len(set(t)) == min(k, len(members) - 1)
        assert ring_successors(members, m, k) == t


@settings(max_examples=80, deadline=None)
@given(member_ids, st.integers(1, 4))
def test_plain_ring_is_sorted_successors_and_balanced(members: list[str], k: int) -> None:
    ring = sorted(members)
    assert ring_order(members) == ring
    received = collections.Counter(t for ts in push_targets(members, k).values() for t in ts)
    for i, m in enumerate(ring):
        expect = [ring[(i + j) % len(ring)] for j in range(1, min(k, len(ring) - 1) + 1)]
        assert ring_successors(members, m, k) == expect
        assert received[m] == min(k, len(ring) - 1)  # everyone holds the same number of replicas


@settings(max_examples=80, deadline=None)
@given(hosts_and_slots(), st.integers(1, 4))
def test_domains_prefer_other_hosts(members: list[str], k: int) -> None:
    domains = {host_domain(m) for m in members}
    for m, targets in push_targets(members, k, domain_of=host_domain).items():
        own = host_domain(m)
        foreign = [t for t in targets if host_domain(t) != own]
        others = [x for x in members if host_domain(x) != own]
        # as many replicas off-host as possible, spread over distinct hosts first
        assert len(foreign) == min(len(targets), len(others))
        distinct = len({host_domain(t) for t in foreign})
        assert distinct == min(len(foreign), len(domains) - 1)
        assert targets[: len(foreign)] == foreign  # off-host targets come first


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 6), st.integers(1, 4), st.data())
def test_equal_hosts_are_balanced(n_hosts: int, slots: int, data: st.DataObject) -> None:
    k = data.draw(st.integers(1, n_hosts - 1))
    members = [f"host-{h}/{s}" for h in range(n_hosts) for s in range(slots)]
    targets = push_targets(members, k, domain_of=host_domain)
    received = collections.Counter(t for ts in targets.values() for t in ts)
    assert set(received.values()) == {k}
    for m, ts in targets.items():
        assert len({host_domain(t) for t in ts} | {host_domain(m)}) == k + 1


def test_replica_holders_and_errors() -> None:
    members = ["a/0", "a/1", "b/0", "b/1"]
    assert replica_holders("a/0", members, 1, domain_of=host_domain) == ["a/0", "b/0"]
    assert replica_holders("b/1", members, 2) == ["b/1", "a/0", "a/1"]
    assert ring_successors(["x"], "x", 3) == []
    with pytest.raises(ConfigError):
        ring_successors(members, "c/0", 1)
    with pytest.raises(ConfigError):
        ring_successors(members, "a/0", -1)
    with pytest.raises(ConfigError):
        ring_order(["", "a"])


@settings(max_examples=120, deadline=None)
@given(member_ids, st.integers(1, 4), st.integers(1, 5), st.data())
def test_relay_tree_reaches_a_holder_and_no_member_serves_more_than_fanout(
    members: list[str], n_holders: int, fanout: int, data: st.DataObject
) -> None:
    holders = members[:n_holders]
    relays = (
        data.draw(st.lists(st.sampled_from(members), unique=True))
        if len(members) > n_holders
        else []
    )
    outside = data.draw(
        st.lists(st.text(min_size=1, max_size=4).filter(lambda m: m not in members), max_size=3)
    )
    tree = [m for m in sorted(set(holders) | set(relays))]
    parents = {m: relay_parent(m, holders, relays, fanout=fanout) for m in tree + outside}
    for h in holders:
        assert parents[h] is None
    served = collections.Counter(parents[m] for m in tree if m not in holders)
    assert max(served.values(), default=0) <= fanout
    depth_bound = 1
    while len(holders) * sum(fanout**d for d in range(1, depth_bound + 1)) < len(tree) - len(
        holders
    ):
        depth_bound += 1
    for m in tree + outside:
        chain, node = [], m
        while parents.get(node) is not None:
            node = parents[node]
            chain.append(node)
            assert node in tree and len(chain) <= depth_bound + (
                m in outside
            )  # no cycle, logarithmic depth
        assert node in holders
    for m in outside:  # a member that cannot serve hangs below one that can, stably
        assert (
            parents[m] in tree
            and relay_parent(m, list(reversed(holders)), relays, fanout=fanout) == parents[m]
        )


def test_relay_parent_refuses_no_holder_and_a_zero_fanout() -> None:
    with pytest.raises(ConfigError):
        relay_parent("a", [], ["a"], fanout=2)
    with pytest.raises(ConfigError):
        relay_parent("a", ["b"], [], fanout=0)
