"""Interop with the JAX ecosystem: Orbax checkpoints and managers (:mod:`.orbax`), Flax NNX /
linen helpers (:mod:`.flax`), Equinox-style states (:mod:`.pytree`).

Every module imports its optional dependency (``orbax-checkpoint``, ``flax``) lazily, inside
the functions that need it, so ``import fastckpt`` never pulls them in.
"""

from __future__ import annotations
