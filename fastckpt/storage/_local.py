"""Object store over a local (or network) filesystem directory."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn, final

import numpy as np

from fastckpt._aio import BlockingPool
from fastckpt.errors import (
    AlreadyExistsError,
    ConfigError,
    CorruptionError,
    NotFoundError,
    PermissionDeniedError,
    StorageError,
    TransientStorageError,
)
from fastckpt.storage._protocol import (
    Buffer,
    ByteRange,
    ObjectInfo,
    Payload,
    PutMode,
    Store,
    clip_range,
    consume,
    payload_parts,
    validate_cutoff,
    validate_key,
)

__all__ = ["TEMP_SUFFIX", "LocalStore"]

_IOV_MAX = 1024  # buffers per preadv call (Linux UIO_MAXIOV)

#: Suffix of in-flight temporary files. ``list`` never reports them and keys whose last
#: segment ends with it are rejected.
TEMP_SUFFIX = ".fastckpt-tmp"

_TRANSIENT_ERRNOS = frozenset(
    e
    for e in (errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT, getattr(errno, "ESTALE", None))
    if e is not None
)
_WRITE_CHUNK = 64 * 1024 * 1024


def _translate(exc: OSError, what: str) -> NoReturn:
    """Raise the fastckpt error for an ``OSError`` raised while doing ``what``."""
    if isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        raise NotFoundError(f"{what}: {exc}") from exc
    if isinstance(exc, FileExistsError):
        raise AlreadyExistsError(f"{what}: {exc}") from exc
    if isinstance(exc, PermissionError):
        raise PermissionDeniedError(f"{what}: {exc}") from exc
    if exc.errno in _TRANSIENT_ERRNOS or isinstance(exc, TimeoutError):
        raise TransientStorageError(f"{what}: {exc}") from exc
    raise StorageError(f"{what}: {exc}") from exc


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, parts: list[memoryview]) -> None:
    for part in parts:
        view = part
        while view.nbytes:
            written = os.write(fd, view[:_WRITE_CHUNK])
            view = view[written:]


@final
class LocalStore(Store):
    """Objects as files under a root directory.

    Keys map to paths below ``root`` (``a/b/c`` -> ``root/a/b/c``). Guarantees:

    * ``put`` writes a hidden temporary file (suffix :data:`TEMP_SUFFIX`) in the target's
      directory, fsyncs it, then publishes it with ``os.replace`` (overwrite) or
      ``os.link`` (create-only: atomic, refused if the key exists), and fsyncs the
      directory. Readers never see a partial object. A crash may leave temporary files;
      ``list`` and ``get`` ignore them.
    * Blocking calls run on the store's own thread pool.
    * ``list_info`` reports ``stat``'s size and ``st_mtime``; :meth:`sweep` removes temporary
      files older than its cutoff and the empty directories ``delete`` leaves behind (a put
      that loses its new directory to it makes it again).

    Limitation: keys are paths, so a key cannot be both an object and a "directory" of other
    objects (``a`` and ``a/b``); such a put raises ``StorageError``.

    Args:
        root: Directory holding the objects; created on the first put.
        max_workers: Threads for blocking file I/O.
        durable: fsync files and directories (turn off only for scratch data on tmpfs).
    """

    def __init__(
        self, root: str | os.PathLike[str], *, max_workers: int = 8, durable: bool = True
    ) -> None:
        if max_workers < 1:
            raise ConfigError(f"max_workers must be >= 1, got {max_workers}")
        self.root = Path(os.path.abspath(os.fspath(root)))
        self.url = self.root.as_uri()
        self._durable = durable
        self._pool = BlockingPool(max_workers, "fastckpt-local")

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def _path(self, key: str) -> Path:
        validate_key(key)
        if key.rsplit("/", 1)[-1].endswith(TEMP_SUFFIX):
            raise ConfigError(f"object key {key!r} ends with the reserved suffix {TEMP_SUFFIX!r}")
        return self.root / key

    def _makedirs(self, directory: Path) -> None:
        """Create ``directory`` and missing parents, fsyncing each new entry's parent."""
        missing: list[Path] = []
        d = directory
        while not d.is_dir():
            missing.append(d)
            if d.parent == d:
                break
            d = d.parent
        for d in reversed(missing):
            try:
                os.mkdir(d)
            except FileExistsError:
                if not d.is_dir():
                    raise StorageError(
                        f"{self.url}: cannot create directory {d}: an object with that key exists"
                    ) from None
                continue
            except NotADirectoryError as exc:
                raise StorageError(
                    f"{self.url}: cannot create directory {d}: a parent is an object"
                ) from exc
            if self._durable:
                _fsync_dir(d.parent)

    def _get_sync(self, path: Path, key: str, byte_range: ByteRange | None) -> Buffer:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            _translate(exc, f"get {self.url}/{key}")
        try:
            size = os.fstat(fd).st_size
            start, stop = clip_range(size, byte_range, key)
            n = stop - start
            head = b""
            if n < 256 * 1024:
                head = os.pread(fd, n, start) if n else b""
                if len(head) == n:
                    return head  # (short reads, e.g. on network file systems, go on below)
            view = np.empty(n, dtype=np.uint8).data.cast("B")
            view[: len(head)] = head
            done = len(head)
            while done < n:
                got = os.preadv(fd, [view[done:]], start + done)
                if got == 0:
                    raise CorruptionError(f"get {self.url}/{key}: object shrank while reading")
                done += got
            return view
        except OSError as exc:
            _translate(exc, f"get {self.url}/{key}")
        finally:
            os.close(fd)

    def _get_into_sync(self, path: Path, key: str, start: int, into: list[memoryview]) -> None:
        what = f"get {self.url}/{key}"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            _translate(exc, what)
        try:
            total = sum(b.nbytes for b in into)
            size = os.fstat(fd).st_size
            clip_range(size, ByteRange(start, total), key)  # NotFoundError past the end
            if start + total > size:
                raise CorruptionError(f"{what}: object ends at {size}, before {start + total}")
            done, todo = 0, consume(into, 0)
            while todo:
                got = os.preadv(fd, todo[:_IOV_MAX], start + done)
                if got == 0:
                    raise CorruptionError(f"{what}: object shrank while reading")
                done += got
                todo = consume(todo, got)
        except OSError as exc:
            _translate(exc, what)
        finally:
            os.close(fd)

    def _put_sync(self, path: Path, key: str, parts: list[memoryview], mode: PutMode) -> None:
        what = f"put {self.url}/{key}"
        directory = path.parent
        tmp = directory / f".{path.name}.{secrets.token_hex(8)}{TEMP_SUFFIX}"
        try:
            for attempt in range(3):
                self._makedirs(directory)
                try:
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                    break
                except FileNotFoundError:  # a concurrent gc pruned the new, still empty directory
                    if attempt == 2:
                        raise
        except OSError as exc:
            _translate(exc, what)
        try:
            try:
                _write_all(fd, parts)
                if self._durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if mode == "create":
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    raise AlreadyExistsError(f"{what}: the object already exists") from None
            else:
                os.replace(tmp, path)
            if self._durable:
                _fsync_dir(directory)
        except IsADirectoryError as exc:
            raise StorageError(f"{what}: other objects live under this key as a prefix") from exc
        except OSError as exc:
            _translate(exc, what)
        finally:
            # (gone after a rename; never masks the put's own error)
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def _scan(self, prefix: str) -> list[tuple[str, os.DirEntry[str]]]:
        """``(key, entry)`` of every object file whose key starts with ``prefix``, sorted."""
        head, _, _ = prefix.rpartition("/")
        if head:
            try:
                validate_key(head)
            except ConfigError:
                return []  # no valid key can start with this prefix
        out: list[tuple[str, os.DirEntry[str]]] = []
        stack = [(self.root / head if head else self.root, f"{head}/" if head else "")]
        while stack:
            directory, rel = stack.pop()
            try:
                entries = list(os.scandir(directory))
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as exc:
                _translate(exc, f"list {self.url}/{prefix}")
            for entry in entries:
                name = rel + entry.name
                if entry.is_dir(follow_symlinks=False):
                    if name.startswith(prefix) or prefix.startswith(name + "/"):
                        stack.append((Path(entry.path), name + "/"))
                elif name.startswith(prefix) and not entry.name.endswith(TEMP_SUFFIX):
                    out.append((name, entry))
        out.sort(key=lambda e: e[0])
        return out

    def _list_info_sync(self, prefix: str) -> list[ObjectInfo]:
        out = []
        for key, entry in self._scan(prefix):
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue  # deleted since the scan
            except OSError as exc:
                _translate(exc, f"list {self.url}/{prefix}")
            out.append(ObjectInfo(key, st.st_size, st.st_mtime))
        return out

    def _sweep_sync(self, older_than: float, dry_run: bool) -> list[str]:
        found = []
        for dirpath, _, files in os.walk(self.root, topdown=False):  # children before parents
            for name in files:
                path = os.path.join(dirpath, name)
                try:
                    if not name.endswith(TEMP_SUFFIX) or os.stat(path).st_mtime >= older_than:
                        continue
                    if not dry_run:
                        os.unlink(path)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    _translate(exc, f"sweep {self.url}")
                found.append(os.path.relpath(path, self.root))
            if not dry_run and dirpath != str(self.root):
                with contextlib.suppress(OSError):  # not empty (or already gone)
                    os.rmdir(dirpath)
        return sorted(found)

    def _delete_sync(self, path: Path, key: str) -> None:
        try:
            os.unlink(path)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return
        except OSError as exc:
            _translate(exc, f"delete {self.url}/{key}")

    async def get(self, key: str, *, byte_range: ByteRange | None = None) -> Buffer:
        return await self._pool.call(self._get_sync, self._path(key), key, byte_range)

    async def get_into(self, key: str, start: int, into: Sequence[memoryview]) -> None:
        await self._pool.call(
            self._get_into_sync,
            self._path(key),
            key,
            start,
            [memoryview(b).cast("B") for b in into],
        )

    async def put(self, key: str, data: Payload, *, mode: PutMode = "overwrite") -> None:
        path = self._path(key)
        if mode not in ("create", "overwrite"):
            raise ConfigError(f"unknown put mode {mode!r}")
        await self._pool.call(self._put_sync, path, key, payload_parts(data), mode)

    async def list_info(self, prefix: str = "") -> list[ObjectInfo]:
        return await self._pool.call(self._list_info_sync, prefix)

    async def sweep(self, *, older_than: float, dry_run: bool = False) -> list[str]:
        """Remove temporary files of interrupted puts last modified before ``older_than``
        (UNIX time) and, unless ``dry_run``, every empty directory below the root. Returns
        the temporary files' paths relative to the root."""
        return await self._pool.call(self._sweep_sync, validate_cutoff(older_than), dry_run)

    async def list(self, prefix: str = "") -> list[str]:
        return [key for key, _ in await self._pool.call(self._scan, prefix)]

    async def delete(self, key: str) -> None:
        await self._pool.call(self._delete_sync, self._path(key), key)

    async def exists(self, key: str) -> bool:
        return await self._pool.call(os.path.isfile, self._path(key))

    async def close(self) -> None:
        self._pool.close()
