"""The RAM tier: raw chunk bytes of recent steps in shared-memory files, one directory per process.

Files live under a tmpfs directory (e.g. ``/dev/shm/fastckpt/<namespace>/<slot>``), so they
outlive the process that wrote them (a restarted process on the same host finds them) but
not the host. Layout (see ``docs/replicas.md``)::

    <root>/.lock                        flock held by the one live owner
    <root>/tmp/<uuid>.data              allocated, not yet sealed (deleted on open)
    <root>/spare/<uuid>.data            freed segments kept for reuse (pages already allocated)
    <root>/step-<N>/<seg>.data          a sealed segment: raw chunk bytes
    <root>/step-<N>/<seg>.index.json    its index; written last, its existence is the seal
    <root>/step-<N>/manifest.json       the step's global manifest (marks it committed)

Guarantees:

* Only sealed data is visible: a segment's index is written (atomic rename) after the data
  file is in place, and a process killed at any point leaves nothing half-visible; ``open``
  deletes temp files and data files without an index.
* Bytes held (sealed segments, manifests, unsealed allocations, spares) never exceed
  ``budget_bytes``.
* Retention: once ``keep_steps`` steps are committed (have a manifest), every step older than
  the oldest of the newest ``keep_steps`` committed steps is dropped. Steps newer than that
  (saves and replicas in progress) are kept. Under budget pressure an allocation for step S
  drops spares, then whole steps older than S, oldest first.

Call sequence for a save: ``seg = allocate(step, n)`` → fill ``seg.buffer`` →
``seal(step, seg, index)`` (or ``discard(seg)``) → later ``put_manifest(step, manifest)``.

Hazard: a budget below ``(keep_steps + 1) *`` one step's footprint (own chunks plus replicas
held for peers) makes a new save evict the last committed step before it is sealed itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import mmap
import os
import shutil
import threading
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType

import numpy as np

from fastckpt._checksum import crc32c
from fastckpt.errors import ChecksumMismatchError, ConfigError, FastckptError

__all__ = ["ChunkLocation", "RamBudgetError", "RamTier", "Segment", "StaleStepError"]

_INDEX_SUFFIX = ".index.json"
_DATA_SUFFIX = ".data"
_MANIFEST = "manifest.json"
_INDEX_VERSION = 1
_MIN_RECYCLE_BYTES = 1 << 20
_MAX_SPARES = 1024


class RamBudgetError(ConfigError):
    """A RAM-tier allocation cannot fit in ``budget_bytes`` (or tmpfs is full)."""


class StaleStepError(FastckptError):
    """Data for a step older than every retained committed step; it would be dropped at once."""


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkLocation:
    """Where one chunk lies in a segment."""

    offset: int
    """Byte offset of the chunk in the segment."""
    length: int
    """Raw length of the chunk in bytes."""
    raw_crc32c: int
    """crc32c of the chunk's raw bytes (``ChunkEntry.raw_crc32c``)."""


class Segment:
    """A writable region of the tier, invisible until sealed. Returned by :meth:`RamTier.allocate`.

    Use as a context manager to discard it if the block raises before :meth:`RamTier.seal`.
    """

    def __init__(self, tier: RamTier, step: int, path: Path, mm: mmap.mmap | None, nbytes: int) -> None:
        self._tier = tier
        self.step = step
        """The step this segment was allocated for."""
        self.nbytes = nbytes
        """Size in bytes."""
        self._path = path
        self._mm = mm
        self._buffer: np.ndarray | None = np.frombuffer(mm, np.uint8) if mm is not None else np.empty(0, np.uint8)
        self.state = "open"
        """``"open"``, ``"sealed"`` or ``"discarded"``."""

    @property
    def buffer(self) -> np.ndarray:
        """The writable uint8 array over the whole segment (shared memory; pre-faulted)."""
        if self._buffer is None:
            raise ConfigError(f"segment is {self.state}; its buffer is no longer writable")
        return self._buffer

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if self.state == "open":
            self._tier.discard(self)


class _Sealed:
    """A sealed segment file and its lazily created read mapping."""

    __slots__ = ("dropped", "index_path", "lock", "mm", "nbytes", "path", "view")

    def __init__(self, path: Path, index_path: Path, nbytes: int, mm: mmap.mmap | None = None) -> None:
        self.path = path
        self.index_path = index_path
        self.nbytes = nbytes
        self.mm = mm
        self.view: memoryview | None = memoryview(mm).toreadonly() if mm is not None else None
        self.dropped = False
        self.lock = threading.Lock()

    def slice(self, offset: int, length: int, prefault: bool) -> memoryview | None:
        """A read-only view of ``[offset, offset + length)``; None once the segment is dropped."""
        with self.lock:
            if self.dropped:
                return None
            if self.view is None:
                if self.nbytes == 0:
                    self.view = memoryview(b"")
                else:
                    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if prefault else 0)
                    fd = os.open(self.path, os.O_RDONLY)
                    try:
                        self.mm = mmap.mmap(fd, self.nbytes, flags=flags, prot=mmap.PROT_READ)
                    finally:
                        os.close(fd)
                    self.view = memoryview(self.mm)
            return self.view[offset : offset + length]

    def unmap(self, *, dropped: bool) -> bool:
        """Release the mapping; False if views handed out are still alive (they keep it)."""
        with self.lock:
            self.dropped = self.dropped or dropped
            if self.view is not None:
                self.view.release()
                self.view = None
            mm, self.mm = self.mm, None
            if mm is None:
                return True
            try:
                mm.close()
            except BufferError:
                return False  # exported views keep the mapping alive until collected
            return True


@dataclasses.dataclass
class _Step:
    segments: dict[str, _Sealed] = dataclasses.field(default_factory=dict)
    chunks: dict[str, tuple[_Sealed, ChunkLocation]] = dataclasses.field(default_factory=dict)
    manifest_bytes: int | None = None

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments.values()) + (self.manifest_bytes or 0)


class RamTier:
    """Per-process store of raw chunk bytes per step in shared-memory files. Thread-safe.

    Opening takes an exclusive ``flock`` on the directory (released when the process dies),
    cleans temp leftovers of a crashed owner and loads every sealed segment's index; data is
    mapped lazily on first read.

    Args:
        root: Tier directory (created if missing); should be on tmpfs (``/dev/shm``).
        budget_bytes: Upper bound of bytes held (see module docstring).
        keep_steps: Committed steps to retain.
        prefault: Pre-fault mappings (``MAP_POPULATE``): a new segment's first fill then runs
            at memcpy speed instead of being bound by page faults.
        recycle: Keep freed segment files as spares and reuse them for new allocations of
            similar size (their pages are already allocated: ~4x faster first fill).

    Raises:
        ConfigError: bad arguments, or another live process owns ``root``.
    """

    def __init__(
        self,
        root: str | Path,
        *,
        budget_bytes: int,
        keep_steps: int = 1,
        prefault: bool = True,
        recycle: bool = True,
    ) -> None:
        if budget_bytes <= 0 or keep_steps <= 0:
            raise ConfigError(f"budget_bytes and keep_steps must be > 0, got {budget_bytes}, {keep_steps}")
        self.root = Path(root)
        self.budget_bytes = budget_bytes
        self.keep_steps = keep_steps
        self._prefault = prefault
        self._recycle = recycle
        self._lock = threading.RLock()
        self._steps: dict[int, _Step] = {}
        self._spares: dict[Path, int] = {}
        self._reserved = 0
        self._closed = False
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock_fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise ConfigError(f"RAM tier {self.root} is in use by another live process") from None
        try:
            self._recover()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ open / close

    def _recover(self) -> None:
        tmp, spare = self.root / "tmp", self.root / "spare"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o700)
        spare.mkdir(mode=0o700, exist_ok=True)
        for p in spare.iterdir():
            if self._recycle and p.suffix == _DATA_SUFFIX and p.is_file():
                self._spares[p] = p.stat().st_size
            else:
                _unlink(p)
        for d in self.root.iterdir():
            step = _parse_step_dir(d.name)
            if step is None or not d.is_dir():
                continue
            st = _Step()
            for p in list(d.iterdir()):
                if p.name.endswith(_INDEX_SUFFIX):
                    self._load_index(st, p)
                elif p.name == _MANIFEST:
                    st.manifest_bytes = p.stat().st_size
            for p in d.iterdir():  # data without index, partial temp files: crash debris
                if p.name != _MANIFEST and not p.name.endswith(_INDEX_SUFFIX) and p.name not in st.segments:
                    _unlink(p)
            if st.segments or st.manifest_bytes is not None:
                self._steps[step] = st
            else:
                shutil.rmtree(d, ignore_errors=True)
        with self._lock:
            self._apply_retention()
            self._make_room(0, for_step=None)

    def _load_index(self, st: _Step, index_path: Path) -> None:
        try:
            doc = json.loads(index_path.read_text())
            data_name = doc["data"]
            nbytes = doc["nbytes"]
            if doc.get("version") != _INDEX_VERSION or "/" in data_name or not data_name.endswith(_DATA_SUFFIX):
                raise ValueError("bad index")
            data_path = index_path.parent / data_name
            if data_path.stat().st_size != nbytes:
                raise ValueError("size mismatch")
            sealed = _Sealed(data_path, index_path, nbytes)
            locs = {}
            for cid, off, length, crc in doc["chunks"]:
                if not (isinstance(cid, str) and 0 <= off and 0 <= length and off + length <= nbytes):
                    raise ValueError("bad chunk location")
                locs[cid] = (sealed, ChunkLocation(off, length, crc))
        except (OSError, ValueError, KeyError, TypeError):
            _unlink(index_path)  # unreadable index: the segment was never (validly) sealed
            return
        st.segments[data_name] = sealed
        st.chunks.update(locs)

    def close(self) -> None:
        """Unmap everything and release the directory lock. Data stays on tmpfs. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for st in self._steps.values():
                for seg in st.segments.values():
                    seg.unmap(dropped=True)
            self._steps.clear()
            os.close(self._lock_fd)

    def __enter__(self) -> RamTier:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # ------------------------------------------------------------------ writing

    def allocate(self, step: int, nbytes: int) -> Segment:
        """Reserve a new writable segment of ``nbytes`` for ``step`` (invisible until sealed).

        May free spares and older steps to make room (see module docstring).

        Raises:
            RamBudgetError: ``nbytes`` cannot fit even after freeing older steps, or tmpfs
                has no room.
            StaleStepError: ``step`` is older than the retained committed steps.
        """
        if nbytes < 0 or step < 0:
            raise ConfigError(f"step and nbytes must be >= 0, got {step}, {nbytes}")
        with self._lock:
            self._check_open()
            floor = self._retention_floor()
            if floor is not None and step < floor:
                raise StaleStepError(f"step {step} is older than the retained committed step {floor}")
            spare = self._pick_spare(nbytes)
            self._make_room(nbytes - (self._spares[spare] if spare else 0), for_step=step, keep_spare=spare)
            if spare is not None:
                del self._spares[spare]
            self._reserved += nbytes
        path = self.root / "tmp" / f"{uuid.uuid4().hex}{_DATA_SUFFIX}"
        try:
            mm = self._create_file(path, nbytes, spare)
        except BaseException:
            with self._lock:
                self._reserved -= nbytes
            raise
        return Segment(self, step, path, mm, nbytes)

    def _create_file(self, path: Path, nbytes: int, spare: Path | None) -> mmap.mmap | None:
        if spare is not None:
            os.rename(spare, path)
            fd = os.open(path, os.O_RDWR)
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)  # shrinks a larger spare (frees its tail)
            if nbytes == 0:
                return None
            try:  # reserve the pages now: a full tmpfs fails here, not with SIGBUS on write
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise RamBudgetError(f"no room on {self.root} for {nbytes} bytes (tmpfs full)") from None
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if self._prefault else 0)
            return mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            _unlink(path)
            raise
        finally:
            os.close(fd)

    def seal(self, step: int, seg: Segment, index: Mapping[str, ChunkLocation], *, verify: bool = False) -> None:
        """Make ``seg``'s chunks visible under ``step``. The segment's buffer stays the replica.

        The data file is moved into the step directory, then the index is written (atomic
        rename) last. A chunk id already present in the step is replaced by the new one.
        Afterwards retention runs (which drops ``step`` itself if it is already stale).

        Args:
            step: Must equal ``seg.step``.
            seg: An open segment from :meth:`allocate`.
            index: chunk id → location in the segment; locations must lie inside it.
            verify: Check every chunk's crc32c before sealing (costs a pass over the data).

        Raises:
            ConfigError: bad index or segment state.
            ChecksumMismatchError: ``verify`` found a chunk whose crc32c differs.
        """
        if seg.state != "open" or seg._tier is not self or seg.step != step:
            raise ConfigError(f"cannot seal a {seg.state} segment of step {seg.step} as step {step}")
        for cid, loc in index.items():
            if not isinstance(cid, str) or not cid:
                raise ConfigError(f"chunk ids must be non-empty str, got {cid!r}")
            if loc.offset < 0 or loc.length < 0 or loc.offset + loc.length > seg.nbytes:
                raise ConfigError(f"chunk {cid!r} at {loc} lies outside the {seg.nbytes}-byte segment")
            if verify and crc32c(seg.buffer[loc.offset : loc.offset + loc.length]) != loc.raw_crc32c:
                raise ChecksumMismatchError(f"chunk {cid!r} of step {step} does not match its crc32c")
        with self._lock:
            self._check_open()
            d = self.root / f"step-{step}"
            d.mkdir(exist_ok=True, mode=0o700)
            name = f"{uuid.uuid4().hex}{_DATA_SUFFIX}"
            data_path, index_path = d / name, d / (name[: -len(_DATA_SUFFIX)] + _INDEX_SUFFIX)
            os.rename(seg._path, data_path)
            doc = {
                "version": _INDEX_VERSION,
                "step": step,
                "data": name,
                "nbytes": seg.nbytes,
                "chunks": [[cid, loc.offset, loc.length, loc.raw_crc32c] for cid, loc in index.items()],
            }
            _atomic_write(index_path, json.dumps(doc, separators=(",", ":")).encode())
            sealed = _Sealed(data_path, index_path, seg.nbytes, seg._mm)
            st = self._steps.setdefault(step, _Step())
            st.segments[name] = sealed
            st.chunks.update({cid: (sealed, loc) for cid, loc in index.items()})
            self._reserved -= seg.nbytes
            seg.state, seg._buffer, seg._mm = "sealed", None, None
            self._apply_retention()

    def discard(self, seg: Segment) -> None:
        """Abandon an open segment: its file and reservation are freed. No-op unless open."""
        with self._lock:
            if seg.state != "open" or seg._tier is not self:
                return
            seg.state, seg._buffer = "discarded", None
            self._reserved -= seg.nbytes
            mm, seg._mm = seg._mm, None
        with contextlib.suppress(BufferError):
            if mm is not None:
                mm.close()
        _unlink(seg._path)

    def put_chunk(self, step: int, chunk_id: str, data: memoryview | bytes | np.ndarray, raw_crc32c: int) -> bool:
        """Store one chunk (e.g. pushed by a peer) after verifying its crc32c; atomic.

        Returns:
            True if stored; False if the step already holds this chunk with the same length
            and crc32c (nothing is written).

        Raises:
            ChecksumMismatchError: ``data`` does not match ``raw_crc32c`` (nothing stored).
            RamBudgetError, StaleStepError: as :meth:`allocate`.
        """
        src = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
        if self.has_chunk(step, chunk_id, length=src.nbytes, raw_crc32c=raw_crc32c):
            return False
        if crc32c(src) != raw_crc32c:
            raise ChecksumMismatchError(f"pushed chunk {chunk_id!r} of step {step} does not match its crc32c")
        with self.allocate(step, src.nbytes) as seg:
            seg.buffer[:] = src
            self.seal(step, seg, {chunk_id: ChunkLocation(0, src.nbytes, raw_crc32c)})
        return True

    def put_manifest(self, step: int, data: bytes | memoryview) -> None:
        """Store the global manifest of ``step`` (atomic); this marks the step committed.

        Retention runs afterwards: steps older than the newest ``keep_steps`` committed ones
        are dropped.
        """
        data = bytes(data)
        with self._lock:
            self._check_open()
            floor = self._retention_floor()
            if floor is not None and step < floor:
                raise StaleStepError(f"step {step} is older than the retained committed step {floor}")
            st = self._steps.get(step)
            old = (st.manifest_bytes or 0) if st else 0
            self._make_room(len(data) - old, for_step=step)
            d = self.root / f"step-{step}"
            d.mkdir(exist_ok=True, mode=0o700)
            _atomic_write(d / _MANIFEST, data)
            self._steps.setdefault(step, _Step()).manifest_bytes = len(data)
            self._apply_retention()

    def drop_step(self, step: int) -> None:
        """Remove a step (indexes first, so it turns invisible before data goes). No-op if absent.

        Views returned earlier by :meth:`get_chunk` stay valid; their memory is freed when
        the last one is collected.
        """
        self._drop(step, recycle=self._recycle)

    def _drop(self, step: int, *, recycle: bool) -> None:
        with self._lock:
            st = self._steps.pop(step, None)
            if st is None:
                return
            for seg in st.segments.values():
                _unlink(seg.index_path)
            _unlink(self.root / f"step-{step}" / _MANIFEST)
            for seg in st.segments.values():
                unmapped = seg.unmap(dropped=True)
                if unmapped and recycle and seg.nbytes >= _MIN_RECYCLE_BYTES and len(self._spares) < _MAX_SPARES:
                    spare = self.root / "spare" / f"{uuid.uuid4().hex}{_DATA_SUFFIX}"
                    os.rename(seg.path, spare)
                    self._spares[spare] = seg.nbytes
                else:
                    _unlink(seg.path)
            shutil.rmtree(self.root / f"step-{step}", ignore_errors=True)

    # ------------------------------------------------------------------ reading

    def get_chunk(self, step: int, chunk_id: str, *, verify: bool = False) -> memoryview | None:
        """A read-only, zero-copy view of a sealed chunk, or None if this tier lacks it.

        The view stays valid (and its bytes unchanged) even if the step is dropped meanwhile.

        Raises:
            ChecksumMismatchError: ``verify`` and the bytes do not match the stored crc32c.
        """
        with self._lock:
            st = self._steps.get(step)
            hit = st.chunks.get(chunk_id) if st else None
        if hit is None:
            return None
        seg, loc = hit
        view = seg.slice(loc.offset, loc.length, self._prefault)
        if view is None:  # dropped meanwhile
            return None
        if verify and crc32c(view) != loc.raw_crc32c:
            raise ChecksumMismatchError(f"RAM copy of chunk {chunk_id!r} of step {step} is corrupt")
        return view

    def chunk_location(self, step: int, chunk_id: str) -> ChunkLocation | None:
        """Length and crc32c (and offset in its segment) of a sealed chunk, or None."""
        with self._lock:
            st = self._steps.get(step)
            hit = st.chunks.get(chunk_id) if st else None
        return hit[1] if hit else None

    def has_chunk(self, step: int, chunk_id: str, *, length: int | None = None, raw_crc32c: int | None = None) -> bool:
        """Whether a sealed chunk exists (and, if given, has this length and crc32c)."""
        loc = self.chunk_location(step, chunk_id)
        return (
            loc is not None
            and (length is None or loc.length == length)
            and (raw_crc32c is None or loc.raw_crc32c == raw_crc32c)
        )

    def chunk_ids(self, step: int) -> list[str]:
        """Sorted ids of the sealed chunks of ``step`` (empty if none)."""
        with self._lock:
            st = self._steps.get(step)
            return sorted(st.chunks) if st else []

    def iter_chunks(self, step: int) -> Iterator[tuple[str, ChunkLocation]]:
        """A snapshot of ``(chunk_id, location)`` for the sealed chunks of ``step``."""
        with self._lock:
            st = self._steps.get(step)
            items = [(cid, loc) for cid, (_, loc) in st.chunks.items()] if st else []
        return iter(items)

    def steps(self) -> list[int]:
        """Steps with any sealed chunk or a manifest, sorted."""
        with self._lock:
            return sorted(self._steps)

    def committed_steps(self) -> list[int]:
        """Steps holding a manifest, sorted."""
        with self._lock:
            return sorted(s for s, st in self._steps.items() if st.manifest_bytes is not None)

    def get_manifest(self, step: int) -> bytes | None:
        """The manifest stored for ``step``, or None."""
        with self._lock:
            st = self._steps.get(step)
            if st is None or st.manifest_bytes is None:
                return None
            try:
                return (self.root / f"step-{step}" / _MANIFEST).read_bytes()
            except FileNotFoundError:
                return None

    def nbytes(self) -> int:
        """Bytes held: sealed segments, manifests, unsealed allocations and spares."""
        with self._lock:
            return self._used()

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError(f"RAM tier {self.root} is closed")

    def _used(self) -> int:
        return sum(st.nbytes for st in self._steps.values()) + self._reserved + sum(self._spares.values())

    def _retention_floor(self) -> int | None:
        committed = sorted(s for s, st in self._steps.items() if st.manifest_bytes is not None)
        return committed[-self.keep_steps] if len(committed) >= self.keep_steps else None

    def _apply_retention(self) -> None:
        floor = self._retention_floor()
        if floor is not None:
            for s in [s for s in self._steps if s < floor]:
                self._drop(s, recycle=self._recycle)

    def _pick_spare(self, nbytes: int) -> Path | None:
        """The spare closest in size to ``nbytes`` within a factor of 2 (None if there is none)."""
        fits = [(abs(size - nbytes), p) for p, size in self._spares.items() if nbytes <= 2 * size and size <= 2 * nbytes]
        return min(fits)[1] if fits and nbytes else None

    def _make_room(self, extra: int, *, for_step: int | None, keep_spare: Path | None = None) -> None:
        """Free spares, then steps older than ``for_step``, until ``extra`` more bytes fit."""
        if self._used() + extra <= self.budget_bytes:
            return
        spares = [p for p in self._spares if p != keep_spare]
        older = sorted(s for s in self._steps if for_step is None or s < for_step)
        freeable = sum(self._spares[p] for p in spares) + sum(self._steps[s].nbytes for s in older)
        if self._used() + extra - freeable > self.budget_bytes:
            raise RamBudgetError(
                f"{extra} more bytes do not fit the RAM tier budget of {self.budget_bytes} "
                f"({self._used()} held, {freeable} freeable)"
            )
        for p in spares:
            if self._used() + extra <= self.budget_bytes:
                return
            _unlink(p)
            del self._spares[p]
        for s in older:
            if self._used() + extra <= self.budget_bytes:
                return
            self._drop(s, recycle=False)  # freed for room: not kept as a spare


def _parse_step_dir(name: str) -> int | None:
    if not name.startswith("step-"):
        return None
    digits = name[5:]
    return int(digits) if digits.isdigit() and digits == str(int(digits)) else None


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    os.rename(tmp, path)


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink()
