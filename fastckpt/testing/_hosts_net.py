"""Plumbing for :mod:`fastckpt.testing.hosts`: tools, probes, keepers, the switch, ``ip``/``tc``.

Private: :mod:`fastckpt.testing.hosts` re-exports the public names (the errors and
:func:`hosts_unavailable_reason`); the rest may change. Nothing runs at import time.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from fastckpt.errors import FastckptError

KEEPER = Path(__file__).with_name("_hosts_keeper.py")
_PROBE_TIMEOUT_S = 10.0


class HostsError(FastckptError):
    """The simulated hosts could not be created, changed or removed as asked."""

    __module__ = "fastckpt.testing.hosts"


class HostDownError(HostsError):
    """The host is down (``Host.kill``); ``Host.revive`` brings a fresh one up."""

    __module__ = "fastckpt.testing.hosts"


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


def ns_batch(
    tools: Tools,
    pid: int,
    tool: str,
    commands: Sequence[str],
    *,
    userns: bool,
    timeout_s: float = 20.0,
) -> None:
    """Run ``ip``/``tc``/``bridge`` commands in ``pid``'s network namespace (one batch)."""
    program = {"ip": tools.ip, "tc": tools.tc, "bridge": tools.bridge}[tool]
    argv = [*ns_argv(tools, pid, userns=userns, host=False), program, "-batch", "-"]
    done = subprocess.run(
        argv,
        input="\n".join(commands) + "\n",
        capture_output=True,
        text=True,
        timeout=timeout_s,
        start_new_session=True,
    )
    if done.returncode != 0:
        raise OSError(
            f"{tool} failed ({done.returncode}): {done.stderr.strip()[-2000:]}\n"
            f"commands: {list(commands)}"
        )


def tc_commands(dev: str, *, rate_mbit: float | None, delay_ms: float) -> list[str]:
    """Qdiscs shaping ``dev``'s egress: netem (delay) at the root, tbf (rate) below it."""
    commands = []
    parent = "root handle 1:"
    if delay_ms > 0:
        # netem holds rate x delay in its queue: size the limit (packets) for it.
        pps = (rate_mbit or 10_000) * 1e6 / 8 / 1500
        limit = max(1000, int(pps * delay_ms / 1000 * 2))
        commands.append(
            f"qdisc add dev {dev} root handle 1: netem delay {delay_ms:g}ms limit {limit}"
        )
        parent = "parent 1:1 handle 10:"
    if rate_mbit is not None:
        rate_bytes = rate_mbit * 1e6 / 8
        burst = max(32 << 10, int(rate_bytes / 1000))  # ~1 ms of traffic, at least 32 KiB
        commands.append(
            f"qdisc add dev {dev} {parent} tbf rate {rate_mbit * 1000:.0f}kbit"
            f" burst {burst} latency 20ms"
        )
    return commands


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
    """SIGKILL ``process``'s process group (it leads one) and reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        process.kill()
    process.wait()


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


def interface_bytes(pid: int, dev: str) -> tuple[int, int]:
    """(received, sent) bytes of ``dev`` in ``pid``'s network namespace, from /proc."""
    with open(f"/proc/{pid}/net/dev") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == dev:
                fields = counters.split()
                return int(fields[0]), int(fields[8])
    raise OSError(f"no interface {dev} in process {pid}'s network namespace")


def local_networks(tools: Tools) -> list[ipaddress.IPv4Network]:
    """The IPv4 networks of this process's own namespace (to keep clear of)."""
    done = subprocess.run(
        [tools.ip, "-o", "-4", "addr", "show"],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    )
    nets = []
    for line in done.stdout.splitlines():
        fields = line.split()
        if "inet" in fields:
            nets.append(ipaddress.IPv4Interface(fields[fields.index("inet") + 1]).network)
    return nets


def choose_subnet(
    subnet: str | None, avoid: Sequence[ipaddress.IPv4Network]
) -> ipaddress.IPv4Network:
    """The given private IPv4 network, or a random 10.213.x.0/24 clear of ``avoid``."""
    if subnet is not None:
        net = ipaddress.ip_network(subnet)
        if not isinstance(net, ipaddress.IPv4Network) or not net.is_private or net.prefixlen > 28:
            raise ValueError(f"subnet must be a private IPv4 network, /28 or larger: {subnet}")
        if any(net.overlaps(other) for other in avoid):
            raise ValueError(f"subnet {net} overlaps a network of this machine's namespace")
        return net
    for _ in range(64):
        net = ipaddress.IPv4Network(f"10.213.{secrets.randbelow(256)}.0/24")
        if not any(net.overlaps(other) for other in avoid):
            return net
    raise ValueError("no free 10.213.x.0/24 subnet; pass subnet=")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Port:
    """One host's plug into the switch: what :meth:`Fabric.start` needs to bring it up."""

    hostname: str
    port: str
    """Name of the switch-side veth (the host side is ``eth0``)."""
    mac: str
    address: str
    rate_mbit: float | None
    delay_ms: float


class Fabric:
    """The switch (a bridge in a namespace of its own) and the commands that run on it.

    Args:
        tools: The programs to run.
        userns: Create a user namespace owning everything (the caller is not root).
        shared_dir: Removed by the switch's keeper when it ends.
        hosts_file: Bound on each host's /etc/hosts.
        start_timeout_s: How long a keeper may take to start.
        keep: Paths under ``/tmp`` or ``/dev/shm`` that stay visible in every host (bound
            from the caller's namespace into the private tmpfs; see :func:`caller_paths`).
    """

    BRIDGE = "br0"

    def __init__(
        self,
        tools: Tools,
        *,
        userns: bool,
        shared_dir: Path,
        hosts_file: Path,
        start_timeout_s: float,
        keep: Sequence[str] = (),
    ) -> None:
        self.tools = tools
        self.userns = userns
        self._keep = list(keep)
        self._hosts_file = hosts_file
        self._timeout_s = start_timeout_s
        switch = spawn_keeper(
            {
                "kind": "switch",
                "userns": "create" if userns else None,
                "remove_on_exit": str(shared_dir),
            }
        )
        try:
            await_ready([switch], start_timeout_s)
        except (OSError, TimeoutError) as exc:
            switch.kill()
            switch.wait()
            raise HostsError(f"the switch did not start: {exc}") from exc
        self._switch: subprocess.Popen[bytes] | None = switch
        try:
            self.batch(
                None, "ip", [f"link add {self.BRIDGE} type bridge", f"link set {self.BRIDGE} up"]
            )
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """End the switch's keeper (the bridge goes with its namespace). Idempotent."""
        if self._switch is not None:
            stop_keeper(self._switch)
            self._switch = None

    def host_argv(self, pid: int, cwd: str) -> list[str]:
        """The ``nsenter`` prefix that runs a program in host keeper ``pid``'s namespaces."""
        return ns_argv(self.tools, pid, userns=self.userns, host=True, cwd=cwd)

    def batch(self, pid: int | None, tool: str, commands: list[str]) -> None:
        """Run ``ip``/``tc``/``bridge`` commands in keeper ``pid``'s (None: the switch's) netns."""
        assert self._switch is not None
        where = self._switch.pid if pid is None else pid
        try:
            ns_batch(self.tools, where, tool, commands, userns=self.userns)
        except (OSError, subprocess.TimeoutExpired) as exc:
            what = "the switch" if pid is None else f"host keeper {pid}"
            raise HostsError(f"configuring {what} failed: {exc}") from exc

    def start(
        self, ports: Sequence[Port], prefixlen: int
    ) -> list[tuple[subprocess.Popen[bytes], str]]:
        """Start a keeper per port, plug it into the switch, address and shape it.

        Returns each keeper and its network namespace id. On failure the new keepers are
        killed (their namespaces and veths go with them) and :class:`HostsError` is raised.
        """
        assert self._switch is not None
        config = {
            "kind": "host",
            "userns": "join" if self.userns else None,
            "userns_pid": self._switch.pid,
            "hosts_file": str(self._hosts_file),
            "keep": self._keep,
        }
        keepers = [spawn_keeper({**config, "hostname": p.hostname}) for p in ports]
        try:
            try:
                ids = await_ready(keepers, self._timeout_s)
            except (OSError, TimeoutError) as exc:
                raise HostsError(f"a host did not start: {exc}") from exc
            plug = []
            for p, keeper in zip(ports, keepers, strict=True):
                plug += [
                    f"link add {p.port} type veth peer name eth0 address {p.mac} netns"
                    f" {keeper.pid}",
                    f"link set {p.port} master {self.BRIDGE}",
                    f"link set {p.port} up",
                ]
            self.batch(None, "ip", plug)
            for p, keeper in zip(ports, keepers, strict=True):
                self.batch(
                    keeper.pid,
                    "ip",
                    [
                        "link set lo up",
                        "link set eth0 up",
                        f"addr add {p.address}/{prefixlen} dev eth0",
                    ],
                )
            self.shape([(k.pid, p) for p, k in zip(ports, keepers, strict=True)], replace=False)
        except BaseException:
            for keeper in keepers:
                keeper.kill()
                keeper.wait()
            raise
        return list(zip(keepers, ids, strict=True))

    def shape(self, ends: Sequence[tuple[int, Port]], *, replace: bool) -> None:
        """Shape both ends of each (host keeper pid, port) as the port says; ``replace``:
        delete the qdiscs installed before (there are some)."""
        switch_side: list[str] = []
        for pid, p in ends:
            host_side = _qdiscs("eth0", p, replace=replace)
            if host_side:
                self.batch(pid, "tc", host_side)
            switch_side += _qdiscs(p.port, p, replace=replace)
        if switch_side:
            self.batch(None, "tc", switch_side)

    def set_port(self, port: str, *, enabled: bool) -> None:
        """Let the switch forward frames from and to ``port``, or drop them all."""
        self.batch(None, "bridge", [f"link set dev {port} state {3 if enabled else 0}"])


def _qdiscs(dev: str, port: Port, *, replace: bool) -> list[str]:
    delete = [f"qdisc del dev {dev} root"] if replace else []
    return delete + tc_commands(dev, rate_mbit=port.rate_mbit, delay_ms=port.delay_ms)
