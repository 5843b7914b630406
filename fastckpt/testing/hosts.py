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

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, final

from fastckpt.testing import _hosts_net as _net
from fastckpt.testing._hosts_net import HostDownError as HostDownError
from fastckpt.testing._hosts_net import HostsError as HostsError
from fastckpt.testing._hosts_net import hosts_unavailable_reason as hosts_unavailable_reason

__all__ = [
    "Host",
    "HostDownError",
    "HostsError",
    "LinkShape",
    "SimulatedHosts",
    "hosts_unavailable_reason",
]

_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?")
_KILL_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinkShape:
    """How a host's link is shaped; each direction separately gets the same shape.

    The rate is a token bucket (tbf) that counts whole Ethernet frames: TCP goodput through
    it is a little under ``rate_mbit`` (1448 payload bytes per 1514 on the wire), as long as
    the machine's CPUs keep up.
    """

    rate_mbit: float | None = None
    """Link rate in Mbit/s (10^6 bit/s), or None: unshaped (as fast as the machine goes)."""
    delay_ms: float = 0.0
    """Delay added to every packet, each direction of the link (netem, which some kernels
    lack). A path crosses two links: between hosts delayed ``a`` and ``b`` one way takes
    ``a + b``, a round trip ``2 * (a + b)``."""

    def __post_init__(self) -> None:
        if self.rate_mbit is not None and not self.rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0 or None, got {self.rate_mbit}")
        if not self.delay_ms >= 0:
            raise ValueError(f"delay_ms must be >= 0, got {self.delay_ms}")

    @property
    def shaped(self) -> bool:
        """Whether any qdisc is needed."""
        return self.rate_mbit is not None or self.delay_ms > 0


@final
class Host:
    """One simulated machine of a :class:`SimulatedHosts` cluster (which creates it).

    Every method is thread-safe. A host is *up* from its creation until :meth:`kill`, and again
    after :meth:`revive`; methods that need a running host raise :class:`HostDownError` while
    it is down. The cluster's :meth:`SimulatedHosts.close` brings every host down for good.
    """

    def __init__(
        self,
        cluster: SimulatedHosts,
        *,
        name: str,
        index: int,
        address: str,
        hostname: str,
        link: LinkShape,
    ) -> None:
        self.name = name
        """Name in the cluster: ``host0``..., or as given to :meth:`SimulatedHosts.add_host`."""
        self.index = index
        """Position in :attr:`SimulatedHosts.hosts`."""
        self.address = address
        """IPv4 address of its ``eth0``; it keeps it across :meth:`revive`."""
        self.hostname = hostname
        """``<cluster name>-<name>``; every host's /etc/hosts maps it to :attr:`address`."""
        self._cluster = cluster
        self._link = link
        self._keeper: subprocess.Popen[bytes] | None = None
        self._netns: str | None = None
        self._generation = 0
        self._partitioned = False

    def __repr__(self) -> str:
        state = "up" if self.is_up else "down"
        return f"Host({self.hostname}, {self.address}, {state})"

    @property
    def shared_dir(self) -> Path:
        """The cluster's :attr:`SimulatedHosts.shared_dir` (the same path inside every host)."""
        return self._cluster.shared_dir

    @property
    def link(self) -> LinkShape:
        """The configured shape of its link (what :meth:`heal` and :meth:`revive` restore)."""
        return self._link

    @property
    def is_up(self) -> bool:
        """Whether it runs (created or revived, not killed, cluster not closed)."""
        return self._keeper is not None

    @property
    def is_partitioned(self) -> bool:
        """Whether :meth:`partition` cut its link (and :meth:`heal` has not restored it)."""
        return self._partitioned

    def popen(self, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside this host (its network, mount and UTS namespaces).

        ``popen_kwargs`` go to :class:`subprocess.Popen` (env, stdout, ...). The program gets a
        session and process group of its own (``start_new_session`` is forced), so
        ``os.killpg(p.pid, ...)`` reaches its children; its pid is the program's own. ``cwd``
        (default: the caller's) is resolved inside the host: a directory under ``/tmp`` or
        ``/dev/shm`` is the host's own, not the caller's. It returns once the process is in
        the host (or failed to enter: then it exits non-zero), so :meth:`pids` lists it and
        :meth:`kill` reaches it. The process lives until it exits, :meth:`kill`, or the
        cluster's close.

        Raises:
            HostDownError: the host is down.
        """
        cwd = os.fspath(popen_kwargs.pop("cwd", None) or os.getcwd())
        popen_kwargs["start_new_session"] = True
        with self._cluster._lock:
            keeper = self._require_up()
            assert self._netns is not None
            prefix = self._cluster._switch().host_argv(keeper.pid, cwd)
            process = subprocess.Popen([*prefix, *argv], **popen_kwargs)
            if not _net.await_entry(process, self._netns, _KILL_TIMEOUT_S):
                _net.kill_group(process)
                raise HostsError(f"{argv[0]!r} did not enter {self.hostname} in time")
            return process

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        check: bool = True,
        input: bytes | str | None = None,
        capture_output: bool = False,
        **popen_kwargs: Any,
    ) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` inside this host to completion, like :func:`subprocess.run`.

        At ``timeout`` seconds its whole process group is SIGKILLed and
        :class:`subprocess.TimeoutExpired` is raised; with ``check``, a non-zero exit raises
        :class:`subprocess.CalledProcessError`. Other arguments are as for :meth:`popen`.
        """
        if capture_output:
            popen_kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if input is not None:
            popen_kwargs["stdin"] = subprocess.PIPE
        with self.popen(argv, **popen_kwargs) as process:
            try:
                out, err = process.communicate(input, timeout=timeout)
            except BaseException:
                _net.kill_group(process)
                raise
        done = subprocess.CompletedProcess(list(argv), process.returncode, out, err)
        if check:
            done.check_returncode()
        return done

    def free_port(self) -> int:
        """A TCP port that was free on this host's address a moment ago (asks inside it)."""
        code = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"
        done = self.run(
            [sys.executable, "-I", "-S", "-c", code], timeout=30, capture_output=True, text=True
        )
        return int(done.stdout)

    def pids(self) -> list[int]:
        """Every process now inside this host (its keeper included); ``[]`` while it is down.

        Found by network namespace through ``/proc``; zombies are not listed.
        """
        with self._cluster._lock:
            if self._netns is None:
                return []
            return _net.pids_in([self._netns])[self._netns]

    def kill(self) -> None:
        """Lose this machine: SIGKILL every process in it, its keeper included; idempotent.

        When it returns no process is left in the host, its tmpfs contents are gone (the mount
        namespace died with its last process), and its link is unplugged. Until
        :meth:`revive`, :meth:`popen` raises :class:`HostDownError`. Raises
        :class:`HostsError` if a process survived 10 s of SIGKILLs (stuck in the kernel).
        """
        with self._cluster._lock:
            keeper, netns = self._keeper, self._netns
            if keeper is None or netns is None:
                return
            self._keeper = self._netns = None
            self._partitioned = False
            survivors = _net.kill_all([netns], _KILL_TIMEOUT_S)
            _net.stop_keeper(keeper)
        if survivors:
            raise HostsError(f"{self.hostname}: processes {survivors} survived SIGKILL")

    def revive(self) -> None:
        """Bring up a fresh, empty machine in this host's place (a replacement).

        Same name, hostname, address and MAC address (peers' ARP caches stay valid); new
        namespaces, empty ``/dev/shm`` and ``/tmp``, no processes, link healed and shaped as
        :attr:`link`. Call it after :meth:`kill`.

        Raises:
            HostsError: the host is up, the cluster is closed, or it could not start.
        """
        with self._cluster._lock:
            self._cluster._require_open()
            if self.is_up:
                raise HostsError(f"{self.hostname} is up; kill() it before revive()")
            self._generation += 1
            self._cluster._start([self])

    def partition(self) -> None:
        """Cut its link silently: the switch drops every frame from and to it.

        Processes keep running and sockets stay open; a TCP transfer stalls without an error
        (until its own timeouts, if any) and resumes after :meth:`heal`. Its ``eth0`` keeps
        its carrier (and counts what it sends). Idempotent. Raises :class:`HostDownError`
        while the host is down.
        """
        self._set_port(partitioned=True)

    def heal(self) -> None:
        """Undo :meth:`partition`: the link carries traffic again, still shaped as :attr:`link`.

        Idempotent. TCP resumes at its next retransmission (up to a few seconds after a long
        partition, by TCP's backoff). Raises :class:`HostDownError` while the host is down.
        """
        self._set_port(partitioned=False)

    def shape(self, link: LinkShape) -> None:
        """Change its link's shape, both directions, from now on (also for :meth:`revive`).

        Applied at once on a running host (queued packets are dropped when the qdiscs are
        replaced; TCP recovers); on a down host it is recorded for :meth:`revive`.
        A partition stays in force.

        Raises:
            HostsError: ``tc`` refused (e.g. a delay on a kernel without netem).
        """
        with self._cluster._lock:
            self._cluster._require_open()
            if self._keeper is not None:
                port = dataclasses.replace(
                    self._plug(), rate_mbit=link.rate_mbit, delay_ms=link.delay_ms
                )
                self._cluster._switch().shape([(self._keeper.pid, port)], replace=self._link.shaped)
            self._link = link

    def link_bytes(self) -> tuple[int, int]:
        """``(received, sent)`` bytes on its ``eth0`` since this host (or revival) started.

        From the host's own interface counters; they count Ethernet frames (headers too).
        Raises :class:`HostDownError` while the host is down.
        """
        with self._cluster._lock:
            keeper = self._require_up()
            return _net.interface_bytes(keeper.pid, "eth0")

    # ------------------------------------------------------------------------ internals

    @property
    def _port(self) -> str:
        return f"h{self.index}g{self._generation}"

    @property
    def _mac(self) -> str:
        return f"02:fc:00:00:{self.index // 256:02x}:{self.index % 256:02x}"

    def _require_up(self) -> subprocess.Popen[bytes]:
        if self._keeper is None:
            why = "the cluster is closed" if self._cluster.closed else "it was killed"
            raise HostDownError(f"{self.hostname} is down ({why})")
        if self._keeper.poll() is not None:  # someone else killed it: do not trust its pid
            raise HostsError(
                f"{self.hostname}'s keeper died (status {self._keeper.returncode});"
                " kill() and revive() the host"
            )
        return self._keeper

    def _plug(self) -> _net.Port:
        return _net.Port(
            hostname=self.hostname,
            port=self._port,
            mac=self._mac,
            address=self.address,
            rate_mbit=self._link.rate_mbit,
            delay_ms=self._link.delay_ms,
        )

    def _set_port(self, *, partitioned: bool) -> None:
        with self._cluster._lock:
            self._require_up()
            if partitioned != self._partitioned:
                self._cluster._switch().set_port(self._port, enabled=not partitioned)
                self._partitioned = partitioned


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
        tools = _net.find_tools()
        if isinstance(tools, str):
            raise HostsError(tools)
        self.name = name
        self.userns = not _net.privileged()
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
                keep=_net.caller_paths(),
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
            survivors = _net.kill_all(netns, _KILL_TIMEOUT_S) if netns else []
            for host in self.hosts:
                if host._keeper is not None:
                    _net.stop_keeper(host._keeper)
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
