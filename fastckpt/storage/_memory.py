"""In-process object store backed by a dict; the default fake for tests."""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from typing import ClassVar, final

from fastckpt.errors import AlreadyExistsError, ConfigError, NotFoundError
from fastckpt.storage._protocol import (
    Buffer,
    ByteRange,
    ObjectInfo,
    Payload,
    PutMode,
    Store,
    clip_range,
    payload_parts,
    validate_key,
)

__all__ = ["MemoryStore"]


@dataclasses.dataclass(slots=True, weakref_slot=True, eq=False)
class _Objects:
    """The shared state of one named (or anonymous) memory store: key -> (bytes, put time)."""

    data: dict[str, tuple[bytes, float]] = dataclasses.field(default_factory=dict)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


@final
class MemoryStore(Store):
    """A thread-safe in-process store.

    Stored objects are immutable ``bytes``; :meth:`get` returns a read-only, zero-copy
    ``memoryview`` slice of them. ``put`` copies the payload once (the caller may reuse
    its buffers afterwards) and records ``time.time()`` as the object's ``mtime``.

    Stores opened with the same ``name`` in one process share their objects while at least
    one of them is alive (``mem://name`` URLs rely on this); unnamed stores are private.
    """

    _named: ClassVar[weakref.WeakValueDictionary[str, _Objects]] = weakref.WeakValueDictionary()
    _named_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, name: str | None = None) -> None:
        if name is None:
            self._objects = _Objects()
            self.url = f"mem://anonymous-{id(self._objects):x}"
        else:
            if not isinstance(name, str) or not name or "/" in name:
                raise ConfigError(
                    f"memory store name must be a non-empty str without '/', got {name!r}"
                )
            with MemoryStore._named_lock:
                objects = MemoryStore._named.get(name)
                if objects is None:
                    objects = _Objects()
                    MemoryStore._named[name] = objects
            self._objects = objects
            self.url = f"mem://{name}"
        self.name = name

    def __repr__(self) -> str:
        return f"MemoryStore({self.url!r})"

    async def get(self, key: str, *, byte_range: ByteRange | None = None) -> Buffer:
        validate_key(key)
        with self._objects.lock:
            entry = self._objects.data.get(key)
        if entry is None:
            raise NotFoundError(f"{self.url}/{key}")
        blob = entry[0]
        start, stop = clip_range(len(blob), byte_range, key)
        return memoryview(blob)[start:stop]

    async def put(self, key: str, data: Payload, *, mode: PutMode = "overwrite") -> None:
        validate_key(key)
        if mode not in ("create", "overwrite"):
            raise ConfigError(f"unknown put mode {mode!r}")
        blob = b"".join(payload_parts(data))
        with self._objects.lock:
            if mode == "create" and key in self._objects.data:
                raise AlreadyExistsError(f"{self.url}/{key}")
            self._objects.data[key] = (blob, time.time())

    async def list_info(self, prefix: str = "") -> list[ObjectInfo]:
        with self._objects.lock:
            infos = [
                ObjectInfo(k, len(b), t)
                for k, (b, t) in self._objects.data.items()
                if k.startswith(prefix)
            ]
        return sorted(infos, key=lambda i: i.key)

    async def list(self, prefix: str = "") -> list[str]:
        return [info.key for info in await self.list_info(prefix)]

    async def delete(self, key: str) -> None:
        validate_key(key)
        with self._objects.lock:
            self._objects.data.pop(key, None)

    async def exists(self, key: str) -> bool:
        validate_key(key)
        with self._objects.lock:
            return key in self._objects.data
