"""The storage protocol: the only thing the writer and reader know about storage.

Object semantics only (no directories, no rename): ranged ``get``, ``put`` with
``mode="create"`` (create-only; fails with :class:`~fastckpt.errors.AlreadyExistsError`
if the key exists) or ``mode="overwrite"``, ``list`` (and ``list_info``, with sizes and write
times) by prefix and ``delete``.

Contracts every backend keeps (checked by :class:`fastckpt.testing.store_tests.StoreTests`):

* ``put`` is atomic: readers see either the old object, the whole new object, or nothing.
  A ``put(mode="create")`` that raced another create for the same key succeeds for exactly
  one caller.
* ``get`` of a missing key raises ``NotFoundError``; a range past the end is clipped to the
  object (like HTTP ranges); a range starting past the end raises ``NotFoundError``.
* ``list(prefix)`` returns every key starting with ``prefix`` (sorted, recursive);
  ``list_info(prefix)`` returns the same objects as :class:`ObjectInfo` (exact size, write
  time), from the listing itself (one request per page, not one per object).
* ``delete`` of a missing key is not an error.
* Keys are ``/``-separated relative paths without ``..``, leading ``/``, empty segments or
  NUL; backends reject others with ``ConfigError``.
* Backend failures are translated into the :mod:`fastckpt.errors` tree; transient failures
  are :class:`~fastckpt.errors.TransientStorageError`. Retries are the job of
  :class:`~fastckpt.storage.RetryingStore`, not of callers.

Stores are used from one asyncio event loop (see ``fastckpt._aio``); blocking work inside a
backend runs on the backend's own thread pool.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Sequence
from typing import Literal, cast

from fastckpt._checksum import crc32c
from fastckpt.errors import ConfigError, CorruptionError, NotFoundError

__all__ = [
    "Buffer",
    "ByteRange",
    "ObjectInfo",
    "ObjectMeta",
    "Payload",
    "PutMode",
    "Store",
    "clip_range",
    "consume",
    "payload_parts",
    "validate_cutoff",
    "validate_key",
]

PutMode = Literal["create", "overwrite"]
Buffer = bytes | bytearray | memoryview
#: What ``put`` accepts: one buffer or a sequence of parts written back to back (no concat).
Payload = Buffer | Sequence[Buffer]


@dataclasses.dataclass(frozen=True, slots=True)
class ByteRange:
    """A half-open byte range ``[start, start + length)`` of an object."""

    start: int
    """First byte, inclusive."""
    length: int
    """Number of bytes; must be >= 0."""

    def __post_init__(self) -> None:
        if self.start < 0 or self.length < 0:
            raise ConfigError(f"invalid byte range start={self.start} length={self.length}")

    @property
    def stop(self) -> int:
        """One past the last byte."""
        return self.start + self.length


def validate_key(key: str) -> str:
    """Return ``key`` if it is a safe relative object key, else raise ``ConfigError``."""
    if not isinstance(key, str) or not key:
        raise ConfigError(f"object key must be a non-empty str, got {key!r}")
    if key.startswith("/") or "\x00" in key or "\\" in key:
        raise ConfigError(f"unsafe object key {key!r}")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ConfigError(f"unsafe object key {key!r}")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: no store can name it
        raise ConfigError(f"object key {key!r} is not valid UTF-8") from None
    return key


def validate_cutoff(older_than: float) -> float:
    """Return ``older_than`` if it is a finite UNIX time, else raise ``ConfigError``."""
    if not isinstance(older_than, (int, float)) or not math.isfinite(older_than):
        raise ConfigError(f"older_than must be a finite UNIX time, got {older_than!r}")
    return older_than


def payload_parts(data: Payload) -> list[memoryview]:
    """Normalise a payload into a list of flat byte memoryviews (no copies). Any object with
    the buffer protocol (a numpy array too) is one buffer; only a list or tuple (or another
    non-buffer sequence) is a sequence of parts."""
    if not isinstance(data, (list, tuple)):
        try:
            return [_flat(cast(Buffer, data))]
        except TypeError:
            pass
    return [_flat(p) for p in cast(Sequence[Buffer], data)]


def _flat(buf: Buffer) -> memoryview:
    view = memoryview(buf)
    if view.ndim == 1 and view.format == "B":
        return view
    if not view.c_contiguous:
        raise ConfigError("payload buffers must be C-contiguous")
    return view.cast("B")


def consume(parts: Sequence[memoryview], n: int) -> list[memoryview]:
    """``parts`` without their first ``n`` bytes (views, no copies): what a scatter read
    that has filled ``n`` bytes still has to fill. Empty parts are dropped."""
    out: list[memoryview] = []
    for p in parts:
        if n >= p.nbytes:
            n -= p.nbytes
            continue
        out.append(p[n:] if n else p)
        n = 0
    return out


def clip_range(size: int, byte_range: ByteRange | None, key: str) -> tuple[int, int]:
    """Return ``(start, stop)`` for ``byte_range`` on an object of ``size`` bytes;
    ``NotFoundError`` if it starts past the end (one starting exactly at the end is empty)."""
    if byte_range is None:
        return 0, size
    if byte_range.start > size:
        raise NotFoundError(
            f"range start {byte_range.start} is past the end ({size} bytes) of {key!r}"
        )
    return byte_range.start, min(byte_range.stop, size)


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectMeta:
    """What :meth:`Store.head` reports about a stored object."""

    size: int
    """Object size in bytes."""
    crc32c: int
    """crc32c (Castagnoli) of the object's bytes, as an unsigned 32-bit int."""


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One object as :meth:`Store.list_info` reports it."""

    key: str
    size: int
    """Object size in bytes (exact)."""
    mtime: float
    """When the object was last written (its latest ``put``), as UNIX time in seconds
    (``time.time()``'s scale). Remote stores report the server's clock."""


class Store(abc.ABC):
    """Abstract async object store. Subclasses must be final (extend by wrapping)."""

    #: A short URL-like description, e.g. ``gs://bucket/prefix`` or ``file:///tmp/x``.
    url: str

    @abc.abstractmethod
    async def get(self, key: str, *, byte_range: ByteRange | None = None) -> Buffer:
        """Return the object's bytes, or the bytes of ``byte_range`` (clipped at the end)."""

    @abc.abstractmethod
    async def put(self, key: str, data: Payload, *, mode: PutMode = "overwrite") -> None:
        """Write an object atomically. ``mode="create"`` fails if the key exists."""

    # (Methods annotated ``-> list[...]`` precede ``list``: below it, the name is the method.)

    async def sweep(self, *, older_than: float, dry_run: bool = False) -> list[str]:
        """Remove what interrupted writes left behind that is no object (never an object),
        written before ``older_than`` (UNIX time); return what was (``dry_run``: would be)
        removed, as paths relative to the store. Default: nothing, for backends whose puts
        leave no debris. Wrappers forward it. A cutoff that is no finite number raises
        ``ConfigError``."""
        del dry_run
        validate_cutoff(older_than)
        return []

    @abc.abstractmethod
    async def list_info(self, prefix: str = "") -> list[ObjectInfo]:
        """The objects :meth:`list` reports for ``prefix``, with size and write time, sorted
        by key. Answered by the listing itself (no request per object)."""

    @abc.abstractmethod
    async def list(self, prefix: str = "") -> list[str]:
        """Return all keys starting with ``prefix``, sorted."""

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Delete a key; deleting a missing key is not an error."""

    async def get_into(self, key: str, start: int, into: Sequence[memoryview]) -> None:
        """Read the ``sum(len(b) for b in into)`` bytes of ``key`` starting at ``start`` into
        the writable byte buffers ``into``, filled back to back (a scatter read).

        Unlike :meth:`get`, the range is exact: an object that ends before the last byte
        raises :class:`~fastckpt.errors.CorruptionError` and a range starting past the end
        raises ``NotFoundError``; after a failure the buffers' contents are unspecified. The
        default reads with :meth:`get` and copies; backends override it to read in place.
        """
        total = sum(b.nbytes for b in into)
        data = memoryview(await self.get(key, byte_range=ByteRange(start, total))).cast("B")
        if data.nbytes != total:
            raise CorruptionError(
                f"{self.url}/{key}: object ends {total - data.nbytes} bytes before {start + total}"
            )
        pos = 0
        for b in into:
            b[:] = data[pos : pos + b.nbytes]
            pos += b.nbytes

    async def exists(self, key: str) -> bool:
        """Whether ``key`` exists (default: a one-byte ranged get)."""
        try:
            await self.get(key, byte_range=ByteRange(0, 0))
        except NotFoundError:
            return False
        return True

    async def head(self, key: str) -> ObjectMeta:
        """Return the object's size and crc32c; raise ``NotFoundError`` if it is missing.
        The default reads the whole object; backends that keep checksums override it."""
        data = await self.get(key)
        return ObjectMeta(size=memoryview(data).nbytes, crc32c=crc32c(data))

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and threads. Idempotent."""
