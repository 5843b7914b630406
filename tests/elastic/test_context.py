"""ElasticContext (the bring-your-own-trainer API) in one process: restore-or-init, the
step iterator, cadence saves, stop requests, reports and metrics for the driver."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest

from fastckpt import CheckpointManager
from fastckpt.elastic import ElasticContext, ElasticOptions, Worker, WorkerIdentity

pytestmark = pytest.mark.usefixtures("eight_devices")


def make_worker(tmp_path: Path, generation: int = 0) -> Worker:
    ident = WorkerIdentity(
        run_id="test",
        generation=generation,
        process_id=0,
        num_processes=1,
        coordinator="",
        node_id="0" * 56,
        node_ip="127.0.0.1",
        ram_root=str(tmp_path / "ram"),
        peer_secret=b"s" * 32,
        launch_time=0.0,
    )
    return Worker(ident)


def init() -> dict[str, Any]:
    return {"w": jnp.arange(8.0), "key": jax.random.key(0), "step": jnp.zeros((), jnp.int32)}


@jax.jit
def train_step(state: dict[str, Any]) -> dict[str, Any]:
    key, sub = jax.random.split(state["key"])
    return {
        "w": state["w"] * 0.5 + jax.random.normal(sub, (8,)),
        "key": key,
        "step": state["step"] + 1,
    }


def run(
    tmp_path: Path, total: int, *, generation: int = 0, every: int = 2, stop: bool = False
) -> tuple[ElasticContext, Any, list[int]]:
    target = jax.eval_shape(init)
    seen = []
    worker = make_worker(tmp_path, generation)
    if stop:
        worker.request_stop()
    with ElasticContext(
        worker,
        root=str(tmp_path / "ckpt"),
        options=ElasticOptions(checkpoint_every=every),
    ) as ctx:
        state = ctx.restore_or_init(init, target=target)
        ctx.mark("compiled")
        for step in ctx.steps(total):
            seen.append(step)
            state = train_step(state)
            ctx.log(step + 1, loss=float(state["w"][0]))
            ctx.maybe_save(step + 1, state)
    return ctx, state, seen


def test_fresh_run_then_resume(tmp_path: Path) -> None:
    ctx, _, seen = run(tmp_path, 5)
    assert (ctx.stopped, ctx.start_step, seen) == (False, 0, [0, 1, 2, 3, 4])
    first = ctx.worker.drain()
    assert ctx.manager is not None
    ctx2, state2, seen2 = run(tmp_path, 8, generation=1)
    assert (ctx2.start_step, seen2) == (4, [4, 5, 6, 7])  # newest committed step was 4
    # resuming replays steps 5.. exactly: same key stream, same values
    _, ref, _ = run(tmp_path / "ref", 8)
    assert jnp.array_equal(state2["w"], ref["w"])
    assert int(state2["step"]) == 8
    drained = ctx2.worker.drain()
    report = drained["report"]
    assert report["restored_step"] == 4
    assert report["restore_kind"] == "restore"
    assert report["restore_bytes_by_tier"]
    assert report["t_first_step"] >= report["t_restored"]
    assert report["phase"] == "exit" and drained["step"] == 8
    metrics = first["metrics"] + drained["metrics"]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 5, 6, 7, 8]


def test_stop_request_stops_at_a_checkpoint(tmp_path: Path) -> None:
    run(tmp_path, 4)
    ctx, _, seen = run(tmp_path, 100, generation=1, every=10, stop=True)
    # decided before step 4 ran, so the stop step is 5: saved although 5 is off-cadence
    assert seen == [4]
    assert ctx.stopped and ctx.worker.outcome == "stopped"
    with CheckpointManager(str(tmp_path / "ckpt")) as mgr:
        assert mgr.latest_step() == 5
        assert mgr.metadata(5)["generation"] == 1


def test_options_are_validated() -> None:
    from fastckpt.errors import ConfigError

    with pytest.raises(ConfigError):
        ElasticOptions(checkpoint_every=0)
    with pytest.raises(ConfigError):
        ElasticOptions(ram_every=-1)


def test_wait_for_listener_waits_for_the_coordinator_port_then_returns() -> None:
    """Non-zero processes probe process 0's port before jax.distributed.initialize (a refused
    first connect costs a ~1 s gRPC backoff); the probe waits for a late listener and gives
    up at its timeout."""
    import socket
    import threading
    import time

    from fastckpt.elastic.context import _wait_for_listener

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # a free port, nobody listening yet
    t0 = time.monotonic()
    _wait_for_listener(f"127.0.0.1:{port}", 0.3)
    assert 0.3 <= time.monotonic() - t0 < 2.0  # nothing listens: gives up at the timeout

    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def listen_later() -> None:
        time.sleep(0.4)
        server.bind(("127.0.0.1", port))
        server.listen()

    threading.Thread(target=listen_later, daemon=True).start()
    t0 = time.monotonic()
    try:
        _wait_for_listener(f"127.0.0.1:{port}", 10.0)
        took = time.monotonic() - t0
        assert 0.35 <= took < 2.0, took  # returned soon after the listener appeared
    finally:
        server.close()
