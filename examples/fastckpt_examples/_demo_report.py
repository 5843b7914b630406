"""What :mod:`fastckpt_examples.demo` shows: the live timeline, the loss plot, the JSON line."""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["Timeline", "final_json", "plot_loss"]

MiB = 1 << 20


class Timeline:
    """Prints events as they come, stamped with seconds since the first one."""

    def __init__(self, *, quiet: bool) -> None:
        self.quiet = quiet
        self.names: dict[str, str] = {}
        """Ray node id -> node name (``node0``...); a revived node's new id is added."""
        self.t0: float | None = None
        self._last_gen: int | None = None

    def name(self, node_id: Any) -> str:
        return self.names.get(str(node_id), str(node_id)[:8])

    def _print(self, t: float, msg: str) -> None:
        if self.t0 is None:
            self.t0 = t
        if not self.quiet:
            print(f"[{t - self.t0:7.2f}s] {msg}", flush=True)

    def note(self, msg: str) -> None:
        self._print(time.time(), msg)

    def progress(self, generation: int, step: int) -> None:
        if step and (generation != self._last_gen or step % 10 == 0):
            self._last_gen = generation
            self._print(time.time(), f"generation {generation}: step {step}")

    def event(self, ev: dict[str, Any]) -> None:
        name, t = ev["event"], float(ev["t"])
        if name == "launch":
            nodes = ", ".join(self.name(n) for n in ev["nodes"])
            msg = f"generation {ev['generation']}: launching {len(ev['nodes'])} workers on {nodes}"
        elif name == "started":
            msg = f"generation {ev['generation']}: workers placed, coordinator {ev['coordinator']}"
        elif name == "kill":
            what = "raylet, workers and tmpfs killed" if ev["fault"] == "kill" else "link cut"
            msg = f"FAULT: {ev['node_name']} lost ({what}) at step {ev['step']}"
        elif name == "standby_ready":
            msg = f"warm standby worker ready on {self.name(ev['node'])}"
        elif name == "ray_node_dead":
            msg = f"Ray's GCS marked {ev['node_name']} DEAD"
        elif name == "failure_detected":
            msg = (
                f"driver detected the failure: rank {ev['rank']} on {self.name(ev['node'])}, "
                f"cause {ev['cause']} (known after {ev['cause_known_s']:.2f}s)"
            )
        elif name == "killed_rest":
            msg = f"generation {ev['generation']}: killed the surviving workers"
        elif name == "revive":
            msg = f"{ev['node_name']} is back (an empty replacement node) at step {ev['step']}"
        elif name == "node_joined":
            msg = f"node joined: {', '.join(self.name(n) for n in ev['nodes'])}"
        elif name == "stop_requested":
            msg = f"asking the workers to stop at a checkpoint (step ~{ev['step']}) to grow"
        elif name == "generation_end":
            msg = f"generation {ev['generation']} ended: {ev['outcome']} ({ev['reason']})"
        elif name == "done":
            msg = f"job done in generation {ev['generation']}"
        else:
            msg = f"{name}: { {k: v for k, v in ev.items() if k not in ('t', 'event')} }"
        self._print(t, msg)

    def recoveries(self, summary: dict[str, Any]) -> None:
        """One line per recovery and per resize, with their parts."""
        for rec in summary["recoveries"]:
            if "total_s" not in rec:
                continue
            by_tier = rec["restore_bytes_by_tier"].items()
            tiers = ", ".join(f"{k}={v / MiB:.1f} MiB" for k, v in by_tier)
            parts = ", ".join(f"{k[:-2]} {v:.2f}s" for k, v in rec["parts"].items())
            self._print(
                rec["t_first_step"],
                f"first step on {rec['num_processes']} nodes: restored step {rec['restored_step']} "
                f"({tiers}); kill -> first step {rec['total_s']:.2f}s ({parts}); steps lost "
                f"{rec.get('steps_lost')}",
            )
        for rs in summary["resizes"]:
            self._print(
                rs["t_first_step"],
                f"grew to {rs['num_processes']} nodes at step {rs['restored_step']}: stop request "
                f"-> first step {rs['stop_to_first_step_s']:.2f}s",
            )


def plot_loss(
    metrics: Sequence[dict[str, Any]], summary: dict[str, Any], png: Path, *, names: dict[str, str]
) -> None:
    """Loss vs step, one line per generation, the fault and the grow-back marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for gen in summary["generations"]:
        g = gen["generation"]
        pts = sorted((m["step"], m["loss"]) for m in metrics if m["generation"] == g)
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, lw=1.2, label=f"gen {gen['generation']}: {len(gen['nodes'])} nodes")
    for rec in summary["recoveries"]:
        if rec.get("last_step_before_kill") is not None:
            x = rec["last_step_before_kill"]
            ax.axvline(x, color="red", ls="--", lw=1)
            label = f"{names.get(str(rec['killed_node']), 'a node')} lost"
            if "total_s" in rec:
                label += f"\nfirst step on {rec['num_processes']} after {rec['total_s']:.1f}s"
            ax.annotate(
                label,
                (x, 0.95),
                xycoords=("data", "axes fraction"),
                color="red",
                fontsize=8,
                ha="left",
                va="top",
            )
    for rs in summary["resizes"]:
        if rs.get("restored_step") is not None:
            x = rs["restored_step"]
            ax.axvline(x, color="green", ls=":", lw=1)
            ax.annotate(
                f"node back: {rs['num_processes']} nodes from step {x}",
                (x, 0.7),
                xycoords=("data", "axes fraction"),
                color="green",
                fontsize=8,
                ha="left",
                va="top",
            )
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("fastckpt elastic on Ray: loss through a lost node and its return")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def steady_step_s(metrics: Sequence[dict[str, Any]], generation: int) -> float | None:
    """Median seconds between consecutive steps of ``generation``, its first step excluded."""
    rows = sorted((int(m["step"]), float(m["t"])) for m in metrics if m["generation"] == generation)
    gaps = [t1 - t0 for (s0, t0), (s1, t1) in itertools.pairwise(rows) if s1 == s0 + 1]
    return statistics.median(gaps) if gaps else None


def final_json(
    args: argparse.Namespace,
    summary: dict[str, Any],
    result: dict[str, Any],
    chaos: Sequence[dict[str, Any]],
    cluster: dict[str, Any],
    *,
    note: str | None,
    png: Path,
    wall_s: float,
) -> dict[str, Any]:
    """The demo's last line."""
    rec = summary["recoveries"][0] if summary["recoveries"] else {}
    kill = next((e for e in chaos if e["event"] == "kill"), None)
    dead = next((e for e in chaos if e["event"] == "ray_node_dead"), None)
    gen = rec.get("recovered_generation")
    reps = [r for r in result["reports"] if r.get("generation") == gen]
    resize = summary["resizes"][0] if summary["resizes"] else None
    total = rec.get("total_s")
    steady = None if gen is None else steady_step_s(result["metrics"], gen)
    return {
        "engine": "ray",
        "isolation": cluster["isolation"],
        "isolation_note": note,
        "user": "root" if os.geteuid() == 0 else f"uid {os.geteuid()}",
        "preset": args.preset,
        "nodes": args.nodes,
        "devices_per_node": args.devices_per_node,
        "fault": args.fault,
        "killed_node": None if kill is None else kill["node_name"],
        "kill_step": None if kill is None else kill["step"],
        "standbys_warm_at_kill": None if kill is None else kill["standbys_warm"],
        "kill_to_first_step_s": total,
        "parts": rec.get("parts"),
        "relaunch_detail": rec.get("relaunch_detail"),
        "detection_s": (rec.get("parts") or {}).get("detect_s"),
        "detection_cause": rec.get("cause"),
        "ray_marked_dead_s": None if dead is None or kill is None else dead["t"] - kill["t"],
        "restore_bytes_by_tier": rec.get("restore_bytes_by_tier"),
        "restore_bytes_read_storage": rec.get("restore_bytes_read_storage"),
        "state_bytes_per_node": max(
            (sum((r.get("restore_bytes_by_tier") or {}).values()) for r in reps), default=None
        ),
        "restored_step": rec.get("restored_step"),
        "last_step_before_kill": rec.get("last_step_before_kill"),
        "steps_lost": rec.get("steps_lost"),
        "ram_every": args.ram_every,
        "recovered_generation": gen,
        "failed_relaunches": rec.get("failed_relaunches", []),
        "steady_step_s": steady,
        "overhead_s": None if total is None or steady is None else total - steady,
        "rejoin_stop_to_first_step_s": None if resize is None else resize["stop_to_first_step_s"],
        "rejoin_parts": None if resize is None else resize["parts"],
        "hosts_per_generation": [len(g["nodes"]) for g in summary["generations"]],
        "restarts": result["restarts"],
        "steps": args.steps,
        "final_step": summary["final_step"],
        "final_loss": summary["final_loss"],
        "cluster_start_s": cluster["start_s"],
        "wall_s": wall_s,
        "png": str(png),
    }
