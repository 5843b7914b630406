"""The example elastic worker: ``python -m fastckpt.elastic.worker --root DIR [options]``.

This is the entry point the supervisor launches once per host and generation, and the
reference user of :class:`~fastckpt.elastic.ElasticContext`. It is the edge of the
program: it reads the worker identity from the environment the supervisor set
(:class:`~fastckpt.elastic._protocol.WorkerEnv`) and configures jax from flags; the
library code below it reads neither.

Per generation: initialise ``jax.distributed`` -> build the ``("data", "model")`` mesh
over the devices that exist -> restore the latest checkpoint onto it (or init) while the
train step compiles in a thread -> train, logging the loss of every step to
``metrics.jsonl``, handing state to the manager every ``--checkpoint-every`` steps ->
at ``--steps`` save a final checkpoint and exit 0, or stop at an agreed step and exit 75
when the supervisor asks (a host rejoins).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import jax

import fastckpt
from fastckpt.elastic._protocol import EXIT_DONE, WorkerEnv
from fastckpt.elastic.context import ElasticContext, ElasticOptions
from fastckpt.elastic.data import DataConfig
from fastckpt.elastic.model import PRESETS
from fastckpt.elastic.trainer import TrainConfig, TrainProgram, make_mesh

__all__ = ["build_parser", "main", "train_config_from_args"]


def build_parser() -> argparse.ArgumentParser:
    """Flags of the example worker (shared with the demo, which forwards them)."""
    p = argparse.ArgumentParser(prog="python -m fastckpt.elastic.worker", description=__doc__.splitlines()[0])
    p.add_argument("--root", required=True, help="checkpoint root: path, file://, gs://")
    p.add_argument("--steps", type=int, default=100, help="train until this many steps are done")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model size")
    p.add_argument("--global-batch", type=int, default=24, help="sequences per step, whatever the mesh")
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--init-seed", type=int, default=0)
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--dropout", type=float, default=None, help="override the preset's dropout")
    p.add_argument("--model-axis", type=int, default=2, help="size of the 'model' mesh axis")
    p.add_argument("--checkpoint-every", type=int, default=10, help="hand state to the manager every N steps")
    p.add_argument("--persist-every", type=int, default=None,
                   help="ManagerOptions.save_interval_steps (default: --checkpoint-every)")
    p.add_argument("--keep-last", type=int, default=3, help="committed steps kept by retention")
    p.add_argument("--step-delay-s", type=float, default=0.0, help="sleep after each step (demo pacing)")
    p.add_argument("--compile-cache", default=None, help="jax persistent compilation cache directory")
    p.add_argument("--no-overlap-compile", action="store_true", help="compile after the restore, not during it")
    return p


def train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` the flags describe."""
    import dataclasses

    model = PRESETS[args.preset]
    if args.dropout is not None:
        model = dataclasses.replace(model, dropout=args.dropout)
    return TrainConfig(
        model=model,
        data=DataConfig(seed=args.data_seed, global_batch=args.global_batch),
        learning_rate=args.learning_rate,
        init_seed=args.init_seed,
        model_axis=args.model_axis,
    )


def _configure_jax(args: argparse.Namespace) -> None:
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def run(args: argparse.Namespace, env: WorkerEnv) -> int:
    """Train under the supervisor as ``env`` says. Returns the process exit code."""
    _configure_jax(args)
    cfg = train_config_from_args(args)
    options = ElasticOptions(
        checkpoint_every=args.checkpoint_every,
        manager=fastckpt.ManagerOptions(
            save_interval_steps=args.persist_every or args.checkpoint_every,
            retention=fastckpt.RetentionOptions(keep_last=args.keep_last),
        ),
    )
    batch = cfg.data.global_batch
    with ElasticContext(env, root=args.root, options=options) as ctx:
        prog = TrainProgram(cfg, make_mesh(model_axis=cfg.model_axis))
        with ThreadPoolExecutor(1, thread_name_prefix="compile") as pool:
            compiling = None if args.no_overlap_compile else pool.submit(prog.compile_step)
            state = ctx.restore_or_init(prog.init_state, target=prog.abstract_state)
            step_fn = compiling.result() if compiling is not None else prog.compile_step()
        ctx.mark("compiled")
        data_pos = int(state["data_pos"])
        if data_pos != ctx.start_step * batch:
            raise RuntimeError(f"restored data_pos {data_pos} != step {ctx.start_step} x global batch {batch}")
        for step in ctx.steps(args.steps):
            state, loss = step_fn(state, prog.batch(step * batch))
            ctx.log(step + 1, loss=float(loss))
            ctx.maybe_save(step + 1, state)
            if args.step_delay_s:
                time.sleep(args.step_delay_s)
        if ctx.exit_code == EXIT_DONE:
            ctx.save_final(args.steps, state)
    return ctx.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, read the supervisor-assigned identity from ``os.environ``, train."""
    args = build_parser().parse_args(argv)
    return run(args, WorkerEnv.from_environ(os.environ))


if __name__ == "__main__":
    sys.exit(main())
