"""Compare GCS data paths against fake-gcs-server: fastckpt's GcsStore, google-cloud-storage
media helpers, and tensorstore's ``gcs`` kvstore driver.

Run::

    python -m benchmarks.gcs_backends                    # 8 x 64 MiB, concurrency 4, 3 reps
    python -m benchmarks.gcs_backends --objects 8 --mib 64 --concurrency 8 --reps 3

Each rep writes ``--objects`` fresh objects of ``--mib`` MiB of random bytes with at most
``--concurrency`` requests in flight, then reads the middle half of each (ranged get) and
then each whole object. Figures are MB/s (1e6 bytes/s) of payload and client-process CPU
seconds per GiB (load-independent; the emulator runs in its own process), median over reps;
backends are interleaved within each rep. The
emulator runs with its filesystem backend (``--root``, default a temporary directory).

This script is an "edge": it sets ``TENSORSTORE_GCS_HTTP_URL`` and
``GOOGLE_AUTH_TOKEN_FOR_TESTING`` for tensorstore (which only reads its endpoint from the
environment, once per process); the library itself never does.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from fastckpt.storage import ByteRange, GcsOptions, GcsStore
from fastckpt.testing.gcs_emulator import GcsEmulator

BUCKET = "bench"
Phase = Callable[[int, int], None]  # (rep, object index) -> None
PHASES = ("put", "get_range", "get_full")


def _mbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6


def _timed_threads(fn: Phase, rep: int, n: int, concurrency: int) -> float:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda i: fn(rep, i), range(n)))
    return time.perf_counter() - t0


class FastckptBackend:
    """fastckpt GcsStore: multipart upload streamed from buffers; ranged GET via readinto."""

    name = "fastckpt GcsStore (JSON API, streamed)"

    def __init__(self, endpoint: str, data: list[np.ndarray], concurrency: int) -> None:
        self.data = data
        self.size = data[0].nbytes
        self.concurrency = concurrency
        self.store = GcsStore(
            BUCKET, "fastckpt", options=GcsOptions(endpoint=endpoint, max_workers=concurrency)
        )

    def _run(self, make: Callable[[int], Any], n: int) -> float:
        async def go() -> None:
            sem = asyncio.Semaphore(self.concurrency)

            async def one(i: int) -> None:
                async with sem:
                    await make(i)

            await asyncio.gather(*(one(i) for i in range(n)))

        t0 = time.perf_counter()
        asyncio.run(go())
        return time.perf_counter() - t0

    def put(self, rep: int, n: int) -> float:
        return self._run(lambda i: self.store.put(f"{rep}/{i}", self.data[i], mode="create"), n)

    def get_range(self, rep: int, n: int) -> float:
        rng = ByteRange(self.size // 4, self.size // 2)
        return self._run(lambda i: self.store.get(f"{rep}/{i}", byte_range=rng), n)

    def get_full(self, rep: int, n: int) -> float:
        return self._run(lambda i: self.store.get(f"{rep}/{i}"), n)

    def close(self) -> None:
        asyncio.run(self.store.close())


class GcsLibBackend:
    """google-cloud-storage media helpers (upload_from_file / download_as_bytes)."""

    name = "google-cloud-storage upload_from_file / download_as_bytes"

    def __init__(self, endpoint: str, data: list[np.ndarray], concurrency: int) -> None:
        import requests.adapters
        from google.api_core.client_options import ClientOptions
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        session = requests.Session()
        session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=concurrency + 2))
        client = storage.Client(
            project="bench", credentials=AnonymousCredentials(), _http=session,
            client_options=ClientOptions(api_endpoint=endpoint),
        )  # fmt: skip
        self.bucket = client.bucket(BUCKET)
        self.data = data
        self.size = data[0].nbytes
        self.concurrency = concurrency

    def put(self, rep: int, n: int) -> float:
        def one(rep: int, i: int) -> None:
            self.bucket.blob(f"gcslib/{rep}/{i}").upload_from_file(
                io.BytesIO(memoryview(self.data[i])), size=self.size, if_generation_match=0,
                retry=None, checksum="crc32c",
            )  # fmt: skip

        return _timed_threads(one, rep, n, self.concurrency)

    def get_range(self, rep: int, n: int) -> float:
        def one(rep: int, i: int) -> None:
            start = self.size // 4
            self.bucket.blob(f"gcslib/{rep}/{i}").download_as_bytes(
                start=start, end=start + self.size // 2 - 1, checksum=None, retry=None
            )

        return _timed_threads(one, rep, n, self.concurrency)

    def get_full(self, rep: int, n: int) -> float:
        def one(rep: int, i: int) -> None:
            self.bucket.blob(f"gcslib/{rep}/{i}").download_as_bytes(checksum=None, retry=None)

        return _timed_threads(one, rep, n, self.concurrency)

    def close(self) -> None:
        pass


class TensorstoreBackend:
    """tensorstore's gcs kvstore (C++ HTTP client, simple media uploads)."""

    name = "tensorstore gcs kvstore"

    def __init__(self, endpoint: str, data: list[np.ndarray], concurrency: int) -> None:
        del endpoint  # taken from TENSORSTORE_GCS_HTTP_URL, set in main()
        import tensorstore as ts

        self.kv = ts.KvStore.open(
            {
                "driver": "gcs",
                "bucket": BUCKET,
                "path": "tensorstore/",
                "context": {"gcs_request_concurrency": {"limit": concurrency}},
            }
        ).result()
        # tensorstore's write() takes bytes only: copy once, outside the timed region.
        self.blobs = [d.tobytes() for d in data]
        self.size = data[0].nbytes

    def _wait(self, futures: list[Any]) -> None:
        for f in futures:
            f.result()

    def put(self, rep: int, n: int) -> float:
        t0 = time.perf_counter()
        self._wait([self.kv.write(f"{rep}/{i}", self.blobs[i]) for i in range(n)])
        return time.perf_counter() - t0

    def get_range(self, rep: int, n: int) -> float:
        start = self.size // 4
        sl = slice(start, start + self.size // 2)
        t0 = time.perf_counter()
        futures = [self.kv.read(f"{rep}/{i}", byte_range=sl) for i in range(n)]
        for f in futures:
            assert len(f.result().value) == self.size // 2
        return time.perf_counter() - t0

    def get_full(self, rep: int, n: int) -> float:
        t0 = time.perf_counter()
        futures = [self.kv.read(f"{rep}/{i}") for i in range(n)]
        for f in futures:
            assert len(f.result().value) == self.size
        return time.perf_counter() - t0

    def close(self) -> None:
        pass


BACKENDS = {
    "fastckpt": FastckptBackend,
    "gcs-lib": GcsLibBackend,
    "tensorstore": TensorstoreBackend,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--objects", type=int, default=8)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--root", default=None, help="emulator filesystem root (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a Markdown table")
    args = ap.parse_args(argv)

    size = args.mib * 1024 * 1024
    rng = np.random.default_rng(0)
    data = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(args.objects)]
    total = size * args.objects
    names = args.backends.split(",")
    # phase -> backend -> [(MB/s, client CPU seconds per GiB)] over reps
    samples: dict[str, dict[str, list[tuple[float, float]]]] = {
        p: {n: [] for n in names} for p in PHASES
    }
    labels: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="fastckpt-bench-") as tmp:
        with GcsEmulator(backend="filesystem", root=args.root or os.path.join(tmp, "gcs")) as emu:
            emu.create_bucket(BUCKET)
            os.environ["TENSORSTORE_GCS_HTTP_URL"] = emu.endpoint
            os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "x")
            backends = {n: BACKENDS[n](emu.endpoint, data, args.concurrency) for n in names}
            labels = {n: b.name for n, b in backends.items()}
            try:
                # Interleave backends within each rep so load drift on a shared machine
                # hits all of them alike.
                for rep in range(args.reps):
                    for phase, nbytes in (
                        ("put", total),
                        ("get_range", total // 2),
                        ("get_full", total),
                    ):
                        for n, backend in backends.items():
                            cpu0 = time.process_time()
                            seconds = getattr(backend, phase)(rep, args.objects)
                            cpu = time.process_time() - cpu0
                            samples[phase][n].append(
                                (_mbps(nbytes, seconds), cpu / (nbytes / 2**30))
                            )
            finally:
                for backend in backends.values():
                    backend.close()
    results = {
        labels[n]: {
            **{p: statistics.median(x[0] for x in samples[p][n]) for p in PHASES},
            **{
                f"{p}_cpu_s_per_gib": statistics.median(x[1] for x in samples[p][n]) for p in PHASES
            },
        }
        for n in names
    }
    for n in names:
        print(
            f"# {labels[n]}: "
            + ", ".join(f"{p} {[round(x[0]) for x in samples[p][n]]}" for p in PHASES),
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps({"args": vars(args), "results_mb_per_s": results}, indent=2))
    else:
        print(
            f"{args.objects} x {args.mib} MiB, concurrency {args.concurrency}, median of "
            f"{args.reps} (MB/s)\n"
        )
        print(
            "| backend | put MB/s | ranged get MB/s | full get MB/s | client CPU s/GiB (put / "
            "range / full) |"
        )
        print("|---|---|---|---|---|")
        for name, r in results.items():
            cpu = " / ".join(f"{r[p + '_cpu_s_per_gib']:.2f}" for p in PHASES)
            print(
                f"| {name} | {r['put']:.0f} | {r['get_range']:.0f} | {r['get_full']:.0f} | {cpu} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
