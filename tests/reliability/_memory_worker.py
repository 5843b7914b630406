"""Measure host memory of saves and a restore in a fresh process (RSS sampled every ~2 ms).

Run as ``python _memory_worker.py SPEC_JSON``; prints one JSON line of figures (bytes):

* ``state``: bytes of the state saved (half incompressible float32, half compressible int32,
  so both the raw and the zstd paths of the writer run);
* ``save_base``/``save_peak``: RSS just before the first ``save`` and its peak until the
  commit; the bound the test checks is ``state`` (the staging copy) + ``max_inflight_bytes``;
* ``after_save``: RSS after each of ``repeats`` saves (retention keeps one step);
* ``restore_base``/``restore_peak``: RSS before a restore and its peak.
"""

from __future__ import annotations

import gc
import json
import sys
import threading
import time
from typing import Any


class Sampler:
    """Peak RSS between ``start()`` and ``stop()``, sampled from /proc every ~2 ms."""

    def __init__(self) -> None:
        import psutil

        self._proc = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def rss(self) -> int:
        return int(self._proc.memory_info().rss)

    def start(self) -> int:
        self.peak = base = self.rss()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return base

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(0.002)

    def stop(self) -> int:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self.peak = max(self.peak, self.rss())
        return self.peak


def main(spec: dict[str, Any]) -> None:
    import jax
    import jax.numpy as jnp

    from fastckpt import (
        CheckpointManager,
        ManagerOptions,
        RestoreOptions,
        RetentionOptions,
        SaveOptions,
    )
    from fastckpt.storage import open_store

    mib = 1 << 20
    n = spec["state_mib"] * mib // 4 // 2  # elements per half
    import numpy as np

    rng = np.random.default_rng(0)
    state = {}
    for name, host in (
        ("w", rng.standard_normal(n, dtype=np.float32)),
        ("z", (np.arange(n, dtype=np.int32) * 7) % 13),
    ):
        state[name] = jax.device_put(host)  # no compilation; the host copy is dropped below
        del host
    jax.block_until_ready(state)
    total = sum(int(x.nbytes) for x in state.values())
    opts = ManagerOptions(
        save=SaveOptions(
            max_inflight_bytes=spec["inflight_mib"] * mib,
            max_chunk_bytes=4 * mib,
            object_bytes=8 * mib,
            encode_threads=2,
            upload_concurrency=2,
        ),
        restore=RestoreOptions(read_concurrency=2, max_request_bytes=4 * mib, decode_threads=2),
        retention=RetentionOptions(keep_last=1, keep_every=1000),  # step 0 (warm-up) stays
    )
    sampler = Sampler()
    out: dict[str, Any] = {"state": total}

    def store() -> Any:  # page cache, not fsync: the figures are about this process's memory
        return open_store(spec["root"], local_durable=False)

    with CheckpointManager(store(), options=opts) as mgr:
        mgr.save(0, {"warm": jnp.ones(16)})  # threads, pools and the store exist before measuring
        mgr.wait()
        gc.collect()
        out["save_base"] = sampler.start()
        mgr.save(1, state)
        mgr.wait()
        out["save_peak"] = sampler.stop()
        out["after_save"] = [sampler.rss()]
        for step in range(2, spec["repeats"] + 1):
            mgr.save(step, state)
            mgr.wait()
            out["after_save"].append(sampler.rss())
        last = spec["repeats"]
    del state
    gc.collect()
    with CheckpointManager(store(), options=opts) as mgr:
        mgr.restore(0)  # warm the restore path
        gc.collect()
        out["restore_base"] = sampler.start()
        restored = mgr.restore(last)
        jax.block_until_ready(restored)
        out["restore_peak"] = sampler.stop()
        out["restored"] = sum(int(x.nbytes) for x in restored.values())
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
