"""Processes of simulated hosts: keepers (one per host and the switch's, each holding its
namespaces), entering a host with ``nsenter``, and finding and killing processes by network
namespace. Private to :mod:`fastckpt_examples.cluster.hosts`; nothing runs at import time.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from fastckpt_examples.cluster._hosts_env import Tools

KEEPER = Path(__file__).with_name("_hosts_keeper.py")


def ns_argv(
    tools: Tools, pid: int, *, userns: bool, host: bool, cwd: str | None = None
) -> list[str]:
    """``nsenter`` arguments that run a program in process ``pid``'s namespaces (it execs)."""
    argv = [tools.nsenter, f"--target={pid}", "--net"]
    if host:
        argv += ["--mount", "--uts"]
    if userns:
        argv += ["--user", "--preserve-credentials"]
    if cwd is not None:
        argv.append(f"--wd={cwd}")
    return [*argv, "--"]


_PRIVATE = ("/tmp", "/dev/shm")  # each host mounts its own tmpfs there


def caller_paths() -> list[str]:
    """What of this process lives under ``/tmp`` or ``/dev/shm`` and must stay visible in the
    hosts, or a program started there could not find it: the working directory, the
    interpreter and its prefixes, and ``sys.path`` (a checkout or virtualenv under /tmp).
    Outermost directories only, each existing."""
    found = {os.getcwd(), sys.prefix, sys.base_prefix, os.path.dirname(sys.executable), *sys.path}
    paths = sorted(
        {os.path.realpath(p) for p in found if p} | {os.path.abspath(p) for p in found if p}
    )
    inside = [
        p
        for p in paths
        if os.path.isdir(p)
        and any(p == r or p.startswith(r + "/") for r in _PRIVATE)
        and p not in _PRIVATE
    ]
    return [p for p in inside if not any(p.startswith(q + "/") for q in inside)]


def spawn_keeper(config: dict[str, object]) -> subprocess.Popen[bytes]:
    """Start a keeper (see ``_hosts_keeper``); its stdin is the lifeline: closing it ends it."""
    argv = [sys.executable, "-I", "-S", str(KEEPER), json.dumps(config)]
    return subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def await_ready(keepers: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> list[str]:
    """Each keeper's network namespace id (``net:[inode]``), once all reported ready."""
    deadline = time.monotonic() + timeout_s
    ids: list[str] = []
    for keeper in keepers:
        assert keeper.stdout is not None
        line = b""
        with selectors.DefaultSelector() as sel:
            sel.register(keeper.stdout, selectors.EVENT_READ)
            while not line.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise TimeoutError(f"a keeper did not start within {timeout_s:.0f} s")
                chunk = os.read(keeper.stdout.fileno(), 4096)
                if not chunk:
                    break
                line += chunk
        keeper.stdout.close()
        word, _, rest = line.decode(errors="replace").strip().partition(" ")
        if word != "ready":
            keeper.wait(timeout=5)
            raise OSError(f"a keeper failed: {rest or f'exit status {keeper.returncode}'}")
        ids.append(rest)
    return ids


def stop_keeper(keeper: subprocess.Popen[bytes], timeout_s: float = 15.0) -> None:
    """End a keeper (it sweeps its namespace first) and reap it."""
    if keeper.stdin is not None and not keeper.stdin.closed:
        try:
            keeper.stdin.close()
        except OSError:
            pass
    try:
        keeper.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        keeper.kill()
        keeper.wait(timeout=5)


def pids_in(netns_ids: Iterable[str]) -> dict[str, list[int]]:
    """Every process whose network namespace is one of ``netns_ids``, by namespace."""
    wanted: dict[str, list[int]] = {i: [] for i in netns_ids}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ns = os.readlink(f"/proc/{entry}/ns/net")
        except OSError:
            continue  # gone, a zombie, or not ours to see
        if ns in wanted:
            wanted[ns].append(int(entry))
    return wanted


def await_entry(process: subprocess.Popen[Any], netns: str, timeout_s: float) -> bool:
    """Wait until ``process`` (an ``nsenter``) is in ``netns`` or has exited; False on timeout."""
    deadline = time.monotonic() + timeout_s
    while process.poll() is None:
        try:
            if os.readlink(f"/proc/{process.pid}/ns/net") == netns:
                return True
        except OSError:
            pass  # exiting
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    return True


def kill_group(process: subprocess.Popen[Any]) -> None:
    """SIGKILL a process's group (it leads one), then reap it and close its pipes; quiet if it
    is gone."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except OSError:
            process.kill()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    for stream in (process.stdin, process.stdout, process.stderr):
        if stream is not None:
            try:
                stream.close()
            except OSError:
                pass


def kill_all(netns_ids: Sequence[str], timeout_s: float) -> list[int]:
    """SIGKILL every process in these namespaces until none is left; the survivors if any."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = [p for ps in pids_in(netns_ids).values() for p in ps]
        if not pids or time.monotonic() > deadline:
            return pids
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)
