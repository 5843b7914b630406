"""A real multi-node Ray cluster on one machine, for elastic tests, the demo and benchmarks.

:class:`LocalRayCluster` starts a Ray head on a *control* node plus ``nodes`` worker nodes
(``node0``...), each a separate ``ray start`` raylet with one unit of the custom resource
``fastckpt_node`` (so an actor asking for it lands one per node). Two isolations:

* ``"namespaces"``: every node is a :class:`~fastckpt_examples.cluster.hosts.SimulatedHosts` host:
  own IP address, hostname and private ``/dev/shm``/``/tmp`` (its RAM tier dies with it).
  The caller's namespace has no address on the hosts' network, so a driver must run inside
  the control host: use :meth:`LocalRayCluster.driver_popen`. :meth:`~LocalRayCluster.kill_node`
  loses the machine (raylet, workers, tmpfs); :meth:`~LocalRayCluster.cut_link` cuts its link
  silently.
* ``"processes"``: every node is a group of processes on the caller's network stack
  (``127.0.0.1``), with its own directory under ``/dev/shm`` as RAM root, removed when the
  node is killed. :meth:`~LocalRayCluster.cut_link` freezes the node (SIGSTOP) instead.
* ``"auto"`` (default): namespaces where :func:`~.hosts.hosts_unavailable_reason` says they
  work (root, or unprivileged user namespaces), processes otherwise.

Every worker process of node ``n`` sees ``FASTCKPT_NODE_NAME=n``, ``FASTCKPT_NODE_SHM`` (its
node's private RAM root: an existing, initially empty directory), ``JAX_PLATFORMS=cpu`` and
``XLA_FLAGS=--xla_force_host_platform_device_count=<devices_per_node>``: they are set on
``ray start`` and Ray's workers inherit them. Ray is kept small (see :class:`RaySettings`) and
node death is detected in seconds (see :class:`HealthChecks`). Example::

    with LocalRayCluster(nodes=3, devices_per_node=2) as cluster:
        driver = cluster.driver_popen([sys.executable, "train.py"])  # RAY_ADDRESS is set
        cluster.kill_node("node1")
        dead = cluster.wait_node("node1", "DEAD", timeout_s=15)
        cluster.revive_node("node1")  # an empty replacement joins again
        driver.wait()

**Cleanup:** :meth:`LocalRayCluster.close` (``with`` exit, also after an exception) SIGKILLs
every process of every node and every driver started through the cluster, and removes the
namespaces, RAM roots, Ray's temporary directory and the logs. In namespaced mode the hosts'
keepers also clean up if the caller is SIGKILLed; in process mode they cannot. **Never** run
``ray stop`` next to it: it kills every Ray process of the machine by name.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, final

from fastckpt_examples.cluster import _ray_cluster_nodes as _nodes
from fastckpt_examples.cluster._hosts_procs import kill_group
from fastckpt_examples.cluster._ray_cluster_options import HealthChecks as HealthChecks
from fastckpt_examples.cluster._ray_cluster_options import Isolation as Isolation
from fastckpt_examples.cluster._ray_cluster_options import NodeFootprint as NodeFootprint
from fastckpt_examples.cluster._ray_cluster_options import RayClusterError as RayClusterError
from fastckpt_examples.cluster._ray_cluster_options import RayNode as RayNode
from fastckpt_examples.cluster._ray_cluster_options import RaySettings as RaySettings
from fastckpt_examples.cluster._ray_cluster_options import RayState as RayState
from fastckpt_examples.cluster.hosts import Host, hosts_unavailable_reason
from fastckpt_examples.cluster.multiprocess import free_port

__all__ = [
    "HealthChecks",
    "LocalRayCluster",
    "NodeFootprint",
    "RayClusterError",
    "RayNode",
    "RaySettings",
]

_PROBE = Path(__file__).with_name("_ray_cluster_probe.py")
_GCS_PORT = 6379
_TUNED = HealthChecks()
_SMALL = RaySettings()


@final
class LocalRayCluster:
    """A local multi-node Ray cluster; a context manager (see the module docstring).

    Args:
        nodes: Number of worker nodes (``node0``...), each with one ``fastckpt_node``.
        devices_per_node: Virtual JAX CPU devices per worker process.
        isolation: ``"namespaces"``, ``"processes"`` or ``"auto"``.
        health: Health-check settings of the head; None: Ray's defaults (not passed).
        settings: Per-node Ray settings.
        name: Cluster name (hostnames ``<name>-node0``...; lowercase, digits, ``-``).

    Raises:
        RayClusterError: it did not start (everything started is removed then); with
            ``isolation="namespaces"``, also when simulated hosts are unavailable here.
    """

    def __init__(
        self,
        nodes: int = 4,
        *,
        devices_per_node: int = 2,
        isolation: Isolation = "auto",
        health: HealthChecks | None = _TUNED,
        settings: RaySettings = _SMALL,
        name: str = "fcray",
    ) -> None:
        if nodes < 1 or devices_per_node < 1:
            raise ValueError(
                f"need nodes >= 1 and devices_per_node >= 1: {nodes}, {devices_per_node}"
            )
        if isolation == "auto":
            isolation = "namespaces" if hosts_unavailable_reason() is None else "processes"
        elif isolation == "namespaces" and (why := hosts_unavailable_reason()) is not None:
            raise RayClusterError(f"namespaced Ray cluster unavailable here: {why}")
        elif isolation not in ("namespaces", "processes"):
            raise ValueError(f"isolation must be auto, namespaces or processes: {isolation!r}")
        self.isolation: Literal["namespaces", "processes"] = isolation
        self.names = [f"node{i}" for i in range(nodes)]
        """Worker node names, in order."""
        self.devices_per_node = devices_per_node
        self.health = health
        self.settings = settings
        self._token = secrets.token_hex(4)
        self._lock = threading.RLock()
        self._closed = False
        self._starts: dict[str, subprocess.Popen[Any]] = {}
        self._drivers: list[subprocess.Popen[Any]] = []
        self._probe: subprocess.Popen[str] | None = None
        self._down: set[str] = set()
        self._cut: set[str] = set()
        self._revived_at: dict[str, float] = {}
        self.log_dir = Path(tempfile.mkdtemp(prefix=f"fastckpt-ray-{name}-", dir="/var/tmp"))
        """``<node>.log`` per ``ray start`` (and Ray's temp dir); removed by :meth:`close`."""
        self._backend: _nodes.Backend | None = None
        try:
            if isolation == "namespaces":
                self._backend = _nodes.NamespacedNodes(
                    [_nodes.CONTROL, *self.names], cluster_name=name
                )
                self._gcs_port = _GCS_PORT
            else:
                self._backend = _nodes.ProcessNodes(
                    [_nodes.CONTROL, *self.names], shm_prefix=f"/dev/shm/fastckpt-ray-{self._token}"
                )
                self._gcs_port = free_port()
            self.address = f"{self._backend.address(_nodes.CONTROL)}:{self._gcs_port}"
            """The GCS address a driver passes to ``ray.init(address=...)`` (``RAY_ADDRESS``)."""
            t0 = time.monotonic()
            self._start_node(_nodes.CONTROL)
            self._probe = self._backend.popen(
                _nodes.CONTROL,
                [sys.executable, str(_PROBE), self.address],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env=self._driver_env({}),
            )
            self._await(lambda ns: _nodes.CONTROL in ns, [_nodes.CONTROL], "the head")
            if isolation == "namespaces":
                for n in self.names:
                    self._start_node(n)
                self._await(lambda ns: all(n in ns for n in self.names), self.names, "the nodes")
            else:  # raylets sharing a temp dir and a network stack collide if started at once
                for n in self.names:
                    self._start_node(n)
                    self._await(lambda ns, n=n: n in ns, [n], n)
            self.start_s = time.monotonic() - t0
            """Seconds from the first ``ray start`` until every node was ALIVE."""
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"LocalRayCluster({self.address}, {len(self.names)} nodes, {self.isolation})"

    def __enter__(self) -> LocalRayCluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------------ queries

    def nodes(self) -> list[RayNode]:
        """Every worker node, in order, with the GCS's view of its latest registration."""
        with self._lock:
            table = self._table()
            return [self._node(n, table) for n in self.names]

    def node(self, name: str) -> RayNode:
        """One worker node (see :meth:`nodes`)."""
        self._check_name(name)
        with self._lock:
            return self._node(name, self._table())

    def wait_node(self, name: str, state: RayState, *, timeout_s: float) -> RayNode:
        """Poll (every 50 ms) until the GCS reports node ``name`` in ``state``.

        After :meth:`revive_node`, only a registration newer than the revival counts.

        Raises:
            TimeoutError: not in ``state`` after ``timeout_s``.
        """
        self._check_name(name)
        deadline = time.monotonic() + timeout_s
        while True:
            node = self.node(name)
            if node.ray_state == state:
                return node
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} is {node.ray_state}, not {state}, after {timeout_s} s")
            time.sleep(0.05)

    def footprint(self) -> dict[str, NodeFootprint]:
        """Memory and CPU of each node's Ray processes (raylet, agents, workers; on the
        control node the GCS server and the head's helpers), keyed by node name (the head is
        ``"control"``). The harness's own processes and drivers are not counted."""
        with self._lock:
            self._require_open()
            names = [_nodes.CONTROL, *self.names]
            out = {}
            for name, pids in _nodes.marked_pids(self._token, names).items():
                got = [u for p in pids if (u := _nodes.usage(p)) is not None]
                out[name] = NodeFootprint(
                    name=name,
                    processes=len(got),
                    pss_bytes=sum(u[0] for u in got),
                    rss_bytes=sum(u[1] for u in got),
                    cpu_s=sum(u[2] for u in got),
                )
            return out

    @property
    def control_host(self) -> Host | None:
        """The control node's simulated host (None in process mode): where a service the
        nodes and the driver reach runs, e.g. ``GcsEmulator(host=cluster.control_host)``."""
        backend = self._require_open()
        return backend.host(_nodes.CONTROL) if isinstance(backend, _nodes.NamespacedNodes) else None

    # ------------------------------------------------------------------------ faults

    def kill_node(self, name: str) -> float:
        """Lose node ``name`` as a machine is lost: SIGKILL its raylet and every worker, and
        its RAM root is gone (namespaces: the host and its tmpfs; processes: its directory).
        Returns the wall-clock time (``time.time()``) just before the kill; idempotent (a
        down node: no-op, returns now). The GCS notices by its health checks."""
        self._check_name(name)
        with self._lock:
            backend = self._require_open()
            t = time.time()
            if name in self._down:
                return t
            self._down.add(name)
            self._cut.discard(name)
            try:
                backend.kill(name, self._token)
            except Exception as exc:
                raise RayClusterError(f"killing {name} failed: {exc}") from exc
            self._reap(name)
            return t

    def cut_link(self, name: str) -> float:
        """Silence node ``name`` without an error anyone sees: namespaces: its link drops every
        frame (:meth:`Host.partition`); processes: its processes are frozen (SIGSTOP). Returns
        the wall-clock time just before. Ray declares it dead after its health checks, and its
        raylet exits when it hears that (after :meth:`heal_link`): kill and revive it to bring
        the node back."""
        self._check_name(name)
        with self._lock:
            backend = self._require_up(name)
            t = time.time()
            backend.cut(name, self._token)
            self._cut.add(name)
            return t

    def heal_link(self, name: str) -> None:
        """Undo :meth:`cut_link` (the link carries traffic again / the processes continue)."""
        self._check_name(name)
        with self._lock:
            backend = self._require_up(name)
            backend.heal(name, self._token)
            self._cut.discard(name)

    def revive_node(self, name: str, *, timeout_s: float | None = None) -> RayNode:
        """Start an empty replacement for killed node ``name``: same name, address and
        environment, an empty RAM root; returns once the GCS has it ALIVE.

        Raises:
            RayClusterError: the node is up (kill it first), or it did not join in time.
        """
        self._check_name(name)
        with self._lock:
            backend = self._require_open()
            if name not in self._down:
                raise RayClusterError(f"{name} is up; kill_node() it before revive_node()")
            self._revived_at[name] = time.time()
            backend.revive(name)
            self._down.discard(name)
            self._start_node(name)
        self._await(lambda ns: name in ns, [name], name, timeout_s)
        return self.node(name)

    # ------------------------------------------------------------------------ drivers

    def driver_popen(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, **popen_kwargs: Any
    ) -> subprocess.Popen[Any]:
        """Start a driver program where it reaches the cluster: inside the control host
        (namespaces) or plainly (processes), in a session of its own.

        Its environment is the caller's, plus ``RAY_ADDRESS`` (so ``ray.init()`` joins this
        cluster) and ``RAY_USAGE_STATS_ENABLED=0``, plus ``env``. Other arguments go to
        :class:`subprocess.Popen`. :meth:`close` kills it (and its process group) if it runs.
        """
        with self._lock:
            backend = self._require_open()
            process = backend.popen(
                _nodes.CONTROL, argv, env=self._driver_env(env or {}), **popen_kwargs
            )
            self._drivers.append(process)
            return process

    # ------------------------------------------------------------------------ closing

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._closed

    def close(self) -> None:
        """Remove everything: drivers, every node's processes, namespaces, RAM roots, logs.

        Idempotent; safe after a failed start.

        Raises:
            RayClusterError: a process survived 10 s of SIGKILLs (all else is removed).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            survivors: list[int] = []
            for process in [*self._drivers, *([self._probe] if self._probe else [])]:
                kill_group(process)
            if self._backend is not None:
                survivors = self._backend.close(self._token)
            for name in list(self._starts):
                self._reap(name)
            shutil.rmtree(self.log_dir, ignore_errors=True)
        if survivors:
            raise RayClusterError(f"processes {survivors} survived SIGKILL")

    # ------------------------------------------------------------------------ internals

    def _check_name(self, name: str) -> None:
        if name not in self.names:
            raise ValueError(f"no worker node {name!r}; nodes are {self.names}")

    def _require_open(self) -> _nodes.Backend:
        if self._closed or self._backend is None:
            raise RayClusterError(f"{self!r} is closed")
        return self._backend

    def _require_up(self, name: str) -> _nodes.Backend:
        backend = self._require_open()
        if name in self._down:
            raise RayClusterError(f"{name} is down (killed)")
        return backend

    def _driver_env(self, extra: Mapping[str, str]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != _nodes.MARKER}
        env.update(RAY_ADDRESS=self.address, RAY_USAGE_STATS_ENABLED="0")
        env.update(extra)
        return env

    def _start_node(self, name: str) -> None:
        backend = self._require_open()
        backend.prepare(name)
        s = self.settings
        argv = [
            sys.executable,
            "-m",
            "ray.scripts.scripts",
            "start",
            f"--node-ip-address={backend.address(name)}",
            f"--node-name={name}",
            f"--object-store-memory={s.object_store_bytes}",
            "--include-log-monitor=false",
            "--disable-usage-stats",
            "--block",
        ]
        if self.isolation == "processes":
            argv += [
                f"--temp-dir={self.log_dir / 'ray'}",
                f"--dashboard-agent-listen-port={free_port()}",
            ]
        if name == _nodes.CONTROL:
            config = {**s.system_config, **(self.health.system_config() if self.health else {})}
            argv += [
                "--head",
                f"--port={self._gcs_port}",
                "--num-cpus=0",
                "--include-dashboard=false",
                "--no-monitor",
                f"--system-config={json.dumps(config)}",
            ]
            if self.isolation == "processes":
                argv.append(f"--ray-client-server-port={free_port()}")
        else:
            argv += [
                f"--address={self.address}",
                f"--num-cpus={s.cpus_per_node}",
                f"--resources={json.dumps({s.node_resource: 1})}",
                f"--labels=fastckpt/node={name}",
            ]
        env = _nodes.node_env(
            os.environ,
            devices=self.devices_per_node,
            extra={
                **s.env,
                "FASTCKPT_NODE_NAME": name,
                "FASTCKPT_NODE_SHM": backend.shm_dir(name),
                _nodes.MARKER: f"{self._token}/{name}",
            },
        )
        self._reap(name)
        with open(self.log_dir / f"{name}.log", "ab") as log:
            self._starts[name] = backend.popen(
                name, argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )

    def _reap(self, name: str) -> None:
        process = self._starts.pop(name, None)
        if process is not None:
            kill_group(process)

    def _table(self) -> list[dict[str, Any]]:
        """The GCS's node table, through the probe (one request, one JSON line)."""
        self._require_open()
        assert self._probe is not None
        return _nodes.query_node_table(self._probe)

    def _node(self, name: str, table: list[dict[str, Any]]) -> RayNode:
        backend = self._require_open()
        since_ms = self._revived_at.get(name, 0.0) * 1000 - 1000  # clock skew margin
        mine = [r for r in table if r["name"] == name and r["start_time_ms"] >= since_ms]
        latest = max(mine, key=lambda r: r["start_time_ms"], default=None)
        return RayNode(
            name=name,
            address=backend.address(name),
            hostname=backend.hostname(name),
            shm_dir=backend.shm_dir(name),
            up=name not in self._down,
            link_cut=name in self._cut,
            ray_state="ABSENT" if latest is None else latest["state"],
            node_id=None if latest is None else latest["node_id"],
            started_at=None if latest is None else latest["start_time_ms"] / 1000,
            died_at=None
            if latest is None or not latest["end_time_ms"]
            else latest["end_time_ms"] / 1000,
        )

    def _await(
        self, done: Any, names: Sequence[str], what: str, timeout_s: float | None = None
    ) -> None:
        """Until every node in ``names`` is ALIVE per the GCS; fail fast if a ``ray start``
        exited, with the tail of its log."""
        deadline = time.monotonic() + (timeout_s or self.settings.start_timeout_s)
        while True:
            with self._lock:
                for n in names:
                    process = self._starts.get(n)
                    if process is not None and process.poll() is not None:
                        raise RayClusterError(
                            f"ray start of {n} exited ({process.returncode}):\n{self._log_tail(n)}"
                        )
                try:
                    table = self._table()
                except RayClusterError:
                    table = []  # the GCS is not up yet
                alive = {n for n in names if self._node(n, table).ray_state == "ALIVE"}
            if done(alive):
                return
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {n}:\n{self._log_tail(n)}" for n in names if n not in alive)
                raise RayClusterError(f"{what} did not come up in time:\n{tails}")
            time.sleep(0.1)

    def _log_tail(self, name: str) -> str:
        try:
            return (self.log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"
