"""The per-node worker actor: one process per node and generation, driven by the driver.

An actor is created warm (its constructor sets the process environment, then imports JAX
and the ``preload`` modules) and pinned to one node. The driver then calls, in order,
``node_info`` -> (process 0 only) ``free_port`` -> ``run(train, identity)``; while ``run``
executes, ``poll`` and ``request_stop`` reach it on another thread (``max_concurrency``).
An actor runs at most one generation: ``jax.distributed`` is initialised once per process,
so the driver kills every actor at the end of a generation and relaunches fresh (or
standby) ones. Nothing here is imported by ``import fastckpt``.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from fastckpt.elastic._options import Worker, WorkerIdentity

__all__ = ["NodeActor", "spawn_actor"]


class NodeActor:
    """Body of the worker actor (wrapped by ``ray.remote`` in :func:`spawn_actor`)."""

    def __init__(
        self, env: Mapping[str, str], preload: tuple[str, ...], compile_cache_dir: str | None
    ) -> None:
        os.environ.update(env)  # before the first import of jax: XLA_FLAGS, JAX_PLATFORMS
        import jax

        if compile_cache_dir:
            jax.config.update("jax_compilation_cache_dir", compile_cache_dir)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        for name in preload:
            importlib.import_module(name)
        self._t_ready = time.time()
        self._worker: Worker | None = None
        self._lock = threading.Lock()
        self._pending_stop = False

    def node_info(self) -> dict[str, Any]:
        """``{"node_id", "ip", "pid", "t_ready"}`` of this actor."""
        ctx = ray.get_runtime_context()
        return {
            "node_id": ctx.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "t_ready": self._t_ready,
        }

    def free_port(self) -> int:
        """A TCP port free on this node's address (the coordinator's, for process 0)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ray.util.get_node_ip_address(), 0))
            return int(s.getsockname()[1])

    def run(self, train: Callable[[Worker], Any], identity: WorkerIdentity) -> dict[str, Any]:
        """Run ``train`` as ``identity``. Returns ``{"outcome", "value", "drain"}``: whether the
        loop finished or stopped on request, ``train``'s return value and the last drain."""
        ram_root = os.path.expandvars(identity.ram_root)  # e.g. $FASTCKPT_NODE_SHM
        if ram_root != identity.ram_root:
            identity = dataclasses.replace(identity, ram_root=ram_root)
        worker = Worker(identity)
        worker.mark("actor_run")
        worker.update_report(t_actor_ready=self._t_ready)
        with self._lock:
            self._worker = worker
            if self._pending_stop:
                worker.request_stop()
        value = train(worker)
        return {"outcome": worker.outcome, "value": value, "drain": worker.drain()}

    def poll(self) -> dict[str, Any] | None:
        """The running worker's drain (metrics since the last poll, report, step), or None."""
        with self._lock:
            worker = self._worker
        return worker.drain() if worker is not None else None

    def request_stop(self) -> None:
        """Ask the running (or next) ``train`` to stop at the next agreed step boundary."""
        with self._lock:
            self._pending_stop = True
            if self._worker is not None:
                self._worker.request_stop()


def spawn_actor(
    node_id: str,
    *,
    resource: str,
    env: Mapping[str, str],
    preload: tuple[str, ...],
    compile_cache_dir: str | None,
) -> Any:
    """Create a :class:`NodeActor` pinned to ``node_id``; returns its handle at once.

    It takes half a unit of ``resource`` (so a node offering one unit holds an active actor
    and a standby), no CPU (it must never wait for CPUs that training does not reserve),
    and is never restarted by Ray: the driver decides what runs where.
    """
    cls = ray.remote(NodeActor)
    return cls.options(
        num_cpus=0,
        resources={resource: 0.5},
        max_restarts=0,
        max_concurrency=4,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
    ).remote(dict(env), tuple(preload), compile_cache_dir)
