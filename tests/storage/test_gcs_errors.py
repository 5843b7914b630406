"""GcsStore's translation of HTTP failures, against a scripted local HTTP server."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from fastckpt.errors import (
    AlreadyExistsError,
    ChecksumMismatchError,
    CorruptionError,
    NotFoundError,
    PermissionDeniedError,
    StorageError,
    TransientStorageError,
)
from fastckpt.storage import ByteRange, GcsOptions, GcsStore
from fastckpt.testing.store_tests import run


@dataclass
class Reply:
    status: int = 200
    body: bytes = b""
    content_length: int | None = None  # None: len(body); larger: a truncated body
    content_type: str = "application/octet-stream"


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        reply = self.server.reply
        self.send_response(reply.status)
        self.send_header("Content-Type", reply.content_type)
        self.send_header("Content-Length", str(reply.content_length or len(reply.body)))
        if reply.content_length is not None:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(reply.body)
        self.wfile.flush()
        if reply.content_length is not None:
            self.close_connection = True

    do_GET = do_POST = do_DELETE = _answer


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    reply = Reply()


@pytest.fixture
def stub() -> Iterator[tuple[_Server, GcsStore]]:
    server = _Server(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
    )
    thread.start()
    options = GcsOptions(
        endpoint=f"http://127.0.0.1:{server.server_address[1]}", read_timeout_s=5.0
    )
    store = GcsStore("bkt", "p", options=options)
    yield server, store
    run(store.close())
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (404, NotFoundError),
        (401, PermissionDeniedError),
        (403, PermissionDeniedError),
        (408, TransientStorageError),
        (429, TransientStorageError),
        (500, TransientStorageError),
        (503, TransientStorageError),
        (400, StorageError),
    ],
)
def test_status_mapping(
    stub: tuple[_Server, GcsStore], status: int, error: type[Exception]
) -> None:
    server, store = stub
    server.reply = Reply(
        status=status, body=b'{"error": {"message": "scripted"}}', content_type="application/json"
    )
    with pytest.raises(error):
        run(store.get("k", byte_range=ByteRange(0, 10)))
    with pytest.raises(error):
        run(store.put("k", b"data"))
    with pytest.raises(error):
        run(store.list())


def test_precondition_failed_on_create(stub: tuple[_Server, GcsStore]) -> None:
    server, store = stub
    server.reply = Reply(status=412, body=b"{}", content_type="application/json")
    with pytest.raises(AlreadyExistsError):
        run(store.put("k", b"data", mode="create"))


def test_truncated_body_is_transient(stub: tuple[_Server, GcsStore]) -> None:
    server, store = stub
    server.reply = Reply(status=200, body=b"x" * 1000, content_length=100_000)
    with pytest.raises(TransientStorageError):
        run(store.get("k"))


def test_server_stored_wrong_bytes(stub: tuple[_Server, GcsStore]) -> None:
    server, store = stub
    server.reply = Reply(
        status=200, body=b'{"crc32c": "AAAAAA=="}', content_type="application/json"
    )
    with pytest.raises(ChecksumMismatchError):
        run(store.put("k", b"data"))


def test_server_ignoring_range_is_sliced(stub: tuple[_Server, GcsStore]) -> None:
    server, store = stub
    server.reply = Reply(status=200, body=b"0123456789")
    assert bytes(run(store.get("k", byte_range=ByteRange(3, 4)))) == b"3456"


def test_get_into_status_mapping_and_truncation(stub: tuple[_Server, GcsStore]) -> None:
    server, store = stub
    server.reply = Reply(
        status=503, body=b'{"error": {"message": "scripted"}}', content_type="application/json"
    )
    with pytest.raises(TransientStorageError):
        run(store.get_into("k", 0, [memoryview(bytearray(10))]))
    server.reply = Reply(status=404, body=b"{}", content_type="application/json")
    with pytest.raises(NotFoundError):
        run(store.get_into("k", 0, [memoryview(bytearray(10))]))
    server.reply = Reply(
        status=206, body=b"x" * 1000, content_length=4000
    )  # connection drops mid-body
    with pytest.raises(TransientStorageError):
        run(store.get_into("k", 0, [memoryview(bytearray(1000)), memoryview(bytearray(3000))]))


def test_get_into_server_ignoring_range(stub: tuple[_Server, GcsStore]) -> None:
    server, store = stub
    server.reply = Reply(status=200, body=b"0123456789")
    a, b = bytearray(2), bytearray(3)
    run(store.get_into("k", 3, [memoryview(a), memoryview(b)]))
    assert bytes(a + b) == b"34567"
    with pytest.raises(CorruptionError):  # the whole object is shorter than the range
        run(store.get_into("k", 8, [memoryview(bytearray(5))]))


def test_get_into_oversized_partial_answer_does_not_poison_the_connection(
    stub: tuple[_Server, GcsStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, store = stub
    monkeypatch.setattr(_Handler, "protocol_version", "HTTP/1.1")  # keep-alive connections
    server.reply = Reply(status=206, body=b"abcdefgh")  # more than asked for
    out = bytearray(3)
    run(store.get_into("k", 0, [memoryview(out)]))
    assert bytes(out) == b"abc"
    server.reply = Reply(status=206, body=b"XYZ")
    run(store.get_into("k", 0, [memoryview(out)]))  # a reused connection would read "def"
    assert bytes(out) == b"XYZ"


def test_an_unreadable_crc_in_an_upload_response_is_transient(
    stub: tuple[_Server, GcsStore],
) -> None:
    """A 200 whose crc32c field is not base64 (mangled in transit): a typed, retryable error —
    a create-only retry then checks the object itself — never a bare binascii.Error."""
    server, store = stub
    server.reply = Reply(status=200, body=b'{"crc32c": "AAAAA"}', content_type="application/json")
    with pytest.raises(TransientStorageError, match="unreadable upload response"):
        run(store.put("k", b"data"))


def test_the_client_is_made_in_the_background_without_a_request() -> None:
    """A new GcsStore makes its client and session on its own (a replaced host's first
    restore request does not wait for them) and sends nothing doing so."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        store = GcsStore("b", "p", options=GcsOptions(endpoint=f"http://127.0.0.1:{port}"))
        try:
            deadline = time.monotonic() + 10
            while store._client is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert store._client is not None and store._session is not None
            with pytest.raises(socket.timeout):
                listener.accept()  # no connection was made
        finally:
            asyncio.run(store.close())
    assert store._client is None
