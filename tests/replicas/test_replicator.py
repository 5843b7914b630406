"""Replicator: background pushes to ring peers, failures isolated per target, superseding."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from fastckpt.errors import (
    ConfigError,
    PeerUnavailableError,
    ReplicationError,
    ReplicationTimeoutError,
)
from fastckpt.replicas._client import PeerClient
from fastckpt.replicas._connection import PeerOptions
from fastckpt.replicas._ram import RamTier
from fastckpt.replicas._replicator import Replicator, ReplicatorOptions
from fastckpt.replicas._server import PeerServer

from .conftest import SECRET, fill, seal_chunks, verified_chunk

MakeTier = Callable[..., RamTier]
MakeServer = Callable[..., PeerServer]
FAST = PeerOptions(connect_timeout_s=1, handshake_timeout_s=1, io_timeout_s=2)


class SlowPusher:
    """A pusher that blocks until released (to observe the caller never blocking)."""

    def __init__(self) -> None:
        self.release, self.entered = threading.Event(), threading.Event()
        self.pushed: list[tuple[int, str]] = []

    def list_chunks(self, step: int) -> list[str]:
        return []

    def push_chunks(self, step: int, chunks: Sequence[tuple[str, memoryview, int]]) -> None:
        self.entered.set()
        self.release.wait(10)
        self.pushed.extend((step, cid) for cid, _, _ in chunks)

    def put_manifest(self, step: int, data: bytes | memoryview) -> None:
        self.pushed.append((step, "<manifest>"))


def test_pushes_every_chunk_and_manifest_to_every_target(
    make_tier: MakeTier, make_server: MakeServer
) -> None:
    own = make_tier("own")
    data = fill(1, {"a": 3 << 20, "b": 10, "c": 1 << 20})
    seal_chunks(own, 1, data)
    peers = {n: make_tier(n) for n in ("m1", "m2")}
    targets = {
        n: PeerClient(make_server(t).address, secret=SECRET, options=FAST) for n, t in peers.items()
    }
    rep = Replicator(own, targets=targets, options=ReplicatorOptions(max_inflight_bytes=2 << 20))
    handle = rep.submit(1, manifest=b'{"step":1}')
    report = handle.wait(30)
    assert report is not None and report.ok
    assert report.chunks_pushed == 6 and report.bytes_pushed == 2 * sum(
        a.nbytes for a in data.values()
    )
    for t in peers.values():
        assert t.chunk_ids(1) == sorted(data) and t.get_manifest(1) == b'{"step":1}'
        for cid, a in data.items():
            assert bytes(verified_chunk(t, 1, cid)) == a.tobytes()  # type: ignore[arg-type]
    again = rep.submit(1).wait(30)  # idempotent: peers already hold everything
    assert again is not None and again.chunks_present == 6 and again.bytes_pushed == 0
    assert [r.step for r in rep.wait(5)] == [1, 1]
    assert rep.stats()["chunks_pushed"] == 6
    rep.close()


def test_dead_target_is_reported_and_others_still_served(
    make_tier: MakeTier, make_server: MakeServer
) -> None:
    own = make_tier("own")
    seal_chunks(own, 1, fill(1, {"a": 100, "b": 200}))
    alive = make_tier("alive")
    targets = {
        "dead": PeerClient(("127.0.0.1", 1), secret=SECRET, options=FAST),
        "alive": PeerClient(make_server(alive).address, secret=SECRET, options=FAST),
    }
    rep = Replicator(own, targets=targets)
    rep.submit(1)
    with pytest.raises(ReplicationError) as e:
        rep.wait(30, raise_on_error=True)
    (report,) = e.value.reports
    assert (
        list(report.errors) == ["dead"] and PeerUnavailableError.__name__ in report.errors["dead"]
    )
    assert alive.chunk_ids(1) == ["a", "b"]
    assert rep.stats()["failures"] == 1
    rep.close()


def test_submit_never_blocks_and_newer_steps_supersede(
    make_tier: MakeTier, caplog: pytest.LogCaptureFixture
) -> None:
    own = make_tier("own", keep_steps=5)
    for step in (1, 2):
        seal_chunks(own, step, fill(step, {f"c{i}": 10 for i in range(5)}))
    slow = SlowPusher()
    rep = Replicator(own, targets={"slow": slow}, options=ReplicatorOptions(batch_chunks=1))
    t0 = time.monotonic()
    h1 = rep.submit(1)
    # Returned while the pusher is blocked (for up to 10 s): generous, a busy 2-core VM stalls.
    assert time.monotonic() - t0 < 5
    # Step 2 supersedes step 1 *while it runs* (submitted before the worker took step 1, it
    # would skip step 1 altogether: a race, not what this test checks).
    assert slow.entered.wait(10)
    t0 = time.monotonic()
    h2 = rep.submit(2)
    assert time.monotonic() - t0 < 5 and not h1.done()
    with pytest.raises(ReplicationTimeoutError):
        rep.wait(0.05)
    slow.release.set()
    reports = rep.wait(30)
    assert [r.step for r in reports] == [1, 2]
    assert reports[0].superseded and not reports[0].ok
    assert any(
        "push of RAM step 1 superseded by step 2" in r.getMessage() for r in caplog.records
    ), caplog.text
    assert reports[1].ok and reports[1].chunks_pushed == 5
    assert sum(1 for s, _ in slow.pushed if s == 1) <= 1  # step 1 stopped after its first chunk
    assert h2.done()
    rep.close()
    rep.close()


def test_no_targets_is_a_noop(make_tier: MakeTier) -> None:
    own = make_tier()
    seal_chunks(own, 1, fill(1, {"a": 1}))
    rep = Replicator(own)
    report = rep.submit(1).wait(1)
    assert report is not None and report.ok and report.targets == ()
    rep.close()


def test_chunks_go_in_batches_one_segment_each(
    make_tier: MakeTier, make_server: MakeServer, shm_dir: Path
) -> None:
    own = make_tier("own")
    data = fill(1, {"a": 3 << 20, "b": 10, "c": 1 << 20, "d": 5, "e": 7})
    seal_chunks(own, 1, data)
    peer = make_tier("peer")
    target = PeerClient(make_server(peer).address, secret=SECRET, options=FAST)
    options = ReplicatorOptions(batch_bytes=3 << 20, batch_chunks=2)
    rep = Replicator(own, targets={"peer": target}, options=options)
    report = rep.submit(1).wait(30)
    rep.close()
    assert report is not None and report.ok and report.chunks_pushed == 5
    # batches: [a] (3 MiB fills one), [b, c], [d, e] (two chunks at most)
    assert len(list((shm_dir / "peer" / "step-1").glob("*.data"))) == 3
    for cid, a in data.items():
        assert bytes(verified_chunk(peer, 1, cid)) == a.tobytes()  # type: ignore[arg-type]
    target.close()


class CountingPusher:
    """Records pushes; blocks on steps listed in ``hold`` until ``release`` is set."""

    def __init__(self, hold: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        self.hold, self.release, self.holding = hold, threading.Event(), threading.Event()
        self.pushed: list[tuple[int, str]] = []

    def list_chunks(self, step: int) -> list[str]:
        return []

    def push_chunks(self, step: int, chunks: Sequence[tuple[str, memoryview, int]]) -> None:
        if step in self.hold:
            self.holding.set()
            self.release.wait(10)
        self.pushed.extend((step, cid) for cid, _, _ in chunks)

    def put_manifest(self, step: int, data: bytes | memoryview) -> None:
        self.pushed.append((step, "<manifest>"))


def test_reports_are_bounded_and_running_pushes_are_kept(make_tier: MakeTier) -> None:
    own = make_tier("own", keep_steps=40)
    for step in range(1, 31):
        seal_chunks(own, step, fill(step, {"a": 10}))
    pusher = CountingPusher()
    rep = Replicator(own, targets={"p": pusher}, options=ReplicatorOptions(max_reports=4))
    for step in range(1, 21):
        assert rep.submit(step).wait(10) is not None
    assert len(rep._handles) == 4
    assert rep.stats() == {
        "steps": 20,
        "chunks_pushed": 20,
        "bytes_pushed": 200,
        "failures": 0,
        "reports_forgotten": 16,
    }
    assert [r.step for r in rep.wait(5)] == [17, 18, 19, 20]
    assert rep.wait(5) == []
    # A push still running is never forgotten, however many newer steps finish meanwhile
    # (those go to no target: done at once; each still supersedes the held push).
    pusher.hold = {21}
    held = rep.submit(21)
    assert pusher.holding.wait(
        10
    )  # the push of 21 is running (a newer submit before it starts skips it)
    rep.set_targets({})
    for step in range(22, 31):
        rep.submit(step)
    assert not held.done() and held in rep._handles and len(rep._handles) == 4
    pusher.release.set()
    reports = rep.wait(10)
    assert [r.step for r in reports] == [21, 28, 29, 30]
    assert reports[0].superseded and all(r.ok for r in reports[1:])
    assert rep.stats()["reports_forgotten"] == 16 + 6
    rep.close()


def test_max_reports_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="max_reports"):
        ReplicatorOptions(max_reports=0)
