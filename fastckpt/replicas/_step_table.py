"""What a RAM tier holds per step (:class:`StepState`, rebuilt by :func:`scan_root` when a tier
opens), and :class:`StepTable`, the read side of :class:`~fastckpt.replicas._ram.RamTier`
(internal). Reads take the tier's lock only to look a chunk up: the bytes are served from the
segment's mapping, which guards itself.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path

from fastckpt.replicas._shm import Sealed
from fastckpt.replicas._tier_dir import (
    COMMIT,
    DATA_SUFFIX,
    INDEX_SUFFIX,
    INDEX_VERSION,
    MANIFEST,
    ChunkLocation,
    parse_step_dir,
    unlink,
)

__all__ = ["StepState", "StepTable", "scan_root"]


@dataclasses.dataclass
class StepState:
    """What a tier holds for one step: sealed segments, chunk index, manifest size, and
    whether the step is committed (a manifest or a commit record is stored)."""

    segments: dict[str, Sealed] = dataclasses.field(default_factory=dict)
    chunks: dict[str, tuple[Sealed, ChunkLocation]] = dataclasses.field(default_factory=dict)
    manifest_bytes: int | None = None
    committed: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes held for the step (segments + manifest)."""
        return sum(s.nbytes for s in self.segments.values()) + (self.manifest_bytes or 0)


def load_index(st: StepState, index_path: Path) -> None:
    """Add a sealed segment's index to ``st``; delete an index that is unreadable or whose
    data file is missing or of the wrong size (the segment was never validly sealed)."""
    try:
        doc = json.loads(index_path.read_text())
        data_name = doc["data"]
        nbytes = doc["nbytes"]
        if (
            doc.get("version") != INDEX_VERSION
            or "/" in data_name
            or not data_name.endswith(DATA_SUFFIX)
        ):
            raise ValueError("bad index")
        data_path = index_path.parent / data_name
        if data_path.stat().st_size != nbytes:
            raise ValueError("size mismatch")
        sealed = Sealed(data_path, index_path, nbytes)
        locs = {}
        for cid, off, length, crc in doc["chunks"]:
            if not (isinstance(cid, str) and 0 <= off and 0 <= length and off + length <= nbytes):
                raise ValueError("bad chunk location")
            locs[cid] = (sealed, ChunkLocation(off, length, crc))
    except (OSError, ValueError, KeyError, TypeError):
        unlink(index_path)
        return
    st.segments[data_name] = sealed
    st.chunks.update(locs)


def scan_root(root: Path, *, recycle: bool) -> tuple[dict[Path, int], dict[int, StepState]]:
    """Recover a tier directory after its previous owner died: delete ``tmp/`` and crash
    debris (data files without an index, empty step directories), and return the spares
    (path -> size; all deleted unless ``recycle``) and every step's sealed segments and
    manifest size."""
    tmp, spare = root / "tmp", root / "spare"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o700)
    spare.mkdir(mode=0o700, exist_ok=True)
    spares: dict[Path, int] = {}
    for p in spare.iterdir():
        if recycle and p.suffix == DATA_SUFFIX and p.is_file():
            spares[p] = p.stat().st_size
        else:
            unlink(p)
    steps: dict[int, StepState] = {}
    for d in root.iterdir():
        step = parse_step_dir(d.name)
        if step is None or not d.is_dir():
            continue
        st = StepState()
        # Oldest index first: a chunk sealed again later in the same step (a re-push) must win,
        # as it does in the live tier.
        for p in sorted(d.iterdir(), key=_mtime_ns):
            if p.name.endswith(INDEX_SUFFIX):
                load_index(st, p)
            elif p.name == MANIFEST:
                st.manifest_bytes = p.stat().st_size
                st.committed = True
            elif p.name == COMMIT:
                st.committed = True
        kept = {MANIFEST, COMMIT, *st.segments}
        for p in d.iterdir():  # data without index, partial temp files: crash debris
            if p.name not in kept and not p.name.endswith(INDEX_SUFFIX):
                unlink(p)
        if st.segments or st.committed:
            steps[step] = st
        else:
            shutil.rmtree(d, ignore_errors=True)
    return spares, steps


def _mtime_ns(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0


def _contiguous_segment(hits: Sequence[tuple[Sealed, ChunkLocation] | None]) -> Sealed | None:
    """The segment holding ``hits`` back to back in order; None if any is missing or they
    are not contiguous in one segment."""
    if not hits or hits[0] is None:
        return None
    seg, prev = hits[0]
    for h in hits[1:]:
        if h is None or h[0] is not seg or prev.offset + prev.length != h[1].offset:
            return None
        prev = h[1]
    return seg


class StepTable:
    """The reads of a :class:`~fastckpt.replicas._ram.RamTier` (its base class): chunks,
    spans and manifests of its steps. Thread-safe."""

    root: Path
    _lock: threading.RLock
    _steps: dict[int, StepState]

    def _hit(self, step: int, chunk_id: str) -> tuple[Sealed, ChunkLocation] | None:
        with self._lock:
            st = self._steps.get(step)
            return st.chunks.get(chunk_id) if st else None

    def read_chunk(self, step: int, chunk_id: str) -> tuple[memoryview, ChunkLocation] | None:
        """A read-only, zero-copy view of a sealed chunk and its location, or None (atomic pair).
        The view stays valid (and its bytes unchanged) even if the step is dropped meanwhile."""
        hit = self._hit(step, chunk_id)
        if hit is None:
            return None
        seg, loc = hit
        view = seg.slice(loc.offset, loc.length)
        return None if view is None else (view, loc)  # None: dropped meanwhile

    def segment_of(self, step: int, chunk_id: str) -> memoryview | None:
        """A read-only view of the whole sealed segment holding ``chunk_id`` of ``step`` (a
        writer's stream, for parity), or None; valid as :meth:`read_chunk`'s."""
        hit = self._hit(step, chunk_id)
        return None if hit is None else hit[0].slice(0, hit[0].nbytes)

    def lend_spans(
        self, step: int, groups: Sequence[Sequence[str]]
    ) -> list[tuple[memoryview, list[ChunkLocation]] | None]:
        """Per group of chunk ids, a read-only view spanning them (they must lie back to back
        in one segment) and their locations, in order; None if a chunk is missing, the group
        is empty or not contiguous in one segment, or the step was dropped meanwhile. Does
        not verify checksums (the caller does, against the locations).

        The caller may keep a view indefinitely: its segment is marked lent (the file turns
        read-only), so neither this tier nor one reopened over the directory recycles it;
        once the step is dropped the file is unlinked and its pages (no longer counted
        against ``budget_bytes``) are freed when the last view is collected."""
        with self._lock:
            st = self._steps.get(step)
            hits = [[st.chunks.get(cid) for cid in ids] if st and ids else [None] for ids in groups]
        out: list[tuple[memoryview, list[ChunkLocation]] | None] = [None] * len(groups)
        by_segment: dict[int, tuple[Sealed, list[int]]] = {}
        for i, h in enumerate(hits):
            seg = _contiguous_segment(h)
            if seg is not None:
                by_segment.setdefault(id(seg), (seg, []))[1].append(i)
        for seg, members in by_segment.values():
            spans = []
            for i in members:
                first, last = hits[i][0][1], hits[i][-1][1]  # type: ignore[index]
                spans.append((first.offset, last.offset + last.length - first.offset))
            views = seg.lend(spans)
            if views is None:  # dropped meanwhile
                continue
            for i, view in zip(members, views):
                out[i] = (view, [h[1] for h in hits[i]])  # type: ignore[index]
        return out

    def get_chunk(self, step: int, chunk_id: str) -> memoryview | None:
        """:meth:`read_chunk`'s view alone (unverified)."""
        hit = self.read_chunk(step, chunk_id)
        return None if hit is None else hit[0]

    def chunk_ids(self, step: int) -> list[str]:
        """Sorted ids of the sealed chunks of ``step`` (empty if none)."""
        with self._lock:
            st = self._steps.get(step)
            return sorted(st.chunks) if st else []

    def steps(self) -> list[int]:
        """Steps with any sealed chunk or a manifest, sorted."""
        with self._lock:
            return sorted(self._steps)

    def committed_steps(self) -> list[int]:
        """Committed steps (holding a manifest or a commit record), sorted."""
        with self._lock:
            return sorted(s for s, st in self._steps.items() if st.committed)

    def manifest_steps(self) -> list[int]:
        """Steps whose manifest this tier holds, sorted."""
        with self._lock:
            return sorted(s for s, st in self._steps.items() if st.manifest_bytes is not None)

    def get_manifest(self, step: int) -> bytes | None:
        """The manifest stored for ``step``, or None."""
        with self._lock:
            if step not in self.manifest_steps():
                return None
            try:
                return (self.root / f"step-{step}" / MANIFEST).read_bytes()
            except FileNotFoundError:
                return None
