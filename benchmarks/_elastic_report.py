"""Judging and reporting :mod:`benchmarks.elastic_recovery` results: medians, checks, markdown,
plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks._common import fmt_s, markdown_table, median

__all__ = ["plot", "render", "summarise"]

TARGET_S = 10.0
"""Issue #25: kill -> first step on the resized mesh, ``small`` preset, median."""
GOAL_S = 3.0
PARTS = ("detect_s", "relaunch_s", "restore_s", "compile_s", "first_step_s")
MiB = 1 << 20


def _good(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs that finished (a failed run has only ``scenario``, ``run`` and ``error``)."""
    return [r for r in doc["runs"] if "error" not in r]


def _med(runs: list[dict[str, Any]], key: str) -> float | None:
    xs = [r[key] for r in runs if r.get(key) is not None]
    return median(xs) if xs else None


def _check(
    target: str, value: float, bound: float, note: str = "", *, at_most: bool = True
) -> dict[str, Any]:
    ok = value <= bound if at_most else value >= bound
    return {"target": target, "value": value, "bound": bound, "pass": bool(ok), "note": note}


def summarise(doc: dict[str, Any]) -> None:
    """Add ``summary`` (medians per scenario), ``checks`` (targets) and ``goals`` to ``doc``."""
    summary: dict[str, Any] = {}
    good = _good(doc)
    for scenario in dict.fromkeys(r["scenario"] for r in good):
        runs = [r for r in good if r["scenario"] == scenario]
        ok = [r for r in runs if r.get("kill_to_first_step_s") is not None]
        tiers = sorted({t for r in ok for t in _kinds(r["restore_bytes_by_tier"])})
        summary[scenario] = {
            "runs": len(runs),
            "runs_ok": len(ok),
            "kill_to_first_step_s": _med(ok, "kill_to_first_step_s"),
            "parts": {p: median([r["parts"][p] for r in ok]) if ok else None for p in PARTS},
            "kill_rest_s": _med(
                [{"k": (r.get("relaunch_detail") or {}).get("kill_rest_s")} for r in ok], "k"
            ),
            "steady_step_s": _med(ok, "steady_step_s"),
            "overhead_s": _med(ok, "overhead_s"),
            "detection_s": _med(runs, "detection_s"),
            "ray_marked_dead_s": _med(runs, "ray_marked_dead_s"),
            "state_bytes_per_node": _med(ok, "state_bytes_per_node"),
            "restore_bytes_by_tier": {
                t: median([_kinds(r["restore_bytes_by_tier"]).get(t, 0) for r in ok]) for t in tiers
            },
            "steps_lost_max": max(
                (r["steps_lost"] for r in ok if r["steps_lost"] is not None), default=None
            ),
        }
    doc["summary"] = summary
    ram_every = doc["meta"]["ram_every"]
    checks, goals = [], []
    small = summary.get("small")
    if small and small["kill_to_first_step_s"] is not None:
        runs = ", ".join(fmt_s(r["kill_to_first_step_s"]) for r in good if r["scenario"] == "small")
        checks.append(
            _check(
                "kill -> first step on the resized mesh, small preset, median (s)",
                small["kill_to_first_step_s"],
                TARGET_S,
                f"runs: {runs}",
            )
        )
        goals.append(_check("the same, goal (s)", small["kill_to_first_step_s"], GOAL_S))
    lost = [r for r in good if r.get("kill_to_first_step_s") is not None]
    worst = max((r["steps_lost"] for r in lost if r["steps_lost"] is not None), default=None)
    if worst is not None:
        checks.append(
            _check(
                f"steps lost <= the RAM checkpoint interval ({ram_every})",
                worst,
                ram_every,
                f"max over {len(lost)} runs",
            )
        )
    if lost:
        read = sum(int(r.get("restore_bytes_read_storage") or 0) for r in lost)
        checks.append(
            _check(
                "bytes read from GCS when one node is lost",
                read,
                0,
                f"sum over {len(lost)} runs (own RAM and peers only)",
            )
        )
    bench = summary.get("bench")
    if bench and bench["kill_to_first_step_s"] is not None:
        goals.append(
            _check(
                "bench preset kill -> first step, median (s)",
                bench["kill_to_first_step_s"],
                TARGET_S,
            )
        )
        if bench["overhead_s"] is not None:
            goals.append(
                _check(
                    "bench preset without the one train step, median (s)",
                    bench["overhead_s"],
                    TARGET_S,
                )
            )
    doc["checks"], doc["goals"] = checks, goals


def _kinds(by_tier: dict[str, int] | None) -> dict[str, int]:
    """Bytes by kind of tier: ``ram``, ``peer`` (every ``peer:<node>`` summed), ``storage``."""
    out: dict[str, int] = {}
    for tier, n in (by_tier or {}).items():
        kind = tier.split(":")[0]
        out[kind] = out.get(kind, 0) + int(n)
    return out


def _tiers(t: dict[str, Any] | None) -> str:
    return ", ".join(f"{k}={v / MiB:.1f}" for k, v in sorted(_kinds(t).items()))


def render(doc: dict[str, Any]) -> str:
    """The results as markdown (judged again: :func:`summarise` of a copy)."""
    doc = dict(doc)
    summarise(doc)
    meta, runs, s = doc["meta"], _good(doc), doc["summary"]
    failed = [r for r in doc["runs"] if "error" in r]
    iso = sorted({r["isolation"] for r in runs})
    notes = sorted({r["isolation_note"] for r in runs if r.get("isolation_note")})
    out = [
        "# Elastic recovery on Ray: a lost node -> first step on the resized mesh",
        "",
        f"`{meta['command']}` on {meta['cpus']} CPUs as {meta['user']}, {meta['time']} "
        f"(git {meta['git_commit']}){' (quick: 1 run per scenario)' if meta['quick'] else ''}. "
        f"4 nodes x 2 devices on a LocalRayCluster ({', '.join(iso)}"
        f"{'; ' + '; '.join(notes) if notes else ''}), RAM checkpoint + 1 peer replica every "
        f"{meta['ram_every']} steps, the last rank's node lost at step {meta['kill_step']} "
        f"(bench: {meta.get('bench_kill_step')}) or, if later, once the warm standbys are up; "
        "resumed on 3 nodes; runs share a JAX compile cache.",
        "",
        "## Checks",
        "",
    ]
    for title, items, words in (
        ("check", doc["checks"], ("PASS", "FAIL")),
        ("goal", doc["goals"], ("met", "not met")),
    ):
        rows = [
            [
                c["target"],
                f"{c['value']:.3g}",
                f"{c['bound']:g}",
                words[0] if c["pass"] else words[1],
                c["note"],
            ]
            for c in items
        ]
        out += [markdown_table([title, "value", "bound", "result", "note"], rows), ""]
    heads = [
        "scenario",
        "run",
        "kill -> first step (s)",
        "detect",
        "relaunch",
        "(of it: kill rest)",
        "restore",
        "compile",
        "first step",
        "steady step",
        "overhead",
        "Ray marked dead (s)",
        "steps lost",
        "restored MiB by tier (3 nodes)",
        "GCS bytes",
        "load start / end",
    ]
    rows = []
    for r in runs:
        parts = r["parts"] or {}
        rows.append(
            [
                r["scenario"],
                str(r["run"]),
                fmt_s(r["kill_to_first_step_s"]),
                *(fmt_s(parts.get(p)) for p in PARTS[:2]),
                fmt_s((r.get("relaunch_detail") or {}).get("kill_rest_s")),
                *(fmt_s(parts.get(p)) for p in PARTS[2:]),
                fmt_s(r["steady_step_s"]),
                fmt_s(r["overhead_s"]),
                fmt_s(r["ray_marked_dead_s"]),
                str(r["steps_lost"]),
                _tiers(r["restore_bytes_by_tier"]),
                str(r["restore_bytes_read_storage"]),
                f"{r['loadavg_start'][0]:.1f} / {r['loadavg_end'][0]:.1f}",
            ]
        )
    for name, m in s.items():
        rows.append(
            [
                f"**{name} median**",
                "",
                f"**{fmt_s(m['kill_to_first_step_s'])}**",
                *(fmt_s(m["parts"][p]) for p in PARTS[:2]),
                fmt_s(m["kill_rest_s"]),
                *(fmt_s(m["parts"][p]) for p in PARTS[2:]),
                fmt_s(m["steady_step_s"]),
                f"**{fmt_s(m['overhead_s'])}**",
                fmt_s(m["ray_marked_dead_s"]),
                f"max {m['steps_lost_max']}",
                _tiers(m["restore_bytes_by_tier"]),
                "",
                "",
            ]
        )
    out += ["## Runs", "", markdown_table(heads, rows), ""]
    out += [f"* {r['scenario']} run {r['run']} FAILED: `{r['error'][-300:]}`" for r in failed]
    out += [""] if failed else []
    det = [
        [name, fmt_s(m["detection_s"]), fmt_s(m["ray_marked_dead_s"]), str(m["runs"])]
        for name, m in s.items()
    ]
    out += [
        "## Node-death detection (medians)",
        "",
        markdown_table(
            ["scenario", "driver noticed (s)", "GCS marked the node dead (s)", "runs"], det
        ),
        "",
        "`small`/`bench`: the node's raylet, workers and tmpfs SIGKILLed; `cut`: its link drops "
        "every frame (namespaces; a SIGSTOPped node in process mode). The driver notices first "
        "when a survivor's collective fails or a worker actor dies; the GCS marks the node dead "
        "after its health checks (500 ms period, 3 failures, 500 ms timeout).",
        "",
    ]
    fp = doc.get("footprint")
    if fp:
        rows = [
            [
                name,
                str(n["processes"]),
                f"{n['pss_bytes'] / MiB:.0f}",
                f"{n['rss_bytes'] / MiB:.0f}",
                f"{n['cpu_percent']:.1f}",
            ]
            for name, n in fp["nodes"].items()
        ]
        out += [
            "## Ray's own footprint per node (idle cluster)",
            "",
            markdown_table(["node", "processes", "PSS MiB", "RSS MiB", "CPU % of a core"], rows),
            "",
            f"{fp['isolation']}, measured over {fp['idle_s']:.0f} s, cluster up in "
            f"{fp['start_s']:.1f} s. Settings: `{json.dumps(fp['settings']['ray'])}`; health "
            f"checks `{json.dumps(fp['settings']['health_checks'])}`. A job's worker actors "
            "(JAX processes) are not included.",
            "",
        ]
    out += [
        "Parts (each ends when the *last* worker passes it): detect = the fault -> the driver "
        "notices; relaunch = kill the survivors + warm standby actors take over + "
        "`jax.distributed` and the manager up; restore = the state on every worker's devices; "
        "compile = the train step compiled beyond the restore (it compiles in a thread during "
        "the restore); first step = one full train step on the resized mesh. *kill rest* = "
        "from the driver noticing to the relaunch (killing the survivors, and, when a "
        "survivor's collective failed first, waiting for the GCS to mark the lost node dead: "
        "relaunching onto it would fail). Steady step = "
        "median step interval after it; overhead = total - steady step. A median row takes each "
        "column's median on its own.",
    ]
    return "\n".join(out) + "\n"


def plot(doc: dict[str, Any], path: Path) -> None:
    """Stacked parts per run, the target as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in _good(doc) if r["parts"]]
    labels = [f"{r['scenario']} {r['run']}" for r in runs]
    fig, ax = plt.subplots(figsize=(4 + 1.1 * max(1, len(labels)), 4.5))
    bottom = [0.0] * len(labels)
    colors = ["#7f7f7f", "#9467bd", "#1f77b4", "#ff7f0e", "#2ca02c"]
    for p, c in zip(PARTS, colors):
        vals = [r["parts"][p] for r in runs]
        ax.bar(labels, vals, bottom=bottom, color=c, label=p[:-2].replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, r in enumerate(runs):
        ax.annotate(
            f"{r['kill_to_first_step_s']:.1f}s",
            (i, bottom[i]),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.axhline(TARGET_S, color="red", ls="--", lw=1, label=f"target {TARGET_S:.0f}s (small)")
    ax.set_ylabel("seconds from the fault")
    ax.set_title("Ray: lost node -> first step on 3 nodes (parts)", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
