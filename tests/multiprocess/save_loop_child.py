"""Child for the SIGKILL-during-save test: saves steps 0, 1, 2, ... until it is killed.

Usage: ``python save_loop_child.py ROOT``. The state of step ``s`` is :func:`expected` (a
deterministic function of the step), sharded over 2 virtual devices; the child prints
``start <s>`` before each ``save`` call.
"""

from __future__ import annotations

import os
import sys

import numpy as np

N_ROWS, N_COLS = 1024, 2048  # 8 MiB of float32 + 2 MiB of int8 + a small bf16 vector


def expected(step: int) -> dict[str, np.ndarray]:
    """The host values of step ``step`` (integers below 2**24: exact in float32)."""
    base = np.arange(N_ROWS * N_COLS, dtype=np.int64).reshape(N_ROWS, N_COLS)
    w = ((base * 7 + step) % 100_003).astype(np.float32)
    b = ((base[:, : N_COLS // 4] + step * 3) % 251).astype(np.int8)
    return {"w": w, "b": b}


def main(root: str) -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from fastckpt import CheckpointManager, ManagerOptions, RetentionOptions, SaveOptions

    mesh = Mesh(np.asarray(jax.devices()), ("x",))
    s = NamedSharding(mesh, P("x", None))
    w_base = jax.device_put(np.arange(N_ROWS * N_COLS, dtype=np.int32).reshape(N_ROWS, N_COLS), s)

    @jax.jit
    def make(step: jax.Array) -> dict[str, jax.Array]:
        w = ((w_base * 7 + step) % 100_003).astype(jnp.float32)
        b = ((w_base[:, : N_COLS // 4] + step * 3) % 251).astype(jnp.int8)
        return {"w": w, "b": b}

    opts = ManagerOptions(
        save=SaveOptions(max_chunk_bytes=256 << 10, object_bytes=1 << 20),
        retention=RetentionOptions(keep_last=2),
    )
    with CheckpointManager(root, options=opts) as mgr:
        step = 0
        while True:
            state = make(jnp.int32(step))
            print(f"start {step}", flush=True)
            mgr.save(step, {"state": state, "step": step})
            step += 1


if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"  # before jax starts
    os.environ["JAX_PLATFORMS"] = "cpu"
    main(sys.argv[1])
