"""Shared by the elastic tests: the reference training config and a per-mesh program cache."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

import fastckpt
from fastckpt_examples.data import DataConfig
from fastckpt_examples.model import PRESETS
from fastckpt_examples.trainer import TrainConfig, TrainProgram, TrainState, make_mesh

CFG = TrainConfig(
    model=dataclasses.replace(PRESETS["tiny"], dropout=0.1), data=DataConfig(global_batch=24)
)
"""What ``fastckpt_examples.elastic_train.TrainSpec(preset="tiny", dropout=0.1)`` trains."""
EVERY = 4
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
"""Compile options of the in-process programs (the demo's CPU_FAST_COMPILE_FLAGS): on 2
shared cores compile time dominates these tests."""


def host(tree: Any) -> Any:
    """Host copies of every leaf (typed keys as their raw key data)."""

    def one(x: jax.Array) -> np.ndarray:
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    return jax.tree.map(one, tree)


class Runner:
    """One program per mesh shape, compiled once per test module."""

    def __init__(self) -> None:
        self._cache: dict[int, tuple[TrainProgram, Any]] = {}

    def program(self, n_devices: int) -> tuple[TrainProgram, Any]:
        if n_devices not in self._cache:
            prog = TrainProgram(
                CFG, make_mesh(jax.devices()[:n_devices], model_axis=CFG.model_axis)
            )
            self._cache[n_devices] = (prog, prog.compile_step(FAST_COMPILE))
        return self._cache[n_devices]

    def train(
        self,
        n_devices: int,
        state: TrainState,
        start: int,
        stop: int,
        mgr: fastckpt.CheckpointManager | None = None,
        every: int = EVERY,
    ) -> tuple[TrainState, list[float]]:
        prog, step_fn = self.program(n_devices)
        losses = []
        for step in range(start, stop):
            state, loss = step_fn(state, prog.batch(step * CFG.data.global_batch))
            losses.append(float(loss))
            if mgr is not None and (step + 1) % every == 0:
                mgr.save(step + 1, state)
        return state, losses
