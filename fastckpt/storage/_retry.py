"""Retries with exponential backoff and full jitter, as a wrapper around any store."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar, final

from fastckpt._checksum import crc32c_parts
from fastckpt.errors import (
    AlreadyExistsError,
    ConfigError,
    NotFoundError,
    RetriesExhaustedError,
    TransientStorageError,
)
from fastckpt.storage._protocol import (
    Buffer,
    ByteRange,
    ObjectInfo,
    ObjectMeta,
    Payload,
    PutMode,
    Store,
    payload_parts,
)

__all__ = ["RetryPolicy", "RetryingStore"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """When and how long :class:`RetryingStore` waits between attempts.

    The n-th retry (n = 1, 2, ...) waits ``min(max_backoff_s, initial_backoff_s *
    multiplier ** (n - 1))`` seconds, or a uniformly random fraction of that with
    ``jitter`` ("full jitter"). Only :class:`~fastckpt.errors.TransientStorageError` is
    retried.
    """

    max_attempts: int = 6
    """Total attempts, the first included (1 disables retries)."""
    initial_backoff_s: float = 0.1
    """Backoff ceiling before the first retry."""
    max_backoff_s: float = 10.0
    """Largest backoff ceiling."""
    multiplier: float = 2.0
    """Growth of the ceiling per retry."""
    jitter: bool = True
    """Sleep a uniform random time in ``[0, ceiling]`` instead of the ceiling."""
    deadline_s: float | None = 120.0
    """Give up rather than start a sleep that would end later than this many seconds after
    the first attempt began (None: no deadline). In-flight requests are bounded by the
    backend's own per-request timeouts, not by this."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0 or self.multiplier < 1:
            raise ConfigError("backoffs must be >= 0 and multiplier >= 1")
        if self.deadline_s is not None and self.deadline_s <= 0:
            raise ConfigError(f"deadline_s must be > 0 or None, got {self.deadline_s}")

    def backoff_ceiling(self, retry: int) -> float:
        """The backoff ceiling before retry number ``retry`` (1-based)."""
        exponent = min(retry - 1, 1023)  # (a float power of a long retry series overflows)
        try:
            return min(self.max_backoff_s, self.initial_backoff_s * self.multiplier**exponent)
        except OverflowError:
            return self.max_backoff_s


@final
class RetryingStore(Store):
    """Wrap a store so that transient failures are retried according to a policy.

    Every operation is retried on :class:`~fastckpt.errors.TransientStorageError`; any
    other error propagates at once. When attempts or the deadline run out, it raises
    :class:`~fastckpt.errors.RetriesExhaustedError` whose ``__cause__`` is the last error.

    Create-only puts: a transient error may hide a write that did land. If a later attempt
    then gets :class:`~fastckpt.errors.AlreadyExistsError`, the existing object's size and
    crc32c (``inner.head``) decide: equal, the put succeeds; else ``AlreadyExistsError``
    propagates (as it always does on the first attempt).

    Args:
        inner: The store to wrap.
        policy: Retry policy.
        sleep: Awaitable sleep (tests inject a fake).
        clock: Monotonic clock in seconds (tests inject a fake).
        rng: Random source for jitter.
    """

    def __init__(
        self,
        inner: Store,
        *,
        policy: RetryPolicy | None = None,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.inner = inner
        self.policy = policy or RetryPolicy()
        self.url = inner.url
        self._sleep = sleep
        self._clock = clock
        self._rng = rng or random.Random()

    def __repr__(self) -> str:
        return f"RetryingStore({self.inner!r}, policy={self.policy!r})"

    async def _retry(self, what: str, op: Callable[[], Awaitable[T]]) -> T:
        policy = self.policy
        started = self._clock()
        attempt = 0
        while True:
            attempt += 1
            try:
                return await op()
            except TransientStorageError as exc:
                last = exc
            if attempt >= policy.max_attempts:
                raise RetriesExhaustedError(
                    f"{what}: gave up after {attempt} attempts: {last}"
                ) from last
            ceiling = policy.backoff_ceiling(attempt)
            delay = self._rng.uniform(0.0, ceiling) if policy.jitter else ceiling
            if (
                policy.deadline_s is not None
                and self._clock() - started + delay > policy.deadline_s
            ):
                raise RetriesExhaustedError(
                    f"{what}: gave up after {attempt} attempts ({policy.deadline_s} s deadline): "
                    f"{last}"
                ) from last
            await self._sleep(delay)

    async def get(self, key: str, *, byte_range: ByteRange | None = None) -> Buffer:
        return await self._retry(
            f"get {self.url}/{key}", lambda: self.inner.get(key, byte_range=byte_range)
        )

    async def get_into(self, key: str, start: int, into: Sequence[memoryview]) -> None:
        await self._retry(f"get {self.url}/{key}", lambda: self.inner.get_into(key, start, into))

    async def put(self, key: str, data: Payload, *, mode: PutMode = "overwrite") -> None:
        parts = payload_parts(data)
        what = f"put {self.url}/{key}"
        if mode != "create":
            return await self._retry(what, lambda: self.inner.put(key, parts, mode=mode))
        ambiguous = False

        async def attempt() -> None:
            nonlocal ambiguous
            try:
                await self.inner.put(key, parts, mode="create")
            except TransientStorageError:
                ambiguous = True
                raise
            except AlreadyExistsError:
                if not ambiguous:
                    raise
                try:
                    meta = await self.inner.head(key)
                except NotFoundError:
                    raise TransientStorageError(
                        f"{what}: object vanished after a create conflict"
                    ) from None
                if meta != ObjectMeta(
                    size=sum(p.nbytes for p in parts), crc32c=crc32c_parts(parts)
                ):
                    raise
                # An earlier attempt whose response was lost did write exactly our bytes.

        await self._retry(what, attempt)

    async def sweep(self, *, older_than: float, dry_run: bool = False) -> list[str]:
        return await self._retry(
            f"sweep {self.url}", lambda: self.inner.sweep(older_than=older_than, dry_run=dry_run)
        )

    async def list_info(self, prefix: str = "") -> list[ObjectInfo]:
        return await self._retry(f"list {self.url}/{prefix}", lambda: self.inner.list_info(prefix))

    async def list(self, prefix: str = "") -> list[str]:
        return await self._retry(f"list {self.url}/{prefix}", lambda: self.inner.list(prefix))

    async def delete(self, key: str) -> None:
        await self._retry(f"delete {self.url}/{key}", lambda: self.inner.delete(key))

    async def exists(self, key: str) -> bool:
        return await self._retry(f"exists {self.url}/{key}", lambda: self.inner.exists(key))

    async def head(self, key: str) -> ObjectMeta:
        return await self._retry(f"head {self.url}/{key}", lambda: self.inner.head(key))

    async def close(self) -> None:
        await self.inner.close()
