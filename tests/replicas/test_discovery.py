"""Discovery: peer records, and the one directory (the coordinator's key-value store in a job
of several processes, the checkpoint store's ``_peers/`` in a job of one)."""

from __future__ import annotations

import asyncio

import pytest

from fastckpt.coordination.distributed import LocalCoordinator
from fastckpt.errors import BarrierTimeoutError, ConfigError, ProtocolError
from fastckpt.replicas._startup import PeerDirectory, PeerRecord, make_record
from fastckpt.storage import MemoryStore


def test_record_round_trip_and_validation() -> None:
    r = make_record("host-a/0", ("10.0.0.1", 4242))
    assert PeerRecord.from_json(r.to_json()) == r and r.address == ("10.0.0.1", 4242)
    for bad in (
        "",
        "[]",
        '{"version": 2}',
        r.to_json().replace("4242", '"x"'),
        r.to_json().replace("4242", "0"),
    ):
        with pytest.raises(ProtocolError):
            PeerRecord.from_json(bad)
    with pytest.raises(ConfigError):
        make_record("", ("h", 1))


def _two_processes(index: int, kv: LocalCoordinator | None = None) -> LocalCoordinator:
    """Process ``index`` of a job of two, sharing ``kv``'s key-value store."""
    coord = LocalCoordinator()
    coord.process_index, coord.process_count = index, 2
    if kv is not None:
        coord._kv = kv._kv
    return coord


def test_several_processes_publish_in_the_coordinator() -> None:
    store = MemoryStore()
    p0 = _two_processes(0)
    p1 = _two_processes(1, p0)
    d0 = PeerDirectory(p0, store, run=asyncio.run, namespace="job1", timeout_s=0.1)
    d1 = PeerDirectory(p1, store, run=asyncio.run, namespace="job1", timeout_s=0.1)
    r0, r1 = make_record("h/0", ("127.0.0.1", 5000)), make_record("h/1", ("127.0.0.1", 5001))
    d0.publish(r0)
    with pytest.raises(BarrierTimeoutError, match="process 1"):
        d0.lookup()
    d1.publish(r1)
    assert d0.lookup() == d1.lookup() == {"h/0": r0, "h/1": r1}
    assert asyncio.run(store.list("")) == []  # nothing in the checkpoint store
    with pytest.raises(ConfigError):
        PeerDirectory(p0, store, run=asyncio.run, namespace="a/b")


def test_one_process_publishes_in_the_store_and_the_newest_record_wins() -> None:
    store = MemoryStore()
    d = PeerDirectory(LocalCoordinator(), store, run=asyncio.run)
    a0 = make_record("host/a:0", ("127.0.0.1", 1000))
    b0 = make_record("host/b:0", ("127.0.0.1", 2000))
    d.publish(a0)
    d.publish(b0)
    assert sorted(asyncio.run(store.list("_peers/"))) == [
        "_peers/host%2Fa%3A0.json",
        "_peers/host%2Fb%3A0.json",
    ]
    # another one-process job (or a restarted member) sharing the store finds them
    other = PeerDirectory(LocalCoordinator(), store, run=asyncio.run)
    assert other.lookup() == {"host/a:0": a0, "host/b:0": b0}
    restarted = make_record("host/a:0", ("127.0.0.1", 1001))
    other.publish(restarted)
    assert d.lookup()["host/a:0"] == restarted


def test_unparsable_records_are_skipped_and_the_newest_wins() -> None:
    store = MemoryStore()
    d = PeerDirectory(LocalCoordinator(), store, run=asyncio.run)
    old = PeerRecord(member_id="m", host="h", port=1, incarnation="a", published_unix=1.0)
    new = PeerRecord(member_id="m", host="h", port=2, incarnation="b", published_unix=2.0)
    d.publish(new)
    asyncio.run(
        store.put("_peers/stale.json", old.to_json().encode())
    )  # e.g. left by an earlier incarnation
    asyncio.run(store.put("_peers/garbage.json", b"garbage"))
    assert d.lookup() == {"m": new}


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100000 + "]" * 100000,  # nesting beyond the parser's recursion limit
        '{"version": 1, "member_id": "m", "host": "h", "port": 1, "incarnation": "i", '
        '"published_unix": Infinity}',
        '{"version": 1, "member_id": "m", "host": "h", "port": 1, "incarnation": "i", '
        '"published_unix": NaN}',
        '{"version": 1, "member_id": "m", "host": "h", "port": 1, "incarnation": "i", '
        '"published_unix": 1e400}',
        '{"version": 1, "member_id": "m", "host": "h", "port": 1, "incarnation": "i", '
        '"published_unix": true}',
    ],
)
def test_malformed_records_are_protocol_errors(text: str) -> None:
    """Every malformed record is a ProtocolError (skipped by the directory), and a record
    stamped with a non-finite time cannot outrank every later republish."""
    import json

    # the record's version field, whatever the current one is
    version = json.loads(make_record("m", ("h", 1)).to_json())["version"]
    with pytest.raises(ProtocolError):
        PeerRecord.from_json(text.replace('"version": 1', f'"version": {version}'))
