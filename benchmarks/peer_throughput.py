"""Throughput of the RAM tier and the peer layer against their raw baselines.

Run ``python -m benchmarks.peer_throughput [--sizes-mib 256,1024] [--streams 1,2]
[--frame-mac on,off]``.

Measures, per state size (split into ``--chunk-mib`` chunks):

* own RAM: ``TieredChunkSource.fetch_many`` from this process's tier (crc32c verified + copy
  into a warm destination) vs a numpy copy of the same bytes (same source, same destination);
* peer: ``PeerClient.get_chunks`` from a ``PeerServer`` in another process (crc32c verified,
  received into a warm destination) vs raw loopback TCP (``sendall``/``recv_into``, one
  request per stream, no framing, no checks), both with the same number of streams; once
  per ``--frame-mac`` setting (``on``: every frame authenticated, the default; ``off``: only
  to see what that costs), side by side in one run.

Baseline and candidate runs are interleaved (ABBA order, after one warm-up of each) and
the ratio is the median of the per-pair ratios: on a shared, noisy machine the load drifts
between runs, and a pair of neighbouring runs sees nearly the same load. Throughputs are
the medians of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import functools
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
from fastckpt.replicas._client import PeerClient
from fastckpt.replicas._connection import PeerOptions
from fastckpt.replicas._ram import ChunkLocation, RamTier
from fastckpt.replicas._server import PeerServer
from fastckpt.replicas._sources import TieredChunkSource

MiB = 1 << 20
SECRET = b"benchmark-secret-0123456789"


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _paired(
    nbytes: int, base: Callable[[], None], cand: Callable[[], None], repeats: int
) -> tuple[float, float, float]:
    """(baseline GB/s, candidate GB/s, median of per-pair candidate/baseline ratios)."""
    base()
    cand()
    tb, tc = [], []
    for r in range(repeats):
        if r % 2:
            tc.append(_timed(cand))
            tb.append(_timed(base))
        else:
            tb.append(_timed(base))
            tc.append(_timed(cand))
    ratio = statistics.median(b / c for b, c in zip(tb, tc))
    return nbytes / statistics.median(tb) / 1e9, nbytes / statistics.median(tc) / 1e9, ratio


def _build_tier(root: Path, nbytes: int, chunk: int) -> dict[str, tuple[int, int, int]]:
    """A tier with one sealed step of ``nbytes`` in chunks; returns id -> (offset, length, crc)."""
    chunks: dict[str, tuple[int, int, int]] = {}
    with RamTier(root, budget_bytes=2 * nbytes + MiB) as tier:
        seg = tier.allocate(1, nbytes)
        buf = seg.buffer
        buf[:] = np.frombuffer(np.arange(nbytes // 8, dtype=np.uint64).tobytes(), np.uint8)[:nbytes]
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


def bench_own(
    root: Path, nbytes: int, chunks: dict[str, tuple[int, int, int]], dst: np.ndarray, repeats: int
) -> dict[str, tuple[float, float, float]]:
    with RamTier(root, budget_bytes=2 * nbytes + MiB) as tier:
        views = {cid: tier.get_chunk(1, cid) for cid in chunks}

        def memcpy() -> None:
            for cid, (off, n, _) in chunks.items():
                np.copyto(dst[off : off + n], np.frombuffer(views[cid], np.uint8))  # type: ignore[arg-type]

        def fetch(s: TieredChunkSource) -> Callable[[], None]:
            items = [(cid, n, crc, dst[off : off + n]) for cid, (off, n, crc) in chunks.items()]

            def run() -> None:
                assert s.fetch_many(1, items) == ["ram"] * len(items)

            return run

        out = {
            "fetch (crc32c + copy)": _paired(
                nbytes, memcpy, fetch(TieredChunkSource(tier)), repeats
            ),
            "fetch, verify=False": _paired(
                nbytes, memcpy, fetch(TieredChunkSource(tier, verify=False)), repeats
            ),
        }
        views.clear()  # drop the views into the tier's memory before it closes
    return out


def _spawn(args: list[str]) -> tuple[subprocess.Popen[str], list[int]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.peer_throughput", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, [int(p) for p in proc.stdout.readline().split()]


def _stop(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=30)


def _raw_reader(
    port: int, nbytes: int, dst: np.ndarray, streams: int
) -> tuple[Callable[[], None], Callable[[], None]]:
    share = nbytes // streams
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(streams)]
    for s in socks:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def worker(i: int) -> None:
        s, view = socks[i], dst.data[i * share : (i + 1) * share]
        s.sendall(struct.pack(">Q", view.nbytes))
        pos = 0
        while pos < view.nbytes:
            pos += s.recv_into(view[pos:], view.nbytes - pos)

    def close() -> None:
        for s in socks:
            s.close()

    def run() -> None:
        _run_threads([functools.partial(worker, i) for i in range(streams)])

    return run, close


def _peer_reader(
    client: PeerClient, chunks: dict[str, tuple[int, int, int]], dst: np.ndarray, streams: int
) -> Callable[[], None]:
    parts = _split(list(chunks), streams)

    def worker(ids: list[str]) -> None:
        items = [(cid, dst[o : o + n], crc) for cid in ids for o, n, crc in [chunks[cid]]]
        assert client.get_chunks(1, items) == ["ok"] * len(items)

    def run() -> None:
        _run_threads([functools.partial(worker, ids) for ids in parts])

    return run


def bench_peers(
    root: Path,
    nbytes: int,
    chunks: dict[str, tuple[int, int, int]],
    dst: np.ndarray,
    streams_list: list[int],
    repeats: int,
    frame_macs: list[bool],
) -> dict[tuple[bool, int], tuple[float, float, float]]:
    """Peer GET vs raw TCP, servers in separate processes, per frame_mac setting and stream
    count."""
    raw_proc, (raw_port,) = _spawn(["--serve-raw", str(nbytes)])
    modes = ",".join("on" if m else "off" for m in frame_macs)
    peer_proc, peer_ports = _spawn(["--serve-peer", str(root), "--frame-mac", modes])
    out = {}
    try:
        for frame_mac, port in zip(frame_macs, peer_ports):
            options = PeerOptions(frame_mac=frame_mac)
            client = PeerClient(("127.0.0.1", port), secret=SECRET, options=options)
            for streams in streams_list:
                raw, close = _raw_reader(raw_port, nbytes, dst, streams)
                peer = _peer_reader(client, chunks, dst, streams)
                out[frame_mac, streams] = _paired(nbytes, raw, peer, repeats)
                close()
            client.close()
    finally:
        _stop(peer_proc)
        _stop(raw_proc)
    return out


def _serve_peer(root: str, frame_macs: list[bool]) -> None:
    """Serve the tier at ``root`` once per frame_mac setting (one tier, one server each);
    print their ports on one line, serve until stdin closes."""
    with RamTier(root, budget_bytes=1 << 40) as tier:
        servers = [
            PeerServer(tier, secret=SECRET, options=PeerOptions(frame_mac=m)).start()
            for m in frame_macs
        ]
        try:
            print(" ".join(str(s.address[1]) for s in servers), flush=True)
            sys.stdin.read()
        finally:
            for s in servers:
                s.close()


def _serve_raw(nbytes: int) -> None:
    from benchmarks._tiers import (
        _serve_raw as serve,  # the same raw sender restore_latency measures
    )

    serve(str(nbytes))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes-mib", default="256,1024")
    p.add_argument("--streams", default="1,2")
    p.add_argument("--chunk-mib", type=int, default=16)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--shm", default="/dev/shm")
    p.add_argument(
        "--frame-mac",
        default="on,off",
        help="on, off or both (on,off): frame MACs of the peer runs",
    )
    p.add_argument("--serve-peer", help=argparse.SUPPRESS)
    p.add_argument("--serve-raw", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    frame_macs = [{"on": True, "off": False}[x] for x in a.frame_mac.split(",")]
    if a.serve_peer:
        return _serve_peer(a.serve_peer, frame_macs)
    if a.serve_raw:
        return _serve_raw(a.serve_raw)
    print(f"{'size':>8} {'what':<40} {'GB/s':>7} {'baseline':>9} {'ratio':>6}")
    for size_mib in [int(x) for x in a.sizes_mib.split(",")]:
        nbytes = size_mib * MiB
        with tempfile.TemporaryDirectory(dir=a.shm, prefix="fastckpt-bench-") as d:
            root = Path(d) / "tier"
            chunks = _build_tier(root, nbytes, a.chunk_mib * MiB)
            dst = np.empty(nbytes, np.uint8)
            dst[:] = 0  # pre-fault: measure bandwidth, not first-touch page faults
            for what, (base, cand, ratio) in bench_own(
                root, nbytes, chunks, dst, a.repeats
            ).items():
                print(
                    f"{size_mib:>6}Mi {'own RAM ' + what:<40} {cand:7.2f} {base:9.2f} "
                    f"{ratio:6.2f}  (vs numpy copy)"
                )
            streams_list = [int(x) for x in a.streams.split(",")]
            peers = bench_peers(root, nbytes, chunks, dst, streams_list, a.repeats, frame_macs)
            for (frame_mac, streams), (base, cand, ratio) in sorted(
                peers.items(), key=lambda kv: kv[0][1]
            ):
                what = f"peer get, {streams} stream(s), mac {'on' if frame_mac else 'off'}"
                print(
                    f"{size_mib:>6}Mi {what:<40} {cand:7.2f} {base:9.2f} {ratio:6.2f}  (vs raw TCP)"
                )


if __name__ == "__main__":
    main()
