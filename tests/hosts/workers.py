"""Functions run in each process of a JAX job on simulated hosts (see run_processes)."""

from __future__ import annotations

import socket
from typing import Any


def global_sum() -> dict[str, Any]:
    """A jitted sum over every device of the job; where this process runs."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.asarray(jax.devices()), ("x",))
    n = 8 * len(jax.devices())
    values = np.arange(n, dtype=np.float32)
    array = jax.make_array_from_callback((n,), NamedSharding(mesh, P("x")), lambda i: values[i])
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(array)
    hostname = socket.gethostname()
    return {
        "sum": float(total),
        "expected": float(values.sum()),
        "devices": len(jax.devices()),
        "local_devices": jax.local_device_count(),
        "process": jax.process_index(),
        "hostname": hostname,
        "address": socket.gethostbyname(hostname),
    }
