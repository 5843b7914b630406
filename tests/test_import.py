"""``import fastckpt`` is cheap: jax is imported only when the manager or save/restore is used."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def test_import_does_not_pull_in_jax_until_the_manager_is_used() -> None:
    code = (
        "import sys, fastckpt\n"
        "assert 'jax' not in sys.modules, 'import fastckpt imported jax'\n"
        "opts = fastckpt.ManagerOptions(); assert 'jax' not in sys.modules\n"
        "assert 'CheckpointManager' in dir(fastckpt)\n"
        "from fastckpt import CheckpointManager, RestoreStats, SaveStats, restore, save\n"
        "from fastckpt.manager import CheckpointManager as M\n"
        "assert CheckpointManager is M and 'jax' in sys.modules\n"
        "assert all(hasattr(fastckpt, n) for n in fastckpt.__all__)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_unknown_attribute_is_an_attribute_error() -> None:
    import fastckpt

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        fastckpt.nope  # noqa: B018


def test_core_save_and_restore_never_import_tensorstore(tmp_path: Path) -> None:
    """tensorstore is the ``orbax`` extra's: ``import fastckpt`` and a save + restore under a
    local root (and a GCS store made) leave it unimported."""
    code = (
        "import sys, numpy as np, jax.numpy as jnp, fastckpt\n"
        "from fastckpt.storage import GcsStore, open_store\n"
        f"root = {str(tmp_path / 'ck')!r}\n"
        "fastckpt.save(root, 1, {'w': jnp.arange(8.0), 'n': np.arange(3)})\n"
        "with fastckpt.CheckpointManager(root) as mgr:\n"
        "    mgr.save(2, {'w': jnp.ones(8), 'n': np.arange(3)}); mgr.wait()\n"
        "    assert float(mgr.restore()['w'].sum()) == 8.0 and mgr.last_restore_stats.step == 2\n"
        "assert float(fastckpt.restore(root, 1)['w'].sum()) == 28.0\n"
        "GcsStore('bucket', options=None)\n"
        "import fastckpt.cli, fastckpt.integrations\n"
        "assert 'tensorstore' not in sys.modules, 'tensorstore was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
