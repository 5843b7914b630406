"""The whole thing with real processes: 3 hosts x 2 devices train the example worker with a
RAM tier + peer replicas; host 2 is SIGKILLed mid-run and its RAM wiped; training resumes
on 2 hosts from RAM and peers, grows back to 3 at a checkpoint, and ends where an
uninterrupted in-process run ends (within float tolerance)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

import fastckpt
from fastckpt.elastic import ChaosEvent, Supervisor, SupervisorOptions, summarize
from fastckpt.elastic._protocol import read_jsonl
from fastckpt.elastic.demo import CPU_FAST_COMPILE_FLAGS
from fastckpt.elastic.supervisor import default_worker_cmd

from ._common import CFG, Runner, host

pytestmark = pytest.mark.usefixtures("eight_devices")

TOTAL, PERSIST_EVERY, RAM_EVERY, KILL_AT, REJOIN_AT = 18, 6, 2, 7, 12


def test_sigkill_shrink_rejoin_matches_uninterrupted_run(tmp_path: Path, runner: Runner) -> None:
    root = str(tmp_path / "ckpt")
    worker = default_worker_cmd(
        [
            "--root",
            root,
            "--steps",
            str(TOTAL),
            "--preset",
            "tiny",
            "--dropout",
            str(CFG.model.dropout),
            "--global-batch",
            str(CFG.data.global_batch),
            "--checkpoint-every",
            str(PERSIST_EVERY),
            "--ram-every",
            str(RAM_EVERY),
            "--keep-last",
            "100",
        ]
    )
    env = dict(os.environ, XLA_FLAGS=CPU_FAST_COMPILE_FLAGS)  # compile dominates on 2 cores
    options = SupervisorOptions(
        num_hosts=3,
        devices_per_host=2,
        max_restarts=1,
        events=(
            ChaosEvent(kind="kill", host=2, at_step=KILL_AT),
            ChaosEvent(kind="rejoin", host=2, at_step=REJOIN_AT),
        ),
    )
    run_dir = tmp_path / "run"
    result = Supervisor(
        worker, run_dir=run_dir, local_root=tmp_path / "local", options=options, env=env
    ).run()

    logs = "\n".join(p.read_text()[-2000:] for p in sorted((run_dir / "logs").glob("*.log")))
    assert [(g.hosts, g.outcome) for g in result.generations] == [
        ((0, 1, 2), "failed"),
        ((0, 1), "stopped"),
        ((0, 1, 2), "done"),
    ], logs

    summary = summarize(run_dir)
    [rec] = summary["recoveries"]
    assert rec["killed_host"] == 2
    assert rec["num_processes"] == 2
    assert all(v >= 0 for v in rec["parts"].values())
    assert abs(sum(rec["parts"].values()) - rec["total_s"]) < 1e-6
    # resumed from the newest RAM checkpoint, at most one RAM cadence back, without reading
    # storage: every chunk came from a survivor's own RAM or a peer's replica
    tiers = rec["restore_bytes_by_tier"]
    assert tiers.get("ram", 0) > 0, tiers
    assert all(t == "ram" or t.startswith("peer") for t in tiers), tiers
    assert rec["restored_step"] % RAM_EVERY == 0
    assert 0 < rec["restored_step"] <= rec["last_step_before_kill"]
    assert 0 <= rec["steps_lost"] <= RAM_EVERY
    [resize] = summary["resizes"]
    assert resize["num_processes"] == 3
    assert resize["restored_step"] >= REJOIN_AT

    # the same training as an uninterrupted run on one 3x2 mesh (the run's first mesh)
    prog6, _ = runner.program(6)
    ref_state, ref_losses = runner.train(6, prog6.init_state(), 0, TOTAL)
    latest: dict[int, float] = {}
    for m in sorted(
        read_jsonl(run_dir / "metrics.jsonl"), key=lambda m: (m["generation"], m["step"])
    ):
        latest[m["step"]] = m["loss"]
    assert sorted(latest) == list(range(1, TOTAL + 1))
    np.testing.assert_allclose([latest[s] for s in range(1, TOTAL + 1)], ref_losses, rtol=1e-4)
    with fastckpt.CheckpointManager(root) as mgr:
        assert mgr.latest_step() == TOTAL
        final = mgr.restore(target=runner.program(8)[0].abstract_state)  # yet another mesh: 4x2
    got, ref = host(final), host(ref_state)
    np.testing.assert_array_equal(got["key"], ref["key"])
    for a, b in zip(jax_leaves(got["params"]), jax_leaves(ref["params"]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def jax_leaves(tree: object) -> list[np.ndarray]:
    import jax

    return jax.tree.leaves(tree)


def test_worker_cli_help() -> None:
    import subprocess

    out = subprocess.run(
        [sys.executable, "-m", "fastckpt.elastic", "nope"], capture_output=True, text=True
    )
    assert out.returncode == 2
    assert "run" in out.stderr
