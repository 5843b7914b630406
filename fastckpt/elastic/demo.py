"""``python -m fastckpt.elastic demo``: lose a host mid-training, keep training, get it back.

Scenario (defaults): 4 hosts x 2 virtual CPU devices train the ``small`` transformer; at
step ``--kill-step`` host 3 gets a real SIGKILL and its local (RAM-tier) directory is
wiped; the supervisor notices, kills the survivors, relaunches on 3 hosts (6 devices, same
global batch) which restore the latest checkpoint; at ``--rejoin-step`` host 3 is back,
the workers stop at a checkpoint and the run continues on 4 hosts to ``--steps``.

Output: a live timeline, a PNG of loss vs step with the events marked, and as the LAST
line one JSON object (``kill_to_first_step_s``, its parts, bytes restored per tier, steps
lost, ...; see :func:`fastckpt.elastic.timeline.summarize`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastckpt.elastic.supervisor import (
    EXAMPLE_WORKER_PRELOAD,
    ChaosEvent,
    Supervisor,
    SupervisorOptions,
    SupervisorTerminated,
    default_worker_cmd,
)
from fastckpt.elastic.timeline import summarize

__all__ = ["build_parser", "main", "plot_loss", "run_demo"]

CPU_FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
"""XLA flags the demo gives its workers. On a couple of shared CPU cores compiling the train
step dominates a restart; these trade a slower step for much less compile CPU time.
``--full-opt`` turns them off."""


def build_parser() -> argparse.ArgumentParser:
    """Flags of the demo."""
    p = argparse.ArgumentParser(
        prog="python -m fastckpt.elastic demo", description=__doc__.splitlines()[0]
    )
    p.add_argument("--root", default=None, help="checkpoint root (default: a new temp dir)")
    p.add_argument(
        "--workdir", default=None, help="run dir, local dirs, PNG (default: a new temp dir)"
    )
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--devices-per-host", type=int, default=2)
    p.add_argument("--preset", default="small", help="model preset (tiny, small, bench)")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--kill-step", type=int, default=25)
    p.add_argument("--kill-host", type=int, default=None, help="default: the last host")
    p.add_argument("--rejoin-step", type=int, default=50)
    p.add_argument(
        "--checkpoint-every", type=int, default=20, help="persistent checkpoint cadence (steps)"
    )
    p.add_argument(
        "--ram-every", type=int, default=2, help="RAM-tier + peer replica cadence (0: off)"
    )
    p.add_argument("--step-delay-s", type=float, default=0.0)
    p.add_argument("--png", default=None, help="loss plot path (default: <workdir>/loss.png)")
    p.add_argument("--full-opt", action="store_true", help="do not pass the fast-compile XLA flags")
    p.add_argument("--quiet", action="store_true", help="no live timeline")
    return p


def plot_loss(run_dir: Path, summary: dict[str, Any], png: Path) -> None:
    """Loss vs step, one line per generation, kills and rejoins marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastckpt.elastic._protocol import RunPaths, read_jsonl

    metrics = read_jsonl(RunPaths(run_dir).metrics)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for gen in summary["generations"]:
        pts = sorted(
            (m["step"], m["loss"]) for m in metrics if m["generation"] == gen["generation"]
        )
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, lw=1.2, label=f"gen {gen['generation']}: {len(gen['hosts'])} hosts")
    for rec in summary["recoveries"]:
        if rec.get("last_step_before_kill") is not None:
            ax.axvline(rec["last_step_before_kill"], color="red", ls="--", lw=1)
            label = f"SIGKILL host {rec['killed_host']}"
            if "total_s" in rec:
                label += f"\nfirst step after {rec['total_s']:.1f}s"
            ax.annotate(
                label,
                (rec["last_step_before_kill"], 0.95),
                xycoords=("data", "axes fraction"),
                color="red",
                fontsize=8,
                ha="left",
                va="top",
            )
    for rs in summary["resizes"]:
        if rs.get("restored_step") is not None:
            ax.axvline(rs["restored_step"], color="green", ls=":", lw=1)
            ax.annotate(
                f"host back: resize at step {rs['restored_step']}",
                (rs["restored_step"], 0.75),
                xycoords=("data", "axes fraction"),
                color="green",
                fontsize=8,
                ha="left",
                va="top",
            )
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("fastckpt elastic: loss through host loss and rejoin")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def _printer(t0: list[float]) -> Any:
    def show(ev: dict[str, Any]) -> None:
        if not t0:
            t0.append(float(ev["t"]))
        rel = float(ev["t"]) - t0[0]
        name = ev["event"]
        if name == "launch":
            hosts = ev["hosts"]
            msg = f"generation {ev['generation']}: launched {len(hosts)} workers on hosts {hosts}"
        elif name == "kill":
            msg = (
                f"SIGKILL host {ev['host']} (pid {ev['pid']}) at step ~{ev['step']}; "
                "wiped its local dir"
            )
        elif name == "failure_detected":
            msg = f"failure detected: host {ev['host']} ({ev.get('reason')}, rc={ev.get('rc')})"
        elif name == "killed_rest":
            msg = f"killed the remaining workers on hosts {ev['hosts']}"
        elif name == "host_back":
            msg = (
                f"host {ev['host']} is back (step ~{ev['step']}): "
                "asking workers to stop at a checkpoint"
            )
        elif name == "generation_end":
            msg = f"generation {ev['generation']} ended: {ev['outcome']}"
        else:
            msg = json.dumps({k: v for k, v in ev.items() if k != "t"})
        print(f"[{rel:7.2f}s] {msg}", flush=True)

    return show


def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    """Run the scenario; returns the final JSON summary (also written to ``summary.json``).

    The hosts' local (RAM-tier) directories are made under ``/dev/shm`` and removed when
    the run ends, whatever its outcome; the checkpoint root and the run dir stay.
    """
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fastckpt-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    root = args.root or str(workdir / "ckpt")
    shm = Path("/dev/shm")
    local_root = Path(
        tempfile.mkdtemp(prefix="fastckpt-demo-local-", dir=shm if shm.is_dir() else None)
    )
    kill_host = args.hosts - 1 if args.kill_host is None else args.kill_host
    options = SupervisorOptions(
        num_hosts=args.hosts,
        devices_per_host=args.devices_per_host,
        min_hosts=1,
        max_restarts=2,
        preload=EXAMPLE_WORKER_PRELOAD,
        events=(
            ChaosEvent(kind="kill", host=kill_host, at_step=args.kill_step),
            ChaosEvent(kind="rejoin", host=kill_host, at_step=args.rejoin_step),
        ),
    )
    worker = default_worker_cmd(
        [
            "--root",
            root,
            "--steps",
            str(args.steps),
            "--preset",
            args.preset,
            "--checkpoint-every",
            str(args.checkpoint_every),
            "--ram-every",
            str(args.ram_every),
            "--model-axis",
            str(args.devices_per_host),
            "--step-delay-s",
            str(args.step_delay_s),
        ]
    )
    env = dict(os.environ)
    if not args.full_opt:
        env["XLA_FLAGS"] = " ".join(
            f for f in (env.get("XLA_FLAGS", ""), CPU_FAST_COMPILE_FLAGS) if f
        )
    run_dir = workdir / "run"
    t0: list[float] = []
    sup = Supervisor(
        worker,
        run_dir=run_dir,
        local_root=local_root,
        options=options,
        env=env,
        on_event=None if args.quiet else _printer(t0),
    )
    try:
        result = sup.run()
    finally:  # the hosts' RAM tiers live in /dev/shm: memory until removed
        shutil.rmtree(local_root, ignore_errors=True)
    summary = summarize(run_dir)
    png = Path(args.png) if args.png else workdir / "loss.png"
    plot_loss(run_dir, summary, png)
    if not args.quiet:
        _print_recoveries(summary, t0[0] if t0 else 0.0)
    rec = summary["recoveries"][0] if summary["recoveries"] else {}
    out: dict[str, Any] = {
        "kill_to_first_step_s": rec.get("total_s"),
        "parts": rec.get("parts"),
        "relaunch_detail": rec.get("relaunch_detail"),
        "restore_bytes_by_tier": rec.get("restore_bytes_by_tier"),
        "restored_step": rec.get("restored_step"),
        "last_step_before_kill": rec.get("last_step_before_kill"),
        "steps_lost": rec.get("steps_lost"),
        "recovered_generation": rec.get("recovered_generation"),
        "failed_relaunches": rec.get("failed_relaunches", []),
        "rejoin_stop_to_first_step_s": summary["resizes"][0]["stop_to_first_step_s"]
        if summary["resizes"]
        else None,
        "hosts_per_generation": [len(g["hosts"]) for g in summary["generations"]],
        "restarts": result.restarts,
        "final_step": summary["final_step"],
        "final_loss": summary["final_loss"],
        "png": str(png),
        "root": root,
        "run_dir": str(run_dir),
    }
    (workdir / "summary.json").write_text(json.dumps({"demo": out, "timeline": summary}, indent=1))
    return out


def _print_recoveries(summary: dict[str, Any], t0: float) -> None:
    for rec in summary["recoveries"]:
        if "total_s" not in rec:
            continue
        tiers = ", ".join(
            f"{k}={v / 2**20:.1f} MiB" for k, v in rec["restore_bytes_by_tier"].items()
        )
        parts = ", ".join(f"{k[:-2]} {v:.2f}s" for k, v in rec["parts"].items())
        print(
            f"[{rec['t_first_step'] - t0:7.2f}s] first step done on {rec['num_processes']} hosts: "
            f"restored step {rec['restored_step']} ({tiers}); kill -> first step "
            f"{rec['total_s']:.2f}s "
            f"({parts}); steps lost {rec.get('steps_lost')}"
            + "".join(
                f"; relaunch (generation {f['generation']}) failed first: {f['reason']}"
                for f in rec.get("failed_relaunches", [])
            ),
            flush=True,
        )
    for rs in summary["resizes"]:
        print(
            f"[{rs['t_first_step'] - t0:7.2f}s] resized to {rs['num_processes']} hosts at step "
            f"{rs['restored_step']}: stop request -> first step {rs['stop_to_first_step_s']:.2f}s",
            flush=True,
        )


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry: run the demo, print the timeline, end with the JSON line."""
    args = build_parser().parse_args(argv)
    try:
        out = run_demo(args)
    except SupervisorTerminated as e:  # SIGTERM/SIGHUP: workers were killed, the RAM tiers removed
        print(f"demo terminated: {e}", file=sys.stderr)
        return 143
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
