"""RetryingStore: backoff, exhaustion, deadline, and create-only after an ambiguous failure."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fastckpt.errors import (
    AlreadyExistsError,
    ConfigError,
    NotFoundError,
    RetriesExhaustedError,
    StorageError,
    TransientStorageError,
)
from fastckpt.storage import (
    Buffer,
    ByteRange,
    LocalStore,
    MemoryStore,
    ObjectInfo,
    ObjectMeta,
    Payload,
    PutMode,
    RetryingStore,
    RetryPolicy,
    Store,
)
from fastckpt.storage._local import TEMP_SUFFIX
from fastckpt.testing.store_tests import run


class FlakyStore(Store):
    """Fails the next ``failures[op]`` calls of each operation with TransientStorageError.

    ``land_before_failing`` makes a failing put write the object first (the response was
    "lost"), which is the ambiguous case for create-only puts.
    """

    def __init__(self, inner: Store, *, land_before_failing: bool = False) -> None:
        self.inner = inner
        self.url = "flaky+" + inner.url
        self.failures: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.land_before_failing = land_before_failing

    def fail(self, op: str, n: int) -> None:
        self.failures[op] = n

    def _tick(self, op: str) -> bool:
        self.calls[op] = self.calls.get(op, 0) + 1
        if self.failures.get(op, 0) > 0:
            self.failures[op] -= 1
            return True
        return False

    async def get(self, key: str, *, byte_range: ByteRange | None = None) -> Buffer:
        if self._tick("get"):
            raise TransientStorageError("injected get failure")
        return await self.inner.get(key, byte_range=byte_range)

    async def put(self, key: str, data: Payload, *, mode: PutMode = "overwrite") -> None:
        if self._tick("put"):
            if self.land_before_failing:
                await self.inner.put(key, data, mode=mode)
            raise TransientStorageError("injected put failure")
        await self.inner.put(key, data, mode=mode)

    async def list(self, prefix: str = "") -> list[str]:
        if self._tick("list"):
            raise TransientStorageError("injected list failure")
        return await self.inner.list(prefix)

    async def list_info(self, prefix: str = "") -> list[ObjectInfo]:
        if self._tick("list_info"):
            raise TransientStorageError("injected list_info failure")
        return await self.inner.list_info(prefix)

    async def delete(self, key: str) -> None:
        if self._tick("delete"):
            raise TransientStorageError("injected delete failure")
        await self.inner.delete(key)

    async def head(self, key: str) -> ObjectMeta:
        if self._tick("head"):
            raise TransientStorageError("injected head failure")
        return await self.inner.head(key)


def test_sweep_reaches_the_wrapped_store(tmp_path: Path) -> None:
    """A local store's temp files of killed puts are swept through the wrapper too."""
    inner = LocalStore(tmp_path)
    run(inner.put("a/k", b"v"))
    stray = tmp_path / "a" / f".k.0123{TEMP_SUFFIX}"
    stray.write_bytes(b"partial")
    store = RetryingStore(inner)
    assert run(store.sweep(older_than=time.time() + 60, dry_run=True)) == [
        f"a/.k.0123{TEMP_SUFFIX}"
    ]
    assert stray.exists()
    assert run(store.sweep(older_than=time.time() + 60)) == [f"a/.k.0123{TEMP_SUFFIX}"]
    assert not stray.exists() and run(store.list()) == ["a/k"]


class FakeTime:
    """A clock that only moves when the store sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def fake_time() -> Iterator[FakeTime]:
    yield FakeTime()


def _retrying(inner: Store, fake_time: FakeTime, **policy: object) -> RetryingStore:
    return RetryingStore(
        inner,
        policy=RetryPolicy(**policy),  # type: ignore[arg-type]
        sleep=fake_time.sleep,
        clock=fake_time.clock,
        rng=random.Random(0),
    )


@pytest.mark.parametrize("op", ["get", "put", "list", "list_info", "delete", "head"])
def test_transient_failures_are_retried(op: str, fake_time: FakeTime) -> None:
    flaky = FlakyStore(MemoryStore())
    store = _retrying(flaky, fake_time, max_attempts=4)
    run(store.put("k", b"value"))
    flaky.fail(op, 3)
    if op == "get":
        assert bytes(run(store.get("k", byte_range=ByteRange(1, 3)))) == b"alu"
    elif op == "put":
        run(store.put("k", b"other"))
        assert bytes(run(flaky.inner.get("k"))) == b"other"
    elif op == "list":
        assert run(store.list()) == ["k"]
    elif op == "list_info":
        assert [(i.key, i.size) for i in run(store.list_info())] == [("k", 5)]
    elif op == "delete":
        run(store.delete("k"))
        assert run(flaky.inner.list()) == []
    else:
        assert run(store.head("k")).size == 5
    assert flaky.calls[op] == 4 + (op == "put")  # + the setup put
    assert len(fake_time.sleeps) == 3


def test_backoff_is_bounded_exponential_full_jitter(fake_time: FakeTime) -> None:
    flaky = FlakyStore(MemoryStore())
    flaky.fail("list", 7)
    policy = dict(
        max_attempts=8, initial_backoff_s=0.5, max_backoff_s=3.0, multiplier=2.0, deadline_s=None
    )
    run(_retrying(flaky, fake_time, **policy).list())
    ceilings = [0.5, 1.0, 2.0, 3.0, 3.0, 3.0, 3.0]
    assert len(fake_time.sleeps) == len(ceilings)
    assert all(0.0 <= s <= c for s, c in zip(fake_time.sleeps, ceilings))
    assert len(set(fake_time.sleeps)) == len(ceilings)  # jittered, not constant

    no_jitter = FakeTime()
    flaky.fail("list", 7)
    run(_retrying(flaky, no_jitter, jitter=False, **policy).list())
    assert no_jitter.sleeps == ceilings


def test_exhaustion_raises_from_last_error(fake_time: FakeTime) -> None:
    flaky = FlakyStore(MemoryStore())
    flaky.fail("get", 100)
    store = _retrying(flaky, fake_time, max_attempts=3, deadline_s=None)
    with pytest.raises(RetriesExhaustedError) as info:
        run(store.get("k"))
    assert isinstance(info.value.__cause__, TransientStorageError)
    assert isinstance(info.value, StorageError)
    assert flaky.calls["get"] == 3
    assert len(fake_time.sleeps) == 2


def test_deadline_stops_retrying(fake_time: FakeTime) -> None:
    flaky = FlakyStore(MemoryStore())
    flaky.fail("get", 100)
    store = _retrying(
        flaky,
        fake_time,
        max_attempts=1000,
        initial_backoff_s=1.0,
        max_backoff_s=1.0,
        jitter=False,
        deadline_s=5.5,
    )
    with pytest.raises(RetriesExhaustedError, match="deadline"):
        run(store.get("k"))
    assert fake_time.now <= 5.5
    assert flaky.calls["get"] == 6


def test_real_sleep_is_short() -> None:
    flaky = FlakyStore(MemoryStore())
    flaky.fail("list", 2)
    store = RetryingStore(flaky, policy=RetryPolicy(initial_backoff_s=0.001, max_backoff_s=0.002))
    assert run(store.list()) == []


def test_non_transient_errors_are_not_retried(fake_time: FakeTime) -> None:
    flaky = FlakyStore(MemoryStore())
    store = _retrying(flaky, fake_time)
    with pytest.raises(NotFoundError):
        run(store.get("missing"))
    with pytest.raises(ConfigError):
        run(store.get("../escape"))
    run(store.put("k", b"1", mode="create"))
    with pytest.raises(AlreadyExistsError):
        run(store.put("k", b"1", mode="create"))  # even identical bytes: no ambiguity here
    assert flaky.calls["get"] == 2
    assert fake_time.sleeps == []


def test_create_after_ambiguous_success_is_success(fake_time: FakeTime) -> None:
    flaky = FlakyStore(MemoryStore(), land_before_failing=True)
    store = _retrying(flaky, fake_time)
    flaky.fail("put", 1)
    run(store.put("manifest", [b"commit ", b"step 7"], mode="create"))
    assert bytes(run(flaky.inner.get("manifest"))) == b"commit step 7"
    assert flaky.calls["put"] == 2


def test_create_after_ambiguous_failure_but_someone_else_won(fake_time: FakeTime) -> None:
    flaky = FlakyStore(MemoryStore())  # the failed attempt did NOT land
    store = _retrying(flaky, fake_time)
    run(flaky.inner.put("manifest", b"written by another host"))
    flaky.fail("put", 1)
    with pytest.raises(AlreadyExistsError):
        run(store.put("manifest", b"ours", mode="create"))
    assert bytes(run(flaky.inner.get("manifest"))) == b"written by another host"


def test_create_conflict_same_size_different_bytes(fake_time: FakeTime) -> None:
    flaky = FlakyStore(MemoryStore())
    store = _retrying(flaky, fake_time)
    run(flaky.inner.put("m", b"abcd"))
    flaky.fail("put", 1)
    with pytest.raises(AlreadyExistsError):
        run(store.put("m", b"abce", mode="create"))


def test_create_conflict_check_retries_transient_head(fake_time: FakeTime) -> None:
    flaky = FlakyStore(MemoryStore(), land_before_failing=True)
    store = _retrying(flaky, fake_time)
    flaky.fail("put", 1)
    flaky.fail("head", 2)
    run(store.put("m", b"payload", mode="create"))
    assert flaky.calls["head"] == 3


def test_create_exhausted(fake_time: FakeTime) -> None:
    flaky = FlakyStore(MemoryStore())
    store = _retrying(flaky, fake_time, max_attempts=2)
    flaky.fail("put", 5)
    with pytest.raises(RetriesExhaustedError):
        run(store.put("m", b"payload", mode="create"))
    assert run(flaky.inner.list()) == []


def test_policy_validation() -> None:
    with pytest.raises(ConfigError):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ConfigError):
        RetryPolicy(multiplier=0.5)
    with pytest.raises(ConfigError):
        RetryPolicy(deadline_s=0)
    with pytest.raises(TypeError):
        RetryPolicy(3)  # type: ignore[misc]  # keyword-only
    p = RetryPolicy()
    with pytest.raises(AttributeError):
        p.max_attempts = 2  # type: ignore[misc]  # frozen
