"""Simulated hosts: separate machines on one Linux box, for multi-host tests, demos and benchmarks.

A :class:`SimulatedHosts` cluster is N hosts on one virtual switch. Each host has its own

* **network namespace**: ``lo`` and ``eth0`` with its own IPv4 address, one end of a veth pair
  whose other end is a port of a Linux bridge (in a namespace of its own); the link is shaped
  in both directions (:class:`LinkShape`), can be cut (:meth:`Host.partition`) and healed;
* **mount namespace**: private tmpfs on ``/dev/shm`` and ``/tmp`` (its RAM tier: invisible to
  the others, gone with the host) and an ``/etc/hosts`` naming every host of the cluster;
* **UTS namespace**: its own hostname (``fc-host0``...), which resolves to its own address,
  as JAX's gloo needs (it advertises that address to its peers).

A keeper process per host holds its namespaces; programs enter them with ``nsenter``, which
execs, so a :meth:`Host.popen`'s pid is the program's own. Example::

    with SimulatedHosts(2, link=LinkShape(rate_mbit=1000)) as hosts:
        server = hosts[1].popen([sys.executable, "server.py", "--bind", hosts[1].address])
        hosts[0].run([sys.executable, "client.py", hosts[1].hostname], timeout=30)
        hosts[1].kill()      # the machine is lost: its processes and its /dev/shm are gone
        hosts[1].revive()    # a replacement machine: same name and address, empty

**Needs:** Linux; ``nsenter``, ``unshare`` (util-linux), ``ip``, ``tc``, ``bridge`` (iproute2);
root, or unprivileged user namespaces (then one user namespace, created by the switch's
keeper, owns every namespace of the cluster and nothing needs root). Link delay needs the
kernel's netem qdisc, which some kernels lack. :func:`hosts_unavailable_reason` says whether
this works here.

**Guarantees:**

* Containment: the caller's namespace gets no interface, address or route on the switch; a
  host has no default route and no IPv6, so it reaches only the hosts of its cluster. The
  addresses are private (a random ``10.213.x.0/24`` clear of the machine's, unless given).
* Cleanup: :meth:`SimulatedHosts.close` (``with`` exit, also after an exception or Ctrl-C)
  SIGKILLs every process in every host and ends the keepers: namespaces, veths, bridge,
  qdiscs and tmpfs mounts go with them (nothing is bound under ``/run`` or mounted in the
  caller's namespace); it removes :attr:`SimulatedHosts.shared_dir`. If the caller dies
  instead, even by SIGKILL, each keeper notices (at once: its stdin pipe closes; at the
  latest within 0.5 s: its parent changes), SIGKILLs every process in its host, and the
  switch's keeper removes shared_dir.

**Hazards:**

* Networks, RAM tiers and names are isolated; nothing else is, and it is no security
  boundary: hosts share the PID namespace, CPUs, memory (tmpfs pages count against the
  machine's RAM) and every path but ``/tmp``, ``/dev/shm`` and ``/etc/hosts``.
* Paths under ``/tmp`` and ``/dev/shm`` differ per host (pytest's ``tmp_path`` is under
  ``/tmp``): put what the caller and the hosts share in ``shared_dir``. Only the caller's
  working directory, interpreter and ``sys.path`` stay visible there (bound in, shared), so
  a checkout or virtualenv under ``/tmp`` still runs in the hosts.
* ``/sys/class/net`` inside a host shows the machine's interfaces (sysfs is not remounted).
* Processes are found by network namespace: one that moves to another escapes the sweeps.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import final

from fastckpt_examples.cluster import _hosts_env as _env
from fastckpt_examples.cluster import _hosts_net as _net
from fastckpt_examples.cluster import _hosts_procs as _procs
from fastckpt_examples.cluster._host import KILL_TIMEOUT_S, Host, LinkShape
from fastckpt_examples.cluster._hosts_env import HostDownError, HostsError, hosts_unavailable_reason

__all__ = [
    "Host",
    "HostDownError",
    "HostsError",
    "LinkShape",
    "SimulatedHosts",
    "hosts_unavailable_reason",
]

_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?")


@final
class SimulatedHosts:
    """A cluster of simulated hosts on one virtual switch; a context manager.

    Creating it starts ``count`` hosts named ``host0``... (hostnames ``<name>-host0``...) at
    the first addresses of ``subnet``. Use it in a ``with`` block, or call :meth:`close`.

    Args:
        count: Number of hosts to start now (more with :meth:`add_host`).
        link: Shape of every host's link (change one with :meth:`Host.shape`).
        name: Cluster name: prefix of hostnames and of :attr:`shared_dir`'s name.
        subnet: A private IPv4 network (``"10.213.7.0/24"``); default: a random
            ``10.213.x.0/24`` that overlaps no network of the caller's namespace. Two clusters
            never share a switch, so equal subnets do not clash.
        start_timeout_s: How long a host's keeper may take to start.

    Raises:
        HostsError: the hosts could not be created (nothing is left behind then); the
            message includes :func:`hosts_unavailable_reason` when it has one.
    """

    def __init__(
        self,
        count: int,
        *,
        link: LinkShape = LinkShape(),
        name: str = "fc",
        subnet: str | None = None,
        start_timeout_s: float = 30.0,
    ) -> None:
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if not _NAME.fullmatch(name):
            raise ValueError(f"name must be lowercase letters, digits and '-', got {name!r}")
        tools = _env.find_tools()
        if isinstance(tools, str):
            raise HostsError(tools)
        self.name = name
        self.userns = not _env.privileged()
        """Whether one user namespace owns the cluster (the caller is not root)."""
        self.subnet = _net.choose_subnet(subnet, _net.local_networks(tools))
        """The hosts' IPv4 network."""
        self.hosts: list[Host] = []
        """The hosts, in creation order (``hosts[i].index == i``)."""
        self._link = link
        self._lock = threading.RLock()
        self._fabric: _net.Fabric | None = None
        self._closed = False
        self.shared_dir = Path(tempfile.mkdtemp(prefix=f"fastckpt-hosts-{name}-", dir="/var/tmp"))
        """A directory on disk, at the same path in every host and in the caller, for files
        they share (job specs, results, control files). Removed by :meth:`close`."""
        self._hosts_file = self.shared_dir / ".etc-hosts"
        try:
            self._hosts_file.write_text("")
            self._fabric = _net.Fabric(
                tools,
                userns=self.userns,
                shared_dir=self.shared_dir,
                hosts_file=self._hosts_file,
                start_timeout_s=start_timeout_s,
                keep=_procs.caller_paths(),
            )
            new = [self._new_host(f"host{i}", link) for i in range(count)]
            self._write_hosts_file()
            self._start(new)
        except BaseException as exc:
            self.close()
            if isinstance(exc, HostsError):
                reason = hosts_unavailable_reason(delay=link.delay_ms > 0)
                if reason:
                    raise HostsError(f"{exc} ({reason})") from exc
            raise

    def __repr__(self) -> str:
        return f"SimulatedHosts({self.name!r}, {self.subnet}, {len(self.hosts)} hosts)"

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __len__(self) -> int:
        return len(self.hosts)

    def __iter__(self) -> Iterator[Host]:
        return iter(list(self.hosts))

    def __enter__(self) -> SimulatedHosts:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._closed

    def add_host(self, name: str, *, link: LinkShape | None = None) -> Host:
        """Start one more host on the switch (a GCS emulator's machine, a man in the middle).

        Its hostname is ``<cluster name>-<name>``, its address the next free one; every
        host's /etc/hosts lists it from now on.

        Args:
            name: Unique within the cluster; lowercase letters, digits and ``-``.
            link: Its link's shape; default: the cluster's.
        """
        if not _NAME.fullmatch(name):
            raise ValueError(f"name must be lowercase letters, digits and '-', got {name!r}")
        with self._lock:
            self._require_open()
            if any(h.name == name for h in self.hosts):
                raise ValueError(f"a host named {name!r} exists already")
            host = self._new_host(name, link if link is not None else self._link)
            self._write_hosts_file()
            try:
                self._start([host])
            except BaseException:
                self.hosts.pop()
                self._write_hosts_file()
                raise
            return host

    def close(self) -> None:
        """Remove everything: every host's processes, the keepers, namespaces, links, shared_dir.

        Idempotent; safe after a failed start. Afterwards every host is down for good.

        Raises:
            HostsError: a process survived 10 s of SIGKILLs (everything else is removed).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            netns = [h._netns for h in self.hosts if h._netns is not None]
            survivors = _procs.kill_all(netns, KILL_TIMEOUT_S) if netns else []
            for host in self.hosts:
                if host._keeper is not None:
                    _procs.stop_keeper(host._keeper)
                host._keeper = host._netns = None
            if self._fabric is not None:
                self._fabric.close()
            shutil.rmtree(self.shared_dir, ignore_errors=True)
        if survivors:
            raise HostsError(f"processes {survivors} survived SIGKILL")

    # ------------------------------------------------------------------------ internals

    def _require_open(self) -> None:
        if self._closed:
            raise HostsError(f"{self!r} is closed")

    def _switch(self) -> _net.Fabric:
        self._require_open()
        assert self._fabric is not None
        return self._fabric

    def _new_host(self, name: str, link: LinkShape) -> Host:
        index = len(self.hosts)
        if index + 2 > self.subnet.num_addresses:
            raise HostsError(f"subnet {self.subnet} has no address left for host {index}")
        hostname = f"{self.name}-{name}"
        if len(hostname) > 63:
            raise ValueError(f"hostname {hostname!r} is longer than 63 characters")
        address = str(self.subnet.network_address + index + 1)
        host = Host(self, name=name, index=index, address=address, hostname=hostname, link=link)
        self.hosts.append(host)
        return host

    def _write_hosts_file(self) -> None:
        lines = ["127.0.0.1 localhost"] + [f"{h.address} {h.hostname}" for h in self.hosts]
        with open(self._hosts_file, "r+") as f:  # in place: hosts bind-mount this very inode
            f.write("\n".join(lines) + "\n")
            f.truncate()

    def _start(self, hosts: list[Host]) -> None:
        started = self._switch().start([h._plug() for h in hosts], self.subnet.prefixlen)
        for host, (keeper, netns) in zip(hosts, started, strict=True):
            host._keeper, host._netns, host._partitioned = keeper, netns, False
