"""Discovery: records through a Coordinator, a Store, or callables."""

from __future__ import annotations

import asyncio

import pytest

from fastckpt.coordination.distributed import LocalCoordinator
from fastckpt.errors import BarrierTimeoutError, ConfigError, ProtocolError
from fastckpt.replicas import CallbackDirectory, CoordinatorDirectory, PeerRecord, StoreDirectory, make_record
from fastckpt.storage import MemoryStore


def test_record_round_trip_and_validation() -> None:
    r = make_record("host-a/0", ("10.0.0.1", 4242))
    assert PeerRecord.from_json(r.to_json()) == r and r.address == ("10.0.0.1", 4242)
    for bad in ("", "[]", '{"version": 2}', r.to_json().replace("4242", '"x"'), r.to_json().replace("4242", "0")):
        with pytest.raises(ProtocolError):
            PeerRecord.from_json(bad)
    with pytest.raises(ConfigError):
        make_record("", ("h", 1))


def test_coordinator_directory() -> None:
    coord = LocalCoordinator()
    d = CoordinatorDirectory(coord, namespace="job1", timeout_s=0.1)
    with pytest.raises(BarrierTimeoutError):
        d.lookup()
    assert d.lookup(wait=False) == {}
    r = make_record("h/0", ("127.0.0.1", 5000))
    d.publish(r)
    assert d.lookup() == {"h/0": r}
    with pytest.raises(ConfigError):
        CoordinatorDirectory(coord, namespace="a/b")


def test_store_directory_newest_record_wins() -> None:
    store = MemoryStore()
    d = StoreDirectory(store, prefix="peers/", run=asyncio.run)
    a0 = make_record("host/a:0", ("127.0.0.1", 1000))
    b0 = make_record("host/b:0", ("127.0.0.1", 2000))
    d.publish(a0)
    d.publish(b0)
    assert d.lookup() == {"host/a:0": a0, "host/b:0": b0}
    restarted = make_record("host/a:0", ("127.0.0.1", 1001))
    d.publish(restarted)
    assert d.lookup()["host/a:0"] == restarted
    d.withdraw("host/b:0")
    assert list(d.lookup()) == ["host/a:0"]


def test_callback_directory_skips_garbage_and_keeps_newest() -> None:
    rows: dict[str, str] = {}

    def delete(member_id: str) -> None:
        rows.pop(member_id, None)

    d = CallbackDirectory(rows.__setitem__, lambda: [*rows.values(), "garbage"], delete)
    old = PeerRecord(member_id="m", host="h", port=1, incarnation="a", published_unix=1.0)
    new = PeerRecord(member_id="m", host="h", port=2, incarnation="b", published_unix=2.0)
    d.publish(new)
    rows["stale"] = old.to_json()  # e.g. a record left by a previous incarnation
    assert d.lookup() == {"m": new}
    d.withdraw("m")
    assert d.lookup() == {"m": old}


@pytest.mark.parametrize("text", [
    "[" * 100000 + "]" * 100000,  # nesting beyond the parser's recursion limit
    '{"version": 1, "member_id": "m", "host": "h", "port": 1, "incarnation": "i", "published_unix": Infinity}',
    '{"version": 1, "member_id": "m", "host": "h", "port": 1, "incarnation": "i", "published_unix": NaN}',
    '{"version": 1, "member_id": "m", "host": "h", "port": 1, "incarnation": "i", "published_unix": 1e400}',
    '{"version": 1, "member_id": "m", "host": "h", "port": 1, "incarnation": "i", "published_unix": true}',
])
def test_malformed_records_are_protocol_errors(text: str) -> None:
    """Every malformed record is a ProtocolError (skipped by the directories), and a record
    stamped with a non-finite time cannot outrank every later republish."""
    import json

    # the record's version field, whatever the current one is
    version = json.loads(make_record("m", ("h", 1)).to_json())["version"]
    with pytest.raises(ProtocolError):
        PeerRecord.from_json(text.replace('"version": 1', f'"version": {version}'))
