"""Rebuilding a lost member's chunks of a RAM step from its group's parity (the restore side of
``RamOptions(redundancy="parity")``; ``docs/replicas.md``, "Parity"). A rebuilt chunk is
checked against the manifest's raw crc32c and never returned otherwise
(``ChecksumMismatchError``).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from fastckpt._checksum import crc32c
from fastckpt.errors import ChecksumMismatchError, PeerError
from fastckpt.format.manifest import Manifest
from fastckpt.replicas._parity_client import ParityClient
from fastckpt.replicas._parity_layout import (
    ChunkPlace,
    ParityRecord,
    chunk_places,
    find_parity,
    group_of,
    others,
    parity_groups,
    part_size,
    rebuild_pieces,
)
from fastckpt.replicas._placement import host_domain

__all__ = ["ParityRebuilder", "ParityRebuilds"]

_WINDOW = 32 << 20  # largest range one REBUILD asks for


@dataclasses.dataclass(frozen=True)
class _Plan:
    group: tuple[str, ...]
    stream_len: int
    anchors: dict[str, str]


class ParityRebuilder:
    """Rebuilds chunks of RAM step ``step`` whose writer is lost. Thread-safe.

    Args:
        step: The RAM step.
        places: Where its chunks lie (``chunk_places`` of its manifest).
        peers: Clients by member id, this member's own server included (it may hold a parity).
        group_size: ``RamOptions.group_size`` (a hint: the groups are read from the records).
        known: Chunk lists already fetched, by ``(step, member)``.
    """

    def __init__(
        self,
        step: int,
        places: Mapping[str, ChunkPlace],
        peers: Mapping[str, ParityClient],
        *,
        group_size: int,
        known: Mapping[tuple[int, str], frozenset[str]] | None = None,
    ) -> None:
        self.step = step
        self._peers = dict(peers)
        self._places = dict(places)
        self._lengths: dict[str, int] = {}
        self._anchors: dict[str, str] = {}
        for cid, p in self._places.items():
            self._lengths[p.writer] = max(self._lengths.get(p.writer, 0), p.offset + p.nbytes)
            self._anchors.setdefault(p.writer, cid)
        self._hints = parity_groups(self._lengths, group_size, domain_of=host_domain)
        self._listings = {m: ids for (s, m), ids in (known or {}).items() if s == step}
        self._plans: dict[str, _Plan | None] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(8, thread_name_prefix="fastckpt-rebuild")

    def close(self) -> None:
        """Stop the request threads."""
        self._pool.shutdown(wait=True)

    def _listing(self, member: str) -> frozenset[str] | None:
        with self._lock:
            ids = self._listings.get(member)
        if ids is None:
            peer = self._peers.get(member)
            if peer is None:
                return None
            try:
                ids = frozenset(peer.list_chunks(self.step))
            except PeerError:
                return None
            with self._lock:
                self._listings[member] = ids
        return ids

    def _record(self, member: str) -> ParityRecord | None:
        found = find_parity(self._listing(member) or (), member)
        return None if found is None else found[0]

    def plan(self, writer: str) -> _Plan | None:
        """How ``writer``'s chunks are rebuilt (cached); None when its group cannot: another
        member lacks a complete parity covering it with the manifest's stream length, or a
        survivor with a non-empty stream no longer lists its own data (its anchor chunk)."""
        with self._lock:
            if writer in self._plans:
                return self._plans[writer]
        plan = self._plan(writer)
        with self._lock:
            self._plans[writer] = plan
        return plan

    def _plan(self, writer: str) -> _Plan | None:
        if writer not in self._lengths:
            return None
        hint = group_of(writer, self._hints) if any(writer in g for g in self._hints) else []
        order = [m for m in hint if m != writer] + [m for m in self._peers if m not in hint]
        records = (self._record(m) for m in order)  # the first that names the writer's group
        group = next((r.group for r in records if r is not None and writer in r.group), None)
        if group is None:
            return None
        length = self._lengths[writer]
        anchors: dict[str, str] = {}
        for j in others(group, writer):
            rec = self._record(j)
            if (
                rec is None
                or rec.group != group
                or not rec.complete()
                or rec.contributors.get(writer) != (length, part_size(length, len(group)))
            ):
                return None
            for x in others(group, j):
                if x == writer or rec.contributors[x][0] == 0:
                    continue
                anchor = self._anchors.get(x)
                if anchor is None or anchor not in (self._listing(x) or ()):
                    return None
                anchors[x] = anchor
        return _Plan(group, length, anchors)

    def covers(self, chunk_ids: set[str]) -> bool:
        """Whether every chunk in ``chunk_ids`` is rebuildable (as far as the records tell)."""
        places = [self._places.get(cid) for cid in chunk_ids]
        writers = {p.writer for p in places if p is not None}
        return None not in places and all(self.plan(w) is not None for w in writers)

    def holder(self, chunk_id: str) -> str | None:
        """The parity holder asked for the start of ``chunk_id`` (None: not rebuildable)."""
        place = self._places.get(chunk_id)
        plan = None if place is None else self.plan(place.writer)
        if place is None or plan is None or place.nbytes == 0:
            return None
        first = rebuild_pieces(plan.group, place.writer, plan.stream_len, place.offset, 1)
        return next(first).holder

    def order(self, chunk_ids: Sequence[str]) -> list[int]:
        """The positions of ``chunk_ids`` in the order to rebuild them: taking turns between
        parity holders (so that requests in flight spread over their links)."""
        queues: dict[str | None, list[int]] = {}
        for i, cid in enumerate(chunk_ids):
            queues.setdefault(self.holder(cid), []).append(i)
        turns = itertools.zip_longest(*queues.values())
        return [i for turn in turns for i in turn if i is not None]

    def rebuild(self, chunk_id: str, raw_length: int, raw_crc32c: int, dst: np.ndarray) -> bool:
        """Fill ``dst`` with the chunk rebuilt from parity; False when it cannot be.

        Raises:
            ChecksumMismatchError: the rebuilt bytes do not match the manifest's crc32c
                (corrupt parity or survivor data); ``dst`` holds garbage.
            PeerError: a holder failed mid-request.
        """
        place = self._places.get(chunk_id)
        if place is None or place.nbytes != raw_length or place.raw_crc32c != raw_crc32c:
            return False
        plan = self.plan(place.writer)
        if plan is None:
            return False
        jobs = []
        for piece in rebuild_pieces(
            plan.group, place.writer, plan.stream_len, place.offset, place.nbytes
        ):
            for w in range(0, piece.n, _WINDOW):
                n = min(_WINDOW, piece.n - w)
                jobs.append((piece.holder, piece.u + w, dst[piece.at + w : piece.at + w + n]))

        def ask(job: tuple[str, int, np.ndarray]) -> bool:
            holder, u, into = job
            return self._peers[holder].rebuild(
                self.step,
                lost=place.writer,
                stream_len=plan.stream_len,
                offset=u,
                anchors=plan.anchors,
                into=into,
            )

        if not all(self._pool.map(ask, jobs)):
            return False
        if crc32c(dst) != raw_crc32c:
            raise ChecksumMismatchError(
                f"chunk {chunk_id!r} of step {self.step} rebuilt from parity does not match its "
                "crc32c (corrupt parity or survivor data)"
            )
        return True


class ParityRebuilds:
    """A :class:`ParityRebuilder` per RAM step, made on first use (:meth:`for_step` is the
    restore side's ``TieredChunkSource(rebuild=...)``, which may fall back to older steps).
    Thread-safe.

    Args:
        manifest_of: A RAM step's manifest (None: unknown).
        peers: Clients by member id, this member's own server included.
        group_size: ``RamOptions.group_size``.
    """

    def __init__(
        self,
        manifest_of: Callable[[int], Manifest | None],
        peers: Callable[[], Mapping[str, ParityClient]],
        *,
        group_size: int,
    ) -> None:
        self._manifest_of = manifest_of
        self._peers = peers
        self._group_size = group_size
        self._steps: dict[int, ParityRebuilder | None] = {}
        self._lock = threading.Lock()

    def for_step(
        self,
        step: int,
        manifest: Manifest | None = None,
        known: Mapping[tuple[int, str], frozenset[str]] | None = None,
    ) -> ParityRebuilder | None:
        """The rebuilder of ``step`` (made from ``manifest``, else ``manifest_of(step)``)."""
        with self._lock:
            if step in self._steps:
                return self._steps[step]
        m = manifest if manifest is not None else self._manifest_of(step)
        rb = (
            None
            if m is None
            else ParityRebuilder(
                step, chunk_places(m), self._peers(), group_size=self._group_size, known=known
            )
        )
        with self._lock:
            if step in self._steps:  # made meanwhile
                if rb is not None:
                    rb.close()
                return self._steps[step]
            self._steps[step] = rb
        return rb

    def reset(self) -> None:
        """Forget every step's rebuilder (a new restore: the records may have changed)."""
        with self._lock:
            old, self._steps = self._steps, {}
        for rb in old.values():
            if rb is not None:
                rb.close()
