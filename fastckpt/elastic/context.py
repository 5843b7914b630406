"""``ElasticContext``: the "bring your own trainer" side of the elastic supervisor.

A training script launched by the supervisor (``python -m fastckpt.elastic run -- ...``)
wraps its loop in one context; the context owns ``jax.distributed``, the checkpoint
manager, heartbeats, stop-at-boundary requests and timing reports::

    env = WorkerEnv.from_environ(os.environ)          # the entry point reads the env
    with ElasticContext(env, root="/ckpt", options=ElasticOptions(checkpoint_every=10)) as ctx:
        mesh = make_my_mesh(jax.devices())            # every device of this generation
        state = ctx.restore_or_init(init_fn, target=abstract_state)
        step_fn = compile_my_step(); ctx.mark("compiled")
        for step in ctx.steps(total_steps):           # step = steps completed so far
            state, loss = step_fn(state, batch(step))
            ctx.log(step + 1, loss=float(loss))
            ctx.maybe_save(step + 1, state)
    raise SystemExit(ctx.exit_code)

Call order: ``__enter__`` (initialise ``jax.distributed``, open the manager, start the
heartbeat) -> ``restore_or_init`` once -> ``steps`` once -> ``__exit__`` (wait for the last
save, close). All processes must make the same calls in the same order (SPMD).

Contract of ``steps``: it yields ``start, start + 1, ..., total - 1`` where ``start`` is the
restored step, and stops early only when the supervisor asked for a stop; every process
then stops after the same step (agreed through the coordinator's key-value store), that
step is saved by ``maybe_save`` (forced), and ``exit_code`` becomes
:data:`~fastckpt.elastic._protocol.EXIT_STOPPED`. State after ``k`` completed steps is
"step ``k``": pass ``step + 1`` to ``maybe_save``.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax

import fastckpt
from fastckpt.coordination.distributed import Coordinator, default_coordinator
from fastckpt.elastic._protocol import (
    EXIT_DONE,
    EXIT_ORPHANED,
    EXIT_STOPPED,
    WorkerEnv,
    append_jsonl,
    now,
    write_json_atomic,
)
from fastckpt.errors import ConfigError, NoCheckpointError

__all__ = ["ElasticContext", "ElasticOptions"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ElasticOptions:
    """How the elastic loop checkpoints, beats and agrees on stops."""

    checkpoint_every: int = 10
    """Hand the state to the manager every this many steps. Set it to the manager's finest
    cadence (its RAM-tier interval once there is one); the manager's own options decide
    which tiers a given step goes to (``ManagerOptions.save_interval_steps`` for storage)."""
    manager: fastckpt.ManagerOptions = dataclasses.field(default_factory=fastckpt.ManagerOptions)
    """Options of the :class:`~fastckpt.CheckpointManager` (tiers, cadence, retention)."""
    heartbeat_interval_s: float = 0.5
    """How often the heartbeat thread rewrites this worker's heartbeat file."""
    control_every: int = 1
    """Check for a supervisor stop request every this many steps (one key-value round
    trip per check; process 0 decides, the others follow)."""
    distributed_timeout_s: int = 60
    """``jax.distributed`` initialisation timeout (a missing peer fails the generation)."""
    kv_timeout_s: float = 120.0
    """Longest wait for process 0's stop decision at a control point."""

    def __post_init__(self) -> None:
        for name in ("checkpoint_every", "control_every", "distributed_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.heartbeat_interval_s <= 0 or self.kv_timeout_s <= 0:
            raise ConfigError("heartbeat_interval_s and kv_timeout_s must be > 0")


class ElasticContext:
    """One worker's view of an elastic run. See the module docstring for the call order."""

    def __init__(self, env: WorkerEnv, *, root: str, options: ElasticOptions | None = None) -> None:
        self.env = env
        self.root = root
        self.options = options or ElasticOptions()
        self.paths = env.paths
        self.exit_code = EXIT_DONE
        """:data:`EXIT_DONE`, or :data:`EXIT_STOPPED` once ``steps`` stopped on request."""
        self.start_step = 0
        """The step the run resumed from (0 for a fresh run)."""
        self.manager: fastckpt.CheckpointManager | None = None
        self._coord: Coordinator | None = None
        self._stop_at: int | None = None
        self._step = 0
        self._phase = "launch"
        self._report: dict[str, Any] = {
            "generation": env.generation,
            "host": env.host_id,
            "process": env.process_id,
            "num_processes": env.num_processes,
            "t_launch": env.launch_time,
        }
        self._beat_stop = threading.Event()
        self._beat_thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> ElasticContext:
        self._report["t_enter"] = now()
        self.paths.make_dirs()
        self._beat_thread = threading.Thread(
            target=self._beat_loop, name="fastckpt-heartbeat", daemon=True
        )
        self._beat_thread.start()
        self._set_phase("init")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if self.env.num_processes > 1:
            if self.env.process_id != 0:
                _wait_for_listener(self.env.coordinator, self.options.distributed_timeout_s)
            jax.distributed.initialize(
                coordinator_address=self.env.coordinator,
                num_processes=self.env.num_processes,
                process_id=self.env.process_id,
                initialization_timeout=self.options.distributed_timeout_s,
                heartbeat_timeout_seconds=max(10, self.options.distributed_timeout_s // 4),
                shutdown_timeout_seconds=self.options.distributed_timeout_s,
            )
        self._report["t_distributed"] = (
            now()
        )  # jax.distributed is up (diagnostics: init = distributed + manager)
        self._coord = default_coordinator(timeout_s=self.options.kv_timeout_s)
        self.manager = fastckpt.CheckpointManager(
            self.root, options=self.options.manager, coordinator=self._coord
        )
        self.mark("init")
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            if self.manager is not None:
                self.manager.close()
        finally:
            self._set_phase("exit" if exc is None else "error")
            self._beat_stop.set()
            if self._beat_thread is not None:
                self._beat_thread.join(timeout=2 * self.options.heartbeat_interval_s)
            self._write_report()

    # ------------------------------------------------------------------ restore
    def restore_or_init(self, init_fn: Callable[[], Any], *, target: Any) -> Any:
        """The latest committed state laid out as ``target`` says, or ``init_fn()`` if none.

        ``target`` is a pytree of ``jax.ShapeDtypeStruct`` with shardings for *this*
        generation's mesh; the checkpoint may come from any mesh. Records the restored step
        (:attr:`start_step`), restore time and bytes per tier in this worker's report.
        Collective: every process calls it.
        """
        mgr = self._require_manager()
        self._set_phase("restore")
        t0 = now()
        try:
            # step=None: the manager picks the newest step whose chunks are all reachable
            # (a RAM step, or storage's latest) and every process follows process 0.
            state = mgr.restore(target=target)
            stats = mgr.last_restore_stats
        except NoCheckpointError:  # nothing committed in any tier (raised on every process alike)
            state = init_fn()
            jax.block_until_ready(state)
            self._report.update(restored_step=None, restore_kind="init")
        else:
            assert stats is not None and stats.step is not None
            self.start_step = stats.step
            self._report.update(
                restored_step=self.start_step,
                restore_kind="restore",
                restore_bytes_by_tier=dict(stats.bytes_by_tier),
                restore_bytes_read_storage=stats.bytes_read_storage,
                restore_select_s=stats.select_s,
                restore_fetch_s=stats.fetch_s,
                restore_device_put_s=stats.device_put_s,
                restore_fallbacks=dict(getattr(stats, "fallbacks", {}) or {}),
            )
        self._step = self.start_step
        self._report["restore_s"] = now() - t0
        self.mark("restored")
        return state

    # ------------------------------------------------------------------ loop
    def steps(self, total_steps: int) -> Iterator[int]:
        """Yield the index of each step to run, from :attr:`start_step` to ``total_steps - 1``.

        Starts with :meth:`barrier`, records the step for the heartbeat on every step, marks
        ``first_step`` when the body of the first iteration returns, and checks for a stop
        request every ``control_every`` steps.
        """
        self.barrier("train")
        self._set_phase("train")
        step = self.start_step
        first = True
        while step < total_steps:
            if step % self.options.control_every == 0 and self._stop_at is None:
                self._stop_at = self._agree_stop(step)
            if self._stop_at is not None and step >= self._stop_at:
                self._finish_stop(step)
                return
            self._step = step
            yield step
            if first:
                self.mark("first_step")
                first = False
            step += 1
            self._step = step
        self._report["final_step"] = step

    def maybe_save(
        self, step: int, state: Any, *, metadata: Mapping[str, object] | None = None
    ) -> bool:
        """Hand ``state`` (the state after ``step`` completed steps) to the manager when due.

        Due: ``step % checkpoint_every == 0``; forced at an agreed stop step. Returns
        whether a save started. Returns as soon as the device-to-host copy is done.
        """
        mgr = self._require_manager()
        meta = {
            "generation": self.env.generation,
            "num_processes": self.env.num_processes,
            **(metadata or {}),
        }
        forced = self._stop_at is not None and step == self._stop_at
        if step % self.options.checkpoint_every and not forced:
            return False
        return mgr.save(step, state, metadata=meta, force=forced)

    def save_final(self, step: int, state: Any) -> None:
        """Force a save of ``state`` at ``step`` (unless committed) and wait for the commit.

        Collective. Whether ``step`` is already committed is decided by process 0 for all:
        a per-process look would race with the save itself (a process that asks late can
        see the step a peer already sealed, skip the save, and leave the others waiting).
        """
        mgr = self._require_manager()
        mgr.wait()
        if (
            self._agree(f"final/{step}", lambda: "skip" if mgr.latest_step() == step else "save")
            == "save"
        ):
            mgr.save(
                step, state, metadata={"generation": self.env.generation, "final": True}, force=True
            )
        mgr.wait()

    def log(self, step: int, **metrics: float) -> None:
        """Record metrics of ``step`` (process 0 appends a line to ``metrics.jsonl``)."""
        if self.env.process_id == 0:
            append_jsonl(
                self.paths.metrics,
                {
                    "step": step,
                    "t": now(),
                    "generation": self.env.generation,
                    "num_processes": self.env.num_processes,
                    **metrics,
                },
            )

    def mark(self, name: str) -> None:
        """Timestamp a phase (``t_<name>`` in this worker's report); e.g. ``mark("compiled")``."""
        self._report[f"t_{name}"] = now()
        self._write_report()

    def barrier(self, name: str) -> None:
        """Wait until every process of this generation reaches ``barrier(name)``.

        ``steps`` calls it once before the first step: processes that finished restoring
        and compiling at different times then start their first collective together (gloo
        gives up connecting after ~30 s). Names must be unique within a generation.
        """
        coord = self._coord
        if coord is None or coord.process_count == 1:
            return
        prefix = f"fastckpt-elastic/g{self.env.generation}/barrier/{name}"
        coord.set(f"{prefix}/{coord.process_index}", "1")
        for i in range(coord.process_count):
            coord.get(f"{prefix}/{i}", timeout_s=self.options.kv_timeout_s)

    # ------------------------------------------------------------------ internals
    def _agree(self, name: str, decide: Callable[[], str]) -> str:
        """Process 0 runs ``decide``; every process returns its answer."""
        coord = self._coord
        assert coord is not None
        if coord.process_count == 1:
            return decide()
        key = f"fastckpt-elastic/g{self.env.generation}/agree/{name}"
        if coord.process_index == 0:
            value = decide()
            coord.set(key, value)
            return value
        return coord.get(key, timeout_s=self.options.kv_timeout_s)

    def _agree_stop(self, step: int) -> int | None:
        """Process 0 reads the stop request; everyone learns its decision at ``step``.

        A stop decided before running step ``step`` takes effect after it: the agreed stop
        step is ``step + 1``, so the ``maybe_save(step + 1, ...)`` of this iteration is forced.
        """
        request = self.paths.stop_request(self.env.generation)
        decision = self._agree(f"stop/{step}", lambda: "stop" if request.exists() else "go")
        return step + 1 if decision == "stop" else None

    def _finish_stop(self, step: int) -> None:
        mgr = self._require_manager()
        mgr.wait()
        self._report.update(stopped_at=step, committed_at_stop=mgr.latest_step())
        self.exit_code = EXIT_STOPPED

    def _require_manager(self) -> fastckpt.CheckpointManager:
        if self.manager is None:
            raise ConfigError("ElasticContext is not entered (use it as a context manager)")
        return self.manager

    def _set_phase(self, phase: str) -> None:
        self._phase = phase
        self._beat()

    def _beat(self) -> None:
        hb = {"t": now(), "step": self._step, "phase": self._phase, "pid": os.getpid()}
        write_json_atomic(self.paths.heartbeat(self.env.generation, self.env.host_id), hb)

    def _beat_loop(self) -> None:
        parent = self.env.supervisor_pid or os.getppid()
        while True:
            if os.getppid() != parent:  # the supervisor is gone: nobody would ever reap us
                os._exit(EXIT_ORPHANED)
            if self._beat_stop.wait(self.options.heartbeat_interval_s):
                return
            self._beat()

    def _write_report(self) -> None:
        write_json_atomic(self.paths.report(self.env.generation, self.env.host_id), self._report)


def _wait_for_listener(address: str, timeout_s: float) -> None:
    """Block until ``host:port`` accepts TCP connections (process 0's coordination service).

    Processes of a new generation start together; a client whose first connect reaches the
    coordinator before process 0 has started the service is refused, and gRPC then backs off
    for about a second before it retries. Probing every 5 ms first avoids that. Gives up
    silently at ``timeout_s``: ``initialize`` then reports the failure.
    """
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                return
        except OSError:
            if time.monotonic() >= deadline:
                return
            time.sleep(0.005)
