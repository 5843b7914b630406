"""The :class:`Host` handle: one simulated machine of a :class:`~.hosts.SimulatedHosts`
cluster (run programs in it, kill and revive it, cut, heal and shape its link), and
:class:`LinkShape`. Private: :mod:`fastckpt_examples.cluster.hosts` re-exports both.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, final

from fastckpt_examples.cluster import _hosts_net as _net
from fastckpt_examples.cluster import _hosts_procs as _procs
from fastckpt_examples.cluster._hosts_env import HostDownError, HostsError


class _Cluster(Protocol):
    """What a :class:`Host` uses of the :class:`~.hosts.SimulatedHosts` that
    owns it (declared here so that this module does not import the cluster's)."""

    _lock: threading.RLock
    shared_dir: Path

    @property
    def closed(self) -> bool: ...
    def _require_open(self) -> None: ...
    def _switch(self) -> _net.Fabric: ...
    def _start(self, hosts: list[Host]) -> None: ...


KILL_TIMEOUT_S = 10.0
"""How long SIGKILLs may take to empty a host."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinkShape:
    """How a host's link is shaped; each direction separately gets the same shape.

    The rate is a token bucket (tbf) that counts whole Ethernet frames: TCP goodput through
    it is a little under ``rate_mbit`` (1448 payload bytes per 1514 on the wire), as long as
    the machine's CPUs keep up.
    """

    __module__ = "fastckpt_examples.cluster.hosts"

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

    __module__ = "fastckpt_examples.cluster.hosts"

    def __init__(
        self,
        cluster: _Cluster,
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
            if not _procs.await_entry(process, self._netns, KILL_TIMEOUT_S):
                _procs.kill_group(process)
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
                _procs.kill_group(process)
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
            return _procs.pids_in([self._netns])[self._netns]

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
            survivors = _procs.kill_all([netns], KILL_TIMEOUT_S)
            _procs.stop_keeper(keeper)
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
