"""Turn a run directory into a timeline: recoveries, resizes, their parts, steps lost.

Sources (see :mod:`fastckpt.elastic._protocol`): the supervisor's ``events.jsonl``, the
workers' ``report/*.json`` (phase timestamps and restore stats) and ``metrics.jsonl``.
All timestamps are ``time.time()`` of one machine.

A recovery (after a ``kill`` event) is split into consecutive parts that sum to
``kill_to_first_step_s``; each boundary is the *last* worker to pass it, since the job
runs at the pace of its slowest process:

* ``detect_s``: SIGKILL -> the supervisor notices,
* ``relaunch_s``: -> every new worker has ``jax.distributed`` and its manager up
  (``kill_rest_s``: killing the survivors; ``start_s``: spawn, imports, init),
* ``restore_s``: -> every worker holds the restored state,
* ``compile_s``: -> every worker has the train step compiled (beyond the restore: the
  example worker compiles while it restores),
* ``first_step_s``: -> every worker finished its first step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastckpt.elastic._protocol import RunPaths, read_json, read_jsonl

__all__ = ["recovery_breakdown", "summarize"]


def _reports(paths: RunPaths, generation: int) -> list[dict[str, Any]]:
    out = []
    for p in sorted((paths.root / "report").glob(f"g{generation}-h*.json")):
        rep = read_json(p)
        if rep is not None:
            out.append(rep)
    return out


def recovery_breakdown(
    paths: RunPaths,
    *,
    t_event: float,
    t_detect: float | None,
    generation: int,
    events: list[dict[str, Any]],
) -> dict[str, Any] | None:
    """Parts of the path from ``t_event`` to the first step of ``generation`` (None if it
    never got there)."""
    reps = _reports(paths, generation)
    if not reps or any("t_first_step" not in r for r in reps):
        return None
    launch = next(
        (e for e in events if e["event"] == "launch" and e["generation"] == generation), None
    )
    t_launch = float(launch["t"]) if launch else min(float(r["t_launch"]) for r in reps)
    c_detect = t_detect if t_detect is not None else t_event
    c_init = max(c_detect, max(float(r["t_init"]) for r in reps))
    c_restored = max(c_init, max(float(r["t_restored"]) for r in reps))
    c_compiled = max(c_restored, max(float(r.get("t_compiled", c_restored)) for r in reps))
    c_first = max(c_compiled, max(float(r["t_first_step"]) for r in reps))
    tiers: dict[str, int] = {}
    for r in reps:
        for tier, n in (r.get("restore_bytes_by_tier") or {}).items():
            tiers[tier] = tiers.get(tier, 0) + int(n)
    return {
        "total_s": c_first - t_event,
        "parts": {
            "detect_s": c_detect - t_event,
            "relaunch_s": c_init - c_detect,
            "restore_s": c_restored - c_init,
            "compile_s": c_compiled - c_restored,
            "first_step_s": c_first - c_compiled,
        },
        "relaunch_detail": {
            "kill_rest_s": max(0.0, t_launch - c_detect),
            "start_s": c_init - max(c_detect, t_launch),
        },
        "restore_bytes_by_tier": tiers,
        "restore_bytes_read_storage": sum(
            int(r.get("restore_bytes_read_storage", 0)) for r in reps
        ),
        "restored_step": reps[0].get("restored_step"),
        "num_processes": len(reps),
        "t_first_step": c_first,
    }


def summarize(run_dir: str | Path) -> dict[str, Any]:
    """Everything the demo reports about one run directory.

    Returns ``{"generations", "recoveries", "resizes", "final_step", "final_loss"}``;
    each recovery also has ``killed_host``, ``last_step_before_kill``, ``steps_lost``
    (steps completed before the kill that had to be redone) and ``failed_relaunches``
    (generations after the kill that failed before their first step: the recovery's parts
    then describe the generation that got there, its total counts from the kill).
    """
    paths = RunPaths(Path(run_dir))
    events = read_jsonl(paths.events)
    metrics = read_jsonl(paths.metrics)
    generations = [
        {"generation": e["generation"], "hosts": e["hosts"], "t": e["t"]}
        for e in events
        if e["event"] == "launch"
    ]
    ends = {
        int(e["generation"]): e for e in reversed(events) if e["event"] == "generation_end"
    }  # first wins
    for g in generations:
        end = ends.get(int(g["generation"]))
        g["outcome"] = end["outcome"] if end else "running"
    outcomes = {int(g["generation"]): g["outcome"] for g in generations}
    recoveries = []
    for kill in (e for e in events if e["event"] == "kill"):
        gen = int(kill["generation"])
        detect = next(
            (e for e in events if e["event"] == "failure_detected" and e["generation"] == gen), None
        )
        # The recovery ends at the first step of the first generation after the kill that got
        # there; relaunches that failed before their first step count towards it.
        failed: list[dict[str, Any]] = []
        rec = None
        for later in range(gen + 1, max(outcomes, default=gen) + 1):
            rec = recovery_breakdown(
                paths,
                t_event=float(kill["t"]),
                t_detect=float(detect["t"]) if detect else None,
                generation=later,
                events=events,
            )
            if rec is not None or outcomes.get(later) != "failed":
                break
            failed.append({"generation": later, "reason": ends.get(later, {}).get("reason")})
        done = [
            int(m["step"])
            for m in metrics
            if m["generation"] == gen and float(m["t"]) <= float(kill["t"])
        ]
        last = max(done) if done else None
        entry: dict[str, Any] = {
            "killed_host": kill["host"],
            "generation": gen,
            "last_step_before_kill": last,
            "failed_relaunches": failed,
        }
        if rec is not None:
            entry.update(rec, recovered_generation=later)
            restored = rec["restored_step"] or 0
            entry["steps_lost"] = None if last is None else max(0, last - restored)
        recoveries.append(entry)
    resizes = []
    for stop in (e for e in events if e["event"] == "stop_requested"):
        gen = int(stop["generation"])
        rec = recovery_breakdown(
            paths, t_event=float(stop["t"]), t_detect=None, generation=gen + 1, events=events
        )
        if rec is not None:
            rec["parts"].pop("detect_s")
            detail = rec["relaunch_detail"]
            detail["drain_s"] = detail.pop("kill_rest_s")  # workers reach the stop step, save, exit
            resizes.append({"generation": gen, "stop_to_first_step_s": rec.pop("total_s"), **rec})
    final = max(metrics, key=lambda m: (m["step"], m["t"])) if metrics else None
    return {
        "generations": generations,
        "recoveries": recoveries,
        "resizes": resizes,
        "final_step": final["step"] if final else None,
        "final_loss": final.get("loss") if final else None,
    }
