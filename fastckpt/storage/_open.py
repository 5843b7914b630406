"""Build a store from a URL."""

from __future__ import annotations

import dataclasses
import re
from urllib.parse import unquote, urlsplit

from fastckpt.errors import ConfigError
from fastckpt.storage._gcs import GcsOptions, GcsStore
from fastckpt.storage._local import LocalStore
from fastckpt.storage._memory import MemoryStore
from fastckpt.storage._protocol import Store
from fastckpt.storage._retry import RetryingStore, RetryPolicy

__all__ = ["DEFAULT_RETRY", "open_store"]

#: The policy :func:`open_store` applies unless told otherwise.
DEFAULT_RETRY = RetryPolicy()

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


def open_store(
    url: str,
    *,
    retry: RetryPolicy | None = DEFAULT_RETRY,
    gcs_options: GcsOptions | None = None,
    gcs_endpoint: str | None = None,
    local_durable: bool = True,
) -> Store:
    """Open the store a URL names.

    Accepted forms:

    * ``gs://bucket`` or ``gs://bucket/prefix`` -> :class:`GcsStore`
    * ``file:///abs/path``, ``/abs/path`` or ``relative/path`` -> :class:`LocalStore`
    * ``mem://name`` -> :class:`MemoryStore` shared by name in this process (``mem://``
      alone: a fresh private one)

    GCS and local stores are wrapped in :class:`RetryingStore` unless ``retry`` is None;
    memory stores never fail transiently and are returned bare.

    Args:
        url: The store URL.
        retry: Retry policy for GCS and local stores; None for no retries.
        gcs_options: Base options for a GCS store.
        gcs_endpoint: GCS endpoint override (e.g. an emulator); replaces
            ``gcs_options.endpoint`` (with neither: see :class:`GcsStore`).
        local_durable: fsync local writes.

    ``ConfigError`` for an unknown scheme or a malformed URL.
    """
    if not isinstance(url, str) or not url:
        raise ConfigError(f"store URL must be a non-empty str, got {url!r}")
    match = _SCHEME.match(url)
    scheme = match.group(1).lower() if match else ""
    store: Store
    if scheme == "gs":
        parts = urlsplit(url)
        if not parts.netloc or parts.query or parts.fragment:
            raise ConfigError(f"malformed GCS URL {url!r}; expected gs://bucket[/prefix]")
        options = gcs_options or GcsOptions()
        if gcs_endpoint is not None:
            options = dataclasses.replace(options, endpoint=gcs_endpoint)
        store = GcsStore(parts.netloc, unquote(parts.path).strip("/"), options=options)
    elif scheme == "mem":
        name = url[len("mem://") :]
        return MemoryStore(name) if name else MemoryStore()
    elif scheme == "file":
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
            raise ConfigError(f"malformed file URL {url!r}; expected file:///absolute/path")
        path = unquote(parts.path)
        if not path.startswith("/"):
            raise ConfigError(f"file URL needs an absolute path: {url!r}")
        store = LocalStore(path, durable=local_durable)
    elif scheme:
        raise ConfigError(
            f"unsupported store URL scheme {scheme!r} in {url!r} (use gs://, file://, mem:// or a "
            "path)"
        )
    else:
        store = LocalStore(url, durable=local_durable)
    return store if retry is None else RetryingStore(store, policy=retry)
