"""Host memory under a tight ``max_inflight_bytes``, measured in a fresh process.

A 160 MiB state (half incompressible float32, half compressible int32) is saved with
``max_inflight_bytes`` = 8 MiB, then saved 9 more times, then restored with 2 concurrent
reads of at most 4 MiB. RSS is sampled every ~2 ms (psutil). Bounds checked:

* save: peak - base <= state (the one staging copy) + max_inflight_bytes + slack;
* repeated saves: RSS after save 10 - RSS after save 2 <= growth slack (the staging buffer
  is reused, encoded bytes are freed);
* restore: peak - base <= restored state + read_concurrency * max_request_bytes + slack.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from fastckpt import CheckpointManager, ManagerOptions, RestoreOptions, SaveOptions
from fastckpt.storage import ByteRange, MemoryStore
from fastckpt.storage._protocol import Buffer
from tests.support.wrapping import ForwardingStore

from ._util import HERE, Recorder

MiB = 1 << 20
STATE_MIB = 160
INFLIGHT_MIB = 8
READ_BYTES = 2 * 4 * MiB  # read_concurrency x max_request_bytes
#: Allocator and thread overhead not proportional to the state: zstd contexts, thread
#: stacks, numpy scratch of one chunk per thread, jax's own bookkeeping.
SLACK = 24 * MiB
GROWTH_SLACK = 16 * MiB


def _run(root: Path, repeats: int) -> dict[str, Any]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = re.sub(
        r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    spec = {
        "root": str(root),
        "state_mib": STATE_MIB,
        "inflight_mib": INFLIGHT_MIB,
        "repeats": repeats,
    }
    proc = subprocess.run(
        [sys.executable, str(HERE / "_memory_worker.py"), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_save_and_restore_stay_under_the_memory_bound(tmp_path: Path, recorder: Recorder) -> None:
    r = _run(tmp_path / "ckpt", repeats=10)
    state = r["state"]
    assert state == STATE_MIB * MiB and r["restored"] == state
    save_extra = r["save_peak"] - r["save_base"]
    save_bound = state + INFLIGHT_MIB * MiB + SLACK
    restore_extra = r["restore_peak"] - r["restore_base"]
    restore_bound = state + READ_BYTES + SLACK
    growth = r["after_save"][-1] - r["after_save"][1]
    figures = {
        "state_mib": STATE_MIB,
        "max_inflight_mib": INFLIGHT_MIB,
        "save_peak_over_base_mib": round(save_extra / MiB, 1),
        "save_bound_mib": round(save_bound / MiB, 1),
        "restore_peak_over_base_mib": round(restore_extra / MiB, 1),
        "restore_bound_mib": round(restore_bound / MiB, 1),
        "rss_after_saves_mib": [round(x / MiB, 1) for x in r["after_save"]],
        "growth_save2_to_save10_mib": round(growth / MiB, 1),
    }
    recorder.add("memory", **figures)
    assert save_extra <= save_bound, figures
    assert restore_extra <= restore_bound, figures
    assert growth <= GROWTH_SLACK, figures


class LiveBytesStore(ForwardingStore):
    """A MemoryStore whose ``get`` returns fresh buffers and tracks how many bytes of them are
    still alive (referenced by the reader), and the peak of that."""

    def __init__(self) -> None:
        super().__init__(MemoryStore())
        self.live = self.peak = 0
        self._lock = threading.Lock()

    def _free(self, n: int) -> None:
        with self._lock:
            self.live -= n

    async def get(self, key: str, *, byte_range: ByteRange | None = None) -> Buffer:
        data = np.frombuffer(
            bytes(await self.inner.get(key, byte_range=byte_range)), np.uint8
        ).copy()
        with self._lock:
            self.live += data.nbytes
            self.peak = max(self.peak, self.live)
        weakref.finalize(data, self._free, data.nbytes)
        return memoryview(data)


def test_restore_keeps_at_most_read_concurrency_ranges_in_memory(recorder: Recorder) -> None:
    """Fetched-but-not-yet-decoded ranges are bounded by (``read_concurrency`` + decode
    threads) x ``max_request_bytes``: a fast store cannot run ahead of the decoder (before the
    fix, the whole 32 MiB state was in fetched buffers at once)."""
    store = LiveBytesStore()
    w = np.frombuffer(np.random.default_rng(0).bytes(32 * MiB), np.float32)
    opts = ManagerOptions(
        save=SaveOptions(max_chunk_bytes=1 * MiB, object_bytes=8 * MiB, compression="none"),
        restore=RestoreOptions(read_concurrency=2, max_request_bytes=1 * MiB, max_gap_bytes=0),
    )
    with CheckpointManager(store, options=opts) as mgr:
        mgr.save(1, {"w": w})
        mgr.wait()
        store.peak = 0
        got = mgr.restore(1)
    assert got["w"].tobytes() == w.tobytes()
    # Two read slots; a decode thread may still hold its finished range for an instant after
    # the slot is free (2 threads); plus the manifest read or one re-read.
    bound = (2 + 2) * MiB + 1 * MiB
    recorder.add(
        "memory_restore_read_buffers",
        state_mib=32,
        read_concurrency=2,
        max_request_mib=1,
        peak_live_read_mib=round(store.peak / MiB, 2),
        bound_mib=bound / MiB,
    )
    assert store.peak <= bound, store.peak / MiB
