"""A job whose processes are threads: a :class:`~fastckpt.coordination.distributed.Coordinator` per
thread over one shared key-value dict, for tests of the coordination protocols (commit,
RAM-manifest exchange, step selection) without launching processes."""

from __future__ import annotations

import threading

from fastckpt.coordination.distributed import Coordinator
from fastckpt.errors import BarrierTimeoutError

__all__ = ["ThreadedJob"]


class ThreadedJob(Coordinator):
    """Process ``index`` of ``count``; every instance given the same ``kv`` and ``cond`` is
    the same job. Keys are written once, as in ``jax.distributed``'s store."""

    def __init__(
        self, kv: dict[str, str], cond: threading.Condition, index: int, count: int
    ) -> None:
        self._kv, self._cond = kv, cond
        self.process_index, self.process_count = index, count

    @classmethod
    def of(cls, count: int) -> list[ThreadedJob]:
        """The coordinators of a new job of ``count`` processes."""
        kv: dict[str, str] = {}
        cond = threading.Condition()
        return [cls(kv, cond, i, count) for i in range(count)]

    def set(self, key: str, value: str, *, timeout_s: float | None = None) -> None:
        with self._cond:
            self._kv[key] = value
            self._cond.notify_all()

    def get(self, key: str, *, timeout_s: float) -> str:
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._kv, timeout_s):
                raise BarrierTimeoutError(f"timed out after {timeout_s:.1f}s waiting for {key!r}")
            return self._kv[key]

    def keys(self) -> list[str]:
        """Every key set so far (for assertions about the protocol's rounds)."""
        with self._cond:
            return list(self._kv)
