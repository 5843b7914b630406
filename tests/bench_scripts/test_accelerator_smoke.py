"""The accelerator benchmark runs end to end (on the CPU backend, tiny sizes).

It is run for real only where an accelerator is lent, for minutes at a time; a script that
broke since then would waste that time. This runs every section once, with its bit-exact
checks, and checks the results it writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_accelerator_benchmark_runs_every_section_and_writes_its_results(tmp_path: Path) -> None:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    env.pop("XLA_FLAGS", None)  # one CPU device, as one accelerator
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.accelerator",
        "--sizes-gib",
        "0.02",
        "--reps",
        "1",
        "--threads",
        "2",
        "--overhead-gib",
        "0.02",
        "--overhead-d",
        "256",
        "--overhead-batch",
        "64",
        "--overhead-steps",
        "10",
        "--overhead-rounds",
        "1",
        "--device-copy",
        "pinned_host",  # the accelerator's path: deferred copies, checksummed as they land
        "--out-dir",
        str(tmp_path),
        "--work-dir",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads((tmp_path / "accelerator.json").read_text())
    assert doc["errors"] == [] and doc["env"]["backend"] == "cpu"
    size = doc["sizes"]["0.02"]
    for section in ("limits", "raw_tcp", "ram", "pageable", "disk", "orbax"):
        assert (
            section in size and "error" not in size[section] and "skipped" not in size[section]
        ), section
    assert set(size["ram"]["own_ram"]) == {"2"} and size["ram"]["peer"]["seconds"] > 0
    saves = size["ram"]["saves"]
    assert all(s["bytes_pushed"] > 0 and s["push_s"] > 0 for s in saves)
    assert all(s["deferred_copy_s"] > 0 and s["allocate_s"] >= 0 for s in saves)
    assert doc["overhead"]["steps_per_segment"] == 10 and set(doc["overhead"]["overhead"]) == {
        "fastckpt",
        "device_get",
        "idle_fastckpt",
    }
    assert doc["overhead"]["idle_drain_s"] >= 0
    targets = {c["target"] for c in doc["checks"]}
    assert {
        "first RAM save blocks <= 1.5x a steady one",
        "RAM step committed <= 2x the DMA time",
        "push to a peer >= 70% of raw TCP",
    } <= targets and any(t.startswith("host-idle step") for t in targets)
    assert all(c["value"] is not None for c in doc["checks"])
    md = (tmp_path / "accelerator.md").read_text()
    assert "## Save: what the training thread waits for" in md and "## Step overhead" in md
    assert "## Targets" in md
    assert (tmp_path / "accelerator.png").stat().st_size > 0
