"""Cross-process coordination: a tiny key-value + barrier interface.

``JaxCoordinator`` uses the key-value store of ``jax.distributed`` (the coordination
service every multi-host JAX job already runs). ``LocalCoordinator`` is the single-process
case. Every call has a deadline, writes included: a process cut off from the coordination
service (a network partition) gets :class:`~fastckpt.errors.BarrierTimeoutError` once it
passes, instead of blocking for as long as the partition lasts.
"""

from __future__ import annotations

import abc
import base64
import math
import threading
import time
from typing import Any

from fastckpt.errors import BarrierTimeoutError, ConfigError, DistributedError

__all__ = ["Coordinator", "JaxCoordinator", "LocalCoordinator", "default_coordinator", "time_left"]


def time_left(deadline: float) -> float:
    """Seconds until ``deadline`` (``time.monotonic()``), at least 1 ms: the timeout of the
    next wait of a sequence that shares one deadline (a wait of 0 would mean "no wait")."""
    return max(0.001, deadline - time.monotonic())


class Coordinator(abc.ABC):
    """Key-value store and barrier shared by all processes of a job."""

    process_index: int
    process_count: int
    service_address: str | None = None
    """``host:port`` of the coordination service, where there is one: the peer layer binds
    its server to this host's address on the route to it (what the other hosts reach)."""

    @abc.abstractmethod
    def set(self, key: str, value: str, *, timeout_s: float | None = None) -> None:
        """Publish ``value`` under ``key`` (keys are written once), within ``timeout_s``
        (None: the coordinator's own bound) or ``BarrierTimeoutError``."""

    @abc.abstractmethod
    def get(self, key: str, *, timeout_s: float) -> str:
        """Wait for ``key`` and return its value; ``BarrierTimeoutError`` after the timeout."""

    def set_bytes(self, key: str, value: bytes, *, timeout_s: float | None = None) -> None:
        """Publish binary ``value`` under ``key`` (default: base64 text through ``set``)."""
        self.set(key, base64.b64encode(value).decode("ascii"), timeout_s=timeout_s)

    def get_bytes(self, key: str, *, timeout_s: float) -> bytes:
        """Wait for a binary value published with ``set_bytes`` (same timeout as ``get``)."""
        text = self.get(key, timeout_s=timeout_s)
        try:
            return base64.b64decode(text, validate=True)
        except ValueError as e:
            raise DistributedError(f"key-value {key!r}: not a binary value: {e}") from e

    def try_get(self, key: str) -> str | None:
        """Return the value of ``key`` if set, else None (default: zero-timeout ``get``)."""
        try:
            return self.get(key, timeout_s=0.001)
        except BarrierTimeoutError:
            return None

    def try_get_all(
        self, directory: str, count: int, *, timeout_s: float | None = None
    ) -> list[str | None]:
        """The values of ``<directory>/<i>`` for ``i < count``, None where not set (default:
        one ``try_get`` per key; ``JaxCoordinator`` reads the directory in one request, so a
        poll over hundreds of processes is one round trip, not hundreds)."""
        return [self.try_get(f"{directory}/{i}") for i in range(count)]

    def namespace(self, base: str) -> str:
        """A key prefix unique to this call within the job: ``<base>/m<n>`` where ``n`` counts
        earlier calls with the same ``base`` in this process. SPMD code makes the same calls
        on every process, so all processes get the same prefix."""
        return f"{base}/m{_next_count(self._count_scope(), base)}"

    def _count_scope(self) -> object:
        return self

    def exchange(self, name: str, value: str, *, timeout_s: float) -> list[str]:
        """Publish ``value`` as this process's under ``name`` and return every process's, in
        process order, once all have published: a barrier that carries a value (each name
        used once per job; ``timeout_s`` bounds the whole wait)."""
        if self.process_count == 1:
            return [value]
        deadline = time.monotonic() + timeout_s
        self.set(f"{name}/{self.process_index}", value, timeout_s=timeout_s)
        return [
            self.get(f"{name}/{i}", timeout_s=time_left(deadline))
            for i in range(self.process_count)
        ]

    def barrier(self, name: str, *, timeout_s: float) -> None:
        """Wait until every process reached ``name`` (each name used once per job)."""
        self.exchange(f"{name}/arrived", "1", timeout_s=timeout_s)


# Per coordination-service counters for ``Coordinator.namespace``. The scope is the
# jax.distributed client (one per job incarnation), so that separate JaxCoordinator objects
# of one job count together. The scope object is kept referenced, so its id is never reused.
_COUNTS: dict[int, tuple[object, dict[str, int]]] = {}
_COUNTS_LOCK = threading.Lock()


def _next_count(scope: object, base: str) -> int:
    with _COUNTS_LOCK:
        counts = _COUNTS.setdefault(id(scope), (scope, {}))[1]
        counts[base] = counts.get(base, -1) + 1
        return counts[base]


class LocalCoordinator(Coordinator):
    """The single-process coordinator: an in-memory dict."""

    def __init__(self) -> None:
        self.process_index = 0
        self.process_count = 1
        self._kv: dict[str, str] = {}

    def set(self, key: str, value: str, *, timeout_s: float | None = None) -> None:
        self._kv[key] = value

    def get(self, key: str, *, timeout_s: float) -> str:
        try:
            return self._kv[key]
        except KeyError:
            raise BarrierTimeoutError(f"key {key!r} was never set (single process)") from None


class JaxCoordinator(Coordinator):
    """Coordinator over the ``jax.distributed`` key-value store. Call after initialize().

    Every client call runs with a deadline of ``timeout_s`` (or the shorter wait asked
    for): the client's writes and directory reads have none of their own, and a partition
    from the coordination service would block them for as long as it lasts. A call past its
    deadline raises :class:`BarrierTimeoutError` and is left to finish on its own daemon
    thread (hazard: a write may still land after its caller gave up; every key is written
    once per save attempt, so a late write changes no decision already taken).
    """

    def __init__(
        self,
        client: Any,
        *,
        process_index: int,
        process_count: int,
        timeout_s: float = 300.0,
        service_address: str | None = None,
    ) -> None:
        if not 0 < timeout_s < math.inf:
            raise ConfigError(f"timeout_s must be > 0 and finite, got {timeout_s!r}")
        self._client = client
        self.process_index = process_index
        self.process_count = process_count
        self.timeout_s = timeout_s
        self.service_address = service_address

    def _count_scope(self) -> object:
        return self._client

    def set(self, key: str, value: str, *, timeout_s: float | None = None) -> None:
        self._set(self._client.key_value_set, key, value, timeout_s)

    def get(self, key: str, *, timeout_s: float) -> str:
        return str(self._blocking(self._client.blocking_key_value_get, key, timeout_s))

    def set_bytes(self, key: str, value: bytes, *, timeout_s: float | None = None) -> None:
        self._set(self._client.key_value_set_bytes, key, value, timeout_s)

    def _set(self, put: Any, key: str, value: str | bytes, timeout_s: float | None) -> None:
        _bounded(put, (key, value), self._bound(timeout_s), f"key-value set {key!r}")

    def _bound(self, timeout_s: float | None) -> float:
        return self.timeout_s if timeout_s is None else max(0.001, min(timeout_s, self.timeout_s))

    def get_bytes(self, key: str, *, timeout_s: float) -> bytes:
        return bytes(self._blocking(self._client.blocking_key_value_get_bytes, key, timeout_s))

    def try_get_all(
        self, directory: str, count: int, *, timeout_s: float | None = None
    ) -> list[str | None]:
        pairs = _bounded(
            self._client.key_value_dir_get,
            (directory,),
            self._bound(timeout_s),
            f"key-value directory get {directory!r}",
        )
        found: dict[int, str] = {}
        for key, value in pairs:  # full keys; deeper ones (<directory>/<i>/...) are not ours
            head, _, tail = str(key).rpartition("/")
            if head == directory and tail.isdigit() and int(tail) < count:
                found[int(tail)] = str(value)
        return [found.get(i) for i in range(count)]

    def _blocking(self, get: Any, key: str, timeout_s: float) -> Any:
        # The client's own timeout ends the wait for a key that is not there; the deadline
        # (a little later) ends a call that cannot reach the service at all.
        wait_s = min(timeout_s, self.timeout_s)
        return _bounded(
            get,
            (key, max(1, int(wait_s * 1000))),
            wait_s + _DEADLINE_SLACK_S,
            f"waiting for {key!r}",
            waited_s=wait_s,
        )

    def try_get(self, key: str) -> str | None:
        try:
            value = _bounded(
                self._client.key_value_try_get, (key,), self.timeout_s, f"key-value get {key!r}"
            )
        except BarrierTimeoutError:
            raise
        except DistributedError:  # not set (the client raises NOT_FOUND)
            return None
        return None if value is None else str(value)


_DEADLINE_SLACK_S = 1.0
"""How much longer than its own timeout a blocking get may take before its deadline ends it."""


def _bounded(
    call: Any, args: tuple[Any, ...], deadline_s: float, what: str, *, waited_s: float | None = None
) -> Any:
    """``call(*args)`` on a daemon thread, waited for at most ``deadline_s``.

    Raises:
        BarrierTimeoutError: the call did not return in time, or the client reported that
            its own timeout passed (``waited_s``: the wait it was given).
        DistributedError: the client raised anything else.
    """
    done = threading.Event()
    box: list[Any] = []

    def run() -> None:
        try:
            box.append((True, call(*args)))
        except BaseException as e:  # handed to the caller
            box.append((False, e))
        finally:
            done.set()

    threading.Thread(target=run, name="fastckpt-kv", daemon=True).start()
    if not done.wait(deadline_s):
        raise BarrierTimeoutError(
            f"{what}: no answer from the coordination service within {deadline_s:.1f}s "
            "(unreachable: partitioned or down?)"
        )
    ok, value = box[0]
    if ok:
        return value
    msg = str(value)
    if waited_s is not None and ("DEADLINE_EXCEEDED" in msg or "timed out" in msg.lower()):
        raise BarrierTimeoutError(f"timed out after {waited_s:.1f}s {what}") from value
    raise DistributedError(f"{what} failed: {msg}") from value


def default_coordinator(*, timeout_s: float = 300.0) -> Coordinator:
    """``JaxCoordinator`` if ``jax.distributed`` is initialised with >1 process, else local.

    ``timeout_s`` bounds every call the coordinator makes (see :class:`JaxCoordinator`).
    """
    import jax
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None or jax.process_count() == 1:
        return LocalCoordinator()
    address = distributed.global_state.coordinator_address
    return JaxCoordinator(
        client,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        timeout_s=timeout_s,
        service_address=str(address) if address else None,
    )
