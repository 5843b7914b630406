"""A run interrupted by a failure resumes to the same result as an uninterrupted run:
bit-exact on the same mesh, within float tolerance (same loss curve) on a resized mesh."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

import fastckpt
from fastckpt_examples.trainer import TrainState

from ._common import CFG, EVERY, Runner, host

pytestmark = pytest.mark.usefixtures("eight_devices")

TOTAL, FAIL_AFTER = 12, 10


@pytest.fixture(scope="module")
def reference(runner: Runner) -> tuple[Any, list[float]]:
    prog, _ = runner.program(8)
    state, losses = runner.train(8, prog.init_state(), 0, TOTAL)
    return host(state), losses


def _fail_and_restore(runner: Runner, root: Path, restore_devices: int) -> TrainState:
    """Train on 8 devices to FAIL_AFTER saving every EVERY steps, lose the live state,
    restore the latest committed step onto ``restore_devices`` devices."""
    prog, _ = runner.program(8)
    with fastckpt.CheckpointManager(str(root)) as mgr:
        state, _ = runner.train(8, prog.init_state(), 0, FAIL_AFTER, mgr)
        mgr.wait()
        del state  # the failure: steps after the last checkpoint are gone
        target = runner.program(restore_devices)[0].abstract_state
        restored = mgr.restore(target=target)
    assert int(restored["step"]) == FAIL_AFTER // EVERY * EVERY
    assert int(restored["data_pos"]) == int(restored["step"]) * CFG.data.global_batch
    return restored


def test_resume_on_same_mesh_is_bit_exact(
    runner: Runner, reference: tuple[Any, list[float]], tmp_path: Path
) -> None:
    ref_state, ref_losses = reference
    restored = _fail_and_restore(runner, tmp_path, 8)
    start = int(restored["step"])
    state, losses = runner.train(8, restored, start, TOTAL)
    assert losses == ref_losses[start:]
    jax.tree.map(np.testing.assert_array_equal, host(state), ref_state)


def test_resume_on_resized_mesh_matches_within_tolerance(
    runner: Runner, reference: tuple[Any, list[float]], tmp_path: Path
) -> None:
    ref_state, ref_losses = reference
    restored = _fail_and_restore(runner, tmp_path, 6)  # 4x2 -> 3x2, same global batch
    assert restored["params"]["layers"]["w1"].sharding.mesh.shape == {"data": 3, "model": 2}
    start = int(restored["step"])
    state, losses = runner.train(6, restored, start, TOTAL)
    np.testing.assert_allclose(losses, ref_losses[start:], rtol=1e-5)
    got = host(state)
    np.testing.assert_array_equal(got["key"], ref_state["key"])
    assert int(got["step"]) == TOTAL
    assert int(got["data_pos"]) == TOTAL * CFG.data.global_batch
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
        got["params"],
        ref_state["params"],
    )
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
        got["opt_state"],
        ref_state["opt_state"],
    )
