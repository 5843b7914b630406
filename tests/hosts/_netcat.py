"""A tiny TCP tool run inside simulated hosts by the tests (standard library only).

``recv PORT``: accept one connection, read to EOF, print ``{"bytes", "seconds"}`` (seconds
from the first byte to EOF). ``send HOST PORT NBYTES``: connect and send NBYTES.
``echo PORT``: answer each 1-byte message with 1 byte until EOF. ``ping HOST PORT N``: N
1-byte round trips, print the round-trip times in seconds. Listeners print ``listening``
once they accept connections.
"""

from __future__ import annotations

import json
import socket
import sys
import time


def _listen(port: int) -> socket.socket:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", port))
    server.listen(1)
    print("listening", flush=True)
    return server


def main(mode: str, *args: str) -> None:
    if mode == "recv":
        conn, _ = _listen(int(args[0])).accept()
        buf, total, first = bytearray(1 << 20), 0, 0.0
        while n := conn.recv_into(buf):
            first = first or time.monotonic()
            total += n
        print(json.dumps({"bytes": total, "seconds": time.monotonic() - first}), flush=True)
    elif mode == "send":
        conn = socket.create_connection((args[0], int(args[1])), timeout=60)
        conn.settimeout(None)
        left, chunk = int(args[2]), b"x" * (1 << 20)
        while left > 0:
            conn.sendall(chunk[:left])
            left -= min(left, len(chunk))
        conn.close()
    elif mode == "echo":
        conn, _ = _listen(int(args[0])).accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while conn.recv(1):
            conn.sendall(b"y")
    elif mode == "ping":
        conn = socket.create_connection((args[0], int(args[1])), timeout=10)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for _ in range(int(args[2])):
            t0 = time.monotonic()
            conn.sendall(b"x")
            conn.recv(1)
            rtts.append(time.monotonic() - t0)
        print(json.dumps(rtts), flush=True)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(*sys.argv[1:])
