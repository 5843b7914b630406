"""A writer process for the crash tests: saves steps 1, 2, 3, ... until it is SIGKILLed.

Run as ``python _crash_worker.py SPEC_JSON``. After each committed save it prints
``committed <step>`` (flushed), so the parent knows which saves returned. The state of a step
is a deterministic function of the step (:func:`expected`), so the parent can check every
restored step bit for bit without talking to the child. Nothing here imports jax at import
time: the parent imports this module for :func:`expected`.

Spec keys: ``root`` (path or ``gs://`` URL), ``endpoint`` (GCS endpoint or null),
``ram_root`` (RAM tier directory, or null for storage only), ``max_steps``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np

#: Array leaves: name -> (shape, numpy dtype name). About 0.75 MiB per step.
ARRAYS: dict[str, tuple[tuple[int, ...], str]] = {
    "w": ((256, 512), "float32"),
    "b": ((4096,), "int16"),
    "n": ((333,), "int64"),
}


def expected(step: int) -> dict[str, Any]:
    """The state saved as ``step`` (host values; ``"w"``/``"b"`` are jax arrays in the child)."""
    rng = np.random.default_rng(1000 + step)
    out: dict[str, Any] = {}
    for name, (shape, dtype) in ARRAYS.items():
        dt = np.dtype(dtype)
        out[name] = (
            np.frombuffer(rng.bytes(int(np.prod(shape)) * dt.itemsize), dt).reshape(shape).copy()
        )
    out["step"] = step
    out["tag"] = f"step-{step}"
    return out


def options(ram_root: str | None) -> Any:
    from fastckpt import ManagerOptions, RetentionOptions, SaveOptions
    from fastckpt.options import RamOptions

    ram = (
        None
        if ram_root is None
        else RamOptions(
            root=ram_root, interval_steps=1, keep_steps=1, budget_bytes=64 << 20, secret=None
        )
    )
    return ManagerOptions(
        save=SaveOptions(
            max_chunk_bytes=64 << 10, object_bytes=192 << 10, max_inflight_bytes=1 << 20
        ),
        retention=RetentionOptions(keep_last=2),
        save_interval_steps=2 if ram_root is not None else 1,
        ram=ram,
    )


def main(spec: dict[str, Any]) -> None:
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from fastckpt import CheckpointManager
    from fastckpt.storage import open_store

    devices = np.asarray(jax.devices()[:2])
    mesh = Mesh(devices, ("x",))
    shardings = {
        "w": NamedSharding(mesh, PartitionSpec("x", None)),
        "b": NamedSharding(mesh, PartitionSpec("x")),
    }
    store = open_store(spec["root"], gcs_endpoint=spec.get("endpoint"))
    with CheckpointManager(store, options=options(spec.get("ram_root"))) as mgr:
        print("ready", flush=True)
        for step in range(1, spec["max_steps"] + 1):
            host = expected(step)
            state = {
                k: (jax.device_put(v, shardings[k]) if k in shardings else v)
                for k, v in host.items()
            }
            mgr.save(step, state)
            mgr.wait()
            print(f"committed {step}", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
