"""Every call of ``JaxCoordinator`` has a deadline, writes and directory reads included.

The client here stands in for jax's ``DistributedRuntimeClient`` whose calls never return,
as they do not while a host is partitioned from the coordination service (the real thing,
a partitioned host in a 4-host job, is in tests/hosts). Each case fails if the call is made
without the deadline (it would block the test until pytest's timeout).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from fastckpt.coordination.distributed import JaxCoordinator
from fastckpt.errors import BarrierTimeoutError, ConfigError, DistributedError

TIMEOUT_S = 0.5


class _CutOffClient:
    """Every call blocks until ``release`` is set (a partition that lasts)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls: list[str] = []

    def _block(self, name: str) -> Any:
        self.calls.append(name)
        self.release.wait(30)
        return []

    def key_value_set(self, key: str, value: str) -> None:
        self._block("set")

    def key_value_set_bytes(self, key: str, value: bytes) -> None:
        self._block("set_bytes")

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        return str(self._block("get"))

    def blocking_key_value_get_bytes(self, key: str, timeout_ms: int) -> bytes:
        self._block("get_bytes")
        return b""

    def key_value_dir_get(self, directory: str) -> list[tuple[str, str]]:
        return list(self._block("dir_get"))

    def key_value_try_get(self, key: str) -> str | None:
        self._block("try_get")
        return None


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.set("k", "v"),
        lambda c: c.set_bytes("k", b"v"),
        lambda c: c.get("k", timeout_s=60),
        lambda c: c.get_bytes("k", timeout_s=60),
        lambda c: c.try_get_all("d", 4),
        lambda c: c.try_get("k"),
        lambda c: c.exchange("x", "1", timeout_s=60),
    ],
    ids=["set", "set_bytes", "get", "get_bytes", "try_get_all", "try_get", "exchange"],
)
def test_a_call_to_an_unreachable_service_ends_at_its_deadline(call: Any) -> None:
    client = _CutOffClient()
    coord = JaxCoordinator(client, process_index=0, process_count=2, timeout_s=TIMEOUT_S)
    t0 = time.monotonic()
    with pytest.raises(BarrierTimeoutError, match="coordination service"):
        call(coord)
    took = time.monotonic() - t0
    client.release.set()
    # A get waits for its own timeout (the smaller of the two) plus a second of slack.
    assert TIMEOUT_S * 0.9 <= took < TIMEOUT_S + 1.5, took
    assert client.calls


def test_a_shorter_wait_asked_for_bounds_a_get() -> None:
    client = _CutOffClient()
    coord = JaxCoordinator(client, process_index=0, process_count=2, timeout_s=60)
    t0 = time.monotonic()
    with pytest.raises(BarrierTimeoutError):
        coord.get("k", timeout_s=0.2)
    client.release.set()
    assert time.monotonic() - t0 < 0.2 + 1.5


class _FailingClient:
    def key_value_set(self, key: str, value: str) -> None:
        raise RuntimeError("UNAVAILABLE: connection refused")

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        raise RuntimeError("DEADLINE_EXCEEDED: Barrier timed out")

    def key_value_try_get(self, key: str) -> str | None:
        raise RuntimeError("NOT_FOUND: no such key")


def test_client_errors_are_typed() -> None:
    coord = JaxCoordinator(_FailingClient(), process_index=0, process_count=2, timeout_s=5)
    with pytest.raises(DistributedError, match="connection refused") as info:
        coord.set("k", "v")
    assert not isinstance(info.value, BarrierTimeoutError)
    with pytest.raises(BarrierTimeoutError, match="timed out after"):
        coord.get("k", timeout_s=1)
    assert coord.try_get("k") is None


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan")])
def test_the_deadline_must_be_positive_and_finite(bad: float) -> None:
    with pytest.raises(ConfigError):
        JaxCoordinator(_FailingClient(), process_index=0, process_count=2, timeout_s=bad)
