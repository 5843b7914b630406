"""Elastic recovery on Ray: a lost node -> first completed step on the resized mesh.

Run (timings are only meaningful when nothing else benchmarks at the same time)::

    flock /tmp/fastckpt-bench.lock python -m benchmarks.elastic_recovery          # 3 runs each
    flock /tmp/fastckpt-bench.lock python -m benchmarks.elastic_recovery --quick  # 1 run each
    python -m benchmarks.elastic_recovery --from-json benchmarks/results/elastic_recovery.json

Every run is one ``fastckpt demo`` (:mod:`fastckpt_examples.demo`) in a fresh process, on
the harness the demo uses: a :class:`~fastckpt_examples.cluster.ray_cluster.LocalRayCluster` of 4
nodes x 2 virtual CPU devices (namespaced hosts where the machine allows, else processes),
a GCS emulator, the driver (:func:`fastckpt.elastic.run_elastic`) on the control node, RAM
checkpoint + 1 peer replica every ``--ram-every`` steps. At ``--kill-step`` one node is
lost; the job resumes on 3 nodes and runs a few more steps (no node comes back: growing
back is the demo's business). Scenarios:

* ``small`` (``kill_node``: raylet, workers and tmpfs SIGKILLed), ``--runs`` runs: the target
  kill -> first step < 10 s (median);
* ``bench`` (~0.5 GiB of train state), ``--runs`` runs: reported, with and without the one
  train step the first step includes (``overhead_s`` = total - steady step);
* ``cut`` (``small``, the node's link cut silently instead), 1 run: detection of a node that
  stops answering without an error.

Each run reports the demo's parts (detect, relaunch, restore, compile, first step), the
driver's detection (``detection_s``) and the GCS marking the node dead
(``ray_marked_dead_s``), bytes restored per tier and from GCS, steps lost. Besides, Ray's own
footprint per node (memory and CPU of its processes, idle) is measured on a cluster of the
same settings. Runs share one JAX compile cache (runs after the first of a preset and mesh
hit it: the ``compile`` part). Results: ``benchmarks/results/elastic_recovery.{json,md,png}``
and the block in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import REPO_ROOT, RESULTS_DIR, fmt_s, publish_docs, text_table, write_json
from benchmarks._elastic_report import plot, render, summarise

__all__ = ["main", "render"]


def _env() -> dict[str, str]:
    paths = [str(REPO_ROOT), str(REPO_ROOT / "examples"), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))


def run_once(args: argparse.Namespace, scenario: str, index: int, cache: Path) -> dict[str, Any]:
    """One demo run in a fresh process; its JSON line plus load and wall time."""
    preset = "bench" if scenario == "bench" else "small"
    kill_step = args.bench_kill_step if scenario == "bench" else args.kill_step
    after = min(args.after, 4) if scenario == "bench" else args.after  # bench steps are slow
    steps = -(-(kill_step + after) // args.ram_every) * args.ram_every
    workdir = Path(tempfile.mkdtemp(prefix=f"fastckpt-elastic-{scenario}-{index}-"))
    cmd = [
        sys.executable,
        "-m",
        "fastckpt_examples.demo",
        "--quiet",
        "--workdir",
        str(workdir),
        "--preset",
        preset,
        "--steps",
        str(steps),
        "--kill-step",
        str(kill_step),
        "--rejoin-step",
        "0",
        "--fault",
        "cut" if scenario == "cut" else "kill",
        "--ram-every",
        str(args.ram_every),
        "--checkpoint-every",
        str(args.checkpoint_every),
        "--compile-cache",
        str(cache),
        "--isolation",
        args.isolation,
    ]
    load_start = os.getloadavg()
    t0 = time.time()
    try:
        proc = subprocess.run(
            cmd,
            cwd=REPO_ROOT,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=args.timeout_s,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"{scenario} run {index}: demo failed (exit {proc.returncode}):\n"
                f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
            )
        demo: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return {
        "scenario": scenario,
        "run": index,
        **demo,
        "bench_wall_s": time.time() - t0,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
    }


def measure_footprint(args: argparse.Namespace, idle_s: float = 10.0) -> dict[str, Any]:
    """Ray's processes per node on an idle cluster of the demo's settings: memory now, CPU
    over ``idle_s`` seconds."""
    from fastckpt_examples.cluster.ray_cluster import HealthChecks, LocalRayCluster, RaySettings

    with LocalRayCluster(nodes=4, devices_per_node=2, isolation=args.isolation) as cluster:
        time.sleep(2.0)
        before = cluster.footprint()
        time.sleep(idle_s)
        after = cluster.footprint()
        nodes = {
            name: {
                "processes": f.processes,
                "pss_bytes": f.pss_bytes,
                "rss_bytes": f.rss_bytes,
                "cpu_percent": 100 * (f.cpu_s - before[name].cpu_s) / idle_s,
            }
            for name, f in after.items()
        }
        return {
            "isolation": cluster.isolation,
            "start_s": cluster.start_s,
            "idle_s": idle_s,
            "nodes": nodes,
            "settings": {
                "ray": {k: v for k, v in dataclasses.asdict(RaySettings()).items() if k != "env"},
                "health_checks": dataclasses.asdict(HealthChecks()),
            },
        }


def _git_commit() -> str | None:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:
        return None
    return (head + ("+dirty" if dirty else "")) or None


def build_parser() -> argparse.ArgumentParser:
    """Flags of the benchmark."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.elastic_recovery", description=__doc__.splitlines()[0]
    )
    p.add_argument("--quick", action="store_true", help="1 run per scenario (default 3)")
    p.add_argument("--runs", type=int, default=None, help="runs of small and bench")
    p.add_argument("--scenarios", default="small,bench,cut", help="comma-separated subset")
    p.add_argument(
        "--kill-step", type=int, default=10, help="lose the node at this step (or once warm)"
    )
    p.add_argument("--bench-kill-step", type=int, default=6, help="the same, bench preset")
    p.add_argument("--after", type=int, default=8, help="steps past the kill (to a RAM step)")
    p.add_argument("--ram-every", type=int, default=2, help="RAM + peer replica cadence")
    p.add_argument("--checkpoint-every", type=int, default=20, help="GCS checkpoint cadence")
    p.add_argument("--isolation", choices=["auto", "namespaces", "processes"], default="auto")
    p.add_argument("--timeout-s", type=float, default=900.0, help="per demo run")
    p.add_argument("--no-footprint", action="store_true", help="skip the idle-cluster footprint")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--from-json", type=Path, default=None, help="re-render from a results JSON")
    p.add_argument("--update-docs", action="store_true", help="rewrite the docs block anyway")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the scenarios, write ``elastic_recovery.{json,md,png}``, print the checks."""
    args = build_parser().parse_args(argv)
    if args.from_json:
        doc = json.loads(args.from_json.read_text())
        summarise(doc)  # the judging may have changed since the run
        write_json(args.results_dir / "elastic_recovery.json", doc)
    else:
        runs_n = args.runs or (1 if args.quick else 3)
        shown = argv if argv is not None else sys.argv[1:]
        meta = {
            "command": " ".join(["python -m benchmarks.elastic_recovery", *shown]),
            "quick": args.quick,
            "kill_step": args.kill_step,
            "bench_kill_step": args.bench_kill_step,
            "after": args.after,
            "ram_every": args.ram_every,
            "checkpoint_every": args.checkpoint_every,
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "user": "root" if os.geteuid() == 0 else f"uid {os.geteuid()}",
            "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "git_commit": _git_commit(),
        }
        runs: list[dict[str, Any]] = []
        cache = Path(tempfile.mkdtemp(prefix="fastckpt-elastic-cache-", dir="/var/tmp"))
        try:
            for scenario in args.scenarios.split(","):
                for i in range(1 if scenario == "cut" else runs_n):
                    try:
                        r = run_once(args, scenario, i, cache)
                    except (RuntimeError, subprocess.TimeoutExpired, ValueError) as e:
                        print(f"{scenario} run {i} FAILED: {e}", file=sys.stderr, flush=True)
                        runs.append({"scenario": scenario, "run": i, "error": str(e)[-3000:]})
                        continue
                    runs.append(r)
                    print(
                        f"{scenario} run {i}: kill -> first step {fmt_s(r['kill_to_first_step_s'])}"
                        f" s (detect {fmt_s(r['detection_s'])}, Ray marked dead "
                        f"{fmt_s(r['ray_marked_dead_s'])}), {r['isolation']}",
                        flush=True,
                    )
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        footprint = None if args.no_footprint else measure_footprint(args)
        doc = {"meta": meta, "runs": runs, "footprint": footprint}
        summarise(doc)
        write_json(args.results_dir / "elastic_recovery.json", doc)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "elastic_recovery.md").write_text(render(doc))
    plot(doc, args.results_dir / "elastic_recovery.png")
    publish_docs(
        "elastic_recovery",
        doc,
        render=render,
        results_path=args.results_dir / "elastic_recovery.json",
        quick=bool(doc["meta"]["quick"]),
        force=args.update_docs,
    )
    rows = [
        [c["target"], f"{c['value']:.3g}", f"{c['bound']:g}", "PASS" if c["pass"] else "FAIL"]
        for c in doc["checks"]
    ]
    print(text_table(["check", "value", "bound", "result"], rows))
    return 0 if all(c["pass"] for c in doc["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
