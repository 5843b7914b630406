"""The example elastic worker: ``python -m fastckpt.elastic.worker --root DIR [options]``.

This is the entry point the supervisor launches once per host and generation, and the
reference user of :class:`~fastckpt.elastic.ElasticContext`. It is the edge of the
program: it reads the worker identity from the environment the supervisor set
(:class:`~fastckpt.elastic._protocol.WorkerEnv`) and everything else from flags; the
library code below it reads neither.

Per generation: initialise ``jax.distributed`` -> build the ``("data", "model")`` mesh
over the devices that exist -> restore the latest checkpoint onto it (or init) while the
train step compiles in a thread -> train, logging the loss of every step to
``metrics.jsonl``, checkpointing to RAM + peers every ``--ram-every`` steps and to storage
every ``--checkpoint-every`` steps ->
at ``--steps`` save a final checkpoint and exit 0, or stop at an agreed step and exit 75
when the supervisor asks (a host rejoins).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import fastckpt
from fastckpt.elastic._protocol import EXIT_DONE, WorkerEnv
from fastckpt.elastic.context import ElasticContext, ElasticOptions
from fastckpt.elastic.data import DataConfig
from fastckpt.elastic.model import PRESET_GLOBAL_BATCH, PRESETS
from fastckpt.elastic.trainer import TrainConfig, TrainProgram, make_mesh

__all__ = ["build_parser", "main", "train_config_from_args"]


def build_parser() -> argparse.ArgumentParser:
    """Flags of the example worker (shared with the demo, which forwards them)."""
    p = argparse.ArgumentParser(
        prog="python -m fastckpt.elastic.worker", description=__doc__.splitlines()[0]
    )
    p.add_argument("--root", required=True, help="checkpoint root: path, file://, gs://")
    p.add_argument("--steps", type=int, default=100, help="train until this many steps are done")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model size")
    p.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="sequences per step, whatever the mesh (default: the preset's, else 24)",
    )
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--init-seed", type=int, default=0)
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--dropout", type=float, default=None, help="override the preset's dropout")
    p.add_argument("--model-axis", type=int, default=2, help="size of the 'model' mesh axis")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=10,
        help="persistent checkpoint every N steps (ManagerOptions.save_interval_steps)",
    )
    p.add_argument(
        "--ram-every",
        type=int,
        default=0,
        help="RAM-tier checkpoint (own RAM + peer replica) every N steps; 0: no RAM tier",
    )
    p.add_argument(
        "--ram-replicas", type=int, default=1, help="peers each host replicates its RAM chunks to"
    )
    p.add_argument("--keep-last", type=int, default=3, help="committed steps kept by retention")
    p.add_argument(
        "--step-delay-s", type=float, default=0.0, help="sleep after each step (demo pacing)"
    )
    p.add_argument(
        "--no-overlap-compile", action="store_true", help="compile after the restore, not during it"
    )
    return p


def train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` the flags describe."""
    import dataclasses

    model = PRESETS[args.preset]
    if args.dropout is not None:
        model = dataclasses.replace(model, dropout=args.dropout)
    return TrainConfig(
        model=model,
        data=DataConfig(
            seed=args.data_seed,
            global_batch=args.global_batch or PRESET_GLOBAL_BATCH.get(args.preset, 24),
        ),
        learning_rate=args.learning_rate,
        init_seed=args.init_seed,
        model_axis=args.model_axis,
    )


def run(args: argparse.Namespace, env: WorkerEnv) -> int:
    """Train under the supervisor as ``env`` says. Returns the process exit code."""
    cfg = train_config_from_args(args)
    ram = None
    if args.ram_every:
        ram = fastckpt.RamOptions(
            root=env.local_dir,
            member_id=f"host{env.host_id}",
            interval_steps=args.ram_every,
            replicas=args.ram_replicas,
            secret=fastckpt.peer_secret_from_env(),
        )
    options = ElasticOptions(
        checkpoint_every=math.gcd(args.checkpoint_every, args.ram_every or args.checkpoint_every),
        manager=fastckpt.ManagerOptions(
            save_interval_steps=args.checkpoint_every,
            retention=fastckpt.RetentionOptions(keep_last=args.keep_last),
            ram=ram,
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
            raise RuntimeError(
                f"restored data_pos {data_pos} != step {ctx.start_step} x global batch {batch}"
            )
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
