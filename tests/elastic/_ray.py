"""A small local Ray cluster for the elastic tests (``ray.cluster_utils.Cluster``: several
Ray nodes on this machine, each offering ``fastckpt_node``) and the example run they share."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastckpt.elastic import ElasticJobOptions, JobStatus

REPO = Path(__file__).resolve().parents[2]
NODE: dict[str, Any] = {
    "num_cpus": 1,
    "resources": {"fastckpt_node": 1},
    "object_store_memory": 80 << 20,
}
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}


def start_cluster(nodes: int) -> Iterator[Any]:
    """Yield a connected ``Cluster`` of ``nodes`` nodes; shut it down (by pid) after."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    paths = [str(REPO), str(REPO / "examples"), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)  # the workers import these
    import ray
    from ray.cluster_utils import Cluster

    from fastckpt.elastic.job import HEALTH_CHECK_FAST

    system = {**HEALTH_CHECK_FAST, "enable_worker_prestart": False}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**NODE, "include_dashboard": False, "_system_config": system},
    )
    try:
        for _ in range(nodes - 1):
            cluster.add_node(**NODE)
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def job_options(tmp: Path, **kw: Any) -> ElasticJobOptions:
    """1 CPU device per node, warm workers, a compile cache and RAM dirs under ``tmp``."""
    from fastckpt_examples.elastic_train import PRELOAD

    base: dict[str, Any] = {
        "cpu_devices_per_node": 1,
        "preload": PRELOAD,
        "ram_dir": str(tmp / "ram"),
        "compile_cache_dir": str(tmp.parent / "jax-cache"),
        "max_restarts": 2,
    }
    return ElasticJobOptions(**{**base, **kw})


class Chaos:
    """A ``monitor`` that runs ``action(status)`` once, in generation ``generation``, as soon
    as a worker reports ``at_step`` steps."""

    def __init__(self) -> None:
        self.plan: list[tuple[int, int, Any]] = []

    def at(self, generation: int, step: int, action: Any) -> Chaos:
        self.plan.append((generation, step, action))
        return self

    def __call__(self, status: JobStatus) -> None:
        for item in list(self.plan):
            generation, step, action = item
            if status.generation == generation and status.step >= step and status.workers:
                self.plan.remove(item)
                action(status)
