"""The elastic driver on Ray: one worker actor per node, detect, kill, relaunch, grow back.

One *generation* is one set of worker actors, one per node, sharing a fresh
``jax.distributed`` coordinator (on process 0's node). :func:`run_elastic` runs
generations until one finishes: it launches one on the live nodes, detects a dead worker
process, a lost node or an exception of ``train`` (cause ``process``, ``node``, ``error``),
kills every actor of it at once and relaunches on the nodes alive; more than
``max_restarts`` failures, or fewer than ``min_nodes`` nodes, raise :class:`ElasticRunError`.
When a node returns, every worker stops after one agreed step and saves it, and the next
generation restores it on all nodes (no step lost, no restart counted). The steps in
detail: ``docs/elastic.md`` ("How a job runs").

The driver never touches the checkpoint root; committed state is the core's business.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import ray
import ray.exceptions

import fastckpt
from fastckpt.elastic._actor import spawn_actor
from fastckpt.elastic._options import (
    ElasticJobOptions,
    ElasticResult,
    ElasticRunError,
    FailureCause,
    GenerationResult,
    JobStatus,
    Worker,
    WorkerIdentity,
    WorkerInfo,
)

__all__ = ["HEALTH_CHECK_FAST", "run_elastic"]

HEALTH_CHECK_FAST: dict[str, Any] = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
}
"""Ray ``_system_config`` that marks a lost node dead in ~1.5 s (default: ~15 s). The GCS
then pings every raylet twice a second: fine for tens of nodes, worth raising on
thousands. Only a cluster's head takes it (``ray start --system-config`` / the embedded
cluster); a driver connecting to an existing cluster cannot change it."""


def connect(address: str | None, *, resource: str, init_kwargs: Mapping[str, Any]) -> bool:
    """Connect this process to Ray unless it already is; whether it connected (and so should
    disconnect at the end). ``address`` (or ``RAY_ADDRESS``) names an existing cluster; with
    neither, an embedded local cluster starts, offering one unit of ``resource`` and the tuned
    health checks (``init_kwargs`` go to ``ray.init`` in both cases)."""
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
    if address is None and not os.environ.get("RAY_ADDRESS"):
        kwargs.update(resources={resource: 1}, _system_config=dict(HEALTH_CHECK_FAST))
    kwargs.update(init_kwargs)
    ray.init(address=address, **kwargs)
    return True


def alive_nodes(resource: str) -> dict[str, str]:
    """``{node_id: address}`` of the live nodes that offer ``resource``."""
    return {
        str(node["NodeID"]): str(node["NodeManagerAddress"])
        for node in ray.nodes()
        if node.get("Alive") and node.get("Resources", {}).get(resource, 0) > 0
    }


@dataclasses.dataclass
class _Generation:
    number: int
    nodes: tuple[str, ...]
    t_launch: float
    actors: list[Any] = dataclasses.field(default_factory=list)
    futures: list[Any] = dataclasses.field(default_factory=list)
    workers: tuple[WorkerInfo, ...] = ()
    polls: dict[int, Any] = dataclasses.field(default_factory=dict)
    steps: dict[int, int] = dataclasses.field(default_factory=dict)
    stop_requested: bool = False
    stepped: bool = False


def run_elastic(
    train: Callable[[Worker], Any], *, options: ElasticJobOptions | None = None
) -> ElasticResult:
    """Run ``train`` elastically on the Ray cluster ``options`` name; see the module docstring.

    ``train(worker)`` runs in one actor per node and generation and must wrap its loop in an
    :class:`~fastckpt.elastic.ElasticContext`; it must be importable or picklable. Returns
    when every worker's ``train`` returned without a stop request. Call from the main thread
    if ``monitor`` changes the cluster (Ray adds nodes only from there).
    """
    opts = options or ElasticJobOptions()
    connected = connect(
        opts.ray_address, resource=opts.node_resource, init_kwargs=opts.ray_init_kwargs
    )
    try:
        return _Driver(train, opts).run()
    finally:
        if connected:
            ray.shutdown()


class _Driver:
    def __init__(self, train: Callable[[Worker], Any], opts: ElasticJobOptions) -> None:
        self.opts = opts
        self.train_ref = ray.put(train)
        self.run_id = opts.run_id or uuid.uuid4().hex[:12]
        self.secret = fastckpt.new_peer_secret().encode()
        self.events: list[dict[str, Any]] = []
        self.reports: dict[tuple[int, int], dict[str, Any]] = {}
        self.metrics: list[dict[str, Any]] = []
        self.generations: list[GenerationResult] = []
        self.standby: dict[str, Any] = {}
        self.warming: dict[str, Any] = {}
        self.order: list[str] = []
        self.restarts = 0
        self.env = dict(opts.env)
        if opts.cpu_devices_per_node is not None:
            flag = "--xla_force_host_platform_device_count"
            kept = [f for f in self.env.get("XLA_FLAGS", "").split() if not f.startswith(flag)]
            self.env["XLA_FLAGS"] = " ".join([*kept, f"{flag}={opts.cpu_devices_per_node}"])
            self.env["JAX_PLATFORMS"] = "cpu"

    # ------------------------------------------------------------------ main loop
    def run(self) -> ElasticResult:
        try:
            return self._run()
        finally:
            for handle in self.standby.values():
                ray.kill(handle, no_restart=True)
            self.standby.clear()

    def _run(self) -> ElasticResult:
        number = 0
        while True:
            nodes = self._pick_nodes()
            if len(nodes) < self.opts.min_nodes:
                msg = f"{len(nodes)} nodes alive < min_nodes {self.opts.min_nodes}"
                self._record("give_up", reason=msg)
                raise ElasticRunError(msg, result=self._result(None))
            gen = _Generation(number=number, nodes=nodes, t_launch=time.time())
            outcome, reason, cause, value = "failed", "", None, None
            try:
                self._launch(gen)
                outcome, reason, cause, value = self._watch(gen)
            except _Failed as f:
                reason, cause = str(f), f.cause
            finally:
                self._kill(gen, failed=outcome == "failed")
            self._record("generation_end", generation=number, outcome=outcome, reason=reason)
            self.generations.append(
                GenerationResult(
                    generation=number,
                    nodes=nodes,
                    outcome=outcome,  # type: ignore[arg-type]
                    reason=reason,
                    cause=cause,
                    t_launch=gen.t_launch,
                    t_end=time.time(),
                )
            )
            if outcome == "done":
                self._record("done", generation=number)
                return self._result(value)
            if outcome == "failed":
                self.restarts += 1
                if self.restarts > self.opts.max_restarts:
                    msg = f"generation {number} failed ({reason}); max_restarts exhausted"
                    self._record("give_up", reason=msg)
                    raise ElasticRunError(msg, result=self._result(None))
            number += 1

    def _pick_nodes(self) -> tuple[str, ...]:
        alive = alive_nodes(self.opts.node_resource)
        self.order = [n for n in self.order if n in alive] + sorted(
            n for n in alive if n not in self.order
        )
        for node in [n for n in self.standby if n not in alive]:
            ray.kill(self.standby.pop(node), no_restart=True)
            self.warming.pop(node, None)
        return tuple(self.order[: self.opts.max_nodes])

    # ------------------------------------------------------------------ one generation
    def _spawn(self, node: str) -> Any:
        return spawn_actor(
            node,
            resource=self.opts.node_resource,
            env=self.env,
            preload=self.opts.preload,
            compile_cache_dir=self.opts.compile_cache_dir,
        )

    def _launch(self, gen: _Generation) -> None:
        self._record("launch", generation=gen.number, nodes=list(gen.nodes), t=gen.t_launch)
        for node in gen.nodes:
            self.warming.pop(node, None)
            gen.actors.append(self.standby.pop(node, None) or self._spawn(node))
        infos = self._get([a.node_info.remote() for a in gen.actors], "startup")
        port = self._get([gen.actors[0].free_port.remote()], "startup")[0]
        n = len(gen.actors)
        coordinator = f"{infos[0]['ip']}:{port}" if n > 1 else ""
        gen.workers = tuple(
            WorkerInfo(rank=i, node_id=info["node_id"], ip=info["ip"], pid=info["pid"])
            for i, info in enumerate(infos)
        )
        for rank, (actor, info) in enumerate(zip(gen.actors, infos)):
            ident = WorkerIdentity(
                run_id=self.run_id,
                generation=gen.number,
                process_id=rank,
                num_processes=n,
                coordinator=coordinator,
                node_id=info["node_id"],
                node_ip=info["ip"],
                ram_root=f"{self.opts.ram_dir}/{self.run_id}/node-{info['node_id'][:12]}",
                peer_secret=self.secret,
                launch_time=gen.t_launch,
            )
            gen.futures.append(actor.run.remote(self.train_ref, ident))
        self._record("started", generation=gen.number, coordinator=coordinator)

    def _get(self, refs: list[Any], cause: FailureCause) -> list[Any]:
        try:
            return list(ray.get(refs, timeout=self.opts.startup_timeout_s))
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
            raise _Failed(f"launch failed: {type(e).__name__}: {e}", cause) from e

    def _watch(self, gen: _Generation) -> tuple[str, str, FailureCause | None, Any]:
        opts = self.opts
        pending = dict(enumerate(gen.futures))
        results: dict[int, dict[str, Any]] = {}
        next_nodes = 0.0
        while pending:
            ready, _ = ray.wait(list(pending.values()), num_returns=1, timeout=opts.poll_interval_s)
            for ref in ready:
                rank = next(r for r, f in pending.items() if f == ref)
                del pending[rank]
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    lost = gen.nodes[rank] not in alive_nodes(opts.node_resource)
                    return self._failure(gen, rank, "node" if lost else "process", e)
                except ray.exceptions.RayError as e:
                    return self._failure(gen, rank, "error", e)
                self._absorb(gen, rank, results[rank]["drain"])
            self._collect_polls(gen)
            if time.monotonic() >= next_nodes:
                next_nodes = time.monotonic() + opts.node_poll_interval_s
                alive = alive_nodes(opts.node_resource)
                dead = [r for r, node in enumerate(gen.nodes) if node not in alive]
                if dead:
                    return self._failure(gen, dead[0], "node", None)
                self._maybe_grow(gen, alive)
                self._maybe_fill_standby(gen)
            if opts.monitor is not None:
                step = max(gen.steps.values(), default=0)
                opts.monitor(JobStatus(gen.number, step, gen.workers, self._record))
        outcomes = {r["outcome"] for r in results.values()}
        if outcomes == {"done"}:
            return "done", "every worker finished", None, results[0]["value"]
        if outcomes == {"stopped"} and gen.stop_requested:
            return "stopped", "stopped at a checkpoint to resize", None, None
        return "failed", f"inconsistent outcomes {sorted(outcomes)}", "error", None

    def _failure(
        self, gen: _Generation, rank: int, cause: FailureCause, error: Exception | None
    ) -> tuple[str, str, FailureCause | None, Any]:
        t_detect = time.time()
        if cause in ("error", "process"):  # because its node vanished? (never relaunch onto
            cause = self._await_node_loss(gen, rank, cause)  # a node not yet marked dead)
        node = gen.nodes[rank]
        described = None if error is None else _describe(error)
        self._record(
            "failure_detected",
            t=t_detect,
            cause_known_s=time.time() - t_detect,
            generation=gen.number,
            rank=rank,
            node=node,
            cause=cause,
            error=described,
        )
        reason = f"rank {rank} on node {node[:12]}: {cause}"
        if cause == "error" and described:  # the worker's own exception: say what it was
            reason += f" ({described.strip().splitlines()[-1][:300]})"
        return "failed", reason, cause, None

    def _await_node_loss(self, gen: _Generation, rank: int, cause: FailureCause) -> FailureCause:
        watch = self.opts.node_loss_grace_s
        probe = self.standby.get(gen.nodes[rank]) if cause == "process" else None
        if probe is not None:  # the dead worker's node still answers: a process death, unless
            try:  # its raylet is gone and the node is marked dead in a moment (see the option)
                ray.get(probe.node_info.remote(), timeout=self.opts.node_loss_grace_s)
                watch = min(watch, self.opts.process_death_settle_s)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                self.standby.pop(gen.nodes[rank], None)
                return "node"
        deadline = time.monotonic() + watch
        while time.monotonic() < deadline:
            alive = alive_nodes(self.opts.node_resource)
            if any(node not in alive for node in gen.nodes):
                return "node"
            time.sleep(min(0.1, self.opts.node_poll_interval_s))
        return cause

    def _collect_polls(self, gen: _Generation) -> None:
        if gen.polls:
            ready, _ = ray.wait(list(gen.polls.values()), num_returns=len(gen.polls), timeout=0)
            for rank in [r for r, ref in gen.polls.items() if ref in ready]:
                with contextlib.suppress(ray.exceptions.RayError):
                    drain = ray.get(gen.polls[rank])
                    if drain is not None:
                        self._absorb(gen, rank, drain)
                del gen.polls[rank]
        for rank, actor in enumerate(gen.actors):
            if rank not in gen.polls:
                gen.polls[rank] = actor.poll.remote()

    def _absorb(self, gen: _Generation, rank: int, drain: dict[str, Any]) -> None:
        self.metrics.extend(drain["metrics"])
        self.reports[(gen.number, rank)] = drain["report"]
        gen.steps[rank] = int(drain["step"])

    def _maybe_grow(self, gen: _Generation, alive: dict[str, str]) -> None:
        if not self.opts.grow or gen.stop_requested or not gen.stepped:
            return
        cap = self.opts.max_nodes or len(alive)
        new = [n for n in alive if n not in gen.nodes]
        if new and len(gen.nodes) < cap:
            self._record("node_joined", generation=gen.number, nodes=new)
            for actor in gen.actors:
                actor.request_stop.remote()
            gen.stop_requested = True
            step = max(gen.steps.values(), default=0)
            self._record("stop_requested", generation=gen.number, step=step)

    def _maybe_fill_standby(self, gen: _Generation) -> None:
        if not gen.stepped:
            gen.stepped = len(gen.actors) > 0 and all(
                "t_first_step" in self.reports.get((gen.number, r), {})
                for r in range(len(gen.actors))
            )
        if gen.stepped and self.opts.warm_standby and not gen.stop_requested:
            for node in gen.nodes:
                if node not in self.standby:
                    self.standby[node] = self._spawn(node)
                    self.warming[node] = self.standby[node].node_info.remote()
        if self.warming:  # a timeline mark when a standby has imported what it preloads
            ready, _ = ray.wait(
                list(self.warming.values()), num_returns=len(self.warming), timeout=0
            )
            for node in [n for n, ref in self.warming.items() if ref in ready]:
                with contextlib.suppress(ray.exceptions.RayError):  # died warming: no mark
                    ray.get(self.warming[node])
                    self._record("standby_ready", generation=gen.number, node=node)
                del self.warming[node]

    def _kill(self, gen: _Generation, *, failed: bool) -> None:
        for actor in gen.actors:
            ray.kill(actor, no_restart=True)
        if gen.futures:
            ray.wait(gen.futures, num_returns=len(gen.futures), timeout=self.opts.kill_wait_s)
        if failed:
            self._record("killed_rest", generation=gen.number)

    # ------------------------------------------------------------------ bookkeeping
    def _record(self, name: str, **fields: Any) -> None:
        """Add a timeline event stamped now (unless ``t`` is given)."""
        self.events.append({"t": fields.pop("t", time.time()), "event": name, **fields})
        if self.opts.on_event is not None:
            with contextlib.suppress(Exception):  # a closed pipe must not end the job
                self.opts.on_event(dict(self.events[-1]))

    def _result(self, value: Any) -> ElasticResult:
        return ElasticResult(
            value=value,
            generations=tuple(self.generations),
            restarts=self.restarts,
            events=tuple(self.events),
            reports=tuple(self.reports[k] for k in sorted(self.reports)),
            metrics=tuple(self.metrics),
        )


def _describe(error: Exception) -> str:
    """The user's exception behind a Ray task error (else the error itself), shortened."""
    cause = getattr(error, "cause", None)
    err = cause if isinstance(cause, BaseException) else error
    return f"{type(err).__name__}: {err}"[:2000]


class _Failed(Exception):
    def __init__(self, message: str, cause: FailureCause) -> None:
        super().__init__(message)
        self.cause = cause
