"""The elastic job's API types (no Ray or JAX import): the driver's options and results, what
a worker knows of itself (:class:`WorkerIdentity`, assigned per *generation*: one set of worker
actors sharing one ``jax.distributed`` coordinator) and :class:`Worker`, what ``train``
receives: the identity plus its channel to the driver (stop requests in; metrics, phase
marks and the current step out).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

from fastckpt.errors import ConfigError, FastckptError

__all__ = [
    "ElasticJobOptions",
    "ElasticResult",
    "ElasticRunError",
    "GenerationResult",
    "JobStatus",
    "Worker",
    "WorkerIdentity",
    "WorkerInfo",
]

FailureCause = Literal["process", "node", "error", "startup"]


class ElasticRunError(FastckptError):
    """The elastic job gave up: too many failed generations, or fewer nodes than
    ``min_nodes``. ``result`` holds what happened up to then."""

    def __init__(self, message: str, *, result: ElasticResult | None = None) -> None:
        super().__init__(message)
        self.result = result


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerInfo:
    """One worker actor of the running generation, as the driver sees it."""

    rank: int
    node_id: str
    ip: str
    pid: int


@dataclasses.dataclass
class JobStatus:
    """What the ``monitor`` callback sees on each driver poll; it may record events."""

    generation: int
    """The running generation."""
    step: int
    """Highest step any worker reported (steps completed)."""
    workers: tuple[WorkerInfo, ...]
    """The generation's workers by rank (empty while it is being launched)."""
    _record: Callable[..., None] = dataclasses.field(repr=False)

    def record(self, event: str, **fields: Any) -> None:
        """Add ``{"t", "event", "generation", **fields}`` to the job's timeline (e.g. a
        ``kill`` a chaos test caused: the timeline measures recoveries from it)."""
        self._record(event, generation=self.generation, **fields)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ElasticJobOptions:
    """Shape of the job and its failure policy."""

    ray_address: str | None = None
    """Ray cluster to run on; None: ``RAY_ADDRESS``, else an embedded local cluster. A
    driver already connected (``ray.is_initialized()``) uses its connection."""
    ray_init_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Extra ``ray.init`` arguments when this call connects."""
    node_resource: str = "fastckpt_node"
    """Custom resource that marks a node for workers (one unit per node); each worker
    actor takes half a unit, a warm standby the other half."""
    min_nodes: int = 1
    """Fewest nodes to train on; with fewer alive the job fails."""
    max_nodes: int | None = None
    """Most nodes to train on (None: every node offering the resource)."""
    max_restarts: int = 3
    """Failed generations tolerated (resizes when a node joins do not count)."""
    cpu_devices_per_node: int | None = None
    """Run JAX on CPU with this many virtual devices per worker (tests, demo); None: the
    node's accelerators."""
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Environment set in each worker before JAX is imported (e.g. ``XLA_FLAGS``)."""
    preload: tuple[str, ...] = ()
    """Modules a worker imports when created, before it gets work (the trainer's)."""
    compile_cache_dir: str | None = None
    """JAX persistent compilation cache directory on each node (None: off)."""
    ram_dir: str = "/dev/shm/fastckpt-elastic"
    """Parent of each node's RAM-tier directory (``<ram_dir>/<run_id>/<node>``); environment
    variables in it are expanded on the node (e.g. ``$FASTCKPT_NODE_SHM``)."""
    run_id: str | None = None
    """Names the run (None: a fresh one)."""
    warm_standby: bool = True
    """Keep one spare worker per node (JAX imported) once a generation trains; relaunches
    use them instead of starting processes."""
    grow: bool = True
    """When a node offering the resource appears, stop at a checkpoint and relaunch on
    all nodes."""
    poll_interval_s: float = 0.1
    """Driver loop period (bounds detection latency of a worker death)."""
    node_poll_interval_s: float = 0.5
    """How often the driver lists the cluster's nodes (node loss and arrival)."""
    startup_timeout_s: float = 120.0
    """Longest wait for a generation's actors to be created and placed."""
    kill_wait_s: float = 5.0
    """After killing a generation, longest wait for its actors to be gone."""
    node_loss_grace_s: float = 2.0
    """When ``train`` raised (a collective fails on the survivors before Ray marks a lost
    node dead), how long to watch for a node of the generation to be marked dead."""
    process_death_settle_s: float = 0.5
    """When a worker died and its node's standby still answers, how long to watch the node
    list before calling it a process death: a node whose raylet is gone can keep its worker
    processes (and so a standby's answer) for a moment, and relaunching onto it would fail."""
    monitor: Callable[[JobStatus], None] | None = None
    """Called from the driver loop (the driver's thread) on every poll."""
    on_event: Callable[[dict[str, Any]], None] | None = None
    """Called with each timeline event as the driver records it (the driver's thread), e.g.
    to show a live timeline; an exception it raises is ignored."""

    def __post_init__(self) -> None:
        if self.min_nodes < 1 or self.max_restarts < 0:
            raise ConfigError("need min_nodes >= 1 and max_restarts >= 0")
        if self.max_nodes is not None and self.max_nodes < self.min_nodes:
            raise ConfigError(f"max_nodes {self.max_nodes} < min_nodes {self.min_nodes}")
        if self.cpu_devices_per_node is not None and self.cpu_devices_per_node < 1:
            raise ConfigError("cpu_devices_per_node must be >= 1")
        if self.node_loss_grace_s < 0 or self.process_death_settle_s < 0:
            raise ConfigError("node_loss_grace_s and process_death_settle_s must be >= 0")
        if self.poll_interval_s <= 0 or self.node_poll_interval_s <= 0:
            raise ConfigError("poll intervals must be > 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationResult:
    """What happened to one generation."""

    generation: int
    nodes: tuple[str, ...]
    """Node ids by rank."""
    outcome: Literal["done", "stopped", "failed"]
    reason: str
    cause: FailureCause | None
    """Why it failed (None unless ``failed``)."""
    t_launch: float
    t_end: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class ElasticResult:
    """The whole job: every generation, the failures survived, and the timeline data."""

    value: Any
    """Process 0's ``train`` return value in the generation that finished."""
    generations: tuple[GenerationResult, ...]
    restarts: int
    events: tuple[dict[str, Any], ...]
    """Driver timeline: ``launch``, ``failure_detected``, ``killed_rest``, ``node_joined``,
    ``stop_requested``, ``standby_ready``, ``generation_end``, ``done``/``give_up`` and
    ``monitor`` events."""
    reports: tuple[dict[str, Any], ...]
    """Each worker's last report per generation (phase marks ``t_*``, restore stats)."""
    metrics: tuple[dict[str, Any], ...]
    """Process 0's ``ctx.log`` records of every generation."""

    def summary(self) -> dict[str, Any]:
        """:func:`fastckpt.elastic.timeline.summarize` of this result."""
        from fastckpt.elastic.timeline import summarize

        return summarize(self.events, self.reports, self.metrics)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerIdentity:
    """One worker of one generation, as the driver assigned it."""

    run_id: str
    """Names this run (per-node RAM directories are keyed by it)."""
    generation: int
    """Launch counter; every relaunch (failure or resize) increments it."""
    process_id: int
    """Rank in this generation (0 hosts the ``jax.distributed`` coordinator)."""
    num_processes: int
    """Processes (= nodes) in this generation."""
    coordinator: str
    """``ip:port`` of the coordinator (on process 0's node); ``""`` with one process."""
    node_id: str
    """Ray node id of the node this worker runs on (stable while the node lives)."""
    node_ip: str
    """The node's address (peers reach this worker's RAM tier by it)."""
    ram_root: str
    """This node's RAM-tier directory for this run (keyed by the node, not the rank)."""
    peer_secret: bytes = dataclasses.field(repr=False)
    """The run's shared peer secret (authenticates RAM-tier replication between nodes)."""
    launch_time: float
    """``time.time()`` on the driver when it started launching this generation."""

    @property
    def node_key(self) -> str:
        """Short stable name of the node (the RAM tier's member id)."""
        return f"node-{self.node_id[:12]}"


class Worker:
    """The identity plus the driver channel; thread-safe (the driver's control calls run in
    another thread of the actor than ``train``)."""

    def __init__(self, identity: WorkerIdentity) -> None:
        self.identity = identity
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._metrics: list[dict[str, Any]] = []
        self._report: dict[str, Any] = {
            "generation": identity.generation,
            "process": identity.process_id,
            "num_processes": identity.num_processes,
            "node_id": identity.node_id,
            "t_launch": identity.launch_time,
        }
        self.step = 0
        """Steps completed so far in this generation's view (updated by ``ElasticContext``)."""
        self.outcome: Literal["done", "stopped"] = "done"
        """``stopped`` once the context stopped at an agreed step on the driver's request."""

    # ---------------------------------------------------------------- driver side
    def request_stop(self) -> None:
        """Ask the loop to stop at the next agreed step boundary (idempotent)."""
        self._stop.set()

    def drain(self) -> dict[str, Any]:
        """Metrics recorded since the last drain, the report so far, the current step."""
        with self._lock:
            metrics, self._metrics = self._metrics, []
            return {"step": self.step, "metrics": metrics, "report": dict(self._report)}

    # ---------------------------------------------------------------- worker side
    def stop_requested(self) -> bool:
        """Whether the driver asked this worker to stop at a checkpoint."""
        return self._stop.is_set()

    def record_metrics(self, record: dict[str, Any]) -> None:
        """Queue one metrics record for the driver."""
        with self._lock:
            self._metrics.append(record)

    def update_report(self, **fields: Any) -> None:
        """Merge ``fields`` into this worker's report (phase marks, restore stats)."""
        with self._lock:
            self._report.update(fields)

    def mark(self, name: str) -> None:
        """Timestamp a phase: ``t_<name>`` in the report."""
        self.update_report(**{f"t_{name}": time.time()})
