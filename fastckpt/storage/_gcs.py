"""Google Cloud Storage backend.

Control calls (list, list_info, delete, head) go through ``google-cloud-storage``'s client;
the data path talks to the JSON API directly over the client's pooled, authorised session:

* ``put`` is one multipart upload (``uploadType=multipart``) whose body is streamed from the
  caller's buffers without concatenating them. It carries the payload's crc32c, so GCS
  rejects a corrupted upload, and ``mode="create"`` adds ``ifGenerationMatch=0`` (the
  emulator enforces preconditions on this path, unlike simple media uploads).
* ``get`` streams ``alt=media`` (with an HTTP ``Range``) straight into one preallocated
  buffer. A whole-object download is checked against the object's crc32c from the
  ``x-goog-hash`` header (a mismatch is a transient error, so it is read again); ranged
  reads are verified by the reader against the manifest's chunk checksums.

The library's own retries are disabled everywhere (``retry=None``; the session has no
urllib3 retries): retrying is :class:`~fastckpt.storage.RetryingStore`'s job.
``STORAGE_EMULATOR_HOST`` (see :class:`GcsStore`) is the one environment variable fastckpt
reads unasked, as the GCS client convention has it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import secrets
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast, final
from urllib.parse import quote

import numpy as np

from fastckpt._aio import BlockingPool
from fastckpt._checksum import crc32c_parts
from fastckpt.errors import (
    AlreadyExistsError,
    ChecksumMismatchError,
    ConfigError,
    CorruptionError,
    NotFoundError,
    PermissionDeniedError,
    StorageError,
    TransientStorageError,
)
from fastckpt.storage._gcs_http import (
    StreamBody,
    b64_crc,
    check_media_response,
    check_whole_object,
    crc_from_b64,
    discard,
    end_response,
    readinto_parts,
    status_error,
    translate,
)
from fastckpt.storage._protocol import (
    Buffer,
    ByteRange,
    ObjectInfo,
    ObjectMeta,
    Payload,
    PutMode,
    Store,
    clip_range,
    payload_parts,
    validate_key,
)

if TYPE_CHECKING:
    import requests
    from google.cloud import storage

__all__ = ["GcsOptions", "GcsStore"]

T = TypeVar("T")

_SCOPES = ("https://www.googleapis.com/auth/devstorage.read_write",)
_DEFAULT_BASE = "https://storage.googleapis.com"
_EMULATOR_ENV = "STORAGE_EMULATOR_HOST"


def _emulator_endpoint() -> str | None:
    """``STORAGE_EMULATOR_HOST`` as a base URL (``http://`` added to a bare ``host:port``, as
    gcsfs does), or None when it is unset or empty."""
    value = os.environ.get(_EMULATOR_ENV, "").strip()
    if not value:
        return None
    return value if value.startswith(("http://", "https://")) else f"http://{value}"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GcsOptions:
    """Options for :class:`GcsStore`. The options themselves read nothing from the
    environment; :class:`GcsStore` fills in ``endpoint`` from ``STORAGE_EMULATOR_HOST``."""

    endpoint: str | None = None
    """Base URL of a GCS-compatible endpoint (an emulator: ``http://127.0.0.1:4443``), anonymous
    unless ``credentials`` are given. None: see :class:`GcsStore`."""
    project: str | None = None
    """Project for the client (only used for billing/quota headers)."""
    credentials: Any = None
    """``google.auth`` credentials; None means Application Default Credentials (or
    anonymous with ``endpoint``)."""
    max_workers: int = 16
    """Threads (and pooled HTTP connections) for blocking requests."""
    connect_timeout_s: float = 10.0
    """Per-request connect timeout."""
    read_timeout_s: float = 60.0
    """Per-request timeout between bytes received (not for the whole transfer)."""
    list_page_size: int = 1000
    """Objects per list request (1000 is the JSON API's maximum); a listing pages on."""

    def __post_init__(self) -> None:
        if self.max_workers < 1:
            raise ConfigError(f"max_workers must be >= 1, got {self.max_workers}")
        if self.connect_timeout_s <= 0 or self.read_timeout_s <= 0:
            raise ConfigError("timeouts must be > 0")
        if not 1 <= self.list_page_size <= 1000:
            raise ConfigError(f"list_page_size must be in [1, 1000], got {self.list_page_size}")
        if self.endpoint is not None and not self.endpoint.startswith(("http://", "https://")):
            raise ConfigError(f"endpoint must be an http(s) URL, got {self.endpoint!r}")


@final
class GcsStore(Store):
    """Objects in a GCS bucket, under an optional prefix.

    Object names are ``prefix/key``. All blocking HTTP runs on a private thread pool of
    ``options.max_workers`` threads sharing one pooled session, made (with the client) on a
    background thread at construction.

    Endpoint, as google-cloud-storage's ``Client`` chooses it: ``options.endpoint`` if set;
    else ``STORAGE_EMULATOR_HOST`` if set (read once, here; a bare ``host:port`` gets
    ``http://``), anonymous unless ``options.credentials`` is given; else Google's, with
    Application Default Credentials. :attr:`options` holds the endpoint chosen.

    Args:
        bucket: Bucket name.
        prefix: Key prefix inside the bucket ("" for the bucket root); no leading or
            trailing ``/`` needed.
        options: Endpoint, credentials, concurrency and timeouts.
    """

    def __init__(self, bucket: str, prefix: str = "", *, options: GcsOptions | None = None) -> None:
        if not bucket or "/" in bucket:
            raise ConfigError(f"invalid bucket name {bucket!r}")
        prefix = prefix.strip("/")
        if prefix:
            validate_key(prefix)
        self.bucket = bucket
        self.prefix = prefix
        options = options or GcsOptions()
        if options.endpoint is None and (emulator := _emulator_endpoint()) is not None:
            options = dataclasses.replace(options, endpoint=emulator)
        self.options = options
        self.url = f"gs://{bucket}/{prefix}" if prefix else f"gs://{bucket}"
        self._base = (self.options.endpoint or _DEFAULT_BASE).rstrip("/")
        self._timeout = (self.options.connect_timeout_s, self.options.read_timeout_s)
        self._connect_lock = threading.Lock()  # guards _client/_session creation
        self._pool = BlockingPool(self.options.max_workers, "fastckpt-gcs")
        self._client: storage.Client | None = None
        self._session: requests.Session | None = None
        # The client and session are made on a daemon thread (a first request does not wait
        # for credentials; a failure is raised again where the client is needed); their
        # modules are imported here, as an import there would hold the GIL against a save.
        with contextlib.suppress(ImportError):  # (it imports google-auth and requests too)
            importlib.import_module("google.cloud.storage")
        self._warm = threading.Thread(target=self._warm_up, name="fastckpt-gcs-warm", daemon=True)
        self._warm.start()

    def __repr__(self) -> str:
        return f"GcsStore({self.url!r}, endpoint={self.options.endpoint!r})"

    def _warm_up(self) -> None:
        with contextlib.suppress(Exception):  # raised again where the client is needed
            self._connect()

    def _connect(self) -> tuple[storage.Client, requests.Session]:
        """Create the client and pooled session once (called on a worker thread)."""
        with self._connect_lock:
            if self._client is not None and self._session is not None:
                return self._client, self._session
            try:
                import requests.adapters
                from google.api_core.client_options import ClientOptions
                from google.auth.credentials import AnonymousCredentials
                from google.auth.transport.requests import AuthorizedSession
                from google.cloud import storage
            except ImportError as exc:  # pragma: no cover - dependency missing
                raise ConfigError(f"GcsStore needs google-cloud-storage: {exc}") from exc

            opts = self.options
            credentials = opts.credentials
            project = opts.project
            try:
                if credentials is None and opts.endpoint is not None:
                    credentials = AnonymousCredentials()
                    project = project or "fastckpt"
                elif credentials is None:
                    import google.auth

                    credentials, default_project = google.auth.default(scopes=list(_SCOPES))
                    project = project or default_project
            except Exception as exc:
                raise PermissionDeniedError(
                    f"{self.url}: no usable Google credentials: {exc}"
                ) from exc
            session = AuthorizedSession(credentials)
            adapter = requests.adapters.HTTPAdapter(
                pool_connections=4, pool_maxsize=opts.max_workers + 2, max_retries=0
            )
            session.mount("https://", adapter)
            session.mount("http://", adapter)
            client_options = ClientOptions(api_endpoint=opts.endpoint) if opts.endpoint else None
            client = storage.Client(
                project=project,
                credentials=credentials,
                _http=session,
                client_options=client_options,
            )
            # google-cloud-storage >= 3.x starts a thread per bucket that calls get_bucket with
            # default retries, ignoring ours and outliving close(), while this is truthy.
            if getattr(client, "_bucket_metadata_cache", None) is not None:
                client._bucket_metadata_cache = None
            self._client, self._session = client, session
            return client, session

    def _name(self, key: str) -> str:
        validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _media_url(self, name: str) -> str:
        bucket, obj = quote(self.bucket, safe=""), quote(name, safe="")
        return f"{self._base}/download/storage/v1/b/{bucket}/o/{obj}?alt=media"

    def _head_sync(self, name: str, key: str) -> ObjectMeta:
        what = f"head {self.url}/{key}"
        client, _ = self._connect()
        try:
            blob = client.bucket(self.bucket).get_blob(name, retry=None, timeout=self._timeout)
        except Exception as exc:
            translate(exc, what)
        if blob is None:
            raise NotFoundError(what)
        if blob.crc32c is None or blob.size is None:
            raise StorageError(f"{what}: the server reported no size/crc32c")
        return ObjectMeta(size=int(blob.size), crc32c=crc_from_b64(blob.crc32c))

    def _get_sync(self, name: str, key: str, byte_range: ByteRange | None) -> Buffer:
        what = f"get {self.url}/{key}"
        if byte_range is not None and byte_range.length == 0:
            clip_range(self._head_sync(name, key).size, byte_range, key)  # NotFoundError past end
            return b""
        headers = {"Accept-Encoding": "identity"}
        if byte_range is not None:
            headers["Range"] = f"bytes={byte_range.start}-{byte_range.stop - 1}"
        resp = self._media_get(name, headers, what)
        complete = False
        try:
            if resp.status_code == 416 and byte_range is not None:
                clip_range(self._head_sync(name, key).size, byte_range, key)
                return b""
            check_media_response(resp, what)
            body = self._read_body(resp, what)
            complete = True
            if resp.status_code == 200:
                check_whole_object(resp.headers.get("x-goog-hash"), body, what)
            if byte_range is not None and resp.status_code == 200:
                # The server ignored the Range header; cut the range out ourselves.
                start, stop = clip_range(len(body), byte_range, key)
                return body[start:stop]
            return body
        except Exception as exc:
            translate(exc, what)
        finally:
            end_response(resp, reuse=complete)

    def _media_get(self, name: str, headers: dict[str, str], what: str) -> requests.Response:
        """Start a streamed GET of the object's bytes; errors translated."""
        _, session = self._connect()
        try:
            return session.get(
                self._media_url(name), headers=headers, stream=True, timeout=self._timeout
            )
        except Exception as exc:
            translate(exc, what)

    @staticmethod
    def _read_body(resp: requests.Response, what: str) -> memoryview | bytes:
        length = resp.headers.get("Content-Length")
        if length is None:
            return cast(bytes, resp.raw.read(decode_content=False))
        n = int(length)
        if n == 0:
            return b""
        view = np.empty(n, dtype=np.uint8).data.cast("B")
        readinto_parts(resp, [view], what)
        return view

    def _get_into_sync(self, name: str, key: str, start: int, into: list[memoryview]) -> None:
        what = f"get {self.url}/{key}"
        total = sum(b.nbytes for b in into)
        if total == 0:
            clip_range(self._head_sync(name, key).size, ByteRange(start, 0), key)
            return
        headers = {"Accept-Encoding": "identity", "Range": f"bytes={start}-{start + total - 1}"}
        resp = self._media_get(name, headers, what)
        complete = False
        try:
            if resp.status_code == 416:
                size = self._head_sync(name, key).size
                clip_range(size, ByteRange(start, total), key)  # NotFoundError past the end
                raise CorruptionError(f"{what}: object ends at {size}, before {start + total}")
            check_media_response(resp, what)
            length = resp.headers.get("Content-Length")
            skip = start if resp.status_code == 200 else 0  # 200: the server ignored the Range
            if length is not None and int(length) < skip + total:
                raise CorruptionError(
                    f"{what}: object ends {skip + total - int(length)} bytes before {start + total}"
                )
            if skip:
                discard(resp, skip, what)
            readinto_parts(resp, into, what)
            # Reuse the connection only if nothing of the body is left unread.
            complete = resp.status_code == 206 and length is not None and int(length) == total
        except Exception as exc:
            translate(exc, what)
        finally:
            end_response(resp, reuse=complete)

    def _put_sync(self, name: str, key: str, parts: list[memoryview], mode: PutMode) -> None:
        what = f"put {self.url}/{key}"
        _, session = self._connect()
        crc = crc32c_parts(parts)
        boundary = "fastckpt-" + secrets.token_hex(16)
        metadata = json.dumps({"name": name, "crc32c": b64_crc(crc)})
        head = (
            f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n{metadata}\r\n"
            f"--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n"
        ).encode()
        tail = f"\r\n--{boundary}--\r\n".encode()
        url = (
            f"{self._base}/upload/storage/v1/b/{quote(self.bucket, safe='')}/o?uploadType=multipart"
        )
        if mode == "create":
            url += "&ifGenerationMatch=0"
        try:
            resp = session.post(  # requests streams any iterable of buffers
                url,
                data=cast(Any, StreamBody([head, *parts, tail])),
                headers={"Content-Type": f"multipart/related; boundary={boundary}"},
                timeout=self._timeout,
            )
        except Exception as exc:
            translate(exc, what)
        with resp:
            if resp.status_code == 412 and mode == "create":
                raise AlreadyExistsError(f"{what}: the object already exists")
            if resp.status_code != 200:
                raise status_error(resp.status_code, what, resp.text)
            try:
                stored = resp.json().get("crc32c")
            except ValueError:
                stored = None
        if stored is None:
            return
        try:  # a mangled response is retried (a create-only retry checks the object)
            stored_crc = crc_from_b64(stored)
        except CorruptionError as e:
            raise TransientStorageError(f"{what}: unreadable upload response: {e}") from e
        if stored_crc != crc:
            raise ChecksumMismatchError(
                f"{what}: server stored crc32c {stored}, sent {b64_crc(crc)}"
            )

    def _list_sync(self, prefix: str, fields: str, make: Callable[[str, Any], T]) -> list[T]:
        """``make(key, blob)`` for every object under ``prefix``, sorted by key. ``fields``:
        the per-item fields to ask for (the JSON API pages by ``list_page_size``)."""
        what = f"list {self.url}/{prefix}"
        client, _ = self._connect()
        base = f"{self.prefix}/" if self.prefix else ""
        try:
            blobs = client.list_blobs(
                self.bucket, prefix=base + prefix, fields=f"items({fields}),nextPageToken",
                page_size=self.options.list_page_size, retry=None, timeout=self._timeout,
            )  # fmt: skip
            # Names ending in "/" are folder placeholders (Cloud Console, gcsfuse), no keys.
            out = [(b.name[len(base) :], b) for b in blobs if not b.name.endswith("/")]
        except Exception as exc:
            translate(exc, what)
        out.sort(key=lambda e: e[0])
        return [make(key, blob) for key, blob in out]

    def _info(self, key: str, blob: Any) -> ObjectInfo:
        if blob.size is None or blob.updated is None:
            raise StorageError(f"list {self.url}/{key}: the server reported no size/updated time")
        return ObjectInfo(key, int(blob.size), blob.updated.timestamp())

    def _delete_sync(self, name: str, key: str) -> None:
        client, _ = self._connect()
        try:
            client.bucket(self.bucket).blob(name).delete(retry=None, timeout=self._timeout)
        except Exception as exc:
            try:
                translate(exc, f"delete {self.url}/{key}")
            except NotFoundError:
                return

    async def get(self, key: str, *, byte_range: ByteRange | None = None) -> Buffer:
        return await self._pool.call(self._get_sync, self._name(key), key, byte_range)

    async def get_into(self, key: str, start: int, into: Sequence[memoryview]) -> None:
        parts = [memoryview(b).cast("B") for b in into]
        await self._pool.call(self._get_into_sync, self._name(key), key, start, parts)

    async def put(self, key: str, data: Payload, *, mode: PutMode = "overwrite") -> None:
        name = self._name(key)
        if mode not in ("create", "overwrite"):
            raise ConfigError(f"unknown put mode {mode!r}")
        await self._pool.call(self._put_sync, name, key, payload_parts(data), mode)

    async def list_info(self, prefix: str = "") -> list[ObjectInfo]:
        return await self._pool.call(self._list_sync, prefix, "name,size,updated", self._info)

    async def list(self, prefix: str = "") -> list[str]:
        return await self._pool.call(self._list_sync, prefix, "name", lambda key, _: key)

    async def delete(self, key: str) -> None:
        await self._pool.call(self._delete_sync, self._name(key), key)

    async def head(self, key: str) -> ObjectMeta:
        return await self._pool.call(self._head_sync, self._name(key), key)

    async def exists(self, key: str) -> bool:
        try:
            await self.head(key)
        except NotFoundError:
            return False
        return True

    async def close(self) -> None:
        self._pool.close()
        self._warm.join()  # (a client it makes after close would leak its session)
        with self._connect_lock:
            session, self._session = self._session, None
            self._client = None
        if session is not None:
            session.close()
