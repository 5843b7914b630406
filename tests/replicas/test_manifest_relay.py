"""A restore's manifest travels down a relay tree (threads stand in for processes, real peer
servers on loopback): no host serves more than the fan-out, process 0 alone surveys the
peers, every host keeps a copy, and a relay that never gets its copy, or a corrupt copy,
only sends its children to the holders."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastckpt.errors import ConfigError, DistributedError
from fastckpt.format.chunk_table import table_from_entries
from fastckpt.format.codec import encode_manifest
from fastckpt.format.layout import ram_object_key
from fastckpt.format.manifest import ArrayLeaf, ChunkEntry, KeyPath, Manifest, chunk_id
from fastckpt.options import RamOptions
from fastckpt.replicas import RamReplication
from fastckpt.replicas import _manifest_relay as manifest_relay
from fastckpt.replicas._client import PeerClient, StepLists
from fastckpt.replicas._manifest_relay import (
    ManifestSources,
    decode_candidates,
    encode_candidates,
    manifest_sources,
)
from fastckpt.storage import MemoryStore
from tests.support.threaded_job import ThreadedJob

from .conftest import SECRET, fill, seal_chunks

W: KeyPath = (("d", "w"),)
M = 14  # members h00..h13; h00 (process 0) and h01 hold the manifest, the rest a commit record
MEMBERS = [f"h{i:02d}" for i in range(M)]
IDS = [chunk_id(W, ((2 * i, 2 * i + 2),)) for i in range(M)]


def _manifest() -> bytes:
    chunks = tuple(
        ChunkEntry(((2 * i, 2 * i + 2),), ram_object_key(10, m), 0, 2, 2, "raw", 0, 0)
        for i, m in enumerate(MEMBERS)
    )
    table = table_from_entries(chunks, shape=(2 * M,), itemsize=1)
    return encode_manifest(
        Manifest(
            step=10,
            leaves=(ArrayLeaf(path=W, shape=(2 * M,), dtype="uint8", chunks=table),),
            num_processes=M,
            metadata={"fastckpt_tier": "ram"},
        )
    )


@pytest.fixture
def job(shm_dir: Path, request: pytest.FixtureRequest) -> Iterator[list[RamReplication]]:
    """The 14 members; ``@pytest.mark.parametrize("job", [{option: value}], indirect=True)``
    sets RamOptions fields."""
    extra = getattr(request, "param", {})
    coords = ThreadedJob.of(M)

    def start(
        i: int,
    ) -> RamReplication:  # concurrently, as a job's processes do: each checks its peers
        options = RamOptions(
            root=str(shm_dir / MEMBERS[i]),
            member_id=MEMBERS[i],
            replicas=1,
            secret=SECRET,
            host="127.0.0.1",
            **extra,
        )
        return RamReplication(
            options, coordinator=coords[i], store=MemoryStore(), namespace="t", run=lambda c: None
        )

    with ThreadPoolExecutor(M) as pool:
        out = list(pool.map(start, range(M)))
    for i, rr in enumerate(out):
        seal_chunks(rr.tier, 10, fill(10, {IDS[i]: 2}))
        if i < 2:
            rr.tier.put_manifest(10, _manifest())
        else:
            rr.tier.mark_committed(10)
    yield out
    for rr in out:
        rr.close()


class _Calls:
    """Counts, per peer, the manifests it served and the step lists asked of it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.served: collections.Counter[str] = collections.Counter()
        self.surveys = 0
        self._lock = threading.Lock()
        get_manifest, step_lists = PeerClient.get_manifest, PeerClient.step_lists

        def counted_get(client: PeerClient, step: int) -> bytes | None:
            data = get_manifest(client, step)
            if data is not None:
                with self._lock:
                    self.served[client.name] += 1
            return data

        def counted_lists(client: PeerClient) -> StepLists:
            with self._lock:
                self.surveys += 1
            return step_lists(client)

        monkeypatch.setattr(PeerClient, "get_manifest", counted_get)
        monkeypatch.setattr(PeerClient, "step_lists", counted_lists)


def _select_all(job: list[RamReplication]) -> list[int | None]:
    def one(p: int) -> int | None:
        choice = job[p].select_step(
            None,
            key="sel",
            timeout_s=60,
            wanted=lambda m, p=p: {IDS[p]: ram_object_key(10, MEMBERS[p])},
        )
        return None if choice is None else choice.step

    with ThreadPoolExecutor(M) as pool:
        return list(pool.map(one, range(M)))


def test_the_manifest_goes_down_a_tree_no_host_serves_more_than_the_fanout(
    job: list[RamReplication], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _Calls(monkeypatch)
    assert _select_all(job) == [10] * M
    # 12 hosts lacked it; from the two holders alone one would serve >= 6 copies.
    assert sum(calls.served.values()) == M - 2
    assert max(calls.served.values()) <= RamOptions(root="x").manifest_fanout == 4, calls.served
    assert set(calls.served) - {"h00", "h01"}, "relays served copies too"
    assert calls.surveys == M - 1  # process 0's survey only: no host asked every peer
    assert all(
        10 in rr.tier.manifest_steps() for rr in job
    )  # each kept its copy (it serves later restores)


@pytest.mark.parametrize("job", [{"manifest_relay_wait_s": 0.5}], indirect=True)
def test_a_relay_that_never_gets_its_copy_sends_its_children_to_the_holders(
    job: list[RamReplication], monkeypatch: pytest.MonkeyPatch
) -> None:
    """h02 relays to h10..h13 (fan-out 4 below h00's h02..h05) but cannot store its copy:
    they wait for it at most the relay wait, then read a holder."""
    monkeypatch.setattr(job[2].tier, "put_manifest", lambda step, data: None)
    calls = _Calls(monkeypatch)
    t0 = time.monotonic()
    assert _select_all(job) == [10] * M
    assert time.monotonic() - t0 < 30
    assert calls.served["h02"] == 0 and sum(calls.served.values()) == M - 2
    assert calls.served["h00"] + calls.served["h01"] == 4 + 4 + 4  # their own children and h02's
    assert 10 not in job[2].tier.manifest_steps() and all(
        10 in rr.tier.manifest_steps() for rr in job[10:]
    )


@pytest.mark.parametrize("job", [{"manifest_fanout": 2}], indirect=True)
def test_a_smaller_fanout_makes_a_deeper_tree(
    job: list[RamReplication], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _Calls(monkeypatch)
    assert _select_all(job) == [10] * M
    assert sum(calls.served.values()) == M - 2 and max(calls.served.values()) == 2, calls.served


def test_relay_options_are_validated() -> None:
    with pytest.raises(ConfigError, match="manifest_fanout"):
        RamOptions(root="x", manifest_fanout=0)
    with pytest.raises(ConfigError, match="manifest_relay_wait_s"):
        RamOptions(root="x", manifest_relay_wait_s=0)


def test_a_corrupt_copy_is_skipped_for_the_next_one(
    job: list[RamReplication], monkeypatch: pytest.MonkeyPatch
) -> None:
    """h01 holds a corrupt manifest: it and the hosts below it (h06..h09, and theirs) take
    the next copy instead of finding the step unrestorable."""
    bad = bytearray(_manifest())
    bad[len(bad) // 2] ^= 0xFF
    monkeypatch.setattr(
        job[1].tier, "get_manifest", lambda step: bytes(bad)
    )  # what it reads and serves
    assert _select_all(job) == [10] * M
    assert all(10 in rr.tier.manifest_steps() for rr in job[2:])


@settings(max_examples=60, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(MEMBERS),
        st.tuples(st.sets(st.integers(0, 40)), st.sets(st.integers(0, 40))),
        max_size=6,
    )
)
def test_sources_split_committed_steps_into_holders_and_relays_and_survive_the_message(
    lists: dict,
) -> None:  # type: ignore[type-arg]
    step_lists = {
        m: StepLists(sorted(c | h), sorted(c | h), sorted(h)) for m, (c, h) in lists.items()
    }
    sources = manifest_sources(step_lists)
    for step, src in sources.items():
        assert src.holders == tuple(sorted(m for m, (c, h) in lists.items() if step in h))
        assert src.relays == tuple(
            sorted(m for m, (c, h) in lists.items() if step in c and step not in h)
        )
    steps = sorted(sources, reverse=True)
    assert decode_candidates(encode_candidates(steps, sources)) == (steps, sources)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "[1, 2]",
        '{"steps": [1]}',
        '{"steps": [true], "sources": {}}',
        '{"steps": [-1], "sources": {}}',
        '{"steps": [1], "sources": {"2": [[], []]}}',
        '{"steps": [1], "sources": {"x": [[], []]}}',
        '{"steps": [1], "sources": {"1": [["a"]]}}',
        '{"steps": [1], "sources": {"1": [["a"], [""]]}}',
        '{"steps": [1], "sources": {"1": [["a"], [3]]}}',
        '{"steps": [1], "sources": []}',
        '{"steps": [1], "sources": {}, "extra": 1}',
        '{"steps": [3], "sources": {"\u0663": [[], []]}}',
    ],
)
def test_a_malformed_candidates_message_is_a_distributed_error(text: str) -> None:
    with pytest.raises(DistributedError, match="RAM step candidates"):
        decode_candidates(text)


def test_waiting_for_a_parent_polls_until_it_holds_the_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answers = iter([None, None, b"m"])

    class Parent:
        def get_manifest(self, step: int) -> bytes | None:
            return next(answers)

    assert manifest_relay.wait_for_manifest(Parent(), 10, wait_s=5) == b"m"  # type: ignore[arg-type]

    class Never:
        def get_manifest(self, step: int) -> bytes | None:
            return None

    t0 = time.monotonic()
    assert manifest_relay.wait_for_manifest(Never(), 10, wait_s=0.2) is None  # type: ignore[arg-type]
    assert 0.2 <= time.monotonic() - t0 < 2
    assert ManifestSources(("a",), ()) == ManifestSources(("a",), ())
