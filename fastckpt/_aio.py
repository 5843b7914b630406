"""The one background event loop fastckpt runs its async I/O on, and the sync bridge.

A :class:`LoopThread` owns an asyncio loop on a daemon thread. ``run(coro)`` blocks the
caller until the coroutine finishes; ``submit(coro)`` returns a ``concurrent.futures.Future``.

Ownership: each manager owns one loop thread, uses its store from it only, and passes its
``run`` to whatever drives that store from sync code. One-shot callers (the CLI,
``maintenance.collect_garbage``) use ``asyncio.run`` and close their store in it. Nothing
makes a loop at import.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["BlockingPool", "ByteBudget", "LoopThread"]

T = TypeVar("T")


class LoopThread:
    """An asyncio event loop running on its own daemon thread."""

    def __init__(self, name: str = "fastckpt-io") -> None:
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._ready.set)
        self._loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Schedule ``coro`` on the loop; return a thread-safe future."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("LoopThread.submit called from its own loop thread")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and block until it returns (or raises)."""
        return self.submit(coro).result()

    def close(self) -> None:
        """Stop the loop and join the thread. Idempotent."""
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()


class ByteBudget:
    """An async semaphore counted in bytes. A request larger than the capacity waits for
    the budget to be completely free, then proceeds alone. ``acquire`` returns the amount
    charged (pass it to ``release``); ``waiting`` counts acquirers blocked right now."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.waiting = 0
        self._cond = asyncio.Condition()

    async def acquire(self, n: int) -> int:
        n = min(n, self.capacity)
        async with self._cond:
            self.waiting += 1
            try:
                await self._cond.wait_for(lambda: self.used + n <= self.capacity)
            finally:
                self.waiting -= 1
            self.used += n
        return n

    async def release(self, n: int) -> None:
        async with self._cond:
            self.used -= n
            self._cond.notify_all()


class BlockingPool:
    """Threads for blocking calls made from async code, started on first use; ``close`` waits
    for the calls in flight, and a later call starts a fresh pool."""

    def __init__(self, max_workers: int, name: str) -> None:
        self._max_workers = max_workers
        self._name = name
        self._lock = threading.Lock()  # guards _executor; never held across I/O
        self._executor: ThreadPoolExecutor | None = None

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on a pool thread."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    self._max_workers, thread_name_prefix=self._name
                )
            executor = self._executor
        return await asyncio.get_running_loop().run_in_executor(
            executor, functools.partial(fn, *args)
        )

    def close(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
