"""timeline.summarize on hand-written run directories (no processes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fastckpt.elastic._protocol import RunPaths
from fastckpt.elastic.timeline import summarize


def _write(
    paths: RunPaths,
    events: list[dict[str, Any]],
    reports: dict[str, dict[str, Any]],
    metrics: list[dict[str, Any]],
) -> None:
    paths.make_dirs()
    paths.events.write_text("".join(json.dumps(e) + "\n" for e in events))
    paths.metrics.write_text("".join(json.dumps(m) + "\n" for m in metrics))
    for name, rep in reports.items():
        (paths.root / "report" / f"{name}.json").write_text(json.dumps(rep))


def _report(t0: float, *, first_step: bool = True) -> dict[str, Any]:
    rep = {
        "t_launch": t0,
        "t_init": t0 + 0.5,
        "t_restored": t0 + 1.5,
        "t_compiled": t0 + 1.7,
        "restore_bytes_by_tier": {"ram": 10, "peer:host1": 5},
        "restored_step": 4,
    }
    if first_step:
        rep["t_first_step"] = t0 + 2.0
    return rep


@pytest.mark.parametrize("second_outcome", ["failed", "stopped"])
def test_a_relaunch_that_fails_before_its_first_step_counts_towards_the_recovery(
    tmp_path: Path, second_outcome: str
) -> None:
    paths = RunPaths(tmp_path)
    events = [
        {"event": "launch", "generation": 0, "hosts": [0, 1, 2], "t": 0.0},
        {"event": "kill", "generation": 0, "host": 2, "t": 10.0},
        {"event": "failure_detected", "generation": 0, "t": 10.25},
        {
            "event": "generation_end",
            "generation": 0,
            "outcome": "failed",
            "reason": "host 2 died",
            "t": 10.3,
        },
        {"event": "launch", "generation": 1, "hosts": [0, 1], "t": 10.5},
        {
            "event": "generation_end",
            "generation": 1,
            "outcome": second_outcome,
            "reason": "host 1 died",
            "t": 12.0,
        },
        {"event": "launch", "generation": 2, "hosts": [0, 1], "t": 12.5},
        {"event": "generation_end", "generation": 2, "outcome": "done", "reason": None, "t": 20.0},
    ]
    reports = {
        "g1-h0": _report(10.5, first_step=False),
        "g1-h1": _report(10.5, first_step=False),
        "g2-h0": _report(12.5),
        "g2-h1": _report(12.6),
    }
    metrics = [{"generation": 0, "step": s, "t": float(s), "loss": 1.0} for s in range(1, 6)]
    metrics += [{"generation": 2, "step": s, "t": 14.0 + s, "loss": 0.5} for s in range(5, 7)]
    _write(paths, events, reports, metrics)

    [rec] = summarize(tmp_path)["recoveries"]
    if second_outcome == "stopped":  # a planned stop is not part of this recovery
        assert "total_s" not in rec and rec["failed_relaunches"] == []
        return
    assert rec["failed_relaunches"] == [{"generation": 1, "reason": "host 1 died"}]
    assert rec["recovered_generation"] == 2 and rec["num_processes"] == 2
    assert rec["total_s"] == pytest.approx(
        12.6 + 2.0 - 10.0
    )  # the kill -> the last worker's first step
    assert sum(rec["parts"].values()) == pytest.approx(rec["total_s"])
    assert rec["parts"]["detect_s"] == pytest.approx(0.25)
    assert rec["last_step_before_kill"] == 5 and rec["steps_lost"] == 1
    assert rec["restore_bytes_by_tier"] == {"ram": 20, "peer:host1": 10}


def test_a_clean_recovery_has_no_failed_relaunches(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    events = [
        {"event": "launch", "generation": 0, "hosts": [0, 1], "t": 0.0},
        {"event": "kill", "generation": 0, "host": 1, "t": 10.0},
        {
            "event": "generation_end",
            "generation": 0,
            "outcome": "failed",
            "reason": "host 1 died",
            "t": 10.3,
        },
        {"event": "launch", "generation": 1, "hosts": [0], "t": 10.5},
        {"event": "generation_end", "generation": 1, "outcome": "done", "reason": None, "t": 20.0},
    ]
    _write(
        paths,
        events,
        {"g1-h0": _report(10.5)},
        [{"generation": 0, "step": 4, "t": 9.0, "loss": 1.0}],
    )
    [rec] = summarize(tmp_path)["recoveries"]
    assert rec["failed_relaunches"] == [] and rec["recovered_generation"] == 1
    assert rec["total_s"] == pytest.approx(2.5) and rec["parts"]["detect_s"] == pytest.approx(0.0)
