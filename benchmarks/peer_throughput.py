"""Throughput of the RAM tier and the peer layer against their raw baselines.

Run ``python -m benchmarks.peer_throughput [--sizes-mib 256,1024] [--streams 1,2]``.

Measures, per state size (split into ``--chunk-mib`` chunks):

* own RAM: ``TieredChunkSource.fetch`` from this process's tier (crc32c verified + copy
  into a warm destination) vs a numpy copy of the same bytes (same source, same destination);
* peer: ``PeerClient.get_chunk`` from a ``PeerServer`` in another process (crc32c verified,
  received into a warm destination) vs raw loopback TCP (``sendall``/``recv_into``, one
  request per stream, no framing, no checks), both with the same number of streams.

Each figure is the median of ``--repeats`` timed runs after one warm-up run.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from fastckpt._checksum import crc32c
from fastckpt.replicas import ChunkLocation, PeerClient, PeerServer, RamTier, TieredChunkSource

MiB = 1 << 20
SECRET = b"benchmark-secret-0123456789"


def _median_gbps(nbytes: int, fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def _build_tier(root: Path, nbytes: int, chunk: int) -> dict[str, tuple[int, int, int]]:
    """A tier with one sealed step of ``nbytes`` in chunks; returns id -> (offset, length, crc)."""
    chunks: dict[str, tuple[int, int, int]] = {}
    with RamTier(root, budget_bytes=2 * nbytes + MiB) as tier:
        seg = tier.allocate(1, nbytes)
        buf = seg.buffer
        buf[:] = np.frombuffer(np.arange(nbytes // 8, dtype=np.uint64).tobytes(), np.uint8)[: nbytes]
        for i, off in enumerate(range(0, nbytes, chunk)):
            n = min(chunk, nbytes - off)
            chunks[f"x['w']@{i}"] = (off, n, crc32c(buf[off : off + n]))
        tier.seal(1, seg, {cid: ChunkLocation(*v) for cid, v in chunks.items()})
    return chunks


def _split(items: list[str], parts: int) -> list[list[str]]:
    return [items[i::parts] for i in range(parts)]


def _run_threads(fns: list[Callable[[], None]]) -> None:
    threads = [threading.Thread(target=f) for f in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def bench_own(root: Path, nbytes: int, chunks: dict[str, tuple[int, int, int]], dst: np.ndarray, repeats: int) -> dict[str, float]:
    with RamTier(root, budget_bytes=2 * nbytes + MiB) as tier:
        views = {cid: tier.get_chunk(1, cid) for cid in chunks}
        source = TieredChunkSource(tier)
        source_nv = TieredChunkSource(tier, verify=False)

        def memcpy() -> None:
            for cid, (off, n, _) in chunks.items():
                np.copyto(dst[off : off + n], np.frombuffer(views[cid], np.uint8))

        def fetch(s: TieredChunkSource) -> Callable[[], None]:
            def run() -> None:
                for cid, (off, n, crc) in chunks.items():
                    assert s.fetch(1, cid, n, crc, into=dst[off : off + n]) == "ram"

            return run

        out = {
            "memcpy": _median_gbps(nbytes, memcpy, repeats),
            "own_fetch": _median_gbps(nbytes, fetch(source), repeats),
            "own_fetch_noverify": _median_gbps(nbytes, fetch(source_nv), repeats),
        }
        del views
    return out


def _spawn(args: list[str]) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.peer_throughput", *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def _stop(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=30)


def bench_peer(root: Path, nbytes: int, chunks: dict[str, tuple[int, int, int]], dst: np.ndarray, streams: int, repeats: int) -> float:
    proc, port = _spawn(["--serve-peer", str(root)])
    try:
        client = PeerClient(("127.0.0.1", port), secret=SECRET)
        parts = _split(list(chunks), streams)

        def run() -> None:
            def worker(ids: list[str]) -> None:
                for cid in ids:
                    off, n, crc = chunks[cid]
                    client.get_chunk(1, cid, into=dst[off : off + n], expected_crc32c=crc)

            _run_threads([lambda ids=ids: worker(ids) for ids in parts])

        gbps = _median_gbps(nbytes, run, repeats)
        client.close()
    finally:
        _stop(proc)
    return gbps


def bench_raw(nbytes: int, dst: np.ndarray, streams: int, repeats: int) -> float:
    proc, port = _spawn(["--serve-raw", str(nbytes)])
    try:
        share = nbytes // streams
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(streams)]
        for s in socks:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def run() -> None:
            def worker(i: int) -> None:
                s, view = socks[i], memoryview(dst)[i * share : (i + 1) * share]
                s.sendall(struct.pack(">Q", view.nbytes))
                pos = 0
                while pos < view.nbytes:
                    pos += s.recv_into(view[pos:], view.nbytes - pos)

            _run_threads([lambda i=i: worker(i) for i in range(streams)])

        gbps = _median_gbps(share * streams, run, repeats)
        for s in socks:
            s.close()
    finally:
        _stop(proc)
    return gbps


def _serve_peer(root: str) -> None:
    with RamTier(root, budget_bytes=1 << 40) as tier, PeerServer(tier, secret=SECRET) as server:
        print(server.address[1], flush=True)
        sys.stdin.read()


def _serve_raw(nbytes: int) -> None:
    src = np.ones(nbytes, np.uint8)
    listener = socket.create_server(("127.0.0.1", 0))

    def handle(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hdr = bytearray(8)
        while True:
            view, pos = memoryview(hdr), 0
            while pos < 8:
                got = conn.recv_into(view[pos:])
                if not got:
                    return
                pos += got
            (n,) = struct.unpack(">Q", hdr)
            conn.sendall(memoryview(src)[:n])

    def accept() -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    print(listener.getsockname()[1], flush=True)
    sys.stdin.read()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mib", default="256,1024")
    p.add_argument("--streams", default="1,2")
    p.add_argument("--chunk-mib", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--shm", default="/dev/shm")
    p.add_argument("--serve-peer", help=argparse.SUPPRESS)
    p.add_argument("--serve-raw", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.serve_peer:
        return _serve_peer(a.serve_peer)
    if a.serve_raw:
        return _serve_raw(a.serve_raw)
    print(f"{'size':>8} {'what':<34} {'GB/s':>7} {'baseline':>9} {'ratio':>6}")
    for size_mib in [int(s) for s in a.sizes_mib.split(",")]:
        nbytes = size_mib * MiB
        with tempfile.TemporaryDirectory(dir=a.shm, prefix="fastckpt-bench-") as d:
            root = Path(d) / "tier"
            chunks = _build_tier(root, nbytes, a.chunk_mib * MiB)
            dst = np.empty(nbytes, np.uint8)
            dst[:] = 0  # pre-fault: measure bandwidth, not first-touch page faults
            own = bench_own(root, nbytes, chunks, dst, a.repeats)
            for what in ("own_fetch", "own_fetch_noverify"):
                print(f"{size_mib:>6}Mi {'own RAM ' + what:<34} {own[what]:7.2f} {own['memcpy']:9.2f} {own[what] / own['memcpy']:6.2f}")
            for streams in [int(s) for s in a.streams.split(",")]:
                raw = bench_raw(nbytes, dst, streams, a.repeats)
                peer = bench_peer(root, nbytes, chunks, dst, streams, a.repeats)
                print(f"{size_mib:>6}Mi {f'peer get, {streams} stream(s)':<34} {peer:7.2f} {raw:9.2f} {peer / raw:6.2f}")


if __name__ == "__main__":
    main()
