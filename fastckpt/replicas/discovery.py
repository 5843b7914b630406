"""Publishing and finding peers: member id → address of its :class:`~fastckpt.replicas.PeerServer`.

A :class:`PeerRecord` is a small JSON document. Three directories carry them:

* :class:`CoordinatorDirectory`: the job's :class:`~fastckpt.coordination.distributed.Coordinator`
  key-value store, one key per process index. Coordinator keys are written once, so a
  process publishes once per coordination-service lifetime (a job restart starts a new one).
* :class:`StoreDirectory`: one object per member under a prefix of a
  :class:`~fastckpt.storage.Store` (overwritten on republish, so a restarted member simply
  replaces its record). No read-modify-write: members never race on a shared object.
* :class:`CallbackDirectory`: the same per-member records through two plain callables, for
  any other membership service.

``lookup`` returns the newest record per member id (by ``published_unix``, ties by
``incarnation``); records that fail to parse are skipped, never fatal.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import math
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from fastckpt.coordination.distributed import time_left
from fastckpt.errors import BarrierTimeoutError, ConfigError, ProtocolError

if TYPE_CHECKING:
    from fastckpt.coordination.distributed import Coordinator
    from fastckpt.storage._protocol import Store

__all__ = [
    "CallbackDirectory",
    "CoordinatorDirectory",
    "PeerDirectory",
    "PeerRecord",
    "StoreDirectory",
    "make_record",
]

_RECORD_VERSION = 1


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
        """``(host, port)`` for :class:`~fastckpt.replicas.PeerClient`."""
        return self.host, self.port

    def to_json(self) -> str:
        """The record as compact JSON."""
        return json.dumps({"version": _RECORD_VERSION, **dataclasses.asdict(self)}, separators=(",", ":"))

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
                isinstance(rec.member_id, str)
                and rec.member_id
                and isinstance(rec.host, str)
                and rec.host
                and type(rec.port) is int
                and 0 < rec.port < 65536
                and isinstance(rec.incarnation, str)
                and type(rec.published_unix) in (int, float)
                and math.isfinite(rec.published_unix)
            )
            if not ok:
                raise ValueError("bad field")
        except (ValueError, TypeError, RecursionError) as e:
            raise ProtocolError(f"malformed peer record: {type(e).__name__}: {str(e)[:200]}") from None
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


def _newest(records: Iterable[PeerRecord]) -> dict[str, PeerRecord]:
    out: dict[str, PeerRecord] = {}
    for r in records:
        cur = out.get(r.member_id)
        if cur is None or (r.published_unix, r.incarnation) > (cur.published_unix, cur.incarnation):
            out[r.member_id] = r
    return dict(sorted(out.items()))


def _parse_all(blobs: Iterable[str | bytes]) -> list[PeerRecord]:
    out = []
    for blob in blobs:
        try:
            out.append(PeerRecord.from_json(blob))
        except ProtocolError:
            continue
    return out


class PeerDirectory(abc.ABC):
    """Where members publish their :class:`PeerRecord` and find each other's."""

    @abc.abstractmethod
    def publish(self, record: PeerRecord) -> None:
        """Publish (or replace) this member's record."""

    @abc.abstractmethod
    def lookup(self) -> dict[str, PeerRecord]:
        """The newest record of every member that published, keyed and sorted by member id."""

    def withdraw(self, member_id: str) -> None:  # noqa: B027 - optional
        """Remove a member's record where the directory supports it (default: no-op)."""


class CoordinatorDirectory(PeerDirectory):
    """Records in the coordinator's key-value store: ``fastckpt/<namespace>/peers/<process_index>``.

    Args:
        coordinator: The job's coordinator.
        namespace: Separates jobs or managers sharing one coordinator.
        timeout_s: How long :meth:`lookup` waits for every process to publish.
    """

    def __init__(self, coordinator: Coordinator, *, namespace: str = "default", timeout_s: float = 60.0) -> None:
        if "/" in namespace or not namespace:
            raise ConfigError(f"namespace must be a non-empty str without '/', got {namespace!r}")
        self._coordinator = coordinator
        self._directory = f"fastckpt/{namespace}/peers"  # process i's record: <directory>/<i>
        self._timeout_s = timeout_s

    def publish(self, record: PeerRecord) -> None:
        """Publish under this process's index (once per coordination-service lifetime)."""
        self._coordinator.set(f"{self._directory}/{self._coordinator.process_index}", record.to_json())

    def lookup(self, *, wait: bool = True) -> dict[str, PeerRecord]:
        """Every process's record; with ``wait``, block until all published (or time out).

        Raises:
            BarrierTimeoutError: ``wait`` and some process did not publish within the timeout.
        """
        deadline = time.monotonic() + self._timeout_s
        count = self._coordinator.process_count
        if not wait:  # one request for all processes' records
            return _newest(_parse_all([v for v in self._coordinator.try_get_all(self._directory, count) if v is not None]))
        blobs = []
        for i in range(count):
            remaining = time_left(deadline)
            try:
                blobs.append(self._coordinator.get(f"{self._directory}/{i}", timeout_s=remaining))
            except BarrierTimeoutError as e:
                raise BarrierTimeoutError(f"process {i} did not publish its peer address: {e}") from e
        return _newest(_parse_all(blobs))


class StoreDirectory(PeerDirectory):
    """Records as objects ``<prefix><quoted member id>.json`` in a :class:`~fastckpt.storage.Store`.

    Args:
        store: Any store (the job's checkpoint store, a ``MemoryStore`` in tests).
        prefix: Key prefix, e.g. ``"_peers/"``.
        run: Runs a store coroutine to completion from sync code, on the loop that owns the
            store: the manager's ``LoopThread.run``; ``asyncio.run`` only for a store that
            no loop owns (each call then runs on a loop of its own).
    """

    def __init__(self, store: Store, *, run: Callable[[Coroutine[Any, Any, Any]], Any], prefix: str = "_peers/") -> None:
        if prefix and not prefix.endswith("/"):
            raise ConfigError(f"prefix must end with '/', got {prefix!r}")
        self._store = store
        self._prefix = prefix
        self._run = run

    def _key(self, member_id: str) -> str:
        return f"{self._prefix}{quote(member_id, safe='')}.json"

    def publish(self, record: PeerRecord) -> None:
        self._run(self._store.put(self._key(record.member_id), record.to_json().encode(), mode="overwrite"))

    def lookup(self) -> dict[str, PeerRecord]:
        async def read_all() -> list[bytes]:
            out = []
            for key in await self._store.list(self._prefix):
                if key.endswith(".json"):
                    try:
                        out.append(bytes(await self._store.get(key)))
                    except FileNotFoundError:  # withdrawn meanwhile
                        continue
            return out

        return _newest(_parse_all(self._run(read_all())))

    def withdraw(self, member_id: str) -> None:
        self._run(self._store.delete(self._key(member_id)))


class CallbackDirectory(PeerDirectory):
    """Per-member records through callables.

    Args:
        write: ``write(member_id, record_json)`` stores (replaces) one member's record.
        read_all: Returns every stored record JSON.
        delete: Optional ``delete(member_id)`` for :meth:`withdraw`.
    """

    def __init__(
        self,
        write: Callable[[str, str], None],
        read_all: Callable[[], Iterable[str | bytes]],
        delete: Callable[[str], None] | None = None,
    ) -> None:
        self._write, self._read_all, self._delete = write, read_all, delete

    def publish(self, record: PeerRecord) -> None:
        self._write(record.member_id, record.to_json())

    def lookup(self) -> dict[str, PeerRecord]:
        return _newest(_parse_all(self._read_all()))

    def withdraw(self, member_id: str) -> None:
        if self._delete is not None:
            self._delete(member_id)
