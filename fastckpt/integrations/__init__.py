"""Interop with the JAX ecosystem: Orbax checkpoints and managers, Flax/Equinox-style states.

Every module here imports its optional dependency (``orbax-checkpoint``, ``flax``) lazily,
inside the functions that need it, so ``import fastckpt`` never pulls them in.

* :mod:`fastckpt.integrations.orbax` - read Orbax checkpoints onto any sharding, convert
  both ways, and an Orbax-style manager surface over :class:`fastckpt.CheckpointManager`.
* :mod:`fastckpt.integrations.flax` - Flax NNX / linen helpers.
* :mod:`fastckpt.integrations.pytree` - abstract targets and array/static partitioning
  for states with non-array leaves (Equinox-style modules).
"""

from __future__ import annotations
