"""HTTP plumbing of the GCS backend (internal): streamed request and response bodies,
status and exception translation into fastckpt's error tree, and ``x-goog-hash`` crc32c.

Nothing here retries (:class:`~fastckpt.storage.RetryingStore` does) or knows about keys.
"""

from __future__ import annotations

import base64
import binascii
import http.client
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NoReturn

import numpy as np

from fastckpt._checksum import crc32c_parts
from fastckpt.errors import (
    AlreadyExistsError,
    CorruptionError,
    FastckptError,
    NotFoundError,
    PermissionDeniedError,
    StorageError,
    TransientStorageError,
)
from fastckpt.storage._protocol import Buffer

if TYPE_CHECKING:
    import requests

_READ_BLOCK = 8 * 1024 * 1024


class StreamBody:
    """A re-iterable request body over buffers, with a length (so no chunked encoding)."""

    def __init__(self, parts: list[Buffer]) -> None:
        self._parts = [memoryview(p).cast("B") for p in parts]
        self._len = sum(p.nbytes for p in self._parts)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[memoryview]:
        return (p for p in self._parts if p.nbytes)


def body_reader(resp: requests.Response) -> Callable[[memoryview], int]:
    """``readinto`` for a streamed response body that receives straight into the buffer: the
    wrapped ``http.client`` response's for an identity body with a length (urllib3's copies
    through a temporary ``bytes``), else urllib3's."""
    raw = resp.raw
    fp = getattr(raw, "_fp", None)
    if isinstance(fp, http.client.HTTPResponse) and fp.length is not None and not fp.chunked:
        return fp.readinto
    return raw.readinto  # type: ignore[no-any-return]


def readinto_parts(resp: requests.Response, into: list[memoryview], what: str) -> None:
    """Fill ``into`` back to back from the body; a body that ends early is transient."""
    readinto = body_reader(resp)
    done = 0
    for part in into:
        pos, n = 0, part.nbytes
        while pos < n:
            got = readinto(part[pos:])
            if not got:
                raise TransientStorageError(f"{what}: body truncated after {done + pos} bytes")
            pos += got
        done += n


def discard(resp: requests.Response, n: int, what: str) -> None:
    """Read and drop the next ``n`` bytes of the body."""
    sink = np.empty(min(n, _READ_BLOCK), np.uint8).data
    while n:
        readinto_parts(resp, [sink[: min(n, sink.nbytes)]], what)
        n -= min(n, sink.nbytes)


def status_error(status: int, what: str, detail: str = "") -> StorageError:
    msg = f"{what}: HTTP {status} {detail[:300]}".rstrip()
    if status == 404:
        return NotFoundError(msg)
    if status in (401, 403):
        return PermissionDeniedError(msg)
    if status == 412:
        return AlreadyExistsError(msg)
    if status in (408, 429) or status >= 500:
        return TransientStorageError(msg)
    return StorageError(msg)


def check_media_response(resp: requests.Response, what: str) -> None:
    """Raise unless ``resp`` is a 200/206 with the object's bytes as stored (no transcoding)."""
    if resp.status_code not in (200, 206):
        raise status_error(resp.status_code, what, resp.text)
    encoding = resp.headers.get("Content-Encoding", "identity")
    if encoding != "identity":
        raise StorageError(f"{what}: unexpected Content-Encoding {encoding!r}")


def end_response(resp: requests.Response, *, reuse: bool) -> None:
    """Keep the connection if its body was read to the end, else drop it (bytes left unread
    would be taken for the next response's)."""
    if reuse:
        resp.raw.release_conn()
    else:
        resp.close()


def translate(exc: BaseException, what: str) -> NoReturn:
    """Raise the fastckpt error for a requests/urllib3/google error raised during ``what``."""
    if isinstance(exc, FastckptError):
        raise exc
    import google.api_core.exceptions as gexc
    import google.auth.exceptions as aexc
    import requests
    import urllib3.exceptions

    if isinstance(exc, gexc.GoogleAPICallError) and exc.code is not None:
        raise status_error(int(exc.code), what, str(exc.message)) from exc
    transient = (
        aexc.TransportError | requests.ConnectionError | requests.Timeout
        | requests.exceptions.ChunkedEncodingError | urllib3.exceptions.HTTPError
        | http.client.HTTPException | ConnectionError | TimeoutError
    )  # fmt: skip
    if isinstance(exc, transient):
        raise TransientStorageError(f"{what}: {type(exc).__name__}: {exc}") from exc
    if isinstance(exc, aexc.GoogleAuthError):  # refresh failed, anonymous asked to refresh, ...
        raise PermissionDeniedError(
            f"{what}: authentication failed: {type(exc).__name__}: {exc}"
        ) from exc
    if isinstance(exc, requests.RequestException | OSError):
        raise StorageError(f"{what}: {type(exc).__name__}: {exc}") from exc
    raise exc


def check_whole_object(goog_hash: str | None, body: Buffer, what: str) -> None:
    """Verify a whole-object download against the crc32c the server reports for the object;
    a mismatch (bytes changed on the way) is transient, so a retry reads it again."""
    if not goog_hash:
        return
    for part in goog_hash.split(","):
        name, _, value = part.strip().partition("=")
        if name == "crc32c" and value:
            try:
                want = crc_from_b64(value)
            except ValueError:
                return
            if crc32c_parts([body]) != want:
                raise TransientStorageError(
                    f"{what}: body does not match the object's crc32c (corrupted in transit)"
                )
            return


def b64_crc(value: int) -> str:
    return base64.b64encode(value.to_bytes(4, "big")).decode("ascii")


def crc_from_b64(text: object) -> int:
    """The crc32c a GCS response reports (base64 of 4 big-endian bytes); ``CorruptionError``
    if it is not such a value (a mangled response)."""
    try:
        raw = base64.b64decode(text, validate=True)  # type: ignore[arg-type]
    except (binascii.Error, TypeError, ValueError) as e:
        raise CorruptionError(
            f"GCS reported a crc32c that is not base64: {str(text)[:40]!r}"
        ) from e
    if len(raw) != 4:
        raise CorruptionError(f"GCS reported a crc32c of {len(raw)} bytes, not 4")
    return int.from_bytes(raw, "big")
