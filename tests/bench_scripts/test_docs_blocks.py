"""docs/benchmarks.md shows what each benchmark's committed JSON renders to (no benchmark runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks import _common
from benchmarks._common import (
    DOCS_BLOCKS,
    DOCS_PATH,
    REPO_ROOT,
    RESULTS_DIR,
    DocsBlockError,
    replace_block,
)

# The benchmark modules set XLA flags when imported, before jax is: render in a fresh interpreter.
_RENDER = """
import json, sys
from benchmarks._common import DOCS_BLOCKS, RESULTS_DIR, render_block
blocks = {}
for n in DOCS_BLOCKS:
    blocks[n] = render_block(n, json.loads((RESULTS_DIR / f"{n}.json").read_text()))
json.dump(blocks, sys.stdout)
"""


@pytest.fixture(scope="module")
def rendered() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", _RENDER],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("name", list(DOCS_BLOCKS))
def test_docs_block_matches_committed_json(name: str, rendered: dict[str, str]) -> None:
    assert (RESULTS_DIR / f"{name}.json").exists(), f"no committed results for {name}"
    assert rendered[name] in DOCS_PATH.read_text(), (
        f"the {name} block of docs/benchmarks.md differs from benchmarks/results/{name}.json: "
        "run `python -m benchmarks._common --render-docs` and commit the result"
    )


def test_missing_marker_is_a_clear_error(tmp_path) -> None:
    text = DOCS_PATH.read_text().replace("<!-- /results: leaf_scaling -->", "")
    with pytest.raises(
        DocsBlockError, match=r"one '<!-- results: leaf_scaling .*'<!-- /results: leaf_scaling -->'"
    ):
        replace_block(text, "leaf_scaling", "x")
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n")
    with pytest.raises(DocsBlockError, match="found 0 and 0"):
        _common.update_docs("leaf_scaling", {}, docs, render=lambda doc: "# t\n")
    assert docs.read_text() == "# Benchmarks\n"


def test_publish_only_for_committed_full_runs(tmp_path, monkeypatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(_common, "update_docs", lambda name, doc, render: calls.append(name))
    doc, r = {"meta": {}}, str
    assert not _common.publish_docs(
        "leaf_scaling", doc, render=r, results_path=tmp_path / "leaf_scaling.json"
    )
    assert not _common.publish_docs(
        "leaf_scaling", doc, render=r, results_path=RESULTS_DIR / "leaf_scaling_quick.json"
    )
    assert not _common.publish_docs(
        "leaf_scaling", doc, render=r, results_path=RESULTS_DIR / "leaf_scaling.json", quick=True
    )
    assert _common.publish_docs(
        "leaf_scaling", doc, render=r, results_path=RESULTS_DIR / "leaf_scaling.json"
    )
    assert _common.publish_docs(
        "leaf_scaling", doc, render=r, results_path=tmp_path / "x.json", quick=True, force=True
    )
    assert calls == ["leaf_scaling", "leaf_scaling"]
