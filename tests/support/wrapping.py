"""A pass-through :class:`~fastckpt.storage.Store` for tests that inject faults or measure.

Subclass :class:`ForwardingStore` and override only what the test changes. The abstract
methods and ``sweep`` are forwarded: ``get_into`` and ``head`` keep the protocol's defaults,
which go through this store's own ``get`` (so a wrapped ``get`` sees every read) unless a
subclass overrides them too.
"""

from __future__ import annotations

from fastckpt.storage import Buffer, ByteRange, ObjectInfo, Payload, PutMode, Store

__all__ = ["ForwardingStore"]


class ForwardingStore(Store):
    """Forwards ``get``, ``put``, ``list``, ``list_info``, ``delete`` and ``sweep`` to ``inner``;
    ``url`` is its url."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.url = inner.url

    async def get(self, key: str, *, byte_range: ByteRange | None = None) -> Buffer:
        return await self.inner.get(key, byte_range=byte_range)

    async def put(self, key: str, data: Payload, *, mode: PutMode = "overwrite") -> None:
        await self.inner.put(key, data, mode=mode)

    async def sweep(self, *, older_than: float, dry_run: bool = False) -> list[str]:
        return await self.inner.sweep(older_than=older_than, dry_run=dry_run)

    async def list_info(self, prefix: str = "") -> list[ObjectInfo]:
        return await self.inner.list_info(prefix)

    async def list(self, prefix: str = "") -> list[str]:
        return await self.inner.list(prefix)

    async def delete(self, key: str) -> None:
        await self.inner.delete(key)
