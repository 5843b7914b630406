"""``ElasticContext``: the worker side of an elastic run ("bring your own trainer").

The driver (:func:`fastckpt.elastic.run_elastic`) calls the user's ``train(worker)`` in one
Ray actor per node; ``train`` wraps its loop in one context, which owns
``jax.distributed``, the checkpoint manager (RAM tier on this node + peers + storage),
stop-at-boundary requests from the driver and timing marks (an example:
``docs/elastic.md``, "Bring your own trainer").

Call order: ``__enter__`` (initialise ``jax.distributed``, open the manager) ->
``restore_or_init`` once -> ``steps`` once -> ``__exit__`` (wait for the last save, close).
All processes must make the same calls in the same order (SPMD).

Contract of ``steps``: it yields ``start, start + 1, ..., total - 1`` where ``start`` is the
restored step, and stops early only when the driver asked for a stop (a node joined);
every process then stops after the same step (process 0 decides, through the coordinator's
key-value store), that step is saved by ``maybe_save`` (forced), and :attr:`stopped` is
true. State after ``k`` completed steps is "step ``k``": pass ``step + 1`` to ``maybe_save``.

The RAM tier (``ElasticOptions.ram_every > 0``) lives in :attr:`WorkerIdentity.ram_root`,
a directory of this *node* (it survives a worker restart on the node, not the node's loss);
its member id is the node's, and peers are found by node address.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax

import fastckpt
from fastckpt.coordination.distributed import Coordinator, default_coordinator
from fastckpt.elastic._options import Worker
from fastckpt.errors import ConfigError, NoCheckpointError

__all__ = ["ElasticContext", "ElasticOptions"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ElasticOptions:
    """How the elastic loop checkpoints and agrees on stops."""

    checkpoint_every: int = 10
    """Persistent (storage) checkpoint every this many steps
    (``ManagerOptions.save_interval_steps``)."""
    ram_every: int = 0
    """RAM-tier checkpoint (this node's RAM + ``ram_replicas`` peers) every this many steps;
    0: no RAM tier. The state is handed to the manager every ``gcd`` of the two cadences."""
    ram_replicas: int = 1
    """Peers each node pushes its RAM chunks to."""
    ram_budget_bytes: int = 16 << 30
    """Shared memory the RAM tier may hold on this node."""
    manager: fastckpt.ManagerOptions = dataclasses.field(default_factory=fastckpt.ManagerOptions)
    """Other options of the :class:`~fastckpt.CheckpointManager` (retention, save, restore);
    its ``save_interval_steps`` and ``ram`` are set from the fields above."""
    control_every: int = 1
    """Check for a driver stop request every this many steps (one key-value round trip per
    check; process 0 decides, the others follow)."""
    distributed_timeout_s: int = 60
    """``jax.distributed`` initialisation timeout (a missing peer fails the generation)."""
    kv_timeout_s: float = 120.0
    """Longest wait for process 0's decision at a control point or barrier."""

    def __post_init__(self) -> None:
        for name in ("checkpoint_every", "control_every", "distributed_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.ram_every < 0 or self.ram_replicas < 0 or self.kv_timeout_s <= 0:
            raise ConfigError("ram_every, ram_replicas must be >= 0 and kv_timeout_s > 0")

    @property
    def hand_every(self) -> int:
        """Cadence at which ``maybe_save`` hands the state to the manager."""
        return math.gcd(self.checkpoint_every, self.ram_every or self.checkpoint_every)

    def manager_options(self, worker: Worker) -> fastckpt.ManagerOptions:
        """The manager's options for ``worker``: RAM tier rooted at its node's directory."""
        ident = worker.identity
        ram = None
        if self.ram_every:
            ram = fastckpt.RamOptions(
                root=ident.ram_root,
                member_id=ident.node_key,
                interval_steps=self.ram_every,
                replicas=self.ram_replicas if ident.num_processes > 1 else 0,
                budget_bytes=self.ram_budget_bytes,
                secret=ident.peer_secret,
            )
        return dataclasses.replace(self.manager, save_interval_steps=self.checkpoint_every, ram=ram)


class ElasticContext:
    """One worker's view of an elastic run. See the module docstring for the call order."""

    def __init__(self, worker: Worker, *, root: str, options: ElasticOptions | None = None) -> None:
        self.worker = worker
        self.identity = worker.identity
        self.root = root
        self.options = options or ElasticOptions()
        self.stopped = False
        """True once ``steps`` stopped at an agreed step on the driver's request."""
        self.start_step = 0
        """The step the run resumed from (0 for a fresh run)."""
        self.manager: fastckpt.CheckpointManager | None = None
        self._coord: Coordinator | None = None
        self._stop_at: int | None = None

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> ElasticContext:
        ident = self.identity
        self.worker.mark("enter")
        os.makedirs(ident.ram_root, exist_ok=True)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if ident.num_processes > 1:
            if ident.process_id != 0:
                _wait_for_listener(ident.coordinator, self.options.distributed_timeout_s)
            jax.distributed.initialize(
                coordinator_address=ident.coordinator,
                num_processes=ident.num_processes,
                process_id=ident.process_id,
                initialization_timeout=self.options.distributed_timeout_s,
                heartbeat_timeout_seconds=max(10, self.options.distributed_timeout_s // 4),
                shutdown_timeout_seconds=self.options.distributed_timeout_s,
            )
        self.worker.mark("distributed")
        self._coord = default_coordinator(timeout_s=self.options.kv_timeout_s)
        self.manager = fastckpt.CheckpointManager(
            self.root, options=self.options.manager_options(self.worker), coordinator=self._coord
        )
        self.mark("init")
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            if self.manager is not None:
                self.manager.close()
        finally:
            self.worker.update_report(phase="exit" if exc is None else "error")
            self.worker.mark("exit")

    # ------------------------------------------------------------------ restore
    def restore_or_init(self, init_fn: Callable[[], Any], *, target: Any) -> Any:
        """The latest committed state laid out as ``target`` says, or ``init_fn()`` if none.

        ``target`` is a pytree of ``jax.ShapeDtypeStruct`` with shardings for *this*
        generation's mesh; the checkpoint may come from any mesh. Records the restored step
        (:attr:`start_step`), restore time and bytes per tier in this worker's report.
        Collective: every process calls it.
        """
        mgr = self._require_manager()
        self.worker.update_report(phase="restore")
        t0 = time.time()
        try:
            # step=None: the newest step whose chunks all processes reach, as process 0 picks
            state = mgr.restore(target=target)
            stats = mgr.last_restore_stats
        except NoCheckpointError:  # nothing committed in any tier (raised on every process alike)
            state = init_fn()
            jax.block_until_ready(state)
            self.worker.update_report(restored_step=None, restore_kind="init")
        else:
            assert stats is not None and stats.step is not None
            self.start_step = stats.step
            self.worker.update_report(
                restored_step=self.start_step,
                restore_kind="restore",
                restore_bytes_by_tier=dict(stats.bytes_by_tier),
                restore_bytes_read_storage=stats.bytes_read_storage,
                restore_select_s=stats.select_s,
                restore_fetch_s=stats.fetch_s,
                restore_device_put_s=stats.device_put_s,
                restore_fallbacks=dict(stats.fallbacks),
            )
        self.worker.step = self.start_step
        self.worker.update_report(restore_s=time.time() - t0)
        self.mark("restored")
        return state

    # ------------------------------------------------------------------ loop
    def steps(self, total_steps: int) -> Iterator[int]:
        """Yield the index of each step to run, from :attr:`start_step` to ``total_steps - 1``.

        Starts with :meth:`barrier`, publishes the step to the driver on every step, marks
        ``first_step`` when the body of the first iteration returns, and checks for a stop
        request every ``control_every`` steps.
        """
        self.barrier("train")
        self.worker.update_report(phase="train")
        for step in range(self.start_step, total_steps):
            if step % self.options.control_every == 0 and self._stop_at is None:
                self._stop_at = self._agree_stop(step)
            if self._stop_at is not None and step >= self._stop_at:
                self._finish_stop(step)
                return
            self.worker.step = step
            yield step
            if step == self.start_step:
                self.mark("first_step")
            self.worker.step = step + 1
        self.worker.update_report(final_step=max(self.start_step, total_steps))

    def maybe_save(
        self, step: int, state: Any, *, metadata: Mapping[str, object] | None = None
    ) -> bool:
        """Hand ``state`` (the state after ``step`` completed steps) to the manager when due.

        Due: ``step`` is a multiple of :attr:`ElasticOptions.hand_every`; forced at an agreed
        stop step (the manager's own cadences then pick the tiers). Returns
        whether a save started. Returns as soon as the device-to-host copy is done.
        """
        mgr = self._require_manager()
        meta = {
            "generation": self.identity.generation,
            "num_processes": self.identity.num_processes,
            **(metadata or {}),
        }
        forced = self._stop_at is not None and step == self._stop_at
        if step % self.options.hand_every and not forced:
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
        committed = self._agree(f"final/{step}", lambda: str(mgr.latest_step() == step))
        if committed == "False":
            meta = {"generation": self.identity.generation, "final": True}
            mgr.save(step, state, metadata=meta, force=True)
        mgr.wait()

    def log(self, step: int, **metrics: float) -> None:
        """Record metrics of ``step`` (process 0's reach the driver's result and timeline)."""
        ident = self.identity
        if ident.process_id == 0:
            record = {"step": step, "t": time.time(), "generation": ident.generation}
            self.worker.record_metrics({**record, "num_processes": ident.num_processes, **metrics})

    def mark(self, name: str) -> None:
        """Timestamp a phase (``t_<name>`` in this worker's report); e.g. ``mark("compiled")``."""
        self.worker.mark(name)

    def barrier(self, name: str) -> None:
        """Wait until every process of this generation reaches ``barrier(name)`` (names are
        unique within a generation). ``steps`` calls it before the first step, so that the
        first collective starts together (gloo gives up connecting after ~30 s)."""
        if self._coord is not None:
            self._coord.barrier(
                f"fastckpt-elastic/g{self.identity.generation}/barrier/{name}",
                timeout_s=self.options.kv_timeout_s,
            )

    # ------------------------------------------------------------------ internals
    def _agree(self, name: str, decide: Callable[[], str]) -> str:
        """Process 0 runs ``decide``; every process returns its answer."""
        coord = self._coord
        assert coord is not None
        if coord.process_count == 1:
            return decide()
        key = f"fastckpt-elastic/g{self.identity.generation}/agree/{name}"
        if coord.process_index == 0:
            value = decide()
            coord.set(key, value)
            return value
        return coord.get(key, timeout_s=self.options.kv_timeout_s)

    def _agree_stop(self, step: int) -> int | None:
        """Process 0 reads the stop request; everyone learns its decision at ``step``. A stop
        takes effect after ``step``: the agreed stop step is ``step + 1``, so the
        ``maybe_save(step + 1, ...)`` of this iteration is forced."""
        decision = self._agree(
            f"stop/{step}", lambda: "stop" if self.worker.stop_requested() else "go"
        )
        return step + 1 if decision == "stop" else None

    def _finish_stop(self, step: int) -> None:
        mgr = self._require_manager()
        mgr.wait()
        self.worker.update_report(stopped_at=step, committed_at_stop=mgr.latest_step())
        self.worker.outcome = "stopped"
        self.stopped = True

    def _require_manager(self) -> fastckpt.CheckpointManager:
        if self.manager is None:
            raise ConfigError("ElasticContext is not entered (use it as a context manager)")
        return self.manager


def _wait_for_listener(address: str, timeout_s: float) -> None:
    """Block until ``host:port`` accepts TCP connections (process 0's coordination service),
    so that a client's first connect is not refused (gRPC would then back off for about a
    second). Gives up silently at ``timeout_s``: ``initialize`` then reports the failure."""
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
