"""Helpers for the simulated-hosts tests: running the TCP tool in hosts, and leftovers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastckpt_examples.cluster import _hosts_procs
from fastckpt_examples.cluster.hosts import Host

NETCAT = str(Path(__file__).with_name("_netcat.py"))


def listen(host: Host, mode: str, port: int) -> subprocess.Popen[str]:
    """Start ``_netcat.py MODE PORT`` in ``host``; returns once it listens."""
    proc = host.popen(
        [sys.executable, "-I", NETCAT, mode, str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line == "listening\n", (
        line,
        proc.communicate(timeout=5) if proc.poll() is not None else "",
    )
    return proc


def netcat(host: Host, *args: object, timeout: float = 60) -> str:
    """Run ``_netcat.py ARGS`` in ``host`` to completion; its stdout."""
    done = host.run(
        [sys.executable, "-I", NETCAT, *map(str, args)],
        timeout=timeout,
        capture_output=True,
        text=True,
    )
    return str(done.stdout)


def result(proc: subprocess.Popen[str], timeout: float = 60) -> Any:
    """The JSON a ``_netcat.py`` listener printed last, after it exited 0."""
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def sh(host: Host, script: str, *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``sh -c script`` inside ``host``, output captured."""
    return host.run(["sh", "-c", script], timeout=30, check=check, capture_output=True, text=True)


def root_state() -> dict[str, Any]:
    """What the caller's namespaces show: interfaces, addresses, routes and mounts."""

    def ip(*args: str) -> list[str]:
        out = subprocess.run(["ip", "-o", *args], capture_output=True, text=True, check=True)
        return sorted(out.stdout.splitlines())

    links = sorted(line.split(":")[1].strip() for line in ip("link", "show"))
    with open("/proc/self/mountinfo") as f:
        mounts = sorted(f.read().splitlines())
    return {
        "links": links,
        "addrs": ip("addr", "show"),
        "routes": ip("route", "show"),
        "mounts": mounts,
    }


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def leftovers(*, netns: list[str], pids: list[int], shared_dir: str) -> list[str]:
    """What is left of a cluster: processes in its namespaces, live pids, its shared dir."""
    left = []
    inside = [p for ps in _hosts_procs.pids_in(netns).values() for p in ps]
    if inside:
        left.append(f"processes in the hosts' namespaces: {inside}")
    live = [p for p in pids if alive(p)]
    if live:
        left.append(f"live processes: {live}")
    if os.path.lexists(shared_dir):
        left.append(f"shared_dir {shared_dir} exists")
    return left


def wait_for_nothing_left(grace_s: float = 5.0, **what: Any) -> list[str]:
    """:func:`leftovers`, polled until empty or ``grace_s`` passed."""
    deadline = time.monotonic() + grace_s
    while (left := leftovers(**what)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def eventually(check: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    """Whether ``check()`` became true within ``timeout_s`` (polled)."""
    deadline = time.monotonic() + timeout_s
    while not (ok := check()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return ok
