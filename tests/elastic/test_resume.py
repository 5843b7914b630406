"""A run interrupted by a failure resumes to the same result as an uninterrupted run:
bit-exact on the same mesh, within float tolerance (same loss curve) on a resized mesh."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

import fastckpt
from fastckpt.elastic.data import DataConfig
from fastckpt.elastic.model import PRESETS
from fastckpt.elastic.trainer import TrainConfig, TrainProgram, TrainState, make_mesh

pytestmark = pytest.mark.usefixtures("eight_devices")

CFG = TrainConfig(model=dataclasses.replace(PRESETS["tiny"], dropout=0.1), data=DataConfig(global_batch=24))
TOTAL, EVERY, FAIL_AFTER = 12, 4, 10
FAST_COMPILE = {"xla_backend_optimization_level": 0}  # 2 shared cores: compile time dominates


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
            prog = TrainProgram(CFG, make_mesh(jax.devices()[:n_devices], model_axis=CFG.model_axis))
            self._cache[n_devices] = (prog, prog.compile_step(FAST_COMPILE))
        return self._cache[n_devices]

    def train(self, n_devices: int, state: TrainState, start: int, stop: int,
              mgr: fastckpt.CheckpointManager | None = None) -> tuple[TrainState, list[float]]:
        prog, step_fn = self.program(n_devices)
        losses = []
        for step in range(start, stop):
            state, loss = step_fn(state, prog.batch(step * CFG.data.global_batch))
            losses.append(float(loss))
            if mgr is not None and (step + 1) % EVERY == 0:
                mgr.save(step + 1, state)
        return state, losses


@pytest.fixture(scope="module")
def runner() -> Runner:
    return Runner()


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


def test_resume_on_same_mesh_is_bit_exact(runner: Runner, reference: tuple[Any, list[float]],
                                          tmp_path: Path) -> None:
    ref_state, ref_losses = reference
    restored = _fail_and_restore(runner, tmp_path, 8)
    start = int(restored["step"])
    state, losses = runner.train(8, restored, start, TOTAL)
    assert losses == ref_losses[start:]
    jax.tree.map(np.testing.assert_array_equal, host(state), ref_state)


def test_resume_on_resized_mesh_matches_within_tolerance(runner: Runner, reference: tuple[Any, list[float]],
                                                         tmp_path: Path) -> None:
    ref_state, ref_losses = reference
    restored = _fail_and_restore(runner, tmp_path, 6)  # 4x2 -> 3x2, same global batch
    assert restored["params"]["layers"]["w1"].sharding.mesh.shape == {"data": 3, "model": 2}
    start = int(restored["step"])
    state, losses = runner.train(6, restored, start, TOTAL)
    np.testing.assert_allclose(losses, ref_losses[start:], rtol=1e-5)
    got = host(state)
    np.testing.assert_array_equal(got["key"], ref_state["key"])
    assert int(got["step"]) == TOTAL and int(got["data_pos"]) == TOTAL * CFG.data.global_batch
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), got["params"],
                 ref_state["params"])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), got["opt_state"],
                 ref_state["opt_state"])
