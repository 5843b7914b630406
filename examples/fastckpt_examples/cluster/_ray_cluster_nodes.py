"""Plumbing for :mod:`.ray_cluster`: where Ray nodes run, and ``/proc`` sweeps.

Private; the public face is :class:`.ray_cluster.LocalRayCluster`. A backend places the control
node (the Ray head) and the worker nodes: in simulated hosts (:class:`NamespacedNodes`) or as
plain processes on the caller's network stack (:class:`ProcessNodes`). Every process of a node
carries ``MARKER=<token>/<node name>`` in its environment (set on ``ray start``, inherited by
the raylet and every worker it starts), which is how a node's processes are found,
measured and, in process mode, killed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from fastckpt_examples.cluster._ray_cluster_options import RayClusterError
from fastckpt_examples.cluster.hosts import Host, SimulatedHosts
from fastckpt_examples.cluster.multiprocess import cpu_devices_env

MARKER = "FASTCKPT_RAY_NODE"
CONTROL = "control"
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_KILL_TIMEOUT_S = 10.0


class Backend(Protocol):
    """Where the nodes of one cluster run; every name is ``CONTROL`` or a worker node's."""

    kind: str

    def address(self, name: str) -> str:
        """The node's IPv4 address (what ``ray start --node-ip-address`` gets)."""
        ...

    def hostname(self, name: str) -> str:
        """The node's hostname (``socket.gethostname()`` of its processes)."""
        ...

    def shm_dir(self, name: str) -> str:
        """The node's private RAM root (created empty by :meth:`prepare`)."""
        ...

    def prepare(self, name: str) -> None:
        """Create the node's RAM root; the node is up (after creation or :meth:`revive`)."""
        ...

    def popen(self, name: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` on node ``name`` (own session); ``kwargs`` go to Popen."""
        ...

    def kill(self, name: str, token: str) -> None:
        """Lose the node: SIGKILL all its processes, empty its RAM root."""
        ...

    def cut(self, name: str, token: str) -> None:
        """Silence the node without killing it."""
        ...

    def heal(self, name: str, token: str) -> None:
        """Undo :meth:`cut`."""
        ...

    def revive(self, name: str) -> None:
        """Bring a fresh, empty node up in the killed one's place."""
        ...

    def close(self, token: str) -> list[int]:
        """End every process of every node and remove their RAM roots; survivors, if any."""
        ...


def marked_pids(token: str, names: Iterable[str]) -> dict[str, list[int]]:
    """The live processes of these nodes, by name (zombies excluded): those carrying
    ``MARKER=<token>/<name>`` and their descendants. Descent matters: Ray's agents and workers
    call ``setproctitle``, which may overwrite what ``/proc/<pid>/environ`` shows."""
    wanted = {f"{MARKER}={token}/{n}".encode(): n for n in names}
    found: dict[str, list[int]] = {n: [] for n in wanted.values()}
    prefix = f"{MARKER}={token}/".encode()
    parent: dict[int, int] = {}
    owner: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            if fields[0] == b"Z":
                continue
            parent[int(entry)] = int(fields[1])
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
        except (OSError, IndexError, ValueError):
            continue
        if prefix in env:
            for item in env.split(b"\0"):
                if item in wanted:
                    owner[int(entry)] = wanted[item]
    for pid in parent:
        seen, p = [], pid
        while p not in owner and p in parent and p not in seen and p > 1:
            seen.append(p)
            p = parent[p]
        if p in owner:
            found[owner[p]].append(pid)
    return found


def kill_marked(token: str, names: Sequence[str], timeout_s: float = _KILL_TIMEOUT_S) -> list[int]:
    """SIGKILL every process marked for these nodes until none is left; survivors if any."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = [p for ps in marked_pids(token, names).values() for p in ps]
        if not pids or time.monotonic() > deadline:
            return pids
        signal_all(pids, signal.SIGKILL)
        time.sleep(0.01)


def signal_all(pids: Iterable[int], sig: signal.Signals) -> None:
    """Send ``sig`` to each pid, ignoring those already gone."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def usage(pid: int) -> tuple[int, int, float] | None:
    """``(pss_bytes, rss_bytes, cpu_seconds)`` of a live process, or None if it is gone.

    PSS from ``smaps_rollup`` (0 where the kernel does not offer it), RSS from ``status``, CPU
    as user + system time of the process itself (not of children it reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / _CLK_TCK
        rss = pss = 0
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        pss = int(line.split()[1]) * 1024
        except OSError:
            pass
    except (OSError, IndexError, ValueError):
        return None
    return pss, rss, cpu


class NamespacedNodes:
    """Each node is a simulated host (own network, mount and UTS namespaces); see ``hosts``."""

    kind = "namespaces"

    def __init__(self, names: Sequence[str], *, cluster_name: str) -> None:
        self.hosts = SimulatedHosts(0, name=cluster_name)
        try:
            self._by_name: dict[str, Host] = {n: self.hosts.add_host(n) for n in names}
        except BaseException:
            self.hosts.close()
            raise

    def host(self, name: str) -> Host:
        return self._by_name[name]

    def address(self, name: str) -> str:
        return self._by_name[name].address

    def hostname(self, name: str) -> str:
        return self._by_name[name].hostname

    def shm_dir(self, name: str) -> str:
        return "/dev/shm/fastckpt"  # the host's own tmpfs: private, gone with the host

    def prepare(self, name: str) -> None:
        self._by_name[name].run(["mkdir", "-p", self.shm_dir(name)], timeout=30)

    def popen(self, name: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        return self._by_name[name].popen(argv, **kwargs)

    def kill(self, name: str, token: str) -> None:
        self._by_name[name].kill()

    def cut(self, name: str, token: str) -> None:
        self._by_name[name].partition()

    def heal(self, name: str, token: str) -> None:
        self._by_name[name].heal()

    def revive(self, name: str) -> None:
        self._by_name[name].revive()

    def close(self, token: str) -> list[int]:
        self.hosts.close()
        return []


class ProcessNodes:
    """Nodes as process groups on the caller's network stack, each with a RAM root under
    ``/dev/shm`` of its own (``<shm_prefix>-<name>``)."""

    kind = "processes"

    def __init__(self, names: Sequence[str], *, shm_prefix: str) -> None:
        self._names = list(names)
        self._prefix = shm_prefix
        self._stopped: set[str] = set()

    def address(self, name: str) -> str:
        return "127.0.0.1"

    def hostname(self, name: str) -> str:
        return socket.gethostname()

    def shm_dir(self, name: str) -> str:
        return f"{self._prefix}-{name}"

    def prepare(self, name: str) -> None:
        os.makedirs(self.shm_dir(name), exist_ok=True)

    def popen(self, name: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        kwargs["start_new_session"] = True
        return subprocess.Popen(list(argv), **kwargs)

    def kill(self, name: str, token: str) -> None:
        survivors = kill_marked(token, [name])
        self._stopped.discard(name)
        shutil.rmtree(self.shm_dir(name), ignore_errors=True)
        if survivors:
            raise OSError(f"node {name}: processes {survivors} survived SIGKILL")

    def cut(self, name: str, token: str) -> None:
        # One network stack has no link to cut: freeze the node instead (SIGSTOP), which Ray
        # sees the same way: a raylet that stops answering, sockets open, no error.
        signal_all(marked_pids(token, [name])[name], signal.SIGSTOP)
        self._stopped.add(name)

    def heal(self, name: str, token: str) -> None:
        signal_all(marked_pids(token, [name])[name], signal.SIGCONT)
        self._stopped.discard(name)

    def revive(self, name: str) -> None:
        self.prepare(name)

    def close(self, token: str) -> list[int]:
        survivors = kill_marked(token, self._names)
        for name in self._names:
            shutil.rmtree(self.shm_dir(name), ignore_errors=True)
        return survivors


def node_env(base: Mapping[str, str], *, devices: int, extra: Mapping[str, str]) -> dict[str, str]:
    """``base`` without what would steer a ``ray start`` elsewhere, on ``devices`` virtual CPU
    devices, plus ``extra``."""
    env = cpu_devices_env(
        {k: v for k, v in base.items() if k not in ("RAY_ADDRESS", MARKER)}, devices
    )
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env.update(extra)
    return env


def query_node_table(probe: subprocess.Popen[str]) -> list[dict[str, Any]]:
    """Ask the node probe (:mod:`~fastckpt_examples.cluster._ray_cluster_probe`) for the GCS's node
    table: one request line, one JSON answer line."""
    assert probe.stdin is not None and probe.stdout is not None
    try:
        probe.stdin.write("nodes\n")
        probe.stdin.flush()
        line = probe.stdout.readline()
    except OSError as exc:
        raise RayClusterError(f"the node probe is gone: {exc}") from exc
    if not line:
        raise RayClusterError(f"the node probe exited ({probe.poll()})")
    answer = json.loads(line)
    if not answer["ok"]:
        raise RayClusterError(f"the GCS did not answer: {answer['error']}")
    nodes: list[dict[str, Any]] = answer["nodes"]
    return nodes
