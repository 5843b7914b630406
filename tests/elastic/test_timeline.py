"""timeline.summarize on hand-written job records (no processes)."""

from __future__ import annotations

from typing import Any

import pytest

from fastckpt.elastic.timeline import summarize


def _reports(reports: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """``{"g<gen>-h<rank>": report}`` -> reports carrying their generation and process."""
    out = []
    for name, rep in reports.items():
        gen, rank = name[1:].split("-h")
        out.append({**rep, "generation": int(gen), "process": int(rank)})
    return out


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
    second_outcome: str,
) -> None:
    events = [
        {"event": "launch", "generation": 0, "nodes": [0, 1, 2], "t": 0.0},
        {"event": "kill", "generation": 0, "node": "n2", "t": 10.0},
        {"event": "failure_detected", "generation": 0, "t": 10.25},
        {
            "event": "generation_end",
            "generation": 0,
            "outcome": "failed",
            "reason": "host 2 died",
            "t": 10.3,
        },
        {"event": "launch", "generation": 1, "nodes": [0, 1], "t": 10.5},
        {
            "event": "generation_end",
            "generation": 1,
            "outcome": second_outcome,
            "reason": "host 1 died",
            "t": 12.0,
        },
        {"event": "launch", "generation": 2, "nodes": [0, 1], "t": 12.5},
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
    [rec] = summarize(events, _reports(reports), metrics)["recoveries"]
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


def test_a_clean_recovery_has_no_failed_relaunches() -> None:
    events = [
        {"event": "launch", "generation": 0, "nodes": [0, 1], "t": 0.0},
        {"event": "kill", "generation": 0, "node": "n1", "t": 10.0},
        {"event": "failure_detected", "generation": 0, "cause": "node", "t": 10.0},
        {
            "event": "generation_end",
            "generation": 0,
            "outcome": "failed",
            "reason": "host 1 died",
            "t": 10.3,
        },
        {"event": "launch", "generation": 1, "nodes": [0], "t": 10.5},
        {"event": "generation_end", "generation": 1, "outcome": "done", "reason": None, "t": 20.0},
    ]
    reports = _reports({"g1-h0": _report(10.5)})
    [rec] = summarize(events, reports, [{"generation": 0, "step": 4, "t": 9.0, "loss": 1.0}])[
        "recoveries"
    ]
    assert rec["failed_relaunches"] == [] and rec["recovered_generation"] == 1
    assert rec["total_s"] == pytest.approx(2.5) and rec["parts"]["detect_s"] == pytest.approx(0.0)
