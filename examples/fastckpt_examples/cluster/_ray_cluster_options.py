"""Public value types of :mod:`fastckpt_examples.cluster.ray_cluster` (which re-exports them).

Private module: import these names from :mod:`fastckpt_examples.cluster.ray_cluster`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal

from fastckpt.errors import FastckptError

Isolation = Literal["auto", "namespaces", "processes"]
RayState = Literal["ALIVE", "DEAD", "ABSENT"]

_MIB = 1 << 20


class RayClusterError(FastckptError):
    """The local Ray cluster could not be started, changed or queried as asked."""

    __module__ = "fastckpt_examples.cluster.ray_cluster"


@dataclasses.dataclass(frozen=True, kw_only=True)
class HealthChecks:
    """How the Ray head's GCS health-checks raylets (its ``health_check_*`` system config).

    A node is declared dead after about ``initial_delay_ms`` (once, at its start) plus
    ``failure_threshold`` failed checks, one every ``period_ms``, each failing at the latest
    after ``timeout_ms``. The defaults detect a lost node in ~1-3 s on this harness; Ray's own
    defaults (:meth:`ray_defaults`) take ~15 s. Shorter periods cost one small RPC per node per
    period at the head, and a busy node may be declared dead spuriously.
    """

    period_ms: int = 500
    failure_threshold: int = 3
    timeout_ms: int = 500
    initial_delay_ms: int = 0

    def __post_init__(self) -> None:
        if min(self.period_ms, self.failure_threshold, self.timeout_ms) < 1:
            raise ValueError(f"period, threshold and timeout must be >= 1: {self}")
        if self.initial_delay_ms < 0:
            raise ValueError(f"initial_delay_ms must be >= 0, got {self.initial_delay_ms}")

    @classmethod
    def ray_defaults(cls) -> HealthChecks:
        """Ray 2.x's defaults (3 s period, 5 failures, 10 s timeout, 5 s initial delay)."""
        return cls(period_ms=3000, failure_threshold=5, timeout_ms=10000, initial_delay_ms=5000)

    def system_config(self) -> dict[str, int]:
        """The head's ``_system_config`` entries that apply these checks."""
        return {
            "health_check_period_ms": self.period_ms,
            "health_check_failure_threshold": self.failure_threshold,
            "health_check_timeout_ms": self.timeout_ms,
            "health_check_initial_delay_ms": self.initial_delay_ms,
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class RaySettings:
    """What each Ray node gets. The defaults keep Ray small on a 2-core machine: no dashboard,
    log monitor, autoscaler monitor, usage stats, metrics or pre-started workers, a 100 MiB
    object store. Ray still starts a DashboardAgent and a RuntimeEnvAgent per node."""

    cpus_per_node: int = 1
    """``--num-cpus`` of each worker node (the head has 0: nothing is scheduled there)."""
    node_resource: str = "fastckpt_node"
    """Custom resource each worker node has one unit of (the head none)."""
    object_store_bytes: int = 100 * _MIB
    system_config: Mapping[str, object] = dataclasses.field(
        default_factory=lambda: {
            "enable_worker_prestart": False,
            "enable_metrics_collection": False,
        }
    )
    """More of the head's ``--system-config`` (the health checks are added to it)."""
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Extra environment for every node's processes (and so Ray's workers)."""
    start_timeout_s: float = 60.0
    """How long the head, or all worker nodes together, may take to be ALIVE."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RayNode:
    """A worker node as the harness and Ray's GCS see it now."""

    name: str
    """``node0``...: stable across :meth:`LocalRayCluster.revive_node`."""
    address: str
    """IPv4 address its raylet registers (``127.0.0.1`` for every node in process mode)."""
    hostname: str
    shm_dir: str
    """Its RAM root, as its processes see it (``FASTCKPT_NODE_SHM``)."""
    up: bool
    """Whether the harness runs it (not killed, or revived since)."""
    link_cut: bool
    ray_state: RayState
    """The GCS's state of its latest registration (ABSENT: not registered yet)."""
    node_id: str | None
    """Ray's hex node id of that registration."""
    started_at: float | None
    """Wall-clock time (``time.time()``) the GCS registered it."""
    died_at: float | None
    """Wall-clock time the GCS declared it dead; minus the kill's time: detection latency."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeFootprint:
    """Resources the processes of one node use now (from ``/proc``); drivers excluded."""

    name: str
    processes: int
    pss_bytes: int
    """Proportional set size: shared pages split among their users (sum over nodes is fair)."""
    rss_bytes: int
    cpu_s: float
    """User + system CPU seconds of its live processes since they started."""
