"""What a worker knows about itself, and its channel to the driver.

:class:`WorkerIdentity` is assigned by the driver per generation (a *generation* is one set
of worker actors sharing one ``jax.distributed`` coordinator). :class:`Worker` is what the
user's ``train`` function receives: the identity plus a thread-safe channel that the
driver reads through the actor's control calls (stop requests in; metrics, phase marks
and the current step out). Nothing here imports Ray or JAX.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Literal

__all__ = ["Worker", "WorkerIdentity"]


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
