"""Parity's tier side and pushes (``RamOptions(redundancy="parity")``; layout:
``_parity_layout``; protocol: ``docs/replicas.md``, "Parity").

:class:`ParityStore` XORs verified windows into an open segment of the tier (under its
budget) and seals it once every other member of the group contributed its whole part: a
sealed parity is complete, survives a process restart and is dropped with its step; a window
applied twice (a retried push) is applied once; an open parity is discarded when a newer
step's opens or its step is saved again. :class:`ParityService` answers PUT_PARITY,
GET_STREAM and REBUILD (a restoring host receives only the rebuilt bytes).
:class:`ParityPusher` sends this member's parts after a commit, zero-copy from the tier, as
:class:`~fastckpt.replicas._replicator.Replicator` pushes (a failing target is recorded in
the report, never raised; a newer submit cancels older ones).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from fastckpt._checksum import crc32c
from fastckpt.errors import ConfigError, PeerError, StaleStepError
from fastckpt.replicas._channel import Channel, refusal_code, refuse
from fastckpt.replicas._parity_client import ParityClient
from fastckpt.replicas._parity_layout import (
    PARITY_PREFIX,
    ParityRecord,
    find_parity,
    others,
    parity_chunk_id,
    part_index,
    part_size,
    part_span,
    xor_into,
)
from fastckpt.replicas._ram import ChunkLocation, RamTier, Segment
from fastckpt.replicas._replicator import PushHandles, ReplicationHandle
from fastckpt.replicas._wire import MsgType

__all__ = ["ParityPusher", "ParityService", "ParityStore", "decode_group"]


@dataclasses.dataclass
class _Building:
    group: tuple[str, ...]
    seg: Segment
    size: int
    got: dict[str, int] = dataclasses.field(default_factory=dict)
    windows: dict[str, set[int]] = dataclasses.field(default_factory=dict)
    done: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    layout: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)


def decode_group(text: str) -> tuple[str, ...]:
    """A PUT_PARITY's ``group`` field: a JSON array of distinct non-empty member ids."""
    try:
        group = json.loads(text)
    except ValueError:
        group = None
    if (
        not isinstance(group, list)
        or len(group) < 2
        or not all(isinstance(m, str) and m for m in group)
        or len(set(group)) != len(group)
    ):
        raise ConfigError(f"bad parity group {text[:200]!r}")
    return tuple(group)


class ParityStore:
    """The parities ``member`` holds in ``tier`` (sealed) and builds (open). Thread-safe."""

    def __init__(self, tier: RamTier, member: str) -> None:
        self.tier = tier
        self.member = member
        self._lock = threading.Lock()
        self._open: dict[int, _Building] = {}
        # step -> its sealed parity's record and chunk id, as sealed here or found in the
        # tier (one scan of the step's ids, not one per window or REBUILD)
        self._known: dict[int, tuple[ParityRecord, str]] = {}

    def add(
        self,
        step: int,
        group: tuple[str, ...],
        contributor: str,
        stream_len: int,
        size: int,
        offset: int,
        data: np.ndarray,
    ) -> bool:
        """XOR a verified window of ``contributor``'s part (``offset`` within the part) into
        the parity of ``step``; seals the parity once complete. False: a window applied
        already (or a parity sealed already), nothing changed.

        Raises:
            ConfigError: the window does not fit the group's layout.
            StaleStepError, RamBudgetError: as :meth:`RamTier.allocate`.
        """
        me = self.member
        if me not in group or contributor not in group or contributor == me:
            raise ConfigError(f"{contributor!r} -> {me!r} is not a parity push of group {group}")
        if size != part_size(stream_len, len(group)):
            raise ConfigError(f"part size {size} does not fit a {stream_len}-byte stream")
        start, stop = part_span(stream_len, size, part_index(group, contributor, me))
        if offset + data.nbytes > stop - start:
            raise ConfigError(f"window {offset}+{data.nbytes} outside a {stop - start}-byte part")
        with self._lock:
            if step not in self._open and self.record(step) is not None:
                return False  # (a step being built is not sealed: sealing closes it)
            b = self._building(step, group, size)
            if b.layout.setdefault(contributor, (stream_len, size)) != (stream_len, size):
                raise ConfigError(f"{contributor!r} pushed two layouts of step {step}")
            seen = b.windows.setdefault(contributor, set())
            if offset in seen or contributor in b.done:
                return False
            xor_into(b.seg.buffer[offset:], data)
            seen.add(offset)
            b.got[contributor] = b.got.get(contributor, 0) + data.nbytes
            if b.got[contributor] == stop - start:
                b.done[contributor] = (stream_len, size)
            if set(b.done) == set(others(group, me)):
                self._seal(step, b)
        return True

    def _building(self, step: int, group: tuple[str, ...], size: int) -> _Building:
        """The open parity of ``step`` (hold ``_lock``), big enough for a ``size``-byte part."""
        for old in [s for s in self._open if s < step]:  # superseded pushes
            self.tier.discard(self._open.pop(old).seg)
        b = self._open.get(step)
        if b is not None and b.group != group:
            raise ConfigError(f"step {step}: parity pushed for groups {b.group} and {group}")
        if b is None or size > b.size:
            seg = self.tier.allocate(step, max(size, 1))
            seg.buffer[:] = 0  # (a recycled file holds old bytes)
            if b is None:
                b = self._open[step] = _Building(group, seg, size)
            else:
                seg.buffer[: b.size] = b.seg.buffer[: b.size]
                self.tier.discard(b.seg)
                b.seg, b.size = seg, size
        return b

    def _seal(self, step: int, b: _Building) -> None:
        del self._open[step]
        record = ParityRecord(b.group, self.member, dict(b.done))
        crc = crc32c(b.seg.buffer[: b.size])
        cid = parity_chunk_id(record)
        try:
            self.tier.seal(step, b.seg, {cid: ChunkLocation(0, b.size, crc)})
        except BaseException:
            self.tier.discard(b.seg)
            raise
        self._known[step] = (record, cid)

    def record(self, step: int) -> ParityRecord | None:
        """The sealed (complete) parity of ``step`` this member holds, or None."""
        hit = self.parity(step)
        return None if hit is None else hit[0]

    def parity(self, step: int) -> tuple[ParityRecord, memoryview] | None:
        """The sealed parity of ``step`` and a view of its bytes, or None."""
        known = self._known.get(step)
        if known is not None:
            view = self.tier.get_chunk(step, known[1])
            if view is not None:
                return known[0], view
            self._known.pop(step, None)  # dropped with its step
        found = find_parity(self.tier.chunk_ids(step), self.member)  # sealed by an earlier process
        view = None if found is None else self.tier.get_chunk(step, found[1])
        if found is None or view is None:
            return None
        self._known[step] = found
        return found[0], view

    def discard_from(self, step: int) -> None:
        """Discard the open parities of steps ``>= step`` (an abandoned timeline: the step is
        saved again, its pushes start over; 0: all of them, on close)."""
        with self._lock:
            for s in [s for s in self._open if s >= step]:
                self.tier.discard(self._open.pop(s).seg)


class ParityService:
    """The parity requests of a :class:`PeerServer` (its ``extension``).

    Args:
        store: This member's parities.
        peers: The other members' clients by member id (for REBUILD's GET_STREAMs).
    """

    types = frozenset({MsgType.PUT_PARITY, MsgType.GET_STREAM, MsgType.REBUILD})

    def __init__(self, store: ParityStore, peers: Callable[[], Mapping[str, ParityClient]]) -> None:
        self.store = store
        self._peers = peers
        self.stats = {"rebuilt_bytes": 0, "stream_bytes": 0, "parity_bytes": 0}
        self._lock = threading.Lock()

    def _count(self, key: str, n: int) -> None:
        with self._lock:
            self.stats[key] += n

    def handle(self, chan: Channel, mtype: MsgType, h: dict[str, Any], plen: int) -> bool:
        """Serve one request of :attr:`types` (its header read); True: the connection goes on."""
        if mtype is MsgType.PUT_PARITY:
            return self._put(chan, h, plen)
        if mtype is MsgType.GET_STREAM:
            step, anchor = h["step"], h["anchor"]  # the own stream: the segment holding ``anchor``
            own = not anchor.startswith(PARITY_PREFIX)
            view = self.store.tier.segment_of(step, anchor) if own else None
            if view is None or h["stream_len"] > view.nbytes:
                return refuse(chan, "not_found", f"no stream of step {h['step']} here")
            a = min(h["offset"], h["stream_len"])
            b = min(h["offset"] + h["length"], h["stream_len"])
            self._count("stream_bytes", b - a)
            chan.send(MsgType.STREAM, {}, [view[a:b]])
            return True
        return self._rebuild(chan, h)

    def _put(self, chan: Channel, h: dict[str, Any], plen: int) -> bool:
        buf = np.empty(plen, np.uint8)
        chan.recv_into(buf.data)
        chan.end_payload()  # authentic before it is applied
        try:
            group, step = decode_group(h["group"]), h["step"]
            stored = self.store.add(
                step, group, h["contributor"], h["stream_len"], h["part_size"], h["offset"], buf
            )
        except (StaleStepError, ConfigError) as e:  # (RamBudgetError is a ConfigError)
            return refuse(chan, refusal_code(e), str(e))
        self._count("parity_bytes", plen)
        chan.send(MsgType.OK, {"stored": stored})
        return True

    def _rebuild(self, chan: Channel, h: dict[str, Any]) -> bool:
        step, lost, u, n = h["step"], h["lost"], h["offset"], h["length"]
        hit = self.store.parity(step)
        if hit is None:
            return refuse(chan, "not_found", f"no complete parity of step {step} here")
        rec, pview = hit
        me = self.store.member
        covered = (h["stream_len"], part_size(h["stream_len"], len(rec.group)))
        if rec.contributors.get(lost) != covered:
            return refuse(chan, "not_found", f"the parity of step {step} does not cover {lost!r}")
        size = rec.contributors[lost][1]
        if u + n > size:
            return refuse(chan, "bad_request", f"range {u}+{n} outside a {size}-byte part")
        try:
            anchors = json.loads(h["anchors"])
            if not isinstance(anchors, dict):
                raise ValueError("not an object")
        except ValueError as e:
            return refuse(chan, "bad_request", f"bad anchors: {e}")
        out = np.zeros(n, np.uint8)
        xor_into(out, pview[u : min(u + n, pview.nbytes)])
        jobs = []
        for x in others(rec.group, me):
            if x == lost:
                continue
            stream_len, xs = rec.contributors[x]
            a, b = part_span(stream_len, xs, part_index(rec.group, x, me))
            lo, hi = min(a + u, b), min(a + u + n, b)
            if hi > lo:
                jobs.append((x, lo, hi - lo, stream_len))
        peers = self._peers()
        missing = [x for x, *_ in jobs if x not in peers or not isinstance(anchors.get(x), str)]
        if missing:
            return refuse(chan, "not_found", f"survivors {missing} not reachable or not named")

        def read(job: tuple[str, int, int, int]) -> np.ndarray | None:
            x, lo, count, stream_len = job
            buf = np.empty(count, np.uint8)
            try:
                ok = peers[x].get_stream(step, anchors[x], lo, stream_len, into=buf)
            except PeerError:
                return None
            return buf if ok else None

        with ThreadPoolExecutor(max(1, len(jobs)), thread_name_prefix="fastckpt-rebuild") as ex:
            parts = list(ex.map(read, jobs))
        if any(p is None for p in parts):
            return refuse(chan, "not_found", f"a survivor's stream of step {step} is unreadable")
        for p in parts:
            assert p is not None
            xor_into(out, p)
        self._count("rebuilt_bytes", n)  # before the reply: a client that has it sees the count
        chan.send(MsgType.REBUILT, {}, [out.data])
        return True


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
        targets: Mapping[str, ParityClient],
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
            put = functools.partial(
                target.put_parity,
                step,
                group=list(group),
                contributor=me,
                stream_len=stream.nbytes,
                part_size=size,
            )
            push = functools.partial(self._push, handle, put, stream[a:b])
            self._pool.submit(handle._run, holder, "parity push", push)
        return handle

    def _push(self, handle: ReplicationHandle, put: Callable[..., bool], part: memoryview) -> None:
        """Send ``part`` in windows, ``put(offset=..., data=...)`` each (one, if empty)."""
        for off in range(0, part.nbytes, self.window_bytes) if part.nbytes else range(1):
            if handle._cancelled:
                return
            data = part[off : off + self.window_bytes]
            put(offset=off, data=data)
            handle._record(nbytes=data.nbytes)
        handle._record(pushed=1)

    def close(self) -> None:
        """Finish the running pushes; stop the threads."""
        self._pool.shutdown(wait=True)
