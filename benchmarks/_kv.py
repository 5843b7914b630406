"""A job for ``benchmarks.planning_scale``: how long the ``jax.distributed`` key-value store
takes to hand a value from process 0 to every other process (what a RAM checkpoint's
manifest broadcast cost before process 0 kept it; a few bytes now). Run through
``fastckpt_examples.cluster.multiprocess.run_processes``."""

from __future__ import annotations

import time
from typing import Any


def broadcast_times(sizes: list[int], reps: int) -> dict[str, Any]:
    """Per value size (bytes), the best of ``reps`` times from process 0's ``set`` until
    every process holds the value (a barrier after the ``get``s closes the interval)."""
    from fastckpt.coordination.distributed import default_coordinator

    coord = default_coordinator()
    out: dict[str, float] = {}
    for n in sizes:
        value = "x" * n
        best = float("inf")
        for r in range(reps):
            coord.barrier(f"kv/start/{n}/{r}", timeout_s=120)
            t0 = time.perf_counter()
            if coord.process_index == 0:
                coord.set(f"kv/value/{n}/{r}", value)
            else:
                got = coord.get(f"kv/value/{n}/{r}", timeout_s=300)
                assert len(got) == n
            coord.barrier(f"kv/end/{n}/{r}", timeout_s=300)
            best = min(best, time.perf_counter() - t0)
        out[str(n)] = best
    return {"process": coord.process_index, "processes": coord.process_count, "seconds": out}
