"""The simulated hosts' network: their addresses, the switch (a bridge in a namespace of its
own, :class:`Fabric`), each host's veth into it, and link shaping with ``tc``. Private to
:mod:`fastckpt_examples.cluster.hosts`; nothing runs at import time.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import secrets
import subprocess
from collections.abc import Sequence
from pathlib import Path

from fastckpt_examples.cluster._hosts_env import HostsError, Tools
from fastckpt_examples.cluster._hosts_procs import await_ready, ns_argv, spawn_keeper, stop_keeper


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
