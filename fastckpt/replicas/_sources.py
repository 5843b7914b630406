"""Per-chunk source choice for a restore (``docs/replicas.md``, "Failure handling"): own RAM
tier, then peers in the given order (with ``use_listing`` only those whose chunk list names
the chunk), then a parity rebuild (tier ``"rebuilt"``), else None (storage). Every copy is
verified against the manifest's ``raw_crc32c``; every failure falls through to the next
source, and a peer that was unreachable or spoke garbage is not asked again. Stats record
successful fetches per tier and every fallback with its reason. Thread-safe.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import numpy as np

from fastckpt._checksum import crc32c
from fastckpt.errors import (
    AuthenticationError,
    ChecksumMismatchError,
    ConfigError,
    PeerError,
    PeerUnavailableError,
    ProtocolError,
)
from fastckpt.replicas._client import PeerClient
from fastckpt.replicas._parity_rebuild import ParityRebuilder
from fastckpt.replicas._ram import RamTier

__all__ = ["SourceStats", "TieredChunkSource"]

_MAX_LOG = 256
_REBUILDS_IN_FLIGHT = 8  # chunks rebuilt from parity at once by one fetch_many
_Runs = Sequence[tuple[int, int]] | None  # byte ranges (start, n) of a chunk; None: all of it

FallbackReason = Literal["miss", "corrupt", "unavailable", "protocol", "error"]


@dataclasses.dataclass
class TierStats:
    """Successful fetches from one tier."""

    chunks: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class Fallback:
    """One source that could not provide a chunk."""

    tier: str
    chunk_id: str
    reason: FallbackReason
    detail: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class SourceStats:
    """A snapshot of a :class:`TieredChunkSource`'s counters."""

    tiers: dict[str, TierStats]
    """``"ram"`` and ``"peer:<name>"`` → successful fetches."""
    fallbacks: dict[FallbackReason, int]
    """How often a source failed, by reason."""
    recent_fallbacks: list[Fallback]
    """The latest fallbacks (bounded log)."""
    not_found: int
    """Chunks no RAM source could provide (left to persistent storage)."""
    dead_peers: list[str]
    """Peers no longer asked."""
    listed_peers: list[str] = dataclasses.field(default_factory=list)
    """Peers whose chunk list was fetched, in the order they were asked."""


class TieredChunkSource:
    """Fetches chunks from own RAM, then peers; None means "read persistent storage".

    Args:
        own: This process's tier, or None.
        peers: Peers in the order to try them.
        use_listing: Ask each peer once per step which chunks it holds, and skip peers that
            do not list a chunk.
        verify: Verify the crc32c of own-RAM copies (peer copies are always verified while
            they arrive).
        known_listings: Chunk lists already fetched, by ``(step, peer name)`` (the step
            selection's; read, never written, and consulted before asking a peer).
        rebuild: A step's rebuilder of chunks from parity, tried after the peers (None:
            none for that step).
    """

    def __init__(
        self,
        own: RamTier | None,
        peers: Sequence[PeerClient] = (),
        *,
        use_listing: bool = True,
        verify: bool = True,
        known_listings: Mapping[tuple[int, str], frozenset[str]] | None = None,
        rebuild: Callable[[int], ParityRebuilder | None] | None = None,
    ) -> None:
        self._own = own
        self._rebuild = rebuild
        self._peers = list(peers)
        self._known = known_listings if known_listings is not None else {}
        self._use_listing = use_listing
        self._verify = verify
        self._lock = threading.Lock()
        self._listing_locks = [threading.Lock() for _ in self._peers]
        self._listings: dict[tuple[int, int], frozenset[str]] = {}
        self._listed_order: list[int] = []
        self._dead: set[int] = set()
        self._tiers: dict[str, TierStats] = {}
        self._fallbacks: collections.Counter[str] = collections.Counter()
        self._log: collections.deque[Fallback] = collections.deque(maxlen=_MAX_LOG)
        self._not_found = 0

    def fetch_many(
        self,
        step: int,
        items: Sequence[tuple[str, int, int, memoryview | np.ndarray]],
        *,
        runs: Sequence[Sequence[tuple[int, int]] | None] | None = None,
    ) -> list[str | None]:
        """Fill each item's ``into`` (exactly ``raw_length`` bytes) with the chunk's verified raw
        bytes: ``(chunk_id, raw_length, raw_crc32c, into)`` each. Each peer gets the chunks
        still missing that it lists in one stream (``get_chunks``). With ``runs``, an item
        whose entry is not None gets only those byte ranges ``(start, n)`` (ascending,
        disjoint) at their place in ``into`` (``get_ranges``, still checked against the whole
        chunk's crc32c). Returns the tier per item, None where no RAM source had a good copy.
        """
        dsts = []
        spans = list(runs) if runs is not None else [None] * len(items)
        if len(spans) != len(items):
            raise ConfigError(f"{len(spans)} run lists for {len(items)} items")
        for cid, n, _, into in items:
            dst = (
                np.frombuffer(into, np.uint8)
                if not isinstance(into, np.ndarray)
                else into.reshape(-1).view(np.uint8)
            )
            if dst.nbytes != n:
                raise ConfigError(f"into has {dst.nbytes} bytes, chunk {cid!r} has {n}")
            dsts.append(dst)
        out: list[str | None] = [None] * len(items)
        if self._own is not None:
            for k, ((cid, n, crc, _), dst) in enumerate(zip(items, dsts)):
                if self._fetch_own(step, cid, n, crc, dst, spans[k]):
                    out[k] = "ram"
        for i, peer in enumerate(self._peers):
            todo = [k for k in range(len(items)) if out[k] is None]
            if not todo:
                break
            if i in self._dead:
                continue
            todo = [k for k in todo if self._listed(i, step, items[k][0])]
            if not todo:
                continue
            whole = [k for k in todo if spans[k] is None]
            ranged = [k for k in todo if spans[k] is not None]
            tier = f"peer:{peer.name}"
            t0 = time.perf_counter()
            results: dict[int, str] = {}
            for ks, by_range in ((whole, False), (ranged, True)):
                if not ks:
                    continue
                try:
                    if by_range:
                        answers = peer.get_ranges(
                            step, [(items[k][0], dsts[k], items[k][2], spans[k] or ()) for k in ks]
                        )
                    else:
                        answers = peer.get_chunks(
                            step, [(items[k][0], dsts[k], items[k][2]) for k in ks]
                        )
                    results.update(zip(ks, answers))
                except PeerUnavailableError as e:
                    self._fallback(tier, items[ks[0]][0], "unavailable", e, dead=i)
                    break
                except (ProtocolError, AuthenticationError) as e:
                    self._fallback(tier, items[ks[0]][0], "protocol", e, dead=i)
                    break
                except PeerError as e:
                    self._fallback(tier, items[ks[0]][0], "error", e)
                    break
            got = nok = 0
            for k, r in results.items():
                if r == "ok":
                    out[k] = tier
                    got += _run_bytes(spans[k], items[k][1])
                    nok += 1
                else:
                    self._fallback(tier, items[k][0], "miss" if r == "missing" else "corrupt", None)
            if nok:
                self._success(tier, got, time.perf_counter() - t0, chunks=nok)
        lost = [k for k in range(len(items)) if out[k] is None]
        if lost and self._rebuild is not None:
            rb = self._rebuild(step)
            if rb is not None:
                lost = [lost[i] for i in rb.order([items[k][0] for k in lost])]

            # Several chunks at once: each asks only the holders of its parts, so one at a
            # time would leave the others idle between round trips.
            def rebuilt(k: int) -> bool:
                cid, n, crc, _ = items[k]
                return self._fetch_rebuilt(rb, cid, n, crc, dsts[k], spans[k])

            with ThreadPoolExecutor(
                min(_REBUILDS_IN_FLIGHT, len(lost)), thread_name_prefix="fastckpt-rebuild"
            ) as pool:
                for k, ok in zip(lost, pool.map(rebuilt, lost)):
                    if ok:
                        out[k] = "rebuilt"
        with self._lock:
            self._not_found += sum(1 for t in out if t is None)
        return out

    def lend_many(
        self, step: int, groups: Sequence[Sequence[tuple[str, int, int]]], *, verify: bool = True
    ) -> list[memoryview | None]:
        """Per group of ``(chunk_id, raw_length, raw_crc32c)`` (in the order they must appear),
        a verified, read-only view of them back to back straight from this process's tier,
        which may be kept indefinitely (:meth:`RamTier.lend_spans`). None if there is no own
        tier, they are not back to back in one segment, or a copy fails verification (then
        :meth:`fetch_many` them). ``verify=False`` skips the checksums (the tier's record must
        still match length and crc32c): the caller must verify every chunk of a view before
        using it and :meth:`fetch_many` those of a view that fails; such views count as lent
        in :meth:`stats` whatever the caller finds.
        """
        if self._own is None:
            return [None] * len(groups)
        t0 = time.perf_counter()
        out: list[memoryview | None] = []
        nchunks = nbytes = 0
        hits = self._own.lend_spans(step, [[c[0] for c in g] for g in groups])
        for chunks, hit in zip(groups, hits):
            if hit is None:  # (an empty group gets None from lend_spans)
                out.append(None)
                continue
            view, locs = hit
            base = locs[0].offset
            if verify and self._verify:
                ok = all(
                    loc.length == length
                    and crc32c(view[loc.offset - base : loc.offset - base + loc.length]) == crc
                    for (_, length, crc), loc in zip(chunks, locs)
                )
            else:  # the tier's record must at least name the same bytes
                ok = all(
                    loc.length == length and loc.raw_crc32c == crc
                    for (_, length, crc), loc in zip(chunks, locs)
                )
            out.append(view if ok else None)  # a bad copy: the fetch that follows records it
            if ok:
                nchunks += len(chunks)
                nbytes += sum(c[1] for c in chunks)
        if nchunks:
            self._success("ram", nbytes, time.perf_counter() - t0, chunks=nchunks)
        return out

    def stats(self) -> SourceStats:
        """A snapshot of the counters."""
        with self._lock:
            return SourceStats(
                tiers={k: dataclasses.replace(v) for k, v in self._tiers.items()},
                fallbacks=dict(self._fallbacks),  # type: ignore[arg-type]
                recent_fallbacks=list(self._log),
                not_found=self._not_found,
                dead_peers=[self._peers[i].name for i in sorted(self._dead)],
                listed_peers=[self._peers[i].name for i in self._listed_order],
            )

    def _fetch_own(
        self, step: int, cid: str, n: int, crc: int, dst: np.ndarray, runs: _Runs
    ) -> bool:
        """The own tier's copy of the chunk into ``dst``: whole, or only the byte ranges
        ``runs`` (the whole copy is verified either way)."""
        assert self._own is not None
        t0 = time.perf_counter()
        view = self._own.get_chunk(step, cid)
        if view is None:
            self._fallback("ram", cid, "miss", None)
            return False
        if view.nbytes != n or (self._verify and crc32c(view) != crc):
            self._fallback(
                "ram", cid, "corrupt", f"{view.nbytes} bytes, crc32c mismatch or wrong length"
            )
            return False
        _copy_runs(dst, np.frombuffer(view, np.uint8), runs)
        self._success("ram", _run_bytes(runs, n), time.perf_counter() - t0)
        return True

    def _fetch_rebuilt(
        self, rb: ParityRebuilder | None, cid: str, n: int, crc: int, dst: np.ndarray, runs: _Runs
    ) -> bool:
        """The chunk rebuilt from parity into ``dst`` (only ``runs`` of it, if given)."""
        t0 = time.perf_counter()
        buf = dst if runs is None else np.empty(n, np.uint8)
        try:
            if rb is None or not rb.rebuild(cid, n, crc, buf):
                self._fallback("rebuilt", cid, "miss", None)
                return False
        except ChecksumMismatchError as e:
            self._fallback("rebuilt", cid, "corrupt", e)
            return False
        except PeerError as e:
            self._fallback("rebuilt", cid, "error", e)
            return False
        if runs is not None:
            _copy_runs(dst, buf, runs)
        self._success("rebuilt", _run_bytes(runs, n), time.perf_counter() - t0)
        return True

    def _listed(self, i: int, step: int, chunk_id: str) -> bool:
        if not self._use_listing:
            return True
        key = (step, i)
        listing = self._listings.get(key)
        if listing is None:
            with self._listing_locks[i]:
                listing = self._listings.get(key)
                if listing is None:
                    peer = self._peers[i]
                    try:
                        listing = self._known.get((step, peer.name))
                        if listing is None:
                            listing = frozenset(peer.list_chunks(step))
                    except PeerUnavailableError as e:
                        self._fallback(f"peer:{peer.name}", chunk_id, "unavailable", e, dead=i)
                        return False
                    except PeerError as e:
                        self._fallback(f"peer:{peer.name}", chunk_id, "protocol", e, dead=i)
                        return False
                    with self._lock:
                        self._listings[key] = listing
                        self._listed_order.append(i)
        return chunk_id in listing

    def _success(self, tier: str, nbytes: int, seconds: float, *, chunks: int = 1) -> None:
        with self._lock:
            st = self._tiers.setdefault(tier, TierStats())
            st.chunks += chunks
            st.bytes += nbytes
            st.seconds += seconds

    def _fallback(
        self, tier: str, cid: str, reason: FallbackReason, err: object, *, dead: int | None = None
    ) -> None:
        with self._lock:
            self._fallbacks[reason] += 1
            self._log.append(Fallback(tier, cid, reason, "" if err is None else str(err)[:300]))
            if dead is not None:
                self._dead.add(dead)


def _copy_runs(dst: np.ndarray, src: np.ndarray, runs: _Runs) -> None:
    """``dst[a:a+n] = src[a:a+n]`` for each run (the whole chunk when ``runs`` is None)."""
    if runs is None:
        np.copyto(dst, src)
    for a, n in runs or ():
        dst[a : a + n] = src[a : a + n]


def _run_bytes(runs: _Runs, whole: int) -> int:
    """Bytes a fetch of ``runs`` of a chunk of ``whole`` bytes moves (None: the whole chunk)."""
    return whole if runs is None else sum(n for _, n in runs)
