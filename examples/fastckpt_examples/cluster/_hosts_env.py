"""What simulated hosts need from this machine, and whether it has it: the harness's errors,
the programs it runs (:class:`Tools`) and the probe behind :func:`hosts_unavailable_reason`.

Private: :mod:`fastckpt_examples.cluster.hosts` re-exports the public names (the errors and
:func:`hosts_unavailable_reason`); the rest may change. Nothing runs at import time.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys

from fastckpt.errors import FastckptError

_PROBE_TIMEOUT_S = 10.0


class HostsError(FastckptError):
    """The simulated hosts could not be created, changed or removed as asked."""

    __module__ = "fastckpt_examples.cluster.hosts"


class HostDownError(HostsError):
    """The host is down (``Host.kill``); ``Host.revive`` brings a fresh one up."""

    __module__ = "fastckpt_examples.cluster.hosts"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tools:
    """Absolute paths of the programs the harness runs."""

    nsenter: str
    ip: str
    tc: str
    bridge: str
    unshare: str


def _search_path() -> str:
    return os.pathsep.join([os.environ.get("PATH", os.defpath), "/usr/sbin", "/sbin"])


def find_tools() -> Tools | str:
    """The tools (also looked for in /usr/sbin and /sbin), or why they cannot be found."""
    names = ("nsenter", "ip", "tc", "bridge", "unshare")
    found = {name: shutil.which(name, path=_search_path()) for name in names}
    missing = sorted(name for name, path in found.items() if path is None)
    if missing:
        return f"missing programs: {', '.join(missing)} (util-linux and iproute2)"
    return Tools(**{name: str(path) for name, path in found.items()})


def privileged() -> bool:
    """Whether this process is root (then no user namespace is created)."""
    return os.geteuid() == 0


def probe(tools: Tools, *, delay: bool) -> str | None:
    """Try, in a throwaway namespace, what the harness does; None if it all worked."""
    script = (
        "set -e; ip link add fcprobe0 type veth peer name fcprobe1;"
        " ip link add fcprobebr type bridge; ip link set fcprobe0 master fcprobebr;"
        " ip link set fcprobe0 up; ip link set fcprobebr up;"
        " bridge link set dev fcprobe0 state 0;"
        " tc qdisc add dev fcprobe1 root handle 1: tbf rate 100mbit burst 32k latency 20ms;"
        " mount -t tmpfs tmpfs /dev/shm"
    )
    if delay:  # exit status 3: only netem failed
        script += "; tc qdisc add dev fcprobe0 root handle 1: netem delay 1ms || exit 3"
    user = [] if privileged() else ["--user", "--map-root-user"]
    argv = [tools.unshare, *user, "--net", "--mount", "--uts", "sh", "-c", script]
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=_PROBE_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PATH": _search_path()},
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"probe failed: {exc}"
    if done.returncode == 0:
        return None
    lines = (done.stderr or done.stdout).strip().splitlines()
    detail = lines[-1] if lines else f"exit status {done.returncode}"
    if delay and done.returncode == 3:
        return f"no netem qdisc here (CONFIG_NET_SCH_NETEM), needed for link delay: {detail}"
    if not user:
        return f"cannot create namespaces, links or qdiscs as root here: {detail}"
    return f"unprivileged user namespaces do not work here ({detail}); run as root"


def hosts_unavailable_reason(*, delay: bool = False) -> str | None:
    """None if this process can create simulated hosts; otherwise why not, in one line.

    It tries what the harness does in a throwaway namespace (one short ``unshare`` run, a
    few milliseconds) each time it is called; nothing is cached.

    Args:
        delay: Also require link delay (``LinkShape.delay_ms``: the netem qdisc).
    """
    if not sys.platform.startswith("linux"):
        return f"simulated hosts need Linux namespaces; this is {sys.platform}"
    tools = find_tools()
    if isinstance(tools, str):
        return tools
    return probe(tools, delay=delay)
