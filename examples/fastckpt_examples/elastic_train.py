"""The example trainer on Ray: ``run_elastic(functools.partial(train, spec=spec))``.

This is the reference user of :class:`~fastckpt.elastic.ElasticContext`: everything
elastic is the ``with ElasticContext(...)`` block, ``restore_or_init``, ``ctx.steps``,
``ctx.log``, ``ctx.maybe_save`` and ``ctx.save_final``; the rest is an ordinary JAX loop.

Per generation: build the ``("data", "model")`` mesh over the devices that exist ->
restore the latest checkpoint onto it (or init) while the train step compiles in a thread
-> train, logging the loss of every step, checkpointing to RAM + peers every
``ram_every`` steps and to storage every ``checkpoint_every`` steps -> at ``steps`` save
a final checkpoint, or stop at an agreed step when the driver asks (a node joined).
The global batch and the data position survive every resize: the batch of step ``s`` is
samples ``[s * global_batch, (s + 1) * global_batch)`` whatever the mesh.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastckpt.elastic import ElasticContext, ElasticOptions, Worker
from fastckpt_examples.data import DataConfig
from fastckpt_examples.model import PRESET_GLOBAL_BATCH, PRESETS
from fastckpt_examples.trainer import TrainConfig, TrainProgram, make_mesh

__all__ = ["TrainSpec", "train"]

PRELOAD = ("jax", "optax", "fastckpt.elastic", "fastckpt_examples.trainer")
"""Modules a warm worker imports before it gets work (``ElasticJobOptions.preload``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainSpec:
    """One training run of the example trainer."""

    root: str
    """Checkpoint root: path, ``file://``, ``gs://``."""
    steps: int = 100
    preset: str = "tiny"
    global_batch: int | None = None
    """Sequences per step whatever the mesh (default: the preset's, else 24)."""
    data_seed: int = 0
    init_seed: int = 0
    learning_rate: float = 3e-3
    dropout: float | None = None
    model_axis: int = 1
    """Size of the ``"model"`` mesh axis (use the devices per node)."""
    checkpoint_every: int = 10
    ram_every: int = 0
    ram_replicas: int = 1
    step_delay_s: float = 0.0
    compiler_options: dict[str, Any] | None = None

    def config(self) -> TrainConfig:
        model = PRESETS[self.preset]
        if self.dropout is not None:
            model = dataclasses.replace(model, dropout=self.dropout)
        batch = self.global_batch or PRESET_GLOBAL_BATCH.get(self.preset, 24)
        return TrainConfig(
            model=model,
            data=DataConfig(seed=self.data_seed, global_batch=batch),
            learning_rate=self.learning_rate,
            init_seed=self.init_seed,
            model_axis=self.model_axis,
        )


def train(worker: Worker, *, spec: TrainSpec) -> dict[str, Any]:
    """Train as ``worker`` (one node of one generation). Returns ``{"step", "loss"}``."""
    cfg = spec.config()
    batch = cfg.data.global_batch
    options = ElasticOptions(
        checkpoint_every=spec.checkpoint_every,
        ram_every=spec.ram_every,
        ram_replicas=spec.ram_replicas,
    )
    loss = float("nan")
    step = 0
    with ElasticContext(worker, root=spec.root, options=options) as ctx:
        prog = TrainProgram(cfg, make_mesh(model_axis=cfg.model_axis))
        with ThreadPoolExecutor(1, thread_name_prefix="compile") as pool:
            compiling = pool.submit(prog.compile_step, spec.compiler_options)
            state = ctx.restore_or_init(prog.init_state, target=prog.abstract_state)
            step_fn = compiling.result()
        ctx.mark("compiled")
        if int(state["data_pos"]) != ctx.start_step * batch:
            raise RuntimeError(f"restored data_pos {int(state['data_pos'])} != step x batch")
        step = ctx.start_step
        for step in ctx.steps(spec.steps):
            state, loss_arr = step_fn(state, prog.batch(step * batch))
            loss = float(loss_arr)
            ctx.log(step + 1, loss=loss)
            ctx.maybe_save(step + 1, state)
            if spec.step_delay_s:
                time.sleep(spec.step_delay_s)
        if not ctx.stopped:
            ctx.save_final(spec.steps, state)
    return {"step": int(state["step"]), "loss": loss}
