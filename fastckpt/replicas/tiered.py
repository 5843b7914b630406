"""RAM replication as the manager uses it (its ``writer.tier.Tier``): one object composing
tier, server, pusher, peers.

Call order on a RAM save (all processes, SPMD): :meth:`RamReplication.allocate` (the staging
buffer *is* the shared-memory segment) -> stage -> :meth:`commit` (:meth:`seal`, the commit
round, in which process 0 stores the manifest only after every process sealed, then
:meth:`publish`: commit here, push to the ring successors in the background); on failure
:meth:`abort`. So a crash mid-save never leaves the job without a restorable RAM step. On
restore: :meth:`select_step` (all agree on the newest RAM step from which every process
reaches the chunks it reads) -> :meth:`source` (own RAM, then peers, per chunk). A chunk
found corrupt in every copy while it is read still fails the step (the manager then falls
back to an older one on every process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import random
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from fastckpt.coordination.distributed import Coordinator, time_left
from fastckpt.errors import ConfigError, DistributedError, FastckptError, ManifestError, PeerError
from fastckpt.format.codec import decode_manifest
from fastckpt.format.layout import ram_object_key, ram_writer
from fastckpt.format.manifest import Manifest, chunk_id, chunk_id_prefix, chunk_ids
from fastckpt.options import RamOptions
from fastckpt.replicas._client import PeerClient, StepLists
from fastckpt.replicas._connection import PeerOptions
from fastckpt.replicas._manifest_relay import (
    ManifestSources,
    decode_candidates,
    encode_candidates,
    manifest_sources,
    wait_for_manifest,
)
from fastckpt.replicas._placement import host_domain, push_targets, relay_parent, replica_holders
from fastckpt.replicas._server import PeerServer
from fastckpt.replicas._sources import TieredChunkSource
from fastckpt.replicas._startup import PeerDirectory, check_push_targets, make_record, peer_address
from fastckpt.replicas.ram import ChunkLocation, RamTier, Segment
from fastckpt.replicas.replicator import ReplicationReport, Replicator
from fastckpt.storage._protocol import Store
from fastckpt.writer.commit import CommitRound, CoordinatorFragments
from fastckpt.writer.fragment import ChunkRows, ProcessChunks
from fastckpt.writer.stage import StagedSave

__all__ = ["RamReplication", "StepChoice"]

_T = TypeVar("_T")
_MAX_PEER_QUERIES = 32  # concurrent step/chunk-list queries during step selection

log = logging.getLogger("fastckpt")
_TIER_KEY = "fastckpt_tier"  # in a RAM-only step's manifest metadata: "ram"


@dataclasses.dataclass(frozen=True)
class StepChoice:
    """The step a restore uses, and its RAM manifest (None when storage holds the step)."""

    step: int
    manifest: Manifest | None


class RamReplication:
    """The RAM tier of this host plus its peer server, pusher and peer clients."""

    name = "ram"

    def __init__(self, options: RamOptions, *, coordinator: Coordinator, store: Store, namespace: str,
                 run: Callable[[Any], Any]) -> None:
        self.options = options
        self.member_id = options.member_id or os.path.basename(os.path.normpath(options.root))
        self._coord = coordinator
        multi = coordinator.process_count > 1
        if options.secret is None and multi and options.replicas > 0:
            raise ConfigError(f"RamOptions(replicas={options.replicas}) needs the job's peer secret in a multi-process "
                              "job: RamOptions(secret=fastckpt.peer_secret_from_env(), ...) with FASTCKPT_PEER_SECRET "
                              "set by the launcher, or replicas=0 (each host keeps only its own RAM copy)")
        self.tier = RamTier(options.root, budget_bytes=options.budget_bytes, keep_steps=options.keep_steps,
                            replicated=options.secret is not None and options.replicas > 0)
        self._peer_options = PeerOptions(connect_timeout_s=options.peer_connect_timeout_s,
                                         io_timeout_s=options.peer_io_timeout_s)
        self._segment: Segment | None = None
        self._sealed_ids: list[str] = []
        self._decoded: dict[int, tuple[bytes, Manifest]] = {}
        self._needed: tuple[Manifest, set[str]] | None = None  # chunk ids of a decoded manifest
        self._lists: dict[tuple[int, str], frozenset[str]] = {}  # (step, peer): its chunk ids, this restore
        self._held: int | None = None  # the step whose manifest commit() stored
        self._clients: dict[str, PeerClient] = {}
        self._server: PeerServer | None = None
        self._replicator: Replicator | None = None
        self._directory: PeerDirectory | None = None
        self.advertised: tuple[str, int] | None = None
        """Where the other hosts reach this host's peer server (None: no peer service)."""
        try:
            self._start_peers(options, coordinator, store, namespace, run)
        except BaseException:  # nothing of a replication that was never made keeps running
            self.close()
            raise

    def _start_peers(self, options: RamOptions, coordinator: Coordinator, store: Store, namespace: str,
                     run: Callable[[Any], Any]) -> None:
        """With a secret: serve the tier, publish where, and check the push targets."""
        if options.secret is None:
            return
        multi = coordinator.process_count > 1
        address = peer_address(options.host, service_address=coordinator.service_address,
                               process_count=coordinator.process_count)
        self._server = PeerServer(self.tier, secret=options.secret, host=address.bind, port=options.port,
                                  options=self._peer_options).start()
        self._directory = PeerDirectory(coordinator, store, run=run, namespace=namespace.replace("/", "-"),
                                        timeout_s=options.discovery_timeout_s)
        self.advertised = (address.advertise, self._server.address[1])
        self._directory.publish(make_record(self.member_id, self.advertised))
        self._replicator = Replicator(self.tier)
        if multi and options.replicas > 0:
            peers = self._peers()
            targets = push_targets([self.member_id, *peers], options.replicas, domain_of=host_domain)
            check_push_targets(coordinator, key=f"{namespace}/peercheck", clients=peers,
                               targets=targets.get(self.member_id, []), timeout_s=options.discovery_timeout_s,
                               me=f"{self.member_id} ({self.advertised[0]}:{self.advertised[1]})")

    # ------------------------------------------------------------------ peers
    def _peers(self) -> dict[str, PeerClient]:
        """Clients of every other published member (looked up once, then cached)."""
        if self._directory is None or self.options.secret is None:
            return {}
        if not self._clients:
            for member, rec in self._directory.lookup().items():
                if member != self.member_id:
                    self._clients[member] = PeerClient(rec.address, secret=self.options.secret,
                                                       options=self._peer_options, name=member)
        return self._clients

    # ------------------------------------------------------------------ save
    def due(self, step: int) -> bool:
        """Whether ``step`` is a RAM checkpoint step."""
        return step % self.options.interval_steps == 0

    def allocate(self, step: int, nbytes: int, *, reserve: bool = True) -> np.ndarray:
        """A shared-memory staging buffer for ``step`` (becomes the replica once sealed); with
        ``reserve=False``, the segment's pages must be reserved before it is written.

        Steps ``>= step`` this tier still holds are of an abandoned timeline (the job went back
        to an older step) and are dropped first: otherwise their copies would be served for
        the re-trained steps, and their retention floor would refuse those saves (StaleStepError).
        """
        self.abort()
        abandoned = [s for s in self.tier.steps() if s >= step]
        if abandoned:
            log.warning("fastckpt: dropping RAM steps %s of an abandoned timeline before saving step %d",
                        abandoned, step)
            for s in abandoned:
                self.tier.drop_step(s)
            self._decoded = {}
        self._segment = self.tier.allocate(step, nbytes, reserve=reserve)
        return self._segment.buffer

    def allocate_unreserved(self, step: int, nbytes: int) -> tuple[np.ndarray, Callable[[], None]]:
        """:meth:`allocate` with ``reserve=False``, and the function that reserves that segment's
        pages (``Segment.reserve``: RamBudgetError on a full tmpfs), to call before writing it."""
        buffer = self.allocate(step, nbytes, reserve=False)
        assert self._segment is not None
        return buffer, self._segment.reserve

    def abort(self) -> None:
        """Discard an unsealed segment (a failed save)."""
        seg, self._segment = self._segment, None
        if seg is not None:
            self.tier.discard(seg)

    def seal(self, step: int, staged: StagedSave, raw_crcs: dict[int, list[int]]) -> ProcessChunks:
        """Make this process's staged chunks of ``step`` visible (not yet committed;
        ``raw_crcs[i][j]``: crc32c of item ``j`` of ``staged.arrays[i]``). Returns their rows of
        the manifest: raw, under :func:`ram_object_key` naming this member (their writer)."""
        seg = self._segment
        if seg is None:
            raise FastckptError(f"no RAM segment allocated for step {step}")
        index: dict[str, ChunkLocation] = {}
        rows, key = ChunkRows(), ram_object_key(step, self.member_id)
        for ai, arr in enumerate(staged.arrays):
            prefix = chunk_id_prefix(arr.path)
            for off, item, crc in zip(arr.item_offsets, arr.items, raw_crcs[ai]):
                index[chunk_id(arr.path, item.box, prefix=prefix)] = ChunkLocation(off, item.nbytes, crc)
                rows.add(ai, item.box, key, off, item.nbytes, "raw", crc, crc)
        self.tier.seal(step, seg, index)  # refused or failed: the segment stays here for abort()
        self._segment = None
        self._sealed_ids = list(index)
        return rows.build()

    def commit(self, commit_round: CommitRound, raw_crcs: dict[int, list[int]], metadata: dict[str, object]) -> None:
        """:meth:`seal`, the commit round (fragments through the coordinator; process 0 stores the
        manifest first, and sends it to the others only without a peer service, else it travels
        with its push), then :meth:`publish`."""
        step = commit_round.step
        chunks = self.seal(step, commit_round.staged, raw_crcs)

        def hold(manifest: bytes) -> None:
            self.tier.put_manifest(step, manifest)
            self._held = step

        manifest = commit_round.commit(chunks, route=CoordinatorFragments(round=commit_round), publish=hold,
                                       metadata={**metadata, _TIER_KEY: self.name}, validate=False,
                                       share=self._server is None)
        self.publish(step, manifest)

    def publish(self, step: int, manifest: bytes | None) -> None:
        """Commit the RAM step here — store ``manifest`` (unless the commit round did), or a
        commit record when it is None (held by other hosts) — and start the background peer
        push (with the manifest, when this process has it)."""
        if manifest is None:
            self.tier.mark_committed(step)  # with peers the tier also holds the previous step
        elif self._held != step:
            self.tier.put_manifest(step, manifest)
        if self._replicator is None or self.options.replicas == 0:
            return
        peers = self._peers()
        targets = push_targets([self.member_id, *peers], self.options.replicas, domain_of=host_domain).get(
            self.member_id, [])
        self._replicator.set_targets({m: peers[m] for m in targets if m in peers})
        self._replicator.submit(step, chunk_ids=self._sealed_ids, manifest=manifest)

    def prepare_next(self, nbytes: int) -> None:
        """After a committed step: a spare segment for the next (``RamTier.provision``), so the
        next save does not create its segment file while the step waits; failures are logged."""
        try:
            self.tier.provision(nbytes)
        except Exception as e:  # noqa: BLE001 - only a lost optimisation: the next save creates its own
            log.warning("fastckpt: could not provision a RAM segment: %s", e)

    def wait_pushed(self) -> float:
        """Block until this host's pushes of earlier RAM steps finished (bounded by the peer I/O
        timeouts; a failed one counts); returns the seconds waited. Called before staging the
        next RAM step (backpressure): since commits are collective, once any host commits N+1
        (and frees N-1) every push of N is done, so a host loss always leaves a complete step."""
        if self._replicator is None:
            return 0.0
        t0 = time.perf_counter()
        self._replicator.wait_idle()
        return time.perf_counter() - t0

    def pushing(self) -> bool:
        """Whether a push of an earlier RAM step is still running (``wait_pushed`` would wait)."""
        return self._replicator is not None and not self._replicator.wait_idle(0)

    def wait_replication(self, timeout_s: float | None = None) -> list[ReplicationReport]:
        """Block until pushes of submitted steps finished; return (and forget) their reports,
        oldest first (errors are in them and logged, not raised)."""
        return self._replicator.wait(timeout_s) if self._replicator is not None else []

    # ------------------------------------------------------------------ restore
    def holds_alone(self, manifest: Manifest) -> bool:
        """Whether ``manifest`` is of a RAM-only step (storage does not hold it)."""
        return manifest.metadata.get(_TIER_KEY) == self.name

    def manifest(self, step: int, sources: ManifestSources | None = None) -> Manifest | None:
        """The manifest of RAM step ``step`` from the nearest copy that decodes and names that
        step (:meth:`_manifest_copies`; a bad copy is logged and the next one tried), kept in
        the own tier when it held only the step's commit record; None if no copy does."""
        for data in self._manifest_copies(step, sources):
            try:
                return self._decode(step, data)
            except FastckptError as e:
                log.warning("fastckpt: a copy of RAM step %d's manifest is unusable (%s); trying the next", step, e)
        return None

    def _manifest_copies(self, step: int, sources: ManifestSources | None) -> Iterator[bytes]:
        """Copies of RAM step ``step``'s manifest, nearest first (fetched lazily): the own
        tier's; with ``sources`` (from process 0's survey) the relay parent's
        (``placement.relay_parent``, waited for while it fetches its own), then each holder's
        in random order; last any other peer that says it holds one (all asked at once)."""
        data = self.tier.get_manifest(step)
        if data is not None:
            yield data
        peers = self._peers()
        asked: set[str] = set()
        if sources is not None and sources.holders:
            parent = relay_parent(self.member_id, sources.holders, sources.relays, fanout=self.options.manifest_fanout)
            if parent is not None and parent in peers:
                asked.add(parent)
                data = wait_for_manifest(peers[parent], step, wait_s=self.options.manifest_relay_wait_s)
                if data is not None:
                    yield data
            holders = [m for m in sources.holders if m in peers and m not in asked]
            random.shuffle(holders)  # hosts that fall back spread over the holders
            for member in holders:
                asked.add(member)
                if (data := _manifest_of(peers[member], step)) is not None:
                    yield data
        rest = [c for m, c in peers.items() if m not in asked]
        held = [c for c, has in self._ask_peers(lambda c: (c, step in c.manifest_steps()), rest) if has]
        random.shuffle(held)
        for client in held:
            if (data := _manifest_of(client, step)) is not None:
                yield data

    def _step_lists(self) -> dict[str, StepLists]:
        """This member's and every reachable peer's step lists (one request per peer)."""
        lists = dict(self._ask_peers(lambda c: (c.name, c.step_lists())))
        tier = self.tier
        lists[self.member_id] = StepLists(tier.steps(), tier.committed_steps(), tier.manifest_steps())
        return lists

    def _survey(self) -> dict[int, ManifestSources]:
        """Every committed RAM step of this tier and the reachable peers', with the members
        that hold its manifest and those that hold only its commit record."""
        return manifest_sources(self._step_lists())

    def _ask_peers(self, ask: Callable[[PeerClient], _T], clients: list[PeerClient] | None = None) -> list[_T]:
        """``ask(client)`` for every peer (or ``clients``), concurrently (a job of hundreds of
        hosts, or a dead peer's connect timeout, costs one round trip, not one per peer);
        peers that fail (``PeerError``) are left out."""
        clients = list(self._peers().values()) if clients is None else clients

        def one(client: PeerClient) -> tuple[bool, _T | None]:
            try:
                return True, ask(client)
            except PeerError:
                return False, None

        if len(clients) <= 1:
            answers = [one(c) for c in clients]
        else:
            with ThreadPoolExecutor(min(_MAX_PEER_QUERIES, len(clients)), thread_name_prefix="fastckpt-ask") as pool:
                answers = list(pool.map(one, clients))
        return [a for ok, a in answers if ok]  # type: ignore[misc]

    def steps_by_tier(self) -> dict[int, set[str]]:
        """RAM steps with a manifest: ``{"ram"}`` own tier, ``{"peer"}`` some peer."""
        out: dict[int, set[str]] = {}
        for member, lists in self._step_lists().items():
            for s in lists.committed:  # sealed but not committed: no step
                out.setdefault(s, set()).add("ram" if member == self.member_id else "peer")
        return out

    def _chunk_ids(self, manifest: Manifest) -> set[str]:
        """Every chunk id of ``manifest`` (kept for the manifest decoded last: a restore
        repeated from the same step formats none)."""
        hit = self._needed
        if hit is not None and hit[0] is manifest:
            return hit[1]
        need: set[str] = set()
        for a in manifest.arrays():
            need.update(chunk_ids(a))
        self._needed = (manifest, need)
        return need

    def _reachable(self, step: int, need: set[str], own: list[str], *, keys: Mapping[str, str] | None = None,
                   manifest: Manifest | None = None) -> bool:
        """Whether every chunk id in ``need`` is in ``own`` (the own tier's) or a peer's chunk
        list, asking as few peers as it can: the ring successors first (one by one), then the
        writers of the missing chunks that ``keys`` (chunk id -> object key) name and their
        ring successors (``placement.replica_holders``), then every other peer. The lists
        are kept for this restore's :meth:`source`."""
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
        if keys is not None and manifest is not None:
            holders = self._holders(step, {keys[i] for i in missing if i in keys}, manifest)
            first = [c for c in rest if c.name in holders]
            for ids in self._ask_peers(lambda c: self._listing(step, c), first):
                missing -= ids
            if not missing:
                return True
            rest = [c for c in rest if c.name not in holders]
        for ids in self._ask_peers(lambda c: self._listing(step, c), rest):
            missing -= ids
        return not missing

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

    def _restorable(self, step: int, wanted: Callable[[Manifest], Mapping[str, str]] | None,
                    sources: ManifestSources | None) -> Manifest | None:
        """The manifest of RAM step ``step`` if every chunk this process needs from it
        (``wanted``: chunk id -> object key; default: all of them) is reachable, else None."""
        manifest = self.manifest(step, sources)
        if manifest is None:
            return None
        own = self.tier.chunk_ids(step)
        if len(own) >= sum(len(a.chunks) for a in manifest.arrays()) and self._chunk_ids(manifest).issubset(own):
            return manifest  # this tier holds the whole step (one host, or a restart in place): no planning
        if wanted is None:
            return manifest if self._reachable(step, self._chunk_ids(manifest), own) else None
        keys = wanted(manifest)
        return manifest if self._reachable(step, set(keys), own, keys=keys, manifest=manifest) else None

    def _decode(self, step: int, data: bytes) -> Manifest:
        """``decode_manifest(data)``, reusing the last result for the same bytes: a
        manifest is immutable, and decoding a large tree's costs about as much as
        verifying a few hundred MiB of own-RAM chunks. Bytes that decode are kept in the
        own tier when it held only the step's commit record (:meth:`_keep_copy`)."""
        hit = self._decoded.get(step)
        if hit is not None and hit[0] == data:
            return hit[1]
        manifest = decode_manifest(data)
        if manifest.step != step:
            raise ManifestError(f"the manifest held as RAM step {step}'s is step {manifest.step}'s")
        self._decoded = {step: (data, manifest)}  # the latest only: bounded
        self._keep_copy(step, data)
        return manifest

    def _keep_copy(self, step: int, data: bytes) -> None:
        """Store a valid manifest fetched from a peer when this tier holds only the step's
        commit record: this host then serves it too, so the restores that follow (another
        host lost) find it on more hosts than process 0's and its ring successors."""
        tier = self.tier
        if step in tier.committed_steps() and step not in tier.manifest_steps():
            with contextlib.suppress(FastckptError):  # stale (retention moved on), budget, closed
                tier.put_manifest(step, data)

    def select_step(self, persistent_latest: int | None | Callable[[], int | None], *, key: str, timeout_s: float,
                    older_than: int | None = None,
                    wanted: Callable[[Manifest], Mapping[str, str]] | None = None) -> StepChoice | None:
        """Agree on the step to restore (collective): the newest RAM step newer than storage's
        latest and older than ``older_than`` from which *every* process reaches every chunk it
        needs; None when storage's latest should be used.

        ``persistent_latest`` is storage's latest step, or a callable only process 0 calls
        once its survey is done (the caller's storage listing runs beside it). Process 0
        publishes the candidate steps with their manifests' holders and relays
        (``manifest_relay``); each process checks them, newest first, against ``wanted(manifest)``
        (the chunks its restore reads, chunk id -> object key; default: all) in its own tier or
        a peer's chunk list (:meth:`_reachable`), then all exchange the newest each can
        restore, and those with a newer one check the oldest named, until they agree. The
        chunk lists fetched serve this restore's :meth:`source`. An error of ``wanted`` is
        raised on its process and as ``DistributedError`` on the others;
        ``BarrierTimeoutError`` if a process does not take part within ``timeout_s``.
        """
        coord = self._coord
        deadline = time.monotonic() + timeout_s
        self._lists.clear()  # a new restore: chunk lists fetched earlier may be stale
        if coord.process_index == 0:
            sources = self._survey()
            if callable(persistent_latest):
                persistent_latest = persistent_latest()
            candidates = [s for s in sorted(sources, reverse=True)
                          if (older_than is None or s < older_than) and (persistent_latest is None or s > persistent_latest)]
            if coord.process_count > 1:
                coord.set(f"{key}/candidates", encode_candidates(candidates, sources))
        else:
            candidates, sources = decode_candidates(coord.get(f"{key}/candidates", timeout_s=timeout_s))
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
            except Exception as e:  # ``wanted`` failed (e.g. the target does not match): tell the others
                error, mine = e, f"error {type(e).__name__}: {e}"[:500]
            named = coord.exchange(f"{key}/round{round_}", mine, timeout_s=time_left(deadline))
            if error is not None:
                raise error
            failed = [(i, v) for i, v in enumerate(named) if v.startswith("error ")]
            if failed:
                i, v = failed[0]
                raise DistributedError(f"process {i} could not check the RAM steps for its restore: {v[6:]}")
            if "none" in named:
                return None
            steps = [int(v) for v in named]
            bound = min(steps)
            if max(steps) == bound:
                return StepChoice(bound, verdicts[bound])
        raise AssertionError("unreachable")

    def _ordered_peers(self) -> list[PeerClient]:
        """Peers, this member's ring successors first — where a replacement host's chunks
        were pushed by the host it replaces — then those whose chunk list the last step
        selection fetched (the holders of what this host needs), then the rest in directory
        order."""
        peers = self._peers()
        first = push_targets([self.member_id, *peers], max(1, self.options.replicas), domain_of=host_domain).get(
            self.member_id, []) if peers else []
        listed = {name for _, name in self._lists}
        rest = [m for m in peers if m not in first]
        return ([peers[m] for m in first if m in peers] + [peers[m] for m in rest if m in listed]
                + [peers[m] for m in rest if m not in listed])

    def source(self) -> TieredChunkSource:
        """Per-chunk source: own RAM first, then every peer (listing-guided) in
        :meth:`_ordered_peers` order. Call it after :meth:`select_step`: the source takes the
        chunk lists the selection fetched (later restores no longer see them: may be stale)."""
        peers = self._ordered_peers()
        known, self._lists = self._lists, {}
        return TieredChunkSource(self.tier, peers, known_listings=known)

    def forget_peers(self) -> None:
        """Drop cached peer clients (after membership changes)."""
        for c in self._clients.values():
            c.close()
        self._clients.clear()

    def close(self) -> None:
        """Stop pushing and serving; close the tier (its files stay for a restarted process)."""
        self.abort()
        if self._replicator is not None:
            self._replicator.close(wait=True)
        self.forget_peers()
        if self._server is not None:
            self._server.close()
        self.tier.close()


def _manifest_of(client: PeerClient, step: int) -> bytes | None:
    """``client``'s copy of ``step``'s manifest; None if it has none or cannot answer."""
    try:
        return client.get_manifest(step)
    except PeerError:
        return None
