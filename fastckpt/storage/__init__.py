"""Object storage for fastckpt: the :class:`Store` protocol and its backends.

Backends: :class:`MemoryStore` (in-process), :class:`LocalStore` (files),
:class:`GcsStore` (Google Cloud Storage), and the :class:`RetryingStore` wrapper.
:func:`open_store` builds one from a URL. See ``docs/storage.md``.
"""

from __future__ import annotations

from fastckpt.storage._gcs import GcsOptions as GcsOptions
from fastckpt.storage._gcs import GcsStore as GcsStore
from fastckpt.storage._local import LocalStore as LocalStore
from fastckpt.storage._memory import MemoryStore as MemoryStore
from fastckpt.storage._open import DEFAULT_RETRY as DEFAULT_RETRY
from fastckpt.storage._open import open_store as open_store
from fastckpt.storage._protocol import Buffer as Buffer
from fastckpt.storage._protocol import ByteRange as ByteRange
from fastckpt.storage._protocol import ObjectInfo as ObjectInfo
from fastckpt.storage._protocol import ObjectMeta as ObjectMeta
from fastckpt.storage._protocol import Payload as Payload
from fastckpt.storage._protocol import PutMode as PutMode
from fastckpt.storage._protocol import Store as Store
from fastckpt.storage._protocol import validate_key as validate_key
from fastckpt.storage._retry import RetryingStore as RetryingStore
from fastckpt.storage._retry import RetryPolicy as RetryPolicy

__all__ = [
    "DEFAULT_RETRY",
    "Buffer",
    "ByteRange",
    "GcsOptions",
    "GcsStore",
    "LocalStore",
    "MemoryStore",
    "ObjectInfo",
    "ObjectMeta",
    "Payload",
    "PutMode",
    "RetryPolicy",
    "RetryingStore",
    "Store",
    "open_store",
    "validate_key",
]
