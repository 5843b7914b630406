"""Run inside each process of a 2-process jax.distributed job
(fastckpt_examples.cluster.multiprocess).

:func:`save_until_killed` saves steps 1, 2, ... of the crash worker's deterministic state over
a global mesh (every process holds half of each array) until the chosen victim SIGKILLs
itself at a random moment; the survivor then fails at a barrier (bounded by
``barrier_timeout_s``) and returns. Each process appends ``committed <step>`` to its own
progress file after every save that returned, so the parent knows what was acknowledged.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fastckpt import (
    CheckpointManager,
    DistributedOptions,
    ManagerOptions,
    RetentionOptions,
    SaveOptions,
)

_spec = importlib.util.spec_from_file_location(
    "_crash_worker_mp", Path(__file__).with_name("_crash_worker.py")
)
assert _spec is not None and _spec.loader is not None
_worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_worker)


def save_until_killed(
    root: str, progress_dir: str, victim: int, kill_after_s: float, barrier_timeout_s: float
) -> dict[str, Any]:
    me = jax.process_index()
    mesh = Mesh(np.asarray(jax.devices()).reshape(-1), ("x",))
    shardings = {"w": NamedSharding(mesh, P("x", None)), "b": NamedSharding(mesh, P("x"))}
    options = ManagerOptions(
        save=SaveOptions(max_chunk_bytes=64 << 10, object_bytes=192 << 10),
        retention=RetentionOptions(keep_last=2),
        distributed=DistributedOptions(barrier_timeout_s=barrier_timeout_s),
    )
    progress = Path(progress_dir) / f"progress{me}.txt"
    committed: list[int] = []
    with CheckpointManager(root, options=options) as mgr:
        # Both processes start saving together; the victim's clock starts then.
        if me == victim:
            timer = threading.Timer(kill_after_s, lambda: os.kill(os.getpid(), signal.SIGKILL))
            timer.daemon = True
            timer.start()
        t0 = time.monotonic()
        try:
            for step in range(1, 10_000):
                host = _worker.expected(step)
                state = {
                    k: (
                        jax.make_array_from_callback(v.shape, shardings[k], lambda i, v=v: v[i])
                        if k in shardings
                        else v
                    )
                    for k, v in host.items()
                }
                mgr.save(step, state)
                mgr.wait()
                committed.append(step)
                with progress.open("a") as f:
                    f.write(f"committed {step}\n")
                if time.monotonic() - t0 > kill_after_s + 4 * barrier_timeout_s + 30:
                    break  # the victim never died (cannot happen); do not loop forever
        except Exception as e:  # the survivor: a barrier or commit failure once the victim is gone
            return {"committed": committed, "error": f"{type(e).__name__}: {e}"[:500]}
        finally:
            try:
                mgr.close()
            except Exception:
                pass
    return {"committed": committed, "error": None}
