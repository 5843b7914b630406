"""``import fastckpt`` is cheap: jax is imported only when the manager or save/restore is used."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_import_does_not_pull_in_jax_until_the_manager_is_used() -> None:
    code = (
        "import sys, fastckpt\n"
        "assert 'jax' not in sys.modules, 'import fastckpt imported jax'\n"
        "opts = fastckpt.ManagerOptions(); assert 'jax' not in sys.modules\n"
        "assert 'CheckpointManager' in dir(fastckpt)\n"
        "from fastckpt import CheckpointManager, RestoreStats, SaveStats, restore, save\n"
        "from fastckpt._manager import CheckpointManager as M\n"
        "assert CheckpointManager is M and 'jax' in sys.modules\n"
        "assert all(hasattr(fastckpt, n) for n in fastckpt.__all__)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_unknown_attribute_is_an_attribute_error() -> None:
    import fastckpt

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        fastckpt.nope  # noqa: B018
