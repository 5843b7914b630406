"""RAM replication as the manager uses it (its ``writer.tier.Tier``): tier, server, pushers, peers.

Call order on a RAM save (all processes, SPMD): :meth:`RamReplication.allocate` (the staging
buffer *is* the shared-memory segment) -> stage -> :meth:`commit` (:meth:`seal`, the commit
round, in which process 0 stores the manifest only after every process sealed, then commit
here and push in the background); on failure :meth:`abort`. So a crash mid-save never leaves
the job without a restorable RAM step. With ``redundancy="parity"`` parity parts go to this
member's group instead of copies (the manifest still goes to the ring successors). On
restore: :meth:`select_step` -> :meth:`source` (:class:`StepSelection`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from fastckpt.coordination.distributed import Coordinator
from fastckpt.errors import ConfigError, FastckptError
from fastckpt.format.layout import ram_object_key
from fastckpt.format.manifest import Manifest, chunk_id, chunk_id_prefix
from fastckpt.options import RamOptions
from fastckpt.replicas._connection import PeerOptions
from fastckpt.replicas._parity import ParityPusher, ParityService, ParityStore
from fastckpt.replicas._parity_client import ParityClient
from fastckpt.replicas._parity_layout import group_of, parity_groups
from fastckpt.replicas._parity_rebuild import ParityRebuilds
from fastckpt.replicas._placement import host_domain
from fastckpt.replicas._ram import ChunkLocation, RamTier, Segment
from fastckpt.replicas._replicator import ReplicationReport, Replicator
from fastckpt.replicas._server import PeerServer
from fastckpt.replicas._startup import PeerDirectory, check_push_targets, make_record, peer_address
from fastckpt.replicas._step_selection import StepSelection
from fastckpt.storage import Store
from fastckpt.writer.commit import CommitRound, CoordinatorFragments
from fastckpt.writer.fragment import ChunkRows, ProcessChunks
from fastckpt.writer.stage import StagedSave

__all__ = ["RamReplication"]

log = logging.getLogger("fastckpt")
_TIER_KEY = "fastckpt_tier"  # in a RAM-only step's manifest metadata: "ram"


class RamReplication(StepSelection):
    """The RAM tier of this host plus its peer server, pusher and peer clients."""

    name = "ram"

    def __init__(
        self,
        options: RamOptions,
        *,
        coordinator: Coordinator,
        store: Store,
        namespace: str,
        run: Callable[[Any], Any],
    ) -> None:
        self.options = options
        self.member_id = options.member_id or os.path.basename(os.path.normpath(options.root))
        self._coord = coordinator
        if options.secret is None and coordinator.process_count > 1 and options.replicas > 0:
            raise ConfigError(
                f"RamOptions(replicas={options.replicas}) needs the job's peer secret in a "
                "multi-process job: RamOptions(secret=fastckpt.peer_secret_from_env(), ...) "
                "with FASTCKPT_PEER_SECRET set by the launcher, or replicas=0 (each host keeps "
                "only its own RAM copy)"
            )
        self.tier = RamTier(
            options.root,
            budget_bytes=options.budget_bytes,
            keep_steps=options.keep_steps,
            replicated=options.secret is not None and options.replicas > 0,
        )
        self._peer_options = PeerOptions(
            connect_timeout_s=options.peer_connect_timeout_s, io_timeout_s=options.peer_io_timeout_s
        )
        self._segment: Segment | None = None
        self._sealed_ids: list[str] = []
        # the restore side's (StepSelection)
        self._decoded, self._needed, self._lists = {}, None, {}
        self._clients: dict[str, ParityClient] = {}
        self._parity: ParityRebuilds | None = None  # redundancy="parity" (with a peer service)
        self._parity_pusher: ParityPusher | None = None
        self._parity_store: ParityStore | None = None
        self._self_client: ParityClient | None = None
        self._stream_len = 0
        self._server: PeerServer | None = None
        self._replicator: Replicator | None = None
        self._directory: PeerDirectory | None = None
        self.advertised: tuple[str, int] | None = None
        """Where the other hosts reach this host's peer server (None: no peer service)."""
        try:
            self._start_peers(store, namespace, run)
        except BaseException:  # nothing of a replication that was never made keeps running
            self.close()
            raise

    def _start_peers(self, store: Store, namespace: str, run: Callable[[Any], Any]) -> None:
        """With a secret: serve the tier, publish where, and check the push targets."""
        options, coordinator = self.options, self._coord
        if options.secret is None:
            return
        bind, advertise = peer_address(
            options.host,
            service_address=coordinator.service_address,
            process_count=coordinator.process_count,
        )
        parity = None
        if options.redundancy == "parity":
            self._parity_store = ParityStore(self.tier, self.member_id)
            parity = ParityService(self._parity_store, self._peers)
            self._parity_pusher = ParityPusher()
            self._parity = ParityRebuilds(
                self.manifest, self._rebuild_peers, group_size=options.group_size
            )
        self._server = PeerServer(
            self.tier,
            secret=options.secret,
            host=bind,
            port=options.port,
            options=self._peer_options,
            extension=parity,
        ).start()
        self._directory = PeerDirectory(
            coordinator,
            store,
            run=run,
            namespace=namespace.replace("/", "-"),
            timeout_s=options.discovery_timeout_s,
        )
        self.advertised = (advertise, self._server.address[1])
        self._directory.publish(make_record(self.member_id, self.advertised))
        self._replicator = Replicator(self.tier)
        if coordinator.process_count > 1 and options.replicas > 0:
            check_push_targets(
                coordinator,
                key=f"{namespace}/peercheck",
                clients=self._peers(),
                targets=self._successors(options.replicas),
                timeout_s=options.discovery_timeout_s,
                me=f"{self.member_id} ({self.advertised[0]}:{self.advertised[1]})",
            )

    def _peers(self) -> dict[str, ParityClient]:
        """Clients of every other published member (looked up once, then cached)."""
        if self._directory is None:
            return {}
        if not self._clients:
            found = self._directory.lookup().items()
            self._clients = {m: self._client(r.address, m) for m, r in found if m != self.member_id}
        return self._clients

    def _client(self, address: tuple[str, int], member: str) -> ParityClient:
        assert self.options.secret is not None  # a peer service runs only with one
        return ParityClient(
            address, secret=self.options.secret, options=self._peer_options, name=member
        )

    def _rebuild_peers(self) -> dict[str, ParityClient]:
        """The other members' clients and a client of this member's own server (it may hold
        a parity a rebuild needs)."""
        peers = dict(self._peers())
        if self._self_client is None and self.advertised is not None:
            self._self_client = self._client(self.advertised, self.member_id)
        if self._self_client is not None:
            peers[self.member_id] = self._self_client
        return peers

    def due(self, step: int) -> bool:
        """Whether ``step`` is a RAM checkpoint step."""
        return step % self.options.interval_steps == 0

    def allocate(self, step: int, nbytes: int, *, reserve: bool = True) -> np.ndarray:
        """A shared-memory staging buffer for ``step`` (becomes the replica once sealed); with
        ``reserve=False``, the segment's pages must be reserved before it is written.

        Steps ``>= step`` this tier still holds are of an abandoned timeline (the job went back
        to an older step) and are dropped first (else they would be served for the re-trained
        steps, and their retention floor would refuse those saves).
        """
        self.abort()
        if self._parity_store is not None:
            self._parity_store.discard_from(step)  # unsealed parity of an abandoned timeline
        abandoned = [s for s in self.tier.steps() if s >= step]
        if abandoned:
            log.warning(
                "fastckpt: dropping RAM steps %s of an abandoned timeline before saving step %d",
                abandoned,
                step,
            )
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
                index[chunk_id(arr.path, item.box, prefix=prefix)] = ChunkLocation(
                    off, item.nbytes, crc
                )
                rows.add(ai, item.box, key, off, item.nbytes, "raw", crc, crc)
        self.tier.seal(step, seg, index)  # refused or failed: the segment stays here for abort()
        self._segment = None
        self._sealed_ids = list(index)
        self._stream_len = max((c.offset + c.length for c in index.values()), default=0)
        return rows.build()

    def commit(
        self, commit_round: CommitRound, raw_crcs: dict[int, list[int]], metadata: dict[str, object]
    ) -> None:
        """:meth:`seal`, the commit round (fragments through the coordinator; process 0 stores the
        manifest first, and sends it to the others only without a peer service, else it travels
        with its push), then commit the step here — the manifest, or a commit record where
        other hosts hold it — and start the background peer push (with the manifest, if here)."""
        step = commit_round.step
        chunks = self.seal(step, commit_round.staged, raw_crcs)
        held = False  # whether the commit round stored the manifest here

        def hold(manifest: bytes) -> None:
            nonlocal held
            self.tier.put_manifest(step, manifest)
            held = True

        manifest = commit_round.commit(
            chunks,
            route=CoordinatorFragments(round=commit_round),
            publish=hold,
            metadata={**metadata, _TIER_KEY: self.name},
            validate=False,
            share=self._server is None,
        )
        if manifest is None:
            self.tier.mark_committed(step)  # with peers the tier also holds the previous step
        elif not held:
            self.tier.put_manifest(step, manifest)
        if self._replicator is None or self.options.replicas == 0:
            return
        peers = self._peers()
        self._replicator.set_targets({m: peers[m] for m in self._successors(self.options.replicas)})
        parity = self._parity_pusher is not None
        self._replicator.submit(
            step, chunk_ids=[] if parity else self._sealed_ids, manifest=manifest
        )
        if parity:
            self._push_parity(step, peers)

    def _push_parity(self, step: int, peers: dict[str, ParityClient]) -> None:
        """Start pushing this member's parity parts of ``step`` to the rest of its group (the
        manifest went to the ring successors with the replicator)."""
        assert self._parity_pusher is not None
        groups = parity_groups(
            [self.member_id, *peers], self.options.group_size, domain_of=host_domain
        )
        group = group_of(self.member_id, groups)
        if len(group) < 2:
            return  # a group of one is unprotected
        view = self.tier.segment_of(step, self._sealed_ids[0]) if self._sealed_ids else None
        stream = memoryview(b"") if view is None else view[: self._stream_len]
        self._parity_pusher.submit(
            step, stream=stream, group=group, me=self.member_id, targets=peers
        )

    def prepare_next(self, nbytes: int) -> None:
        """After a committed step: a spare segment for the next (``RamTier.provision``), so the
        next save does not create its segment file while the step waits; failures are logged."""
        try:
            self.tier.provision(nbytes)
        except Exception as e:
            log.warning("fastckpt: could not provision a RAM segment: %s", e)

    def wait_pushed(self) -> float:
        """Block until this host's pushes of earlier RAM steps finished (bounded by the peer I/O
        timeouts; a failed one counts); returns the seconds waited. Called before staging the
        next RAM step, so a host loss always leaves a complete step on the survivors."""
        pushers = self._pushers()
        if not pushers:
            return 0.0
        t0 = time.perf_counter()
        for p in pushers:
            p.wait_idle()
        return time.perf_counter() - t0

    def pushing(self) -> bool:
        """Whether a push of an earlier RAM step is still running (``wait_pushed`` would wait)."""
        return any(not p.wait_idle(0) for p in self._pushers())

    def _pushers(self) -> list[Replicator | ParityPusher]:
        return [p for p in (self._replicator, self._parity_pusher) if p is not None]

    def wait_replication(self, timeout_s: float | None = None) -> list[ReplicationReport]:
        """Block until pushes of submitted steps finished; return (and forget) their reports,
        oldest first (errors are in them and logged, not raised)."""
        reports = [r for p in self._pushers() for r in p.wait(timeout_s)]
        return sorted(reports, key=lambda r: r.step)

    def holds_alone(self, manifest: Manifest) -> bool:
        """Whether ``manifest`` is of a RAM-only step (storage does not hold it)."""
        return manifest.metadata.get(_TIER_KEY) == self.name

    def close(self) -> None:
        """Stop pushing and serving; close the tier (its files stay for a restarted process)."""
        self.abort()
        for p in self._pushers():
            p.close()
        if self._parity is not None:
            self._parity.reset()
        if self._self_client is not None:
            self._self_client.close()
        for c in self._clients.values():
            c.close()
        self._clients.clear()
        if self._server is not None:
            self._server.close()
        if self._parity_store is not None:
            self._parity_store.discard_from(0)
        self.tier.close()
