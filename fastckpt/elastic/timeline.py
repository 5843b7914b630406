"""Turn an elastic job's records into a timeline: recoveries, resizes, their parts, steps lost.

Sources (:class:`~fastckpt.elastic.ElasticResult`): the driver's events, the workers'
reports (phase timestamps ``t_*`` and restore stats) and process 0's metrics. Timestamps
are ``time.time()`` of the machines involved (comparable only with synchronised clocks).

A recovery (from a ``kill`` event a chaos monitor recorded, else from the failure's
detection) is split into consecutive parts that sum to ``kill_to_first_step_s``; each
boundary is the *last* worker to pass it, since the job runs at the pace of its slowest
process:

* ``detect_s``: the kill -> the driver notices (``cause``: ``process`` or ``node``),
* ``relaunch_s``: -> every new worker has ``jax.distributed`` and its manager up
  (``kill_rest_s``: killing the survivors; ``start_s``: actors placed, init),
* ``restore_s``: -> every worker holds the restored state,
* ``compile_s``: -> every worker has the train step compiled (beyond the restore: the
  example worker compiles while it restores),
* ``first_step_s``: -> every worker finished its first step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["recovery_breakdown", "summarize"]


def recovery_breakdown(
    reports: Sequence[dict[str, Any]],
    *,
    t_event: float,
    t_detect: float | None,
    generation: int,
    events: list[dict[str, Any]],
) -> dict[str, Any] | None:
    """Parts of the path from ``t_event`` to the first step of ``generation`` (None if it
    never got there)."""
    reps = [r for r in reports if r.get("generation") == generation]
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


def summarize(
    events: Sequence[dict[str, Any]],
    reports: Sequence[dict[str, Any]],
    metrics: Sequence[dict[str, Any]],
) -> dict[str, Any]:
    """Everything the demo reports about one job.

    Returns ``{"generations", "recoveries", "resizes", "final_step", "final_loss"}``;
    each recovery also has ``killed_node``, ``cause``, ``last_step_before_kill``, ``steps_lost``
    (steps completed before the kill that had to be redone) and ``failed_relaunches``
    (generations after the kill that failed before their first step: the recovery's parts
    then describe the generation that got there, its total counts from the kill).
    """
    events = list(events)
    # The first generation_end of a generation wins.
    ends = {int(e["generation"]): e for e in reversed(events) if e["event"] == "generation_end"}
    generations = [
        {"generation": e["generation"], "nodes": e["nodes"], "t": e["t"]}
        for e in events
        if e["event"] == "launch"
    ]
    for g in generations:
        g["outcome"] = ends.get(int(g["generation"]), {}).get("outcome", "running")
    outcomes = {int(g["generation"]): g["outcome"] for g in generations}
    recoveries = []
    for detect in (e for e in events if e["event"] == "failure_detected"):
        gen = int(detect["generation"])
        kill = next((e for e in events if e["event"] == "kill" and e["generation"] == gen), detect)
        # The recovery ends at the first step of the first generation after the kill that got
        # there; relaunches that failed before their first step count towards it.
        failed: list[dict[str, Any]] = []
        rec = None
        for later in range(gen + 1, max(outcomes, default=gen) + 1):
            rec = recovery_breakdown(
                reports,
                t_event=float(kill["t"]),
                t_detect=float(detect["t"]),
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
            "killed_node": kill.get("node"),
            "cause": detect.get("cause"),
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
            reports, t_event=float(stop["t"]), t_detect=None, generation=gen + 1, events=events
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
