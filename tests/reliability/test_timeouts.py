"""Timeouts: every network wait fastckpt makes ends, with a typed error, in bounded time.

* GCS: a proxy that accepts each request and then says nothing (``stall``), or stops in
  the middle of a response body (``stall_body``), for every store operation.
* Peers: a server that authenticates and then stalls before replying, in the middle of a
  chunk, or stops reading a pushed chunk; and a restore whose only peer stalls (it falls
  back to storage).
* Barriers: a job of two processes where the other never shows up, at every wait of a save
  (commit barrier, RAM manifest exchange) and of a restore (RAM step choice, end barrier).
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fastckpt import (
    CheckpointManager,
    DistributedOptions,
    ManagerOptions,
    RetentionOptions,
    SaveOptions,
)
from fastckpt.coordination.distributed import Coordinator
from fastckpt.errors import (
    BarrierTimeoutError,
    PeerUnavailableError,
    RetriesExhaustedError,
    SaveError,
    TransientStorageError,
)
from fastckpt.options import RamOptions
from fastckpt.replicas import _wire as wire
from fastckpt.replicas._client import PeerClient
from fastckpt.replicas._connection import PeerOptions, server_handshake
from fastckpt.replicas._sources import TieredChunkSource
from fastckpt.replicas._wire import MsgType
from fastckpt.storage import (
    ByteRange,
    GcsOptions,
    GcsStore,
    MemoryStore,
    RetryingStore,
    RetryPolicy,
)
from fastckpt.testing.gcs_emulator import GcsEmulator
from tests.support.fault_proxy import FaultProxy
from tests.support.tag_raw import tag_raw

from ._util import BUCKET, Recorder, device_state, state_mismatches

_prefixes = itertools.count()
READ_TIMEOUT_S = 0.3
SECRET = b"timeouts-secret-0123456789ab"


def _causes(e: BaseException | None) -> list[type[BaseException]]:
    out = []
    while e is not None:
        out.append(type(e))
        e = e.__cause__ or e.__context__
    return out


# ============================================================================ GCS


@pytest.fixture
def stalled(gcs_emulator: GcsEmulator) -> Iterator[tuple[FaultProxy, str]]:
    """A proxy (no faults yet) and a prefix holding object ``obj`` (1 MiB)."""
    prefix = f"stall{next(_prefixes):04d}"
    seed_store = GcsStore(BUCKET, prefix, options=GcsOptions(endpoint=gcs_emulator.endpoint))
    asyncio.run(seed_store.put("obj", np.random.default_rng(0).bytes(1 << 20)))
    with FaultProxy(gcs_emulator.endpoint, stall_s=30.0) as proxy:
        yield proxy, prefix


_OPS: dict[str, Callable[[Any], Any]] = {
    "get": lambda s: s.get("obj"),
    "get_range": lambda s: s.get("obj", byte_range=ByteRange(10, 1000)),
    "put": lambda s: s.put("new", b"x" * 1000),
    "put_create": lambda s: s.put("new2", b"x" * 1000, mode="create"),
    "list": lambda s: s.list(""),
    "delete": lambda s: s.delete("obj"),
    "head": lambda s: s.head("obj"),
    "exists": lambda s: s.exists("obj"),
}


@pytest.mark.parametrize("kind", ["stall", "stall_body"])
def test_stalled_gcs_calls_fail_in_bounded_time(
    stalled: tuple[FaultProxy, str], kind: str, recorder: Recorder
) -> None:
    proxy, prefix = stalled
    proxy.configure(rate=1.0, kinds=(kind,))
    opts = GcsOptions(endpoint=proxy.endpoint, connect_timeout_s=1.0, read_timeout_s=READ_TIMEOUT_S)
    ops = _OPS if kind == "stall" else {k: v for k, v in _OPS.items() if k.startswith("get")}
    worst = {}
    for name, op in ops.items():
        bare = GcsStore(BUCKET, prefix, options=opts)
        retrying = RetryingStore(
            GcsStore(BUCKET, prefix, options=opts),
            policy=RetryPolicy(max_attempts=3, initial_backoff_s=0.01, deadline_s=5.0),
        )
        cases = [(bare, TransientStorageError, 4 * READ_TIMEOUT_S + 2)]
        if name in ("get_range", "put_create"):  # the retry loop ends too (3 attempts)
            cases.append((retrying, RetriesExhaustedError, 3 * (4 * READ_TIMEOUT_S) + 2))
        for store, error, bound in cases:
            t0 = time.monotonic()
            with pytest.raises(error) as info:
                asyncio.run(op(store))
            took = time.monotonic() - t0
            assert took < bound, (name, took)
            assert "timed out" in str(info.value).lower() or "timeout" in str(info.value).lower(), (
                info.value
            )
            worst[name] = max(worst.get(name, 0.0), round(took, 2))
        for store in (bare, retrying):
            asyncio.run(store.close())
    assert proxy.faults()[kind] >= len(ops)
    # Nothing of the client keeps retrying behind our back (google-cloud-storage's bucket
    # metadata thread did, with its own retries, for up to 120 s after close()).
    lingering = [t.name for t in threading.enumerate() if "_background" in t.name]
    assert lingering == [], lingering
    recorder.add(
        f"timeout_gcs_{kind}",
        calls=sum(1 for _ in worst),
        read_timeout_s=READ_TIMEOUT_S,
        max_seconds_by_op=worst,
    )


def test_manager_save_and_restore_over_a_stalled_gcs_fail_in_bounded_time(
    gcs_emulator: GcsEmulator, recorder: Recorder
) -> None:
    prefix = f"stallmgr{next(_prefixes):04d}"
    policy = RetryPolicy(max_attempts=2, initial_backoff_s=0.01, deadline_s=3.0)
    with FaultProxy(gcs_emulator.endpoint, stall_s=30.0) as proxy:
        gcs = GcsStore(
            BUCKET,
            prefix,
            options=GcsOptions(endpoint=proxy.endpoint, read_timeout_s=READ_TIMEOUT_S),
        )
        opts = ManagerOptions(save=SaveOptions(max_chunk_bytes=64 << 10, object_bytes=128 << 10))
        with CheckpointManager(RetryingStore(gcs, policy=policy), options=opts) as mgr:
            mgr.save(1, device_state(1))
            mgr.wait()
            proxy.configure(rate=1.0, kinds=("stall",))
            t0 = time.monotonic()
            mgr.save(2, device_state(2))
            with pytest.raises(SaveError):
                mgr.wait()
            save_s = time.monotonic() - t0
            t0 = time.monotonic()
            with pytest.raises(RetriesExhaustedError):
                mgr.restore(1)
            restore_s = time.monotonic() - t0
            proxy.configure(rate=0.0)
            assert mgr.persistent_steps() == [1]
    assert save_s < 15 and restore_s < 10
    recorder.add(
        "timeout_gcs_manager", save_error_s=round(save_s, 2), restore_error_s=round(restore_s, 2)
    )


# ============================================================================ peers


class StallingPeer:
    """Authenticates properly, then stalls at the chosen point:

    * ``"reply"``: reads the request, never answers;
    * ``"payload"``: answers GET_CHUNKS with a CHUNKS head and half the payload, then nothing;
    * ``"read"``: stops reading (a pushed chunk fills the socket buffers and the sender blocks).
    """

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        self.stop = threading.Event()
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(10)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            chan = server_handshake(
                conn, secret=SECRET, options=PeerOptions(handshake_timeout_s=10, io_timeout_s=10)
            )
            if self.mode != "read":
                t, _h, plen = chan.recv_head()
                if plen:
                    chan.recv_payload()
                if self.mode == "payload" and t is MsgType.GET_CHUNKS:
                    head = wire.encode_frame(
                        MsgType.CHUNKS, {"lengths": [1 << 20], "crcs": [0], "missing": []}, 1 << 20
                    )
                    conn.sendall(tag_raw(chan, head + b"\0" * (1 << 19)))
            self.stop.wait(60)
        except Exception:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.listener.close()
        for c in self.conns:
            c.close()


@pytest.fixture
def stalling_peer(request: pytest.FixtureRequest) -> Iterator[StallingPeer]:
    peer = StallingPeer(request.param)
    yield peer
    peer.close()


IO_TIMEOUT_S = 0.5
PEER_OPTS = PeerOptions(connect_timeout_s=1.0, handshake_timeout_s=1.0, io_timeout_s=IO_TIMEOUT_S)


@pytest.mark.parametrize("stalling_peer", ["reply", "payload"], indirect=True)
def test_stalled_peer_transfer_fails_in_bounded_time(
    stalling_peer: StallingPeer, recorder: Recorder
) -> None:
    with PeerClient(stalling_peer.address, secret=SECRET, options=PEER_OPTS) as client:
        into = np.zeros(1 << 20, np.uint8)
        for call in (
            lambda: client.get_chunks(1, [("a", into, None)]),
            lambda: client.list_chunks(1),
            client.steps,
        ):
            t0 = time.monotonic()
            with pytest.raises(PeerUnavailableError):
                call()
            took = time.monotonic() - t0
            assert took < 2 * IO_TIMEOUT_S + 1.5, took
    recorder.add(
        f"timeout_peer_{stalling_peer.mode}",
        calls=3,
        io_timeout_s=IO_TIMEOUT_S,
        max_seconds=round(took, 2),
    )


@pytest.mark.parametrize("stalling_peer", ["read"], indirect=True)
def test_push_to_a_peer_that_stops_reading_fails_in_bounded_time(
    stalling_peer: StallingPeer,
) -> None:
    data = np.zeros(64 << 20, np.uint8)  # far more than the socket buffers hold
    with PeerClient(stalling_peer.address, secret=SECRET, options=PEER_OPTS) as client:
        t0 = time.monotonic()
        with pytest.raises(PeerUnavailableError):
            client.push_chunks(1, [("big", data, 0)])
        assert time.monotonic() - t0 < 4 * IO_TIMEOUT_S + 2


@pytest.mark.parametrize("stalling_peer", ["payload"], indirect=True)
def test_restore_with_a_stalling_peer_falls_back_to_storage(
    stalling_peer: StallingPeer, recorder: Recorder
) -> None:
    store = MemoryStore()
    opts = ManagerOptions(save=SaveOptions(max_chunk_bytes=64 << 10))
    with CheckpointManager(store, options=opts) as mgr:
        mgr.save(1, device_state(1))
        mgr.wait()
    peer = PeerClient(stalling_peer.address, secret=SECRET, options=PEER_OPTS, name="stalling")
    source = TieredChunkSource(None, [peer], use_listing=False)  # ask the peer for every chunk
    t0 = time.monotonic()
    with CheckpointManager(store, options=opts, chunk_source=source) as mgr:
        got = mgr.restore(1)
        stats = mgr.last_restore_stats
    took = time.monotonic() - t0
    assert state_mismatches(got, 1) == []
    assert stats.chunks_by_tier.get("storage", 0) == sum(stats.chunks_by_tier.values())
    assert source.stats().fallbacks.get("unavailable", 0) >= 1 and source.stats().dead_peers == [
        "stalling"
    ]
    assert took < 4 * IO_TIMEOUT_S + 5, took
    recorder.add(
        "timeout_peer_restore_fallback", restore_s=round(took, 2), fallback="storage", wrong_data=0
    )
    peer.close()


# ============================================================================ barriers


class HalfJob(Coordinator):
    """A two-process job in which the other process never shows up (keys it would set never
    appear). ``get`` waits for real, until its timeout."""

    def __init__(self, process_index: int) -> None:
        self.process_index = process_index
        self.process_count = 2
        self._kv: dict[str, str] = {}
        self.waits: list[tuple[str, float]] = []

    def set(self, key: str, value: str, *, timeout_s: float | None = None) -> None:
        self._kv[key] = value

    def get(self, key: str, *, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        t0 = time.monotonic()
        while key not in self._kv:
            if time.monotonic() > deadline:
                self.waits.append((key, time.monotonic() - t0))
                raise BarrierTimeoutError(f"timed out after {timeout_s:.1f}s waiting for {key!r}")
            time.sleep(0.01)
        return self._kv[key]

    def try_get(self, key: str) -> str | None:
        return self._kv.get(key)


BARRIER_S = 0.6


def _options(**kw: Any) -> ManagerOptions:
    return ManagerOptions(
        distributed=DistributedOptions(barrier_timeout_s=BARRIER_S),
        retention=RetentionOptions(keep_last=None),
        **kw,
    )


@pytest.fixture
def shm() -> Iterator[Path]:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    d = base / f"fastckpt-to-{uuid.uuid4().hex[:10]}"
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("me", [0, 1])
@pytest.mark.parametrize("ram", [False, True], ids=["storage", "ram"])
def test_save_waiting_for_a_missing_process_times_out(
    me: int, ram: bool, shm: Path, recorder: Recorder
) -> None:
    store = MemoryStore()
    coord = HalfJob(me)
    opts = _options(ram=RamOptions(root=str(shm), interval_steps=1, replicas=0) if ram else None)
    with CheckpointManager(store, options=opts, coordinator=coord) as mgr:
        t0 = time.monotonic()
        mgr.save(1, device_state(1))
        with pytest.raises(SaveError) as info:
            mgr.wait()
        took = time.monotonic() - t0
        assert BarrierTimeoutError in _causes(info.value), _causes(info.value)
        assert took < BARRIER_S + 3, took
        assert mgr.persistent_steps() == []  # nothing committed
    assert took >= 0.9 * BARRIER_S  # it did wait for the other process
    recorder.add(
        "timeout_barrier_save",
        cases=1,
        barrier_timeout_s=BARRIER_S,
        max_seconds_to_error=round(took, 2),
        waits=[k.split("/", 2)[-1] for k, _ in coord.waits],
    )


def test_restore_waiting_for_a_missing_process_times_out(shm: Path, recorder: Recorder) -> None:
    store = MemoryStore()
    with CheckpointManager(store, options=_options()) as mgr:  # a genuine single-process step
        mgr.save(1, device_state(1))
        mgr.wait()
    for me in (0, 1):
        coord = HalfJob(me)
        opts = _options(ram=RamOptions(root=str(shm / f"p{me}"), interval_steps=1, replicas=0))
        with CheckpointManager(store, options=opts, coordinator=coord) as mgr:
            t0 = time.monotonic()
            with pytest.raises(BarrierTimeoutError):
                # process 1 waits for process 0's choice; process 0 for the end barrier
                mgr.restore()
            took = time.monotonic() - t0
            assert took < BARRIER_S + 3, took
        recorder.add(
            "timeout_barrier_restore",
            cases=1,
            max_seconds_to_error=round(took, 2),
            waits=[k.split("/", 2)[-1] for k, _ in coord.waits],
        )
