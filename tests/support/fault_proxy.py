"""A fault-injecting HTTP/1.1 proxy for reliability tests (in front of the GCS emulator).

A harness of fastckpt's own reliability tests (the repository's, not the package's), in front
of :mod:`~fastckpt.testing.gcs_emulator`.

:class:`FaultProxy` listens on ``127.0.0.1``, forwards every request to an upstream HTTP
server (the emulator) and, for a configurable fraction of requests (seeded RNG), injects one
fault instead of the faithful answer. Point a client at :attr:`FaultProxy.endpoint`::

    with GcsEmulator() as emu, FaultProxy(emu.endpoint, rate=0.1, seed=7) as proxy:
        store = GcsStore("bucket", options=GcsOptions(endpoint=proxy.endpoint, read_timeout_s=0.5))
        ...
        proxy.counts()   # {"requests": 212, "forwarded": 190, "fault:503": 3, ...}

Fault kinds (:data:`FAULT_KINDS`):

* ``"429"``, ``"500"``, ``"503"``: answered by the proxy; the request never reaches upstream.
* ``"reset"``: the connection is reset (RST) before the request is forwarded.
* ``"lost_response"``: the request *is* forwarded (it takes effect upstream), then the
  connection is reset instead of answering: the ambiguous failure of a real network.
* ``"truncate"``: forwarded; the answer declares its full ``Content-Length`` but the body is
  cut short (or the head itself, for an empty body) and the connection closed.
* ``"stall"``: nothing is answered for ``stall_s`` seconds (longer than the client's
  timeout), then the connection is closed.
* ``"slow"``: forwarded; the answer is dripped in ``slow_pieces`` pieces ``slow_delay_s``
  apart (it completes; a client with a per-read timeout above ``slow_delay_s`` succeeds).

Not in the default set (:data:`DEFAULT_KINDS`), ask for them explicitly:

* ``"stall_body"``: forwarded; the head and half the body are sent, then nothing for
  ``stall_s`` (a stall *between* body bytes, after the client saw a 200).
* ``"corrupt"``: forwarded; one bit of a non-empty response body is flipped. Only end-to-end
  checksums can catch it.

Every loop is bounded: a connection thread exits on ``close()``, after ``idle_timeout_s``
without a request, or after ``max_requests_per_connection``; stalls wait on the stop event;
the proxy closes itself ``max_lifetime_s`` after it started. All threads are daemons.
"""

from __future__ import annotations

import collections
import contextlib
import http.client
import random
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Final
from urllib.parse import urlsplit

__all__ = ["ALL_KINDS", "DEFAULT_KINDS", "FAULT_KINDS", "FaultProxy", "InjectedFault"]

FAULT_KINDS: Final = (
    "429",
    "500",
    "503",
    "reset",
    "lost_response",
    "truncate",
    "stall",
    "slow",
    "stall_body",
    "corrupt",
)
#: The network faults a correct client must survive by retrying (``"slow"`` is not even a failure).
DEFAULT_KINDS: Final = ("429", "500", "503", "reset", "lost_response", "truncate", "stall", "slow")
ALL_KINDS: Final = FAULT_KINDS

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "content-length",
    }
)
_MAX_HEAD = 64 << 10
_POLL_S = 0.2
_UNSET = object()
_REASONS = {
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
}


class InjectedFault(Exception):
    """Internal: a request whose connection the proxy ends on purpose."""


class _Closed(Exception):
    """Internal: the client closed the connection, or the proxy is stopping."""


class _Request:
    __slots__ = ("body", "headers", "method", "target", "version")

    def __init__(
        self, method: str, target: str, version: str, headers: list[tuple[str, str]], body: bytes
    ) -> None:
        self.method = method
        self.target = target
        self.version = version
        self.headers = headers
        self.body = body

    def header(self, name: str) -> str | None:
        name = name.lower()
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None


class _Reader:
    """Buffered reads from a socket that poll the proxy's stop event (bounded waits)."""

    def __init__(self, sock: socket.socket, stop: threading.Event, idle_timeout_s: float) -> None:
        self.sock = sock
        self.stop = stop
        self.idle_timeout_s = idle_timeout_s
        self.buf = bytearray()

    def _fill(self) -> None:
        deadline = time.monotonic() + self.idle_timeout_s
        while True:
            if self.stop.is_set():
                raise _Closed
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise _Closed from None
                continue
            except OSError:
                raise _Closed from None
            if not data:
                raise _Closed
            self.buf += data
            return

    def until(self, sep: bytes, limit: int) -> bytes:
        while True:
            i = self.buf.find(sep)
            if i >= 0:
                out = bytes(self.buf[: i + len(sep)])
                del self.buf[: i + len(sep)]
                return out
            if len(self.buf) > limit:
                raise _Closed
            self._fill()

    def exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out


class FaultProxy:
    """A threaded HTTP/1.1 proxy that injects faults into a fraction of requests.

    Args:
        upstream: Base URL of the server to forward to (``http://host:port``).
        rate: Probability in ``[0, 1]`` that a request gets a fault.
        kinds: Fault kinds to draw from (uniformly), or a mapping kind -> weight.
        seed: Seed of the proxy's RNG (the draw sequence is deterministic for a given
            request order).
        eligible: ``eligible(method, path, body)``: only requests it accepts can get a fault
            (default: all). ``path`` includes the query; ``body`` is the request body.
        stall_s: How long a ``"stall"``/``"stall_body"`` holds the connection silent.
        slow_delay_s: Pause between the pieces of a ``"slow"`` answer.
        slow_pieces: Pieces of a ``"slow"`` answer.
        idle_timeout_s: A client connection idle this long is closed.
        upstream_timeout_s: Socket timeout towards upstream.
        max_requests_per_connection: A connection is closed after this many requests.
        max_lifetime_s: The proxy closes itself this long after ``start()``.
    """

    def __init__(
        self,
        upstream: str,
        *,
        rate: float = 0.0,
        kinds: Iterable[str] | Mapping[str, float] = DEFAULT_KINDS,
        seed: int = 0,
        eligible: Callable[[str, str, bytes], bool] | None = None,
        stall_s: float = 5.0,
        slow_delay_s: float = 0.05,
        slow_pieces: int = 4,
        idle_timeout_s: float = 60.0,
        upstream_timeout_s: float = 30.0,
        max_requests_per_connection: int = 100_000,
        max_lifetime_s: float = 900.0,
    ) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream must be an http://host:port URL, got {upstream!r}")
        self._upstream = (parts.hostname, parts.port or 80)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._rate = 0.0
        self._kinds: list[str] = []
        self._weights: list[float] = []
        self._eligible = eligible
        self.configure(rate=rate, kinds=kinds)
        self.stall_s = stall_s
        self.slow_delay_s = slow_delay_s
        self.slow_pieces = max(2, slow_pieces)
        self.idle_timeout_s = idle_timeout_s
        self.upstream_timeout_s = upstream_timeout_s
        self.max_requests_per_connection = max_requests_per_connection
        self.max_lifetime_s = max_lifetime_s
        self._counts: collections.Counter[str] = collections.Counter()
        self.log: collections.deque[tuple[str, str, str]] = collections.deque(maxlen=2000)
        """The last injected faults as ``(kind, method, path)``."""
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        self._threads: set[threading.Thread] = set()
        self._conns: set[socket.socket] = set()
        self._timer: threading.Timer | None = None

    # ------------------------------------------------------------------ control

    def configure(
        self,
        *,
        rate: float | None = None,
        kinds: Iterable[str] | Mapping[str, float] | None = None,
        eligible: Callable[[str, str, bytes], bool] | object | None = _UNSET,
    ) -> None:
        """Change the fault rate, kinds or eligibility while running (thread-safe)."""
        with self._lock:
            if rate is not None:
                if not 0.0 <= rate <= 1.0:
                    raise ValueError(f"rate must be in [0, 1], got {rate}")
                self._rate = float(rate)
            if kinds is not None:
                weights = dict(kinds) if isinstance(kinds, Mapping) else {k: 1.0 for k in kinds}
                unknown = set(weights) - set(FAULT_KINDS)
                if unknown or not weights or any(w < 0 for w in weights.values()):
                    raise ValueError(
                        f"kinds must be a non-empty subset of {FAULT_KINDS}, got {sorted(weights)}"
                    )
                self._kinds, self._weights = list(weights), [float(w) for w in weights.values()]
            if eligible is not _UNSET:
                self._eligible = eligible  # type: ignore[assignment]

    @property
    def endpoint(self) -> str:
        """Base URL of the proxy, e.g. ``http://127.0.0.1:40123``."""
        if self._listener is None:
            raise RuntimeError("FaultProxy is not started")
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def counts(self) -> dict[str, int]:
        """Counters: ``requests``, ``forwarded``, ``upstream_errors``, ``proxy_errors`` and
        ``fault:<kind>``."""
        with self._lock:
            return dict(self._counts)

    def faults(self) -> dict[str, int]:
        """Injected faults by kind (kinds never injected are absent)."""
        return {k[len("fault:") :]: v for k, v in self.counts().items() if k.startswith("fault:")}

    def reset_counts(self) -> None:
        """Zero every counter and clear the log."""
        with self._lock:
            self._counts.clear()
            self.log.clear()

    def start(self) -> FaultProxy:
        """Bind a free port on 127.0.0.1 and start accepting. Returns self."""
        if self._listener is not None:
            return self
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self._listener.settimeout(_POLL_S)
        self._spawn(self._accept_loop, "fault-proxy-accept")
        self._timer = threading.Timer(self.max_lifetime_s, self.close)
        self._timer.daemon = True
        self._timer.start()
        return self

    def close(self) -> None:
        """Stop accepting, drop every connection and join the threads (bounded). Idempotent."""
        self._stop.set()
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.cancel()
        with self._lock:
            conns = list(self._conns)
            threads = list(self._threads)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + 5.0
        for t in threads:
            if t is not threading.current_thread():
                t.join(timeout=max(0.0, deadline - time.monotonic()))
        if self._listener is not None:
            self._listener.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _count(self, key: str) -> None:
        with self._lock:
            self._counts[key] += 1

    def _spawn(self, fn: Callable[..., None], name: str, *args: object) -> None:
        def run() -> None:
            try:
                fn(*args)
            finally:
                with self._lock:
                    self._threads.discard(threading.current_thread())

        t = threading.Thread(target=run, name=name, daemon=True)
        with self._lock:
            self._threads.add(t)
        t.start()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(_POLL_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.add(conn)
            self._spawn(self._serve, "fault-proxy-conn", conn)

    def _draw(self, req: _Request) -> str | None:
        with self._lock:
            if self._rate <= 0.0 or (
                self._eligible is not None and not self._eligible(req.method, req.target, req.body)
            ):
                return None
            if self._rng.random() >= self._rate:
                return None
            kind = self._rng.choices(self._kinds, weights=self._weights)[0]
            self._counts[f"fault:{kind}"] += 1
            self.log.append((kind, req.method, req.target))
            return kind

    def _serve(self, conn: socket.socket) -> None:
        reader = _Reader(conn, self._stop, self.idle_timeout_s)
        upstream: http.client.HTTPConnection | None = None
        try:
            for _ in range(self.max_requests_per_connection):
                req = self._read_request(reader)
                self._count("requests")
                kind = self._draw(req)
                if kind in ("429", "500", "503"):
                    self._send_status(conn, int(kind), head_only=req.method == "HEAD")  # type: ignore[arg-type]
                    continue
                if kind == "reset":
                    raise InjectedFault
                if kind == "stall":
                    self._stop.wait(self.stall_s)
                    raise _Closed
                try:
                    upstream, status, reason, headers, body = self._forward(upstream, req)
                except (OSError, http.client.HTTPException):
                    self._count("upstream_errors")
                    upstream = None
                    self._send_status(conn, 502, head_only=req.method == "HEAD")
                    continue
                self._count("forwarded")
                if kind == "lost_response":
                    raise InjectedFault
                if kind == "corrupt" and body:
                    flipped = bytearray(body)
                    with self._lock:
                        i = self._rng.randrange(len(flipped))
                    flipped[i] ^= 0x01 << (i % 8)
                    body = bytes(flipped)
                self._send_response(conn, req, status, reason, headers, body, kind)
                if kind == "truncate" or (req.header("connection") or "").lower() == "close":
                    raise _Closed
        except InjectedFault:
            with contextlib.suppress(OSError):  # RST instead of FIN
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except (_Closed, OSError):
            pass
        except Exception:  # a malformed request or a proxy bug costs this connection only
            self._count("proxy_errors")
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            if upstream is not None:
                upstream.close()

    def _read_request(self, reader: _Reader) -> _Request:
        head = reader.until(b"\r\n\r\n", _MAX_HEAD)
        lines = head[:-4].decode("latin-1").split("\r\n")
        try:
            method, target, version = lines[0].split(" ", 2)
        except ValueError:
            raise _Closed from None
        headers = []
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers.append((name.strip(), value.strip()))
        req = _Request(method, target, version, headers, b"")
        if (req.header("transfer-encoding") or "").lower() == "chunked":
            body = bytearray()
            while True:
                size = int(reader.until(b"\r\n", 1024).split(b";")[0].strip(), 16)
                if size == 0:
                    while reader.until(b"\r\n", _MAX_HEAD) != b"\r\n":
                        pass  # trailers
                    break
                body += reader.exact(size)
                reader.exact(2)
            req.body = bytes(body)
            req.headers = [(k, v) for k, v in headers if k.lower() != "transfer-encoding"]
        else:
            n = int(req.header("content-length") or 0)
            req.body = reader.exact(n) if n else b""
        return req

    def _forward(
        self, upstream: http.client.HTTPConnection | None, req: _Request
    ) -> tuple[http.client.HTTPConnection, int, str, list[tuple[str, str]], bytes]:
        for attempt in (0, 1):
            if upstream is None:
                upstream = http.client.HTTPConnection(
                    *self._upstream, timeout=self.upstream_timeout_s
                )
            try:
                upstream.putrequest(
                    req.method, req.target, skip_host=True, skip_accept_encoding=True
                )
                for k, v in req.headers:
                    if k.lower() not in _HOP_BY_HOP:
                        upstream.putheader(k, v)
                if req.body or req.method in ("POST", "PUT", "PATCH"):
                    upstream.putheader("Content-Length", str(len(req.body)))
                upstream.endheaders(req.body or None)
                resp = upstream.getresponse()
                body = resp.read()
                headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP_BY_HOP]
                if req.method == "HEAD":
                    length = resp.getheader("Content-Length")
                    if length is not None:
                        headers.append(("Content-Length", length))
                if resp.will_close:
                    upstream.close()
                    upstream = None
                    conn_out = http.client.HTTPConnection(
                        *self._upstream, timeout=self.upstream_timeout_s
                    )
                else:
                    conn_out = upstream
                return conn_out, resp.status, resp.reason, headers, body
            except (OSError, http.client.HTTPException):
                if upstream is not None:
                    upstream.close()
                upstream = None
                if attempt == 1 or req.method == "POST":
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _send_status(self, conn: socket.socket, status: int, *, head_only: bool = False) -> None:
        body = f'{{"error": {{"code": {status}, "message": "injected by FaultProxy"}}}}'.encode()
        head = (
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: "
            "application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: keep-alive\r\n\r\n"
        ).encode()
        conn.sendall(head if head_only else head + body)

    def _send_response(
        self,
        conn: socket.socket,
        req: _Request,
        status: int,
        reason: str,
        headers: list[tuple[str, str]],
        body: bytes,
        kind: str | None,
    ) -> None:
        lines = [f"HTTP/1.1 {status} {reason}"]
        lines += [f"{k}: {v}" for k, v in headers]
        if req.method != "HEAD":
            lines.append(f"Content-Length: {len(body)}")
        lines.append("Connection: keep-alive")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        if req.method == "HEAD":
            body = b""
        if kind == "stall_body":
            conn.sendall(head + body[: len(body) // 2])
            self._stop.wait(self.stall_s)
            raise _Closed
        if kind == "truncate":
            if body:
                conn.sendall(head + body[: len(body) // 2])
            else:
                conn.sendall(head[: len(head) // 2])
            return
        data = head + body
        if kind == "slow":
            step = max(1, -(-len(data) // self.slow_pieces))
            for off in range(0, len(data), step):
                conn.sendall(data[off : off + step])
                if off + step < len(data) and self._stop.wait(self.slow_delay_s):
                    raise _Closed
            return
        conn.sendall(data)
