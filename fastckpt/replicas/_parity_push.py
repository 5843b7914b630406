"""Background pushing of a RAM step's parity parts to the other members of this member's group
(``RamOptions(redundancy="parity")``; layout in :mod:`~fastckpt.replicas._parity_layout`).

Call sequence: after the step is committed, ``submit(...)`` (returns at once) →
``wait_idle()`` before staging the next RAM step → ``wait()`` for the reports → ``close()``.
Part ``k`` of the stream goes to the ``k``-th other member in windows, zero-copy from the
tier's mapping; a failing target is recorded in the report (never raised); a newer submit
cancels older pushes still running.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from fastckpt.replicas._parity_layout import others, part_size, part_span
from fastckpt.replicas._replicator import PushHandles, ReplicationHandle

__all__ = ["ParityPusher", "ParityTarget"]


class ParityTarget(Protocol):
    """What the pusher needs of a group member (``ParityClient`` is one)."""

    def put_parity(
        self,
        step: int,
        *,
        group: Sequence[str],
        contributor: str,
        stream_len: int,
        part_size: int,
        offset: int,
        data: memoryview,
    ) -> bool: ...


class ParityPusher(PushHandles):
    """Pushes this member's parity parts on background threads (their handles: the base class).

    Args:
        window_bytes: Bytes per PUT_PARITY request (the receiver buffers one window to
            verify it before it is applied).
    """

    def __init__(self, *, window_bytes: int = 16 << 20) -> None:
        super().__init__("parity push", max_reports=64)
        self.window_bytes = window_bytes
        self._pool = ThreadPoolExecutor(8, thread_name_prefix="fastckpt-parity")

    def submit(
        self,
        step: int,
        *,
        stream: memoryview,
        group: Sequence[str],
        me: str,
        targets: Mapping[str, ParityTarget],
    ) -> ReplicationHandle:
        """Queue pushing ``stream`` (this member's bytes ``[0, L)`` of ``step``) as parts to
        the other members of ``group``. Never blocks on I/O."""
        holders = others(group, me)
        handle = ReplicationHandle(step, [], None, tuple(holders))
        self.add(handle)
        size = part_size(stream.nbytes, len(group))
        for k, holder in enumerate(holders):
            a, b = part_span(stream.nbytes, size, k)
            target = targets.get(holder)
            if target is None:
                handle._target_done(holder, "not reachable (not in the peer directory)")
                continue
            push = functools.partial(
                self._push, handle, target, list(group), me, stream, size, a, b
            )
            self._pool.submit(handle._run, holder, "parity push", push)
        return handle

    def _push(
        self,
        handle: ReplicationHandle,
        target: ParityTarget,
        group: list[str],
        me: str,
        stream: memoryview,
        size: int,
        a: int,
        b: int,
    ) -> None:
        for off in range(0, b - a, self.window_bytes) if b > a else range(1):
            if handle._cancelled:
                return
            data = stream[a + off : min(a + off + self.window_bytes, b)]
            target.put_parity(
                handle.step,
                group=group,
                contributor=me,
                stream_len=stream.nbytes,
                part_size=size,
                offset=off,
                data=data,
            )
            handle._record(nbytes=data.nbytes)
        handle._record(pushed=1)

    def close(self, *, wait: bool = True) -> None:
        """Finish (``wait``) or cancel the running pushes; stop the threads."""
        if not wait:
            self.cancel_all()
        self._pool.shutdown(wait=wait)
