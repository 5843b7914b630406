"""A TCP relay that delays every byte by a fixed time in each direction (stdlib only).

Run inside a simulated host: ``python _delay_relay.py BIND PORT TARGET_HOST TARGET_PORT DELAY_MS``.
It prints ``listening`` once it accepts connections, and relays each accepted connection to
``TARGET_HOST:TARGET_PORT``, holding every piece it reads for ``DELAY_MS`` before writing it
on: a request/response round trip through it takes ``2 * DELAY_MS`` more, as a distant
server's would, while the bandwidth stays what the two ends and the relay manage.

It stands in for the netem qdisc, which the kernel of the machine the benchmarks run on
lacks. Unlike netem it delays data, not TCP's own acknowledgements: each side's congestion
window sees a short round trip to the relay, which is what a TCP-terminating proxy in front
of a distant service looks like too. Runs until killed.
"""

from __future__ import annotations

import collections
import socket
import sys
import threading
import time

_PIECE = 1 << 18
_MAX_HELD = 64 << 20  # per direction: back-pressure beyond this


def _pump(src: socket.socket, dst: socket.socket, delay_s: float) -> None:
    held: collections.deque[tuple[float, bytes]] = collections.deque()
    cond = threading.Condition()
    state = {"bytes": 0, "eof": False}

    def writer() -> None:
        try:
            while True:
                with cond:
                    while not held and not state["eof"]:
                        cond.wait()
                    if not held:
                        break
                    due, data = held[0]
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                with cond:
                    held.popleft()
                    state["bytes"] -= len(data)
                    cond.notify_all()
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    out = threading.Thread(target=writer, daemon=True)
    out.start()
    try:
        while data := src.recv(_PIECE):
            with cond:
                while state["bytes"] > _MAX_HELD:
                    cond.wait()
                held.append((time.monotonic() + delay_s, data))
                state["bytes"] += len(data)
                cond.notify_all()
    except OSError:
        pass
    with cond:
        state["eof"] = True
        cond.notify_all()
    out.join()


def _serve(conn: socket.socket, target: tuple[str, int], delay_s: float) -> None:
    try:
        upstream = socket.create_connection(target, timeout=10)
    except OSError:
        conn.close()
        return
    upstream.settimeout(None)
    for s in (conn, upstream):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    back = threading.Thread(target=_pump, args=(upstream, conn, delay_s), daemon=True)
    back.start()
    _pump(conn, upstream, delay_s)
    back.join()
    conn.close()
    upstream.close()


def main(argv: list[str]) -> None:
    bind, port, target_host, target_port, delay_ms = argv
    listener = socket.create_server((bind, int(port)), backlog=128)
    print("listening", flush=True)
    while True:
        conn, _ = listener.accept()
        threading.Thread(
            target=_serve,
            args=(conn, (target_host, int(target_port)), float(delay_ms) / 1000),
            daemon=True,
        ).start()


if __name__ == "__main__":
    main(sys.argv[1:])
