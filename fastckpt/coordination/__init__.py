"""How the processes of a job agree: a deadline-bounded key-value store and barrier
(:class:`Coordinator`, on ``jax.distributed``'s coordination service or alone), and the
restore agreement built on it. Depends on ``format`` and ``errors`` only."""

from fastckpt.coordination.distributed import (
    Coordinator,
    JaxCoordinator,
    LocalCoordinator,
    default_coordinator,
    time_left,
)

__all__ = ["Coordinator", "JaxCoordinator", "LocalCoordinator", "default_coordinator", "time_left"]
