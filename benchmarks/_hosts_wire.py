"""The link between two simulated hosts, measured without a job: raw TCP and the peer wire.

Run inside the hosts by :mod:`benchmarks.hosts` (``python -m benchmarks._hosts_wire ROLE ...``):

* ``serve ADDRESS NBYTES CHUNK_BYTES TIER_ROOT``: on the host a restore pulls from. Builds a
  :class:`~fastckpt.replicas._ram.RamTier` at ``TIER_ROOT`` (the host's own ``/dev/shm``) holding
  one step of ``NBYTES`` in chunks of ``CHUNK_BYTES`` (``benchmarks.peer_throughput``'s
  tier), serves it with two :class:`~fastckpt.replicas._server.PeerServer` s bound to ``ADDRESS``
  (``frame_mac=True`` and ``False``), and runs a raw TCP sender there (per connection, each
  8-byte length request is answered by a ``sendall`` of that many bytes from a warm buffer:
  no framing, no checks). Prints one JSON line (ports, chunk table), serves until its stdin
  closes, then removes the tier.
* ``client ADDRESS SERVER_PID``: on the receiving host. Reads the server's JSON line, then one
  command per line (``{"mode": M, "streams": N}``, M: ``raw``, ``rawfresh``, ``on``, ``off``,
  ``fresh``) and answers each with one JSON line: seconds, and the CPU seconds of this process
  and of the server process during it (the server's CPU-time clock, ``clock_getcpuclockid``: the
  hosts share the PID namespace; nanoseconds, where ``/proc/<pid>/stat`` counts 10 ms ticks).
  Peer modes use ``PeerClient.get_chunks`` (crc32c verified; the chunks split over N
  connections) into a warm buffer (``on``, ``off``: ``frame_mac``) or, with frame MACs, into
  memory allocated for the run and first touched by the receive (``fresh``: as a restore's new
  arrays are), and the bytes received are compared with the tier's (raising
  :class:`BitExactError` on a difference); raw receives into the warm buffer (``rawfresh``: into
  new memory) and checks nothing. Connections are opened (and authenticated) on a mode's first
  command, which is the warm-up the driver discards.

The secret is the job's: ``FASTCKPT_PEER_SECRET`` (``fastckpt.peer_secret_from_env()``).
"""

from __future__ import annotations

import ctypes
import json
import shutil
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np


class BitExactError(AssertionError):
    """Bytes received over the peer wire differ from the tier's."""


def _cpu_clock(pid: int) -> int:
    """The CPU-time clock of process ``pid`` (for ``time.clock_gettime``)."""
    clock = ctypes.c_int()
    err = ctypes.CDLL(None).clock_getcpuclockid(pid, ctypes.byref(clock))
    if err:
        raise OSError(err, f"clock_getcpuclockid({pid})")
    return clock.value


def _pattern(nbytes: int) -> np.ndarray:
    """The bytes ``benchmarks.peer_throughput._build_tier`` writes into its tier."""
    return np.arange(nbytes // 8, dtype=np.uint64).view(np.uint8)


def _recv_exact(conn: socket.socket, view: memoryview) -> None:
    pos = 0
    while pos < view.nbytes:
        got = conn.recv_into(view[pos:], view.nbytes - pos)
        if not got:
            raise ConnectionError("the sender closed the connection")
        pos += got


def _serve_raw(listener: socket.socket, src: np.ndarray) -> None:
    def handle(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hdr = bytearray(8)
        with conn:
            try:
                while True:
                    _recv_exact(conn, memoryview(hdr))
                    conn.sendall(src.data[: struct.unpack(">Q", hdr)[0]])
            except OSError:
                return

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


def serve(address: str, nbytes: int, chunk: int, tier_root: str) -> None:
    """The ``serve`` role (see the module docstring)."""
    import fastckpt
    from benchmarks.peer_throughput import _build_tier
    from fastckpt.replicas._connection import PeerOptions
    from fastckpt.replicas._ram import RamTier
    from fastckpt.replicas._server import PeerServer

    secret = fastckpt.peer_secret_from_env()
    root = Path(tier_root)
    chunks = _build_tier(root, nbytes, chunk)
    src = np.ones(nbytes, np.uint8)  # warm
    listener = socket.create_server((address, 0), backlog=16)
    threading.Thread(target=_serve_raw, args=(listener, src), daemon=True).start()
    try:
        with RamTier(root, budget_bytes=1 << 40) as tier:
            servers = {
                m: PeerServer(
                    tier, secret=secret, host=address, options=PeerOptions(frame_mac=m == "on")
                ).start()
                for m in ("on", "off")
            }
            try:
                print(
                    json.dumps(
                        {
                            "nbytes": nbytes,
                            "raw": listener.getsockname()[1],
                            **{m: s.address[1] for m, s in servers.items()},
                            "chunks": chunks,
                        }
                    ),
                    flush=True,
                )
                sys.stdin.read()
            finally:
                for s in servers.values():
                    s.close()
    finally:
        listener.close()
        shutil.rmtree(root, ignore_errors=True)


def _get_chunks(peer: Any, items: list[Any], streams: int) -> list[str]:
    """``peer.get_chunks`` of ``items``, split round-robin over ``streams`` threads (each its
    own pooled connection); the outcomes in ``items`` order."""
    if streams == 1:
        return list(peer.get_chunks(1, items))
    parts: list[list[str]] = [[] for _ in range(streams)]

    def one(i: int) -> None:
        parts[i] = list(peer.get_chunks(1, items[i::streams]))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = [""] * len(items)
    for i in range(streams):
        out[i::streams] = parts[i]
    return out


def client(address: str, server_pid: int) -> None:
    """The ``client`` role (see the module docstring)."""
    import fastckpt
    from fastckpt._hostmem import alloc_aligned
    from fastckpt.replicas._client import PeerClient
    from fastckpt.replicas._connection import PeerOptions

    secret = fastckpt.peer_secret_from_env()
    server_cpu = _cpu_clock(server_pid)
    cfg = json.loads(sys.stdin.readline())
    nbytes = int(cfg["nbytes"])
    dst = np.ones(nbytes, np.uint8)  # warm: bandwidth, not first-touch page faults
    want = _pattern(nbytes)
    peers = {
        m: PeerClient(
            (address, int(cfg[m])), secret=secret, options=PeerOptions(frame_mac=m == "on")
        )
        for m in ("on", "off")
    }

    def items(into: np.ndarray) -> list[tuple[str, np.ndarray, int]]:
        return [(cid, into[off : off + n], crc) for cid, (off, n, crc) in cfg["chunks"].items()]

    raw: dict[int, list[socket.socket]] = {}

    def run_raw(streams: int, into: np.ndarray) -> None:
        if streams not in raw:
            raw[streams] = [
                socket.create_connection((address, int(cfg["raw"])), timeout=60)
                for _ in range(streams)
            ]
        share = nbytes // streams

        def one(i: int) -> None:
            s, view = raw[streams][i], into.data[i * share : (i + 1) * share]
            s.sendall(struct.pack(">Q", view.nbytes))
            _recv_exact(s, view)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    for line in sys.stdin:
        cmd = json.loads(line)
        mode = cmd["mode"]
        if mode in ("on", "off"):
            dst.fill(0)
        c0, s0, t0 = time.process_time(), time.clock_gettime(server_cpu), time.perf_counter()
        if mode in ("raw", "rawfresh"):
            run_raw(int(cmd["streams"]), alloc_aligned(nbytes) if mode == "rawfresh" else dst)
            moved = nbytes // int(cmd["streams"]) * int(cmd["streams"])
        else:
            into = alloc_aligned(nbytes) if mode == "fresh" else dst  # (its pages: untouched)
            todo = items(into)
            outcomes = _get_chunks(
                peers["off" if mode == "off" else "on"], todo, max(1, int(cmd.get("streams", 1)))
            )
            moved = nbytes
        seconds = time.perf_counter() - t0
        time.sleep(0.05)  # the server accounts its last send after the client read it
        doc: dict[str, Any] = {
            "seconds": seconds,
            "bytes": moved,
            "client_cpu_s": time.process_time() - c0,
            "server_cpu_s": time.clock_gettime(server_cpu) - s0,
        }
        if mode not in ("raw", "rawfresh"):
            if outcomes != ["ok"] * len(todo) or not np.array_equal(into, want):
                raise BitExactError(f"get_chunks ({mode}): outcomes {set(outcomes)}; bytes differ")
            doc["checked_bytes"] = nbytes
            del into, todo
        print(json.dumps(doc), flush=True)
    for p in peers.values():
        p.close()
    for socks in raw.values():
        for s in socks:
            s.close()


def main(argv: list[str]) -> None:
    role, *args = argv
    if role == "serve":
        serve(args[0], int(args[1]), int(args[2]), args[3])
    elif role == "client":
        client(args[0], int(args[1]))
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
