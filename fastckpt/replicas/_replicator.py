"""Background pushing of a sealed RAM step to this process's ring peers (``docs/replicas.md``,
"Failure handling").

Call sequence: ``r = Replicator(tier, targets=...)`` → after each ``tier.seal(step, ...)``:
``r.submit(step)`` (returns at once; optionally with ``manifest=``) → ``r.wait()`` before
exiting → ``r.close()``. Chunks leave zero-copy from the tier's mmap; each target gets only
the chunks it does not list. A failing target stops receiving this step (recorded in the
report) without affecting the others; a newer step's submit cancels older pushes. Nothing
raises into the training loop unless ``wait(raise_on_error=True)`` asks for it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from fastckpt.errors import ConfigError, ReplicationError, ReplicationTimeoutError
from fastckpt.replicas._client import PeerClient
from fastckpt.replicas._ram import RamTier
from fastckpt.replicas._wire import MAX_BATCH_CHUNKS

_log = logging.getLogger(__name__)

__all__ = [
    "PushHandles",
    "ReplicationHandle",
    "ReplicationReport",
    "Replicator",
    "ReplicatorOptions",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicatorOptions:
    """How hard the replicator pushes."""

    max_inflight_bytes: int = 256 << 20
    """Bytes being sent at once, over all targets (a chunk larger than this goes alone)."""
    concurrency: int = 2
    """Targets pushed to in parallel (threads)."""
    batch_bytes: int = 256 << 20
    """Bytes per batch (one request, one segment on the target); a larger chunk goes alone."""
    batch_chunks: int = 1024
    """At most this many chunks per batch (bounds the request header)."""
    max_reports: int = 64
    """Steps whose reports are kept for :meth:`Replicator.wait`; beyond that the oldest
    finished ones are forgotten (counted in :meth:`Replicator.stats`), running ones never."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 1:
                raise ConfigError(f"{f.name} must be >= 1")
        if self.batch_chunks > MAX_BATCH_CHUNKS:
            raise ConfigError(
                f"batch_chunks must be <= {MAX_BATCH_CHUNKS} (what a peer accepts in one request)"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicationReport:
    """Outcome of replicating one step."""

    step: int
    targets: tuple[str, ...]
    chunks_pushed: int
    """Chunk transfers completed (per target)."""
    chunks_present: int
    """Chunks a target already held (nothing sent)."""
    bytes_pushed: int
    seconds: float
    """Wall time from submit to the last push finishing."""
    errors: dict[str, str]
    """Target → the error that stopped pushes to it."""
    superseded: bool
    """A newer step was submitted before this one finished; the rest was skipped."""

    @property
    def ok(self) -> bool:
        """Every chunk (and the manifest, if any) reached every target."""
        return not self.errors and not self.superseded


class ReplicationHandle:
    """Tracks one :meth:`Replicator.submit`."""

    def __init__(
        self, step: int, chunk_ids: list[str], manifest: bytes | None, targets: tuple[str, ...]
    ) -> None:
        self.step = step
        self._chunk_ids = chunk_ids
        self._manifest = manifest
        self._targets = targets
        self._lock = threading.Lock()
        self._pending = len(targets)
        self._done = threading.Event()
        self._cancelled = False
        self._started = time.perf_counter()
        self._finished = self._started
        self._pushed = self._present = self._bytes = 0
        self._errors: dict[str, str] = {}
        if not targets:
            self._done.set()

    def done(self) -> bool:
        """Whether every target has been dealt with."""
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> ReplicationReport | None:
        """Block until done; the report, or None if ``timeout_s`` passed first."""
        return self.report() if self._done.wait(timeout_s) else None

    def report(self) -> ReplicationReport:
        """The report so far (final once :meth:`done`)."""
        with self._lock:
            end = self._finished if self._done.is_set() else time.perf_counter()
            return ReplicationReport(
                step=self.step,
                targets=self._targets,
                chunks_pushed=self._pushed,
                chunks_present=self._present,
                bytes_pushed=self._bytes,
                seconds=end - self._started,
                errors=dict(self._errors),
                superseded=self._cancelled,
            )

    def _run(self, target: str, what: str, push: Callable[[], None]) -> bool:
        """Run ``push``, one target's share of this step, and record it done; a failure is
        logged and recorded, never raised. True if it failed."""
        error: str | None = None
        try:
            push()
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            _log.warning(
                "fastckpt: %s of RAM step %d to %s failed: %s", what, self.step, target, error
            )
        finally:
            self._target_done(target, error)
        return error is not None

    def _record(self, *, pushed: int = 0, present: int = 0, nbytes: int = 0) -> None:
        with self._lock:
            self._pushed += pushed
            self._present += present
            self._bytes += nbytes

    def _target_done(self, target: str, error: str | None) -> None:
        with self._lock:
            if error is not None:
                self._errors[target] = error
            self._pending -= 1
            if self._pending == 0:
                self._finished = time.perf_counter()
                self._chunk_ids, self._manifest = [], None  # no worker reads them any more
                self._done.set()


class PushHandles:
    """The handles of submitted pushes, oldest first (the base of :class:`Replicator` and the
    parity pusher): a newer step cancels older ones still running (superseded, logged); of the
    finished ones only the newest ``max_reports`` are kept until :meth:`wait` takes them.
    Thread-safe."""

    def __init__(self, what: str, *, max_reports: int) -> None:
        self._what, self._max_reports = what, max_reports
        self._lock = threading.Lock()
        self._handles: collections.deque[ReplicationHandle] = collections.deque()
        self.forgotten = 0
        """Finished handles dropped unread."""

    def add(self, handle: ReplicationHandle) -> None:
        with self._lock:
            for old in self._handles:
                if old.step < handle.step and not old.done():
                    old._cancelled = True
                    _log.warning(
                        "fastckpt: %s of RAM step %d superseded by step %d before it finished; "
                        "until %d is pushed, losing a host may leave no complete RAM step "
                        "(pushes take longer than the RAM checkpoint interval)",
                        self._what,
                        old.step,
                        handle.step,
                        handle.step,
                    )
            self._handles.append(handle)
            excess = max(0, len(self._handles) - self._max_reports)
            forget = {id(h) for h in [h for h in self._handles if h.done()][:excess]}  # oldest
            self.forgotten += len(forget)
            self._handles = collections.deque(h for h in self._handles if id(h) not in forget)

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until every push added so far finished (done, failed or cancelled), keeping
        the reports; False on timeout."""
        return self._wait(timeout_s)[1] is None

    def wait(self, timeout_s: float | None = None) -> list[ReplicationReport]:
        """Wait for every push added so far; return (and forget) their reports, oldest first.

        Raises:
            ReplicationTimeoutError: a push still running after ``timeout_s``.
        """
        handles, running = self._wait(timeout_s)
        if running is not None:
            raise ReplicationTimeoutError(
                f"{self._what} of step {running.step} still running after {timeout_s}s"
            )
        with self._lock:  # an add meanwhile may have forgotten some of them already
            taken = {id(h) for h in handles}
            self._handles = collections.deque(h for h in self._handles if id(h) not in taken)
        return [h.report() for h in handles]

    def _wait(
        self, timeout_s: float | None
    ) -> tuple[list[ReplicationHandle], ReplicationHandle | None]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            handles = list(self._handles)
        for h in handles:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not h._done.wait(left):  # no report built per handle: a save calls this every time
                return handles, h
        return handles, None


class Replicator(PushHandles):
    """Pushes sealed steps of a :class:`RamTier` to peers on background threads (their handles:
    the base class).

    Args:
        tier: This process's tier (chunks are read zero-copy from it).
        targets: Member id → pusher (e.g. ``PeerClient``); usually this member's ring successors
            (:func:`~fastckpt.replicas._placement.ring_successors`). Replace with
            :meth:`set_targets`.
        options: Concurrency and in-flight bound.
    """

    def __init__(
        self,
        tier: RamTier,
        *,
        targets: Mapping[str, PeerClient] | None = None,
        options: ReplicatorOptions | None = None,
    ) -> None:
        self._tier = tier
        self.options = options or ReplicatorOptions()
        self._targets: dict[str, PeerClient] = dict(targets or {})
        self._pool = ThreadPoolExecutor(
            self.options.concurrency, thread_name_prefix="fastckpt-replicator"
        )
        super().__init__("push", max_reports=self.options.max_reports)
        self._state_lock = threading.Lock()  # targets, totals, closed (the base's: handles)
        self._budget = threading.Condition()
        self._inflight = 0
        self._closed = False
        self._totals = dict.fromkeys(("steps", "chunks_pushed", "bytes_pushed", "failures"), 0)

    def set_targets(self, targets: Mapping[str, PeerClient]) -> None:
        """Targets for later submits (e.g. after a membership change)."""
        with self._state_lock:
            self._targets = dict(targets)

    def submit(
        self, step: int, *, chunk_ids: Sequence[str] | None = None, manifest: bytes | None = None
    ) -> ReplicationHandle:
        """Queue pushing ``step``'s chunks (all of them by default), then ``manifest``, to every
        target. Never blocks on I/O. Older steps still being pushed are cancelled."""
        with self._state_lock:
            if self._closed:
                raise ConfigError("Replicator is closed")
            ids = list(chunk_ids) if chunk_ids is not None else self._tier.chunk_ids(step)
            targets = dict(self._targets)
            handle = ReplicationHandle(step, ids, manifest, tuple(sorted(targets)))
            self.add(handle)
            self._totals["steps"] += 1
            for name in handle._targets:
                self._pool.submit(self._push, handle, name, targets[name])
        return handle

    def wait(
        self, timeout_s: float | None = None, *, raise_on_error: bool = False
    ) -> list[ReplicationReport]:
        """Wait for every submitted step; return (and forget) their reports, oldest first
        (of finished steps only the newest ``options.max_reports`` are kept).

        Raises:
            ReplicationTimeoutError: pushes still running after ``timeout_s``.
            ReplicationError: ``raise_on_error`` and a report has errors.
        """
        reports = super().wait(timeout_s)
        failed = [r for r in reports if r.errors]
        if raise_on_error and failed:
            detail = "; ".join(f"step {r.step}: {r.errors}" for r in failed)
            raise ReplicationError(f"replication failed: {detail}", reports)
        return reports

    def stats(self) -> dict[str, int]:
        """Totals since creation: steps submitted, chunks and bytes pushed, failed (step,
        target) pairs, reports forgotten unread (``ReplicatorOptions.max_reports``)."""
        with self._state_lock:
            return {**self._totals, "reports_forgotten": self.forgotten}

    def close(self) -> None:
        """Stop the workers after finishing queued work. Idempotent."""
        with self._state_lock:
            self._closed = True
        self._pool.shutdown(wait=True)

    def _push(self, handle: ReplicationHandle, name: str, target: PeerClient) -> None:
        failed = handle._run(name, "push", functools.partial(self._push_all, handle, target))
        with self._state_lock:
            self._totals["failures"] += failed

    def _push_all(self, handle: ReplicationHandle, target: PeerClient) -> None:
        step = handle.step
        present: set[str] = set()
        if handle._chunk_ids:
            present = set(target.list_chunks(step))  # e.g. a re-submit: skip what arrived already
        batch: list[tuple[str, memoryview, int]] = []
        batch_bytes = 0
        for cid in handle._chunk_ids:
            if handle._cancelled:
                return
            if cid in present:
                handle._record(present=1)
                continue
            hit = self._tier.read_chunk(step, cid)
            if hit is None:
                raise ConfigError(
                    f"chunk {cid!r} of step {step} is not (or no longer) in the RAM tier"
                )
            view, loc = hit
            o = self.options
            if batch and (
                batch_bytes + view.nbytes > o.batch_bytes or len(batch) >= o.batch_chunks
            ):
                self._send(handle, step, batch, target)
                batch, batch_bytes = [], 0
            batch.append((cid, view, loc.raw_crc32c))
            batch_bytes += view.nbytes
        if batch and not handle._cancelled:
            self._send(handle, step, batch, target)
        if handle._manifest is not None and not handle._cancelled:
            target.put_manifest(step, handle._manifest)

    def _send(
        self,
        handle: ReplicationHandle,
        step: int,
        batch: list[tuple[str, memoryview, int]],
        target: PeerClient,
    ) -> None:
        """Push one batch under the in-flight budget and record it."""
        n = sum(v.nbytes for _, v, _ in batch)
        with self._budget:
            while self._inflight and self._inflight + n > self.options.max_inflight_bytes:
                self._budget.wait()
            self._inflight += n
        try:
            target.push_chunks(step, batch)
        finally:
            with self._budget:
                self._inflight -= n
                self._budget.notify_all()
        handle._record(pushed=len(batch), nbytes=n)
        with self._state_lock:
            self._totals["chunks_pushed"] += len(batch)
            self._totals["bytes_pushed"] += n
