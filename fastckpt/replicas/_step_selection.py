"""The restore side of :class:`~fastckpt.replicas._tiered.RamReplication` (internal): which
RAM step a restore uses, its manifest, and the chunk source. A chunk corrupt in every copy
still fails the step (the manager falls back on every process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import random
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from fastckpt.coordination.distributed import Coordinator, time_left
from fastckpt.errors import DistributedError, FastckptError, ManifestError, PeerError
from fastckpt.format.codec import decode_manifest
from fastckpt.format.layout import ram_writer
from fastckpt.format.manifest import Manifest, chunk_ids
from fastckpt.options import RamOptions
from fastckpt.replicas._client import PeerClient, StepLists
from fastckpt.replicas._manifest_relay import (
    ManifestSources,
    decode_candidates,
    encode_candidates,
    manifest_sources,
    wait_for_manifest,
)
from fastckpt.replicas._parity_rebuild import ParityRebuilds
from fastckpt.replicas._placement import host_domain, relay_parent, replica_holders, ring_successors
from fastckpt.replicas._ram import RamTier
from fastckpt.replicas._sources import TieredChunkSource

__all__ = ["StepChoice", "StepSelection"]

_T = TypeVar("_T")
_MAX_PEER_QUERIES = 32  # concurrent step/chunk-list queries during step selection

log = logging.getLogger("fastckpt")


@dataclasses.dataclass(frozen=True)
class StepChoice:
    """The step a restore uses, and its RAM manifest (None when storage holds the step)."""

    step: int
    manifest: Manifest | None


class StepSelection:
    """Step selection, manifest fetching and the chunk source of a restore: the base class of
    :class:`~fastckpt.replicas._tiered.RamReplication`, which owns the state below."""

    options: RamOptions
    member_id: str
    tier: RamTier
    _coord: Coordinator
    _decoded: dict[int, tuple[bytes, Manifest]]  # step -> its manifest's bytes, decoded
    _needed: tuple[Manifest, set[str]] | None  # chunk ids of a decoded manifest
    _lists: dict[tuple[int, str], frozenset[str]]  # (step, peer): its chunk ids, this restore
    _parity: ParityRebuilds | None  # with redundancy="parity": rebuilds a lost member's chunks

    def _peers(self) -> Mapping[str, PeerClient]:
        """Clients of the other members (``RamReplication._peers``)."""
        raise NotImplementedError

    def manifest(self, step: int, sources: ManifestSources | None = None) -> Manifest | None:
        """The manifest of RAM step ``step`` from the nearest copy that decodes and names that
        step (a bad copy is logged and the next one tried); None if no copy does."""
        for data in self._manifest_copies(step, sources):
            try:
                return self._decode(step, data)
            except FastckptError as e:
                log.warning(
                    "fastckpt: a copy of RAM step %d's manifest is unusable (%s); trying the next",
                    step,
                    e,
                )
        return None

    def _manifest_copies(self, step: int, sources: ManifestSources | None) -> Iterator[bytes]:
        """Copies of RAM step ``step``'s manifest, nearest first (fetched lazily): the own
        tier's; with ``sources`` the relay parent's (waited for while it fetches its own),
        then each holder's in random order; last any other peer that says it holds one."""
        data = self.tier.get_manifest(step)
        if data is not None:
            yield data
        peers = self._peers()
        asked: set[str] = set()
        if sources is not None and sources.holders:
            parent = relay_parent(
                self.member_id, sources.holders, sources.relays, fanout=self.options.manifest_fanout
            )
            if parent is not None and parent in peers:
                asked.add(parent)
                data = wait_for_manifest(
                    peers[parent], step, wait_s=self.options.manifest_relay_wait_s
                )
                if data is not None:
                    yield data
            holders = [m for m in sources.holders if m in peers and m not in asked]
            random.shuffle(holders)  # hosts that fall back spread over the holders
            for member in holders:
                asked.add(member)
                if (data := _manifest_of(peers[member], step)) is not None:
                    yield data
        rest = [c for m, c in peers.items() if m not in asked]
        held = [
            c
            for c, has in self._ask_peers(lambda c: (c, step in c.step_lists().manifests), rest)
            if has
        ]
        random.shuffle(held)
        for client in held:
            if (data := _manifest_of(client, step)) is not None:
                yield data

    def _step_lists(self) -> dict[str, StepLists]:
        """This member's and every reachable peer's step lists (one request per peer)."""
        lists = dict(self._ask_peers(lambda c: (c.name, c.step_lists())))
        t = self.tier
        lists[self.member_id] = StepLists(t.steps(), t.committed_steps(), t.manifest_steps())
        return lists

    def _ask_peers(
        self, ask: Callable[[PeerClient], _T], clients: list[PeerClient] | None = None
    ) -> list[_T]:
        """``ask(client)`` for every peer (or ``clients``), concurrently; peers that fail
        (``PeerError``) are left out."""
        clients = list(self._peers().values()) if clients is None else clients

        def one(client: PeerClient) -> tuple[bool, _T | None]:
            try:
                return True, ask(client)
            except PeerError:
                return False, None

        if len(clients) <= 1:
            answers = [one(c) for c in clients]
        else:
            with ThreadPoolExecutor(
                min(_MAX_PEER_QUERIES, len(clients)), thread_name_prefix="fastckpt-ask"
            ) as pool:
                answers = list(pool.map(one, clients))
        return [a for ok, a in answers if ok]  # type: ignore[misc]

    def steps_by_tier(self) -> dict[int, set[str]]:
        """RAM steps with a manifest: ``{"ram"}`` own tier, ``{"peer"}`` some peer (with
        parity, whether a lost member's share can be rebuilt is for :meth:`select_step`)."""
        out: dict[int, set[str]] = {}
        for member, lists in self._step_lists().items():
            for s in lists.committed:  # sealed but not committed: no step
                out.setdefault(s, set()).add("ram" if member == self.member_id else "peer")
        return out

    def _chunk_ids(self, manifest: Manifest) -> set[str]:
        """Every chunk id of ``manifest`` (kept for the manifest asked last)."""
        hit = self._needed
        if hit is not None and hit[0] is manifest:
            return hit[1]
        need: set[str] = set()
        for a in manifest.arrays():
            need.update(chunk_ids(a))
        self._needed = (manifest, need)
        return need

    def _reachable(
        self,
        step: int,
        need: set[str],
        own: list[str],
        manifest: Manifest,
        keys: Mapping[str, str] | None,
    ) -> bool:
        """Whether every chunk id in ``need`` is in ``own`` (the own tier's) or a peer's chunk
        list (else rebuildable from parity), asking as few peers as it can: the ring
        successors one by one, then the writers of the missing chunks that ``keys`` (chunk id
        -> object key) name and their push targets, then every other peer. The lists are kept
        for this restore's :meth:`source`."""
        missing = need.difference(own)
        if not missing:
            return True
        ordered = self._ordered_peers()
        k = max(1, self.options.replicas)
        for client in ordered[:k]:
            missing -= self._listing(step, client)
            if not missing:
                return True
        rest = ordered[k:]
        if keys is not None:
            holders = self._holders(step, {keys[i] for i in missing if i in keys}, manifest)
            first = [c for c in rest if c.name in holders]
            for ids in self._ask_peers(lambda c: self._listing(step, c), first):
                missing -= ids
            if not missing:
                return True
            rest = [c for c in rest if c.name not in holders]
        for ids in self._ask_peers(lambda c: self._listing(step, c), rest):
            missing -= ids
        if not missing or self._parity is None:
            return not missing
        rb = self._parity.for_step(step, manifest, self._lists)
        return rb is not None and rb.covers(missing)

    def _holders(self, step: int, keys: set[str], manifest: Manifest) -> set[str]:
        """Members that may hold the chunks stored under object ``keys`` of RAM step ``step``:
        each key's writer and its push targets on the ring of all the step's writers (the
        membership it was pushed under). Keys that name no writer add nothing."""
        writers = {w for key in keys if (w := ram_writer(step, key)) is not None}
        if not writers:
            return set()
        ring = {w for key in manifest.object_keys() if (w := ram_writer(step, key)) is not None}
        k = max(1, self.options.replicas)
        return {m for w in writers for m in replica_holders(w, ring, k, domain_of=host_domain)}

    def _listing(self, step: int, client: PeerClient) -> frozenset[str]:
        """``client``'s chunk ids of ``step`` (empty if it cannot answer), kept by peer name."""
        key = (step, client.name)
        ids = self._lists.get(key)
        if ids is None:
            try:
                ids = frozenset(client.list_chunks(step))
            except PeerError:
                return frozenset()
            self._lists[key] = ids
        return ids

    def _restorable(
        self,
        step: int,
        wanted: Callable[[Manifest], Mapping[str, str]] | None,
        sources: ManifestSources | None,
    ) -> Manifest | None:
        """The manifest of RAM step ``step`` if every chunk this process needs from it
        (``wanted``: chunk id -> object key; default: all of them) is reachable, else None."""
        manifest = self.manifest(step, sources)
        if manifest is None:
            return None
        own = self.tier.chunk_ids(step)
        if len(own) >= sum(len(a.chunks) for a in manifest.arrays()) and self._chunk_ids(
            manifest
        ).issubset(own):
            # this tier holds the whole step (one host, or a restart in place): no planning
            return manifest
        keys = None if wanted is None else wanted(manifest)
        need = self._chunk_ids(manifest) if keys is None else set(keys)
        return manifest if self._reachable(step, need, own, manifest, keys) else None

    def _decode(self, step: int, data: bytes) -> Manifest:
        """``decode_manifest(data)``, reusing the last result for the same bytes; bytes that
        decode are kept in the own tier when it held only the commit record (this host then
        serves them to later restores too)."""
        hit = self._decoded.get(step)
        if hit is not None and hit[0] == data:
            return hit[1]
        manifest = decode_manifest(data)
        if manifest.step != step:
            raise ManifestError(f"the manifest held as RAM step {step}'s is step {manifest.step}'s")
        self._decoded = {step: (data, manifest)}  # the latest only: bounded
        if step in self.tier.committed_steps() and step not in self.tier.manifest_steps():
            with contextlib.suppress(FastckptError):  # stale (retention moved on), budget, closed
                self.tier.put_manifest(step, data)
        return manifest

    def select_step(
        self,
        persistent_latest: int | Callable[[], int | None] | None,
        *,
        key: str,
        timeout_s: float,
        older_than: int | None = None,
        wanted: Callable[[Manifest], Mapping[str, str]] | None = None,
    ) -> StepChoice | None:
        """Agree on the step to restore (collective; the rounds: ``docs/replicas.md``, "Which
        step a restore uses"): the newest RAM step newer than storage's latest
        (``persistent_latest``: the step, or a callable only process 0 calls) and older than
        ``older_than`` from which *every* process reaches every chunk it needs
        (``wanted(manifest)``: chunk id -> object key; default: all); None when storage's
        latest should be used. The chunk lists fetched serve :meth:`source`. An error of
        ``wanted`` is raised on its process and as ``DistributedError`` on the others;
        ``BarrierTimeoutError`` if a process does not take part within ``timeout_s``.
        """
        coord = self._coord
        deadline = time.monotonic() + timeout_s
        self._lists.clear()  # a new restore: chunk lists fetched earlier may be stale
        if self._parity is not None:
            self._parity.reset()
        if coord.process_index == 0:
            sources = manifest_sources(self._step_lists())  # every committed step's holders
            if callable(persistent_latest):
                persistent_latest = persistent_latest()
            candidates = [
                s
                for s in sorted(sources, reverse=True)
                if (older_than is None or s < older_than)
                and (persistent_latest is None or s > persistent_latest)
            ]
            if coord.process_count > 1:
                coord.set(f"{key}/candidates", encode_candidates(candidates, sources))
        else:
            candidates, sources = decode_candidates(
                coord.get(f"{key}/candidates", timeout_s=timeout_s)
            )
        verdicts: dict[int, Manifest | None] = {}
        bound: int | None = None
        for round_ in itertools.count():
            mine: str = "none"
            error: BaseException | None = None
            try:
                for step in candidates:  # newest first
                    if bound is not None and step > bound:
                        continue
                    if step not in verdicts:
                        verdicts[step] = self._restorable(step, wanted, sources.get(step))
                    if verdicts[step] is not None:
                        mine = str(step)
                        break
            except Exception as e:  # ``wanted`` failed (e.g. a target that does not match)
                error, mine = e, f"error {type(e).__name__}: {e}"[:500]
            named = coord.exchange(f"{key}/round{round_}", mine, timeout_s=time_left(deadline))
            if error is not None:
                raise error
            for i, v in enumerate(named):
                if v.startswith("error "):
                    raise DistributedError(
                        f"process {i} could not check the RAM steps for its restore: {v[6:]}"
                    )
            if "none" in named:
                return None
            steps = [int(v) for v in named]
            bound = min(steps)
            if max(steps) == bound:
                return StepChoice(bound, verdicts[bound])
        raise AssertionError("unreachable")

    def _ordered_peers(self) -> list[PeerClient]:
        """Peers: this member's ring successors first (where a replaced host pushed), then
        those whose chunk list the step selection fetched, then the rest."""
        peers = self._peers()
        first = self._successors(max(1, self.options.replicas)) if peers else []
        listed = {name for _, name in self._lists}
        rest = sorted((m for m in peers if m not in first), key=lambda m: m not in listed)
        return [peers[m] for m in first + rest]  # (the sort is stable)

    def _successors(self, k: int) -> list[str]:
        """This member's ``k`` ring successors among the published members (its push targets)."""
        members = [self.member_id, *self._peers()]
        return ring_successors(members, self.member_id, k, domain_of=host_domain)

    def source(self) -> TieredChunkSource:
        """Per-chunk source: own RAM first, then every peer (listing-guided) in
        :meth:`_ordered_peers` order. Call it after :meth:`select_step`: the source takes the
        chunk lists the selection fetched (later restores no longer see them: may be stale)."""
        peers = self._ordered_peers()
        known, self._lists = self._lists, {}
        rebuild = None if self._parity is None else self._parity.for_step
        return TieredChunkSource(self.tier, peers, known_listings=known, rebuild=rebuild)


def _manifest_of(client: PeerClient, step: int) -> bytes | None:
    """``client``'s copy of ``step``'s manifest; None if it has none or cannot answer."""
    try:
        return client.get_manifest(step)
    except PeerError:
        return None
