"""A peer's start-up (internal): where its server listens (:func:`peer_address`), how
members find each other (:class:`PeerDirectory`), and the check that every host reaches the
peers it pushes to (:func:`check_push_targets`)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import socket
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from fastckpt.coordination.distributed import time_left
from fastckpt.errors import (
    BarrierTimeoutError,
    ConfigError,
    PeerError,
    PeersUnreachableError,
    ProtocolError,
)

if TYPE_CHECKING:
    from fastckpt.coordination.distributed import Coordinator
    from fastckpt.replicas._client import PeerClient
    from fastckpt.storage import Store

__all__ = [
    "PeerDirectory",
    "PeerRecord",
    "check_push_targets",
    "make_record",
    "peer_address",
    "route_source_address",
    "split_host_port",
]

_WILDCARDS = frozenset({"0.0.0.0", "::", ""})
_RECORD_VERSION = 1
_STORE_PREFIX = "_peers/"
_MAX_PROBES = 32
_SHOWN = 8


def split_host_port(address: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> ``(host, port)``.

    Raises:
        ConfigError: not of that form.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"not a host:port address: {address!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ConfigError(f"an IPv6 address needs brackets, as in [::1]:1234: {address!r}")
    return host, int(port)


def route_source_address(host: str, port: int) -> str:
    """This host's own address on the route to ``host`` (a name or an IPv4/IPv6 literal): a
    connected UDP socket's own address (connecting one sends nothing).

    Raises:
        ConfigError: ``host`` does not resolve, or no route leads to any of its addresses.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except socket.gaierror as e:
        raise ConfigError(f"cannot resolve the coordinator host {host!r}: {e}") from e
    errors = []
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.connect(sockaddr)
            except OSError as e:
                errors.append(f"{sockaddr[0]}: {e}")
                continue
            return str(s.getsockname()[0])
    raise ConfigError(f"no route to the coordinator {host!r} ({'; '.join(errors) or 'no address'})")


def peer_address(
    host: str | None, *, service_address: str | None, process_count: int
) -> tuple[str, str]:
    """``(bind, advertise)``: where this host's peer server listens and what peers are told.

    * ``host`` set to an address or name: bind and advertise it (an explicit choice wins).
    * ``host`` a wildcard (``"0.0.0.0"``, ``"::"``): bind every interface, advertise the
      default address below.
    * ``host`` None: in a multi-process job, the address of the route to the coordination
      service (``service_address``, ``host:port``); alone, loopback.

    Raises:
        ConfigError: a multi-process job without a coordination service address and no
            ``host`` (there is nothing to infer a reachable address from), or no route.
    """
    if host is not None and host not in _WILDCARDS:
        return host, host
    if process_count <= 1 and service_address is None:
        default = "127.0.0.1"
    elif service_address is None:
        raise ConfigError(
            "RamOptions.host is needed: this multi-process job has no coordination service "
            "address to find a reachable peer address from"
        )
    else:
        default = route_source_address(*split_host_port(service_address))
    if host is None:
        return default, default
    return ("::" if ":" in default else "0.0.0.0"), default  # (``default`` is an IP literal)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeerRecord:
    """Where one member's peer server listens."""

    member_id: str
    """Content-stable member id (e.g. ``"<host>/<slot>"``)."""
    host: str
    """Address peers connect to."""
    port: int
    """TCP port."""
    incarnation: str
    """Random id of the publishing process; changes when the member restarts."""
    published_unix: float = 0.0
    """Publication time (seconds since the epoch); the newest record of a member wins."""

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` for a ``PeerClient``."""
        return self.host, self.port

    def to_json(self) -> str:
        """The record as compact JSON."""
        return json.dumps(
            {"version": _RECORD_VERSION, **dataclasses.asdict(self)}, separators=(",", ":")
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> PeerRecord:
        """Parse and validate a record.

        Raises:
            ProtocolError: not a valid record.
        """
        try:
            d = json.loads(text)
            if not isinstance(d, dict) or d.pop("version", None) != _RECORD_VERSION:
                raise ValueError("unknown record version")
            rec = cls(**d)
            ok = (
                all(isinstance(v, str) and v for v in (rec.member_id, rec.host))
                and type(rec.port) is int
                and 0 < rec.port < 65536
                and isinstance(rec.incarnation, str)
                and type(rec.published_unix) in (int, float)
                and math.isfinite(rec.published_unix)
            )
            if not ok:
                raise ValueError("bad field")
        except (ValueError, TypeError, RecursionError) as e:
            raise ProtocolError(
                f"malformed peer record: {type(e).__name__}: {str(e)[:200]}"
            ) from None
        return rec


def make_record(member_id: str, address: tuple[str, int]) -> PeerRecord:
    """A fresh record for ``member_id`` at ``address``, stamped now with a new incarnation."""
    if not isinstance(member_id, str) or not member_id:
        raise ConfigError("member_id must be a non-empty string")
    return PeerRecord(
        member_id=member_id,
        host=address[0],
        port=int(address[1]),
        incarnation=uuid.uuid4().hex,
        published_unix=time.time(),
    )


def _newest(blobs: Iterable[str | bytes]) -> dict[str, PeerRecord]:
    """The newest of the records that parse, by member id (sorted)."""
    out: dict[str, PeerRecord] = {}
    for blob in blobs:
        try:
            r = PeerRecord.from_json(blob)
        except ProtocolError:
            continue
        cur = out.get(r.member_id)
        if cur is None or (r.published_unix, r.incarnation) > (cur.published_unix, cur.incarnation):
            out[r.member_id] = r
    return dict(sorted(out.items()))


class PeerDirectory:
    """Where the members of a job publish their :class:`PeerRecord` and find each other's
    (``docs/replicas.md``, "Discovery"): with several processes the coordinator's key-value
    store (:meth:`lookup` waits until every process published), alone objects
    ``_peers/<quoted member id>.json`` in the checkpoint store.

    Args:
        coordinator: The job's coordinator; its ``process_count`` chooses the place.
        store: The checkpoint store (a job of one process).
        run: Runs a store coroutine to completion from sync code, on the loop that owns the
            store: the manager's ``LoopThread.run``; ``asyncio.run`` for a store no loop owns.
        namespace: Separates jobs or managers sharing one coordinator (no ``/``).
        timeout_s: How long :meth:`lookup` waits for every process to publish.
    """

    def __init__(
        self,
        coordinator: Coordinator,
        store: Store,
        *,
        run: Callable[[Coroutine[Any, Any, Any]], Any],
        namespace: str = "default",
        timeout_s: float = 60.0,
    ) -> None:
        self._multi = coordinator.process_count > 1
        if self._multi and ("/" in namespace or not namespace):
            raise ConfigError(f"namespace must be a non-empty str without '/', got {namespace!r}")
        self._coordinator = coordinator
        self._directory = f"fastckpt/{namespace}/peers"  # process i's record: <directory>/<i>
        self._timeout_s = timeout_s
        self._store = store
        self._run = run

    def publish(self, record: PeerRecord) -> None:
        """Publish this member's record (under this process's index, or replacing its object)."""
        if self._multi:
            self._coordinator.set(
                f"{self._directory}/{self._coordinator.process_index}", record.to_json()
            )
        else:
            key = f"{_STORE_PREFIX}{quote(record.member_id, safe='')}.json"
            self._run(self._store.put(key, record.to_json().encode(), mode="overwrite"))

    def lookup(self) -> dict[str, PeerRecord]:
        """The newest record of every member that published (by ``published_unix``, ties by
        ``incarnation``; records that fail to parse are skipped), keyed and sorted by member
        id.

        Raises:
            BarrierTimeoutError: some process did not publish within the timeout.
        """
        if not self._multi:
            return _newest(self._run(self._read_store()))
        deadline = time.monotonic() + self._timeout_s
        blobs = []
        for i in range(self._coordinator.process_count):
            remaining = time_left(deadline)
            try:
                blobs.append(self._coordinator.get(f"{self._directory}/{i}", timeout_s=remaining))
            except BarrierTimeoutError as e:
                raise BarrierTimeoutError(
                    f"process {i} did not publish its peer address: {e}"
                ) from e
        return _newest(blobs)

    async def _read_store(self) -> list[bytes]:
        out = []
        for key in await self._store.list(_STORE_PREFIX):
            if key.endswith(".json"):
                with contextlib.suppress(FileNotFoundError):  # deleted meanwhile
                    out.append(bytes(await self._store.get(key)))
        return out


def check_push_targets(
    coord: Coordinator,
    *,
    key: str,
    me: str,
    clients: Mapping[str, PeerClient],
    targets: Sequence[str],
    timeout_s: float,
) -> None:
    """Fail the job's start on every process when any host cannot reach (or authenticate to)
    a peer it pushes to (else its RAM steps would silently lack their replicas).

    Every process (SPMD; ``key`` the same on all) probes its ``targets`` at once and reports
    to process 0, which publishes the job's verdict.

    Raises:
        PeersUnreachableError: some host could not reach a peer; every process raises it,
            naming the members and addresses (``me`` describes this host).
        BarrierTimeoutError: a process did not report within ``timeout_s``.
    """

    def probe(member: str) -> str | None:
        client = clients[member]
        try:
            client.step_lists()
        except PeerError as e:
            return f"{me} cannot reach {member} at {client.address[0]}:{client.address[1]}: {e}"
        return None

    known = [t for t in targets if t in clients]
    with ThreadPoolExecutor(
        max(1, min(_MAX_PROBES, len(known))), thread_name_prefix="fastckpt-probe"
    ) as pool:
        problems = [p for p in pool.map(probe, known) if p is not None]
    problems += [
        f"{me} found no published address of its peer {t}" for t in targets if t not in clients
    ]
    coord.set(f"{key}/{coord.process_index}", json.dumps(problems))
    if coord.process_index == 0:
        deadline = time.monotonic() + timeout_s
        found = [
            p
            for i in range(coord.process_count)
            for p in json.loads(coord.get(f"{key}/{i}", timeout_s=time_left(deadline)))
        ]
        coord.set(f"{key}/verdict", json.dumps(found))
    found = json.loads(coord.get(f"{key}/verdict", timeout_s=timeout_s))
    if found:
        more = f" (and {len(found) - _SHOWN} more)" if len(found) > _SHOWN else ""
        raise PeersUnreachableError(
            "RAM replicas cannot work: hosts cannot reach the peers they replicate to: "
            + "; ".join(found[:_SHOWN])
            + more
            + ". Check RamOptions.host (default: this host's address on the "
            "route to the jax.distributed coordinator), firewalls between the hosts, and that "
            "every process has the same secret"
        )
