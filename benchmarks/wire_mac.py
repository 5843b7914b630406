"""What authenticating the peer wire costs: candidate MACs, then a loopback transfer.

Run ``python -m benchmarks.wire_mac [--mib 512] [--chunk-mib 16] [--repeats 5]``
(``--quick``: 128 MiB, 3 repeats).

Part 1, one thread, best of ``--reps`` over a 64 MiB buffer fed in 4 MiB windows (as the
peer receive path feeds its checksum): crc32c (what every chunk already pays), HMAC-SHA256,
keyed BLAKE2b, Poly1305, GMAC (AES-256-GCM with the data as associated data, the chosen
frame MAC), AES-256-GCM (streamed into a reused buffer) and ChaCha20-Poly1305 (one call)
encryption (what encrypting would cost);
GMAC on two threads at once (it releases the GIL, so the receive helper thread overlaps it
with the socket); and the cost per small frame (a header) of a tag from a reused ``AESGCM``,
of a fresh ``Cipher(GCM)`` context (one per payload) and of HMAC-SHA256.

Part 2, ``PeerClient.get_chunks`` of ``--mib`` MiB in ``--chunk-mib`` MiB chunks (crc32c
checked) from a ``PeerServer`` in another process over loopback, into a warm buffer: raw TCP
(the same bytes, one request, no framing, no checks), ``frame_mac=False`` and
``frame_mac=True``. The three run interleaved (rotating order, after a warm-up of each);
throughput is the median, and the CPU seconds of client and server processes are medians
too. Where the CPU goes: each side's extra CPU with MACs against the GMAC time part 1
predicts for the bytes it tagged or verified.

Writes ``benchmarks/results/wire_mac.{json,md}`` (``_quick`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import hmac
import os
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import (
    RESULTS_DIR,
    MiB,
    cpu_seconds,
    markdown_table,
    publish_docs,
    text_table,
    write_json,
)

SECRET = b"benchmark-secret-0123456789"
WINDOW = 4 * MiB
MODES = ("raw TCP", "frame_mac=False", "frame_mac=True")


# =========================================================================== part 1


def _best(fn: Callable[[], Any], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _candidates(view: memoryview) -> dict[str, Callable[[], Any]]:
    """name -> a function that authenticates (or checksums) all of ``view`` once."""
    import crc32c
    from cryptography.hazmat.primitives import poly1305
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    key, nonce = os.urandom(32), os.urandom(12)
    windows = [view[off : off + WINDOW] for off in range(0, view.nbytes, WINDOW)]
    chacha = ChaCha20Poly1305(key)

    def crc() -> int:
        value = 0
        for w in windows:
            value = crc32c.crc32c(w, value)
        return value

    def streamed(make: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            ctx = make()
            for w in windows:
                ctx.update(w)
            return ctx.digest() if hasattr(ctx, "digest") else ctx.finalize()

        return run

    def gmac() -> bytes:
        ctx = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
        for w in windows:
            ctx.authenticate_additional_data(w)
        ctx.finalize()
        return bytes(ctx.tag)

    window_out = bytearray(WINDOW + 15)  # update_into needs room for a block more

    def aes_gcm() -> bytes:  # streamed like the MAC, into one reused buffer
        ctx = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
        for w in windows:
            ctx.update_into(w, window_out)
        ctx.finalize()
        return bytes(ctx.tag)

    whole_out = bytearray(view.nbytes + 16)

    def chacha20() -> Any:  # no streaming API: one call over the whole buffer, no allocation
        if hasattr(chacha, "encrypt_into"):  # cryptography >= 45
            return chacha.encrypt_into(nonce, view, None, whole_out)
        return chacha.encrypt(nonce, view, None)

    return {
        "crc32c": crc,
        "HMAC-SHA256": streamed(lambda: hmac.new(key, digestmod=hashlib.sha256)),
        "keyed BLAKE2b": streamed(lambda: hashlib.blake2b(key=key[:32])),
        "Poly1305": streamed(lambda: poly1305.Poly1305(key)),
        "GMAC (AES-256-GCM, data as AAD)": gmac,
        "AES-256-GCM encrypt (streamed)": aes_gcm,
        "ChaCha20-Poly1305 encrypt": chacha20,
    }


def _per_frame_us(n: int = 20000) -> dict[str, float]:
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    key, nonce = os.urandom(32), os.urandom(12)
    header = os.urandom(200)
    aesgcm, aes = AESGCM(key), algorithms.AES(key)

    def fresh() -> None:
        ctx = Cipher(aes, modes.GCM(nonce)).encryptor()
        ctx.authenticate_additional_data(header)
        ctx.finalize()

    fns: dict[str, Callable[[], Any]] = {
        "AESGCM(key).encrypt(nonce, b'', header), key reused": lambda: aesgcm.encrypt(
            nonce, b"", header
        ),
        "fresh Cipher(AES, GCM) context + tag": fresh,
        "HMAC-SHA256 of the header": lambda: hmac.new(key, header, hashlib.sha256).digest(),
    }
    out = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out[name] = (time.perf_counter() - t0) / n * 1e6
    return out


def measure_macs(reps: int) -> dict[str, Any]:
    buf = np.frombuffer(os.urandom(64 * MiB), np.uint8)
    view = memoryview(buf)
    rows = {name: view.nbytes / _best(fn, reps) / 1e9 for name, fn in _candidates(view).items()}
    gmac = _candidates(view)["GMAC (AES-256-GCM, data as AAD)"]

    def two() -> None:
        threads = [threading.Thread(target=gmac) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    two_threads = 2 * view.nbytes / _best(two, reps) / 1e9
    return {
        "gbps_one_thread": rows,
        "gmac_two_threads_gbps": two_threads,
        "per_frame_us": _per_frame_us(),
    }


# =========================================================================== part 2


def measure_transfer(nbytes: int, chunk: int, repeats: int, shm: str) -> dict[str, Any]:
    from benchmarks.peer_throughput import _build_tier, _raw_reader, _spawn, _stop
    from fastckpt.replicas._client import PeerClient
    from fastckpt.replicas._connection import PeerOptions

    with tempfile.TemporaryDirectory(dir=shm, prefix="fastckpt-bench-") as d:
        root = Path(d) / "tier"
        chunks = _build_tier(root, nbytes, chunk)
        dst = np.empty(nbytes, np.uint8)
        dst[:] = 0  # pre-fault: measure bandwidth, not first-touch page faults
        peer_proc, (port_off, port_on) = _spawn(
            ["--serve-peer", str(root), "--frame-mac", "off,on"]
        )
        raw_proc, (port_raw,) = _spawn(["--serve-raw", str(nbytes)])
        procs = {
            MODES[0]: (raw_proc, port_raw),
            MODES[1]: (peer_proc, port_off),
            MODES[2]: (peer_proc, port_on),
        }
        runs: dict[str, Callable[[], None]] = {}
        closers = []
        for mode in MODES[1:]:
            opts = PeerOptions(frame_mac=mode.endswith("True"))
            client = PeerClient(("127.0.0.1", procs[mode][1]), secret=SECRET, options=opts)
            closers.append(client.close)
            items = [(cid, dst[off : off + n], crc) for cid, (off, n, crc) in chunks.items()]

            def run(client: PeerClient = client, items: list[Any] = items) -> None:
                assert client.get_chunks(1, items) == ["ok"] * len(items)

            runs[mode] = run
        raw, close_raw = _raw_reader(procs[MODES[0]][1], nbytes, dst, 1)
        runs[MODES[0]] = raw
        closers.append(close_raw)
        samples: dict[str, dict[str, list[float]]] = {
            m: {"s": [], "client_cpu": [], "server_cpu": []} for m in MODES
        }
        try:
            for mode in MODES:  # warm-up
                runs[mode]()
            for r in range(repeats):
                order = MODES[r % 3 :] + MODES[: r % 3]
                for mode in order:
                    pid = procs[mode][0].pid
                    c0, s0, t0 = time.process_time(), cpu_seconds(pid), time.perf_counter()
                    runs[mode]()
                    t1 = time.perf_counter()
                    time.sleep(0.05)  # the server counts its last send after the client read it
                    samples[mode]["s"].append(t1 - t0)
                    samples[mode]["client_cpu"].append(time.process_time() - c0)
                    samples[mode]["server_cpu"].append(cpu_seconds(pid) - s0)
        finally:
            for close in closers:
                close()
            _stop(peer_proc)
            _stop(raw_proc)
    out: dict[str, Any] = {}
    for mode, s in samples.items():
        med = {k: statistics.median(v) for k, v in s.items()}
        out[mode] = {
            "gbps": nbytes / med["s"] / 1e9,
            "seconds": med["s"],
            "client_cpu_s": med["client_cpu"],
            "server_cpu_s": med["server_cpu"],
            "samples_s": s["s"],
        }
    return out


# =========================================================================== report


def report(doc: dict[str, Any]) -> tuple[str, str]:
    macs = doc["macs"]
    rows = [[k, f"{v:.2f}"] for k, v in macs["gbps_one_thread"].items()]
    rows.append(["GMAC, 2 threads at once (aggregate)", f"{macs['gmac_two_threads_gbps']:.2f}"])
    t1 = (["candidate (64 MiB in 4 MiB windows, 1 thread)", "GB/s"], rows)
    t2 = (
        ["per small frame (200-byte header)", "us"],
        [[k, f"{v:.2f}"] for k, v in macs["per_frame_us"].items()],
    )
    tr = doc["transfer"]
    gmac = macs["gbps_one_thread"]["GMAC (AES-256-GCM, data as AAD)"]
    predicted = doc["nbytes"] / gmac / 1e9
    rows3 = []
    for mode in MODES:
        r = tr[mode]
        rows3.append(
            [
                mode,
                f"{r['gbps']:.2f}",
                f"{r['gbps'] / tr[MODES[0]]['gbps']:.0%}",
                f"{r['seconds']:.3f}",
                f"{r['client_cpu_s']:.3f}",
                f"{r['server_cpu_s']:.3f}",
            ]
        )
    t3 = (["get_chunks", "GB/s", "of raw", "s", "client CPU s", "server CPU s"], rows3)
    on, off = tr["frame_mac=True"], tr["frame_mac=False"]
    dc, ds = on["client_cpu_s"] - off["client_cpu_s"], on["server_cpu_s"] - off["server_cpu_s"]
    mib = doc["nbytes"] / MiB
    where = (
        f"Where the CPU goes: with MACs the client used {dc:+.3f} CPU s "
        f"({dc / on['client_cpu_s']:.0%} of its CPU) and the server {ds:+.3f} CPU s "
        f"({ds / on['server_cpu_s']:.0%} of its CPU) more than without; GMAC over "
        f"{mib:.0f} MiB at the one-thread rate above takes {predicted:.3f} s per side. "
        f"Throughput with MACs: {on['gbps'] / off['gbps']:.0%} of frame_mac=False."
    )
    cmd = "python -m benchmarks.wire_mac" + (" --quick" if doc["quick"] else "")
    cpus = f", {doc['cpus']} CPUs" if doc.get("cpus") else ""
    head = (
        f"`{cmd}`, {doc['when']} (git {doc['git']}){cpus}. Part 2: "
        f"{mib:.0f} MiB in {doc['chunk'] / MiB:.0f} MiB chunks, median of {doc['repeats']} "
        "interleaved runs."
    )
    md = "\n\n".join(
        [
            "# Peer wire authentication: what it costs",
            head,
            "## Candidate MACs",
            markdown_table(*t1),
            markdown_table(*t2),
            "## Loopback transfer, client and server processes",
            markdown_table(*t3),
            where,
        ]
    )
    text = "\n\n".join([text_table(*t1), text_table(*t2), text_table(*t3), where])
    return md + "\n", text


def render(doc: dict[str, Any]) -> str:
    """The markdown report of a results JSON (also the body of its docs/benchmarks.md block)."""
    return report(doc)[0]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--chunk-mib", type=int, default=16)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--reps", type=int, default=5, help="best-of for part 1")
    p.add_argument("--shm", default="/dev/shm")
    p.add_argument("--quick", action="store_true")
    p.add_argument(
        "--update-docs",
        action="store_true",
        help="rewrite the docs/benchmarks.md block even for --quick",
    )
    a = p.parse_args(argv)
    if a.quick:
        a.mib, a.repeats, a.reps = 128, 3, 3
    git = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    doc: dict[str, Any] = {
        "when": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "git": git,
        "quick": a.quick,
        "nbytes": a.mib * MiB,
        "chunk": a.chunk_mib * MiB,
        "repeats": a.repeats,
        "cpus": os.cpu_count(),
        "macs": measure_macs(a.reps),
    }
    doc["transfer"] = measure_transfer(a.mib * MiB, a.chunk_mib * MiB, a.repeats, a.shm)
    md, text = report(doc)
    print(text)
    name = "wire_mac_quick" if a.quick else "wire_mac"
    write_json(RESULTS_DIR / f"{name}.json", doc)
    (RESULTS_DIR / f"{name}.md").write_text(md)
    publish_docs(
        "wire_mac",
        doc,
        render=render,
        results_path=RESULTS_DIR / f"{name}.json",
        quick=a.quick,
        force=a.update_docs,
    )


if __name__ == "__main__":
    main()
