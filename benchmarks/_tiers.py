"""Helpers for the RAM-tier / peer benchmarks: helper processes, raw TCP, digests, a train step.

Nothing here imports jax at module import time (like :mod:`benchmarks._common`).

* :class:`HelperProcess`: a child ``python -m benchmarks._tiers <role> ...`` that prints
  one line (its port) when ready and exits when its stdin closes. Roles:

  - ``serve-peer``: a plain process serving a ``RamTier`` with a ``PeerServer`` (accepts
    pushes) and publishing its address as a peer record in a checkpoint store's ``_peers/``
    directory, where a one-process :class:`~fastckpt.CheckpointManager` with RAM options
    finds it;
  - ``serve-raw``: a raw loopback TCP sender (8-byte length request, then ``sendall`` of
    that many bytes from a warm buffer; no framing, no checks);
  - ``sink-raw``: a raw loopback TCP receiver (8-byte length, then that many bytes into a
    warm buffer, then a 1-byte ack; no checks).

* :func:`measure_loopback_tcp`: raw TCP throughput from a ``serve-raw`` process with N
  parallel streams into a warm destination (the limit a peer restore is compared with).
* :class:`RawCheckpointFloor`: the least a RAM checkpoint with a peer push does, without
  fastckpt (copy, crc32c, raw send to a ``sink-raw`` process): the step-overhead floor.
* :func:`tree_digest`: per-leaf crc32c of a pytree's global values (bit-exact check
  between processes without keeping two copies of a state).
* :func:`matmul_state` / :func:`make_matmul_step`: a training-like state and jitted step.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

MiB = 1 << 20
PEER_SECRET = b"fastckpt-benchmark-secret-0123456789"
REPO_ROOT = Path(__file__).resolve().parent.parent


# =========================================================================== helper processes


class HelperProcess:
    """A helper child process (``python -m benchmarks._tiers ROLE ARGS...``).

    Starting returns at once (the child's start-up overlaps the caller's work); ``port``
    waits for the line the child prints when ready. Closing its stdin stops it. Use as a
    context manager.
    """

    def __init__(self, role: str, args: Sequence[str], *, start_timeout_s: float = 120.0) -> None:
        self.role = role
        self._timeout_s = start_timeout_s
        self._port: int | None = None
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks._tiers", role, *args],
            cwd=REPO_ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.pid = self._proc.pid

    @property
    def port(self) -> int:
        """The port the child listens on (waits until it is ready)."""
        if self._port is None:
            line = _readline_timeout(self._proc, self._timeout_s)
            if not line.strip().isdigit():
                self.close()
                raise RuntimeError(f"helper {self.role} did not start (said {line!r})")
            self._port = int(line)
        return self._port

    def close(self) -> None:
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def __enter__(self) -> HelperProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _readline_timeout(proc: subprocess.Popen[str], timeout_s: float) -> str:
    out: list[str] = []
    t = threading.Thread(target=lambda: out.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        proc.kill()
        raise RuntimeError(f"helper process did not answer within {timeout_s:.0f}s")
    return out[0] if out else ""


def peer_process(
    tier_root: str | os.PathLike[str], store_root: str, *, member_id: str, budget_bytes: int
) -> HelperProcess:
    """Start a ``serve-peer`` helper (see the module docstring)."""
    return HelperProcess("serve-peer", [str(tier_root), store_root, member_id, str(budget_bytes)])


def raw_sink_process() -> HelperProcess:
    """Start a ``sink-raw`` helper (receives what :class:`RawCheckpointFloor` sends)."""
    return HelperProcess("sink-raw", [])


def raw_tcp_process(nbytes: int) -> HelperProcess:
    """Start a ``serve-raw`` helper able to send up to ``nbytes`` per request."""
    return HelperProcess("serve-raw", [str(nbytes)])


def _serve_peer(tier_root: str, store_root: str, member_id: str, budget_bytes: str) -> None:
    from fastckpt.coordination.distributed import LocalCoordinator
    from fastckpt.replicas._ram import RamTier
    from fastckpt.replicas._server import PeerServer
    from fastckpt.replicas._startup import PeerDirectory, make_record
    from fastckpt.storage import open_store

    store = open_store(store_root)
    with (
        RamTier(tier_root, budget_bytes=int(budget_bytes)) as tier,
        PeerServer(tier, secret=PEER_SECRET) as server,
    ):
        # a one-process "job": its record goes to the store's _peers/, where a manager finds it
        PeerDirectory(LocalCoordinator(), store, run=asyncio.run).publish(
            make_record(member_id, server.address)
        )
        print(server.address[1], flush=True)
        sys.stdin.read()


def _recv_exact(conn: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``conn``; False if the peer closed the connection first."""
    pos = 0
    while pos < view.nbytes:
        got = conn.recv_into(view[pos:], view.nbytes - pos)
        if not got:
            return False
        pos += got
    return True


def _serve_requests(answer: Callable[[socket.socket, int], None]) -> None:
    """Listen on loopback, print the port, and answer each connection's 8-byte length
    requests with ``answer(conn, n)`` (a thread per connection) until stdin closes."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)

    def handle(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hdr = bytearray(8)
        with conn:
            while _recv_exact(conn, memoryview(hdr)):
                answer(conn, struct.unpack(">Q", hdr)[0])

    def accept() -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    print(listener.getsockname()[1], flush=True)
    sys.stdin.read()


def _serve_raw(nbytes: str) -> None:
    src = np.ones(int(nbytes), np.uint8)
    _serve_requests(lambda conn, n: conn.sendall(src.data[:n]))


def _sink_raw() -> None:
    bufs: dict[int, np.ndarray] = {}  # per connection: warm once, later receives reuse its pages

    def receive(conn: socket.socket, n: int) -> None:
        buf = bufs.get(id(conn))
        if buf is None or buf.nbytes < n:
            buf = bufs[id(conn)] = np.ones(n, np.uint8)
        if _recv_exact(conn, buf.data[:n]):
            conn.sendall(b"k")

    _serve_requests(receive)


# =========================================================================== raw TCP

_CRC_WINDOW = 4 << 20  # as the peer client's receive (fastckpt.replicas._channel)


def measure_loopback_tcp(
    port: int, nbytes: int, *, streams: int, reps: int, fresh: bool = False, checksum: bool = False
) -> dict[str, Any]:
    """Raw loopback TCP from a ``serve-raw`` helper: ``nbytes`` split over ``streams``
    connections (one thread each, one request per stream), received into a warm buffer, or
    with ``fresh`` into newly allocated page-aligned memory (allocation timed), as a restore
    must (its arrays are new memory).

    With ``checksum`` each stream also computes the crc32c of every 4 MiB window right after
    it lands (in cache, in the receiving thread): the least a *verified* receive does, so
    its figure is the ceiling of any restore that checks what it received on this machine.

    Returns GB/s (best and median of ``reps`` after one warm-up) and the stream count.
    """
    from fastckpt._checksum import crc32c
    from fastckpt._hostmem import alloc_aligned

    dst = np.ones(nbytes, np.uint8)  # warm: bandwidth, not first-touch page faults
    share = nbytes // streams
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(streams)]
    for s in socks:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def worker(i: int) -> None:
        s, view = socks[i], dst.data[i * share : (i + 1) * share]
        s.sendall(struct.pack(">Q", view.nbytes))
        window = _CRC_WINDOW if checksum else view.nbytes
        crc = 0
        for start in range(0, view.nbytes, window):
            piece = view[start : start + window]
            if not _recv_exact(s, piece):
                raise OSError("raw TCP server closed the connection")
            if checksum:
                crc = crc32c(piece, crc)

    def once() -> float:
        nonlocal dst
        threads = [threading.Thread(target=functools.partial(worker, i)) for i in range(streams)]
        t0 = time.perf_counter()
        if fresh:
            dst = alloc_aligned(nbytes)
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0

    try:
        once()
        times = [once() for _ in range(reps)]
    finally:
        for s in socks:
            s.close()
    moved = share * streams
    return {
        "streams": streams,
        "gbps": moved / min(times) / 1e9,
        "median_gbps": moved / float(np.median(times)) / 1e9,
        "all_s": times,
    }


class RawCheckpointFloor:
    """The least work a RAM checkpoint with a push to one peer does, written without fastckpt.

    Every ``interval`` steps, :meth:`save` copies every addressable shard of the state into
    one warm host buffer on ``threads`` threads and returns (the train step donates the
    state's buffers, so a checkpoint must copy them off before the next step); a background
    thread then computes the crc32c of the copy (on ``threads`` threads, as every chunk must
    carry one) and sends it over one loopback TCP connection to a ``sink-raw`` process,
    which receives into warm memory and checks nothing. No shared memory, no framing, no
    manifest, no verification on receipt: strictly less than the target asks of a RAM
    checkpoint, so the step overhead it adds is what even that much costs on this machine
    (a measured reference beside fastckpt's, not a proven lower bound).
    """

    def __init__(self, port: int, nbytes: int, *, interval: int, threads: int = 2) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._interval, self._threads = interval, threads
        self._buf = np.ones(nbytes, np.uint8)  # warm: no page faults in the measurement
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="floor")
        self._sock = socket.create_connection(("127.0.0.1", port))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sender: threading.Thread | None = None
        self._error: BaseException | None = None
        self.crcs: list[int] = []

    def save(self, step: int, state: Any) -> None:
        if step % self._interval:
            return
        import jax

        self.wait()  # as fastckpt waits for the previous push before a new RAM step
        shards = [
            np.asarray(s.data).reshape(-1).view(np.uint8)
            for leaf in jax.tree_util.tree_leaves(state)
            for s in leaf.addressable_shards
        ]
        offsets = np.cumsum([0] + [a.nbytes for a in shards])
        if offsets[-1] > self._buf.nbytes:
            raise ValueError(
                f"state of {offsets[-1]} bytes exceeds the floor's {self._buf.nbytes}-byte buffer"
            )

        def copy(part: int) -> None:
            for i in range(part, len(shards), self._threads):
                self._buf[offsets[i] : offsets[i + 1]] = shards[i]

        list(self._pool.map(copy, range(self._threads)))
        n = int(offsets[-1])
        self._sender = threading.Thread(target=self._send, args=(n,), daemon=True)
        self._sender.start()

    def _send(self, n: int) -> None:
        try:
            self._send_checked(n)
        except BaseException as e:  # re-raised by wait()
            self._error = e

    def _send_checked(self, n: int) -> None:
        from fastckpt._checksum import crc32c  # the same crc32c library fastckpt calls

        piece = -(-n // self._threads)
        self.crcs = list(
            self._pool.map(
                lambda a: crc32c(self._buf.data[a : min(n, a + piece)]), range(0, n, piece)
            )
        )
        self._sock.sendall(struct.pack(">Q", n))
        self._sock.sendall(self._buf.data[:n])
        if self._sock.recv(1) != b"k":
            raise OSError("raw sink closed the connection")

    def wait(self) -> None:
        if self._sender is not None:
            self._sender.join()
            self._sender = None
        if self._error is not None:
            raise RuntimeError("raw checkpoint floor failed") from self._error

    def close(self) -> None:
        self.wait()
        self._sock.close()
        self._pool.shutdown()


# =========================================================================== state checks


def tree_digest(tree: Any) -> list[int]:
    """crc32c of every leaf's global value (assembled shard by shard on host), in flatten order."""
    import jax

    from benchmarks._common import host_value
    from fastckpt._checksum import crc32c

    out = []
    for leaf in jax.tree_util.tree_leaves(tree):
        out.append(crc32c(np.ascontiguousarray(host_value(leaf)).reshape(-1).view(np.uint8)))
    return out


def time_restores(
    mgr: Any,
    target: Any,
    digest: list[int],
    reps: int,
    *,
    tag: str,
    expect_tier: str,
    before: Any = None,
) -> list[dict[str, Any]]:
    """``reps + 1`` timed restores of ``target`` through ``mgr`` (the first one reported apart;
    ``before`` runs before each, untimed): each must read only from ``expect_tier`` (or its
    ``expect_tier:<member>`` sources), and the first must match ``digest`` (:func:`tree_digest`)."""
    import jax

    from benchmarks._common import cpu_seconds

    out = []
    for i in range(reps + 1):
        if before is not None:
            before()
        gc.collect()
        c0 = cpu_seconds()
        t0 = time.perf_counter()
        restored = mgr.restore(target=target)
        stats = mgr.last_restore_stats
        jax.block_until_ready(restored)
        t1 = time.perf_counter()
        cpu = cpu_seconds() - c0
        tiers = dict(stats.bytes_by_tier)
        if not tiers or not all(k == expect_tier or k.startswith(expect_tier + ":") for k in tiers):
            raise AssertionError(f"{tag}: restore read from {tiers}, expected only {expect_tier!r}")
        if i == 0 and tree_digest(restored) != digest:
            raise AssertionError(f"{tag}: restored state differs from the saved one")
        del restored
        out.append(
            {
                "seconds": t1 - t0,
                "cpu_s": cpu,
                "fetch_s": stats.fetch_s,
                "device_put_s": stats.device_put_s,
                "bytes_by_tier": tiers,
                "restored_bytes": stats.restored_bytes,
                "loadavg": os.getloadavg()[0],
                "verified": i == 0,
            }
        )
        print(
            f"[fastckpt {tag}] restore {i}: {t1 - t0:.3f}s (cpu {cpu:.2f}s, fetch "
            f"{stats.fetch_s:.2f}s, "
            f"device_put {stats.device_put_s:.2f}s) {tiers}",
            file=sys.stderr,
            flush=True,
        )
    return out


def measure_placement(tree: Any, *, reps: int) -> float:
    """Seconds (best of ``reps``) jax takes to make ``tree``'s arrays from host shards that are
    ready and contiguous — one ``make_array_from_callback`` per leaf, as a restore does: the
    part of an own-RAM restore that neither moves nor verifies bytes."""
    import jax

    from benchmarks._common import host_value
    from fastckpt._hostmem import alloc_aligned

    def key(idx: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        return tuple(sl.indices(n)[:2] for sl, n in zip(idx, shape))

    leaves = jax.tree_util.tree_leaves(tree)
    shards = []
    for x in leaves:
        host = host_value(x)
        by_index = {}
        for idx in x.sharding.addressable_devices_indices_map(x.shape).values():
            part = np.asarray(host[idx])
            buf = (
                alloc_aligned(max(part.nbytes, 1))[: part.nbytes]
                .view(part.dtype)
                .reshape(part.shape)
            )
            buf[...] = (
                part  # page-aligned, as a restore's buffers: jax may alias them instead of copying
            )
            by_index[key(idx, x.shape)] = buf
        shards.append(by_index)

    def once() -> float:
        t0 = time.perf_counter()
        out = [
            jax.make_array_from_callback(
                x.shape, x.sharding, lambda idx, x=x, s=s: s[key(idx, x.shape)]
            )
            for x, s in zip(leaves, shards)
        ]
        jax.block_until_ready(out)
        return time.perf_counter() - t0

    once()
    return min(once() for _ in range(reps))


# =========================================================================== training-like loop


def matmul_state(nbytes: int, mesh: Any, *, d: int = 1024, seed: int = 0) -> dict[str, Any]:
    """Params + Adam-like moments: ``L`` f32 ``d x d`` matrices each (``3 * L * d * d * 4``
    bytes ~ ``nbytes``), sharded ``("data", "model")`` over ``mesh``."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    layers = max(1, round(nbytes / (3 * d * d * 4)))
    sh = NamedSharding(mesh, PartitionSpec("data", "model"))
    rng = np.random.default_rng(seed)
    base = (rng.standard_normal((d, d), dtype=np.float32) * (1.0 / np.sqrt(d))).astype(np.float32)

    def leaf(i: int, scale: float) -> Any:
        return jax.device_put(np.roll(base, i, axis=0) * np.float32(scale), sh)

    state = {
        "params": [leaf(i, 1.0) for i in range(layers)],
        "mu": [leaf(i + 1, 0.0) for i in range(layers)],
        "nu": [leaf(i + 2, 0.0) for i in range(layers)],
    }
    return jax.block_until_ready(state)


def make_matmul_step(batch: int = 256, d: int = 1024) -> Callable[[Any, Any], Any]:
    """A jitted, donated "train step": forward through every matrix (``tanh(x @ W)``), a
    matmul-based gradient per matrix, and an Adam-like update of params and moments. Every
    step returns fresh values of the whole state."""
    import jax
    import jax.numpy as jnp

    def step(state: Any, x: Any) -> Any:
        params, mu, nu = state["params"], state["mu"], state["nu"]
        new_p, new_mu, new_nu = [], [], []
        h = x
        for w, m, v in zip(params, mu, nu):
            out = jnp.tanh(h @ w)
            g = (h.T @ out) / batch  # (d, d): a matmul-shaped "gradient"
            m = 0.9 * m + 0.1 * g
            v = 0.999 * v + 0.001 * g * g
            new_p.append(w - 1e-3 * m / (jnp.sqrt(v) + 1e-8))
            new_mu.append(m)
            new_nu.append(v)
            h = out
        return {"params": new_p, "mu": new_mu, "nu": new_nu}

    return jax.jit(step, donate_argnums=0)


# =========================================================================== entry point


def _main(argv: list[str]) -> None:
    role, args = argv[0], argv[1:]
    if role == "serve-peer":
        _serve_peer(*args)
    elif role == "serve-raw":
        _serve_raw(*args)
    elif role == "sink-raw":
        _sink_raw(*args)
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    _main(sys.argv[1:])
