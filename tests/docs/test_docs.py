"""Every ```python block in README.md and docs/*.md runs, file by file, in a fresh process.

Blocks of one file run in order in one interpreter (later blocks may use earlier names),
inside a temporary working directory, with 8 virtual CPU devices. A block fenced as
```python title="…" or ```py is treated the same. Shell blocks (```sh) are set-up commands
and are exercised by CI itself.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```(?:python|py)[^\n]*\n(.*?)^```", re.S | re.M)


def python_blocks(path: Path) -> list[str]:
    return [textwrap.dedent(b) for b in _BLOCK.findall(path.read_text())]


def test_docs_exist() -> None:
    assert (ROOT / "docs" / "architecture.md").exists()
    assert sum(len(python_blocks(p)) for p in DOCS) >= 1


@pytest.mark.parametrize("doc", [p for p in DOCS if python_blocks(p)], ids=lambda p: p.name)
def test_doc_code_blocks_run(doc: Path, tmp_path: Path) -> None:
    blocks = python_blocks(doc)
    script = "\n\n".join(f"# --- block {i} of {doc.name}\n{b}" for i, b in enumerate(blocks))
    (tmp_path / "doc_blocks.py").write_text(script)
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu"
    )
    proc = subprocess.run(
        [sys.executable, "doc_blocks.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, (
        f"{doc.name} code blocks failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
