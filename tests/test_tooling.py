"""The tree stays honest: ruff (lint and format, 100 columns) over the repository and mypy
(strict) over the package, with the versions the test extra pins (pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize(
    "command",
    [("ruff", "check", "."), ("ruff", "format", "--check", ".")],
    ids=["ruff-check", "ruff-format"],
)
def test_ruff(command: tuple[str, ...]) -> None:
    proc = _run(*command)
    assert proc.returncode == 0, (
        f"{' '.join(command)} failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"
    )


def test_mypy_strict_on_the_package() -> None:
    proc = _run("mypy")  # files and strictness: [tool.mypy] in pyproject.toml
    assert proc.returncode == 0, f"mypy failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"
