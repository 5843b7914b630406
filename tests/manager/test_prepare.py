"""The first save of a process finds its staging memory ready: ``CheckpointManager.prepare``
(explicit, or after ``restore``) provisions it in the background — the RAM tier's segment
(also from the spare a previous process left on this host), else a pre-faulted staging
buffer. Checked by counters of the allocations, not by timing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from fastckpt import CheckpointManager, ManagerOptions, RetentionOptions
from fastckpt.errors import NoCheckpointError
from fastckpt.options import RamOptions
from tests.support.arrays import P, assert_bit_exact, device_data, named

MIB = 1 << 20


def _state(seed: int) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A state over 1 MiB (RAM segments below that are not recycled) and its host copy."""
    w, hw = device_data((512, 1024), np.float32, named((2, 4), ("x", "y"), P("x", "y")), seed=seed)
    r, hr = device_data((4096,), np.float32, named((2, 4), ("x", "y"), P()), seed=seed + 1)
    return {"w": w, "r": r, "host": np.arange(7), "step": seed}, {"w": hw, "r": hr}


def _abstract(state: dict[str, Any]) -> Any:
    return jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            if isinstance(x, jax.Array)
            else x
        ),
        state,
    )


def _ram(root: Path) -> ManagerOptions:
    return ManagerOptions(
        save_interval_steps=1000,  # RAM-only steps
        retention=RetentionOptions(keep_last=None),
        ram=RamOptions(root=str(root), interval_steps=1, replicas=0, budget_bytes=64 * MIB),
    )


def _ready(mgr: CheckpointManager) -> int:
    return mgr._tier.tier.allocated_ready  # type: ignore[union-attr]


@pytest.mark.parametrize("abstract", [False, True])
def test_prepare_makes_the_first_ram_saves_segment_ready(
    tmp_path: Path, shm_dir: Path, abstract: bool
) -> None:
    """After ``prepare`` (concrete or abstract state), the first save's allocation takes a
    mapped, pre-faulted spare of its exact size (and, for a concrete state, finds every leaf
    planned); without it, the first save creates its file."""
    state, host = _state(1)
    with CheckpointManager(str(tmp_path / "a"), options=_ram(shm_dir / "a")) as mgr:
        mgr.prepare(_abstract(state) if abstract else state)
        misses = mgr._saver.plans.misses
        assert misses == (0 if abstract else 2)  # the two jax leaves
        mgr.save(1, state)
        mgr.wait()
        assert _ready(mgr) == 1
        assert (mgr._saver.plans.misses == misses) is not abstract
        got = mgr.restore(1, target=_abstract(state))
        assert_bit_exact(got["w"], host["w"])
        assert_bit_exact(got["r"], host["r"])
    with CheckpointManager(str(tmp_path / "b"), options=_ram(shm_dir / "b")) as mgr:
        mgr.save(1, state)  # nothing prepared
        mgr.wait()
        assert _ready(mgr) == 0


def test_a_fresh_start_prepares_from_the_restore_target(tmp_path: Path, shm_dir: Path) -> None:
    """``restore(target=...)`` with nothing committed prepares the saves of that target."""
    state, _ = _state(2)
    with CheckpointManager(str(tmp_path / "a"), options=_ram(shm_dir / "a")) as mgr:
        with pytest.raises(NoCheckpointError):
            mgr.restore(target=_abstract(state))
        mgr.save(1, state)
        mgr.wait()
        assert _ready(mgr) == 1


def test_a_restarted_process_saves_into_the_spare_its_predecessor_left(
    tmp_path: Path, shm_dir: Path
) -> None:
    """A process restarted on the same host restores, and its first save reuses the spare
    segment file the previous process left in the tier directory (same inode), mapped
    and pre-faulted in the background after the restore."""
    state, host = _state(3)
    with CheckpointManager(str(tmp_path / "ckpt"), options=_ram(shm_dir / "h")) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state)
        mgr.wait()
    (spare,) = (shm_dir / "h" / "spare").iterdir()
    inode = spare.stat().st_ino
    with CheckpointManager(str(tmp_path / "ckpt"), options=_ram(shm_dir / "h")) as mgr:
        got = mgr.restore(target=_abstract(state))
        assert_bit_exact(got["w"], host["w"])
        mgr.save(4, got)
        mgr.wait()
        assert _ready(mgr) == 1
        (data,) = (shm_dir / "h" / "step-4").glob("*.data")
        assert data.stat().st_ino == inode
        again = mgr.restore(4, target=_abstract(state))
        assert_bit_exact(again["w"], host["w"])


def test_prepare_provisions_the_first_persistent_saves_buffer(tmp_path: Path) -> None:
    """Without a RAM tier, ``prepare`` keeps a staging buffer of the state's size that the
    first save takes (no fresh allocation)."""
    state, host = _state(4)
    with CheckpointManager(str(tmp_path / "ckpt")) as mgr:
        mgr.prepare(state)
        mgr.save(0, state)
        mgr.wait()
        assert mgr._saver.pool.reused == 1
        assert_bit_exact(mgr.restore(0, target=_abstract(state))["w"], host["w"])
    with CheckpointManager(str(tmp_path / "other")) as mgr:
        mgr.save(0, state)
        mgr.wait()
        assert mgr._saver.pool.reused == 0
