"""Run the reliability scenarios with many trials and record the figures.

    python -m benchmarks.reliability                 # 50 trials per randomised scenario
    python -m benchmarks.reliability --trials 200    # more
    python -m benchmarks.reliability --out /tmp/r.json -- -k crash   # a subset (pytest args)
    python -m benchmarks.reliability --merge -- -k memory            # re-run some, keep the rest

It runs ``tests/reliability`` (the same tests CI runs, with the same assertions) with
``FASTCKPT_NIGHTLY_TRIALS=<trials>``: randomised tests scale their trial counts from it (crash
trials: exactly ``trials``; others a fixed fraction, see each test). Each test adds what it ran
and saw (trials, faults injected by kind, outcomes, wrong data) to a session recorder, which
is written to ``benchmarks/results/reliability.json``; this script then adds the run's
metadata. A failing test fails the run (exit status 1), and the figures recorded so far are
still written.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._common import markdown_table, publish_docs

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "results" / "reliability.json"


def _cell(v: Any) -> str:
    if isinstance(v, dict):
        return ", ".join(
            f"{k} {_cell(x)}" if not isinstance(x, dict) else f"{k}: ({_cell(x)})"
            for k, x in v.items()
        )
    if isinstance(v, list):
        return ", ".join(map(str, v))
    return str(v)


def render(doc: dict[str, Any]) -> str:
    """The recorded scenarios as markdown (what each means: docs/reliability.md)."""
    wrong = sum(
        int(s.get(k) or 0)
        for s in doc["scenarios"].values()
        for k in ("wrong_data", "lost_or_wrong_data")
    )
    rows = []
    for name, s in sorted(doc["scenarios"].items()):
        lost = s.get("wrong_data", s.get("lost_or_wrong_data"))
        rest = {
            k: v
            for k, v in s.items()
            if k not in ("wrong_data", "lost_or_wrong_data", "trials", "outcomes", "outcome")
        }
        rows.append(
            [
                name,
                _cell(s.get("trials", s.get("trials_each", s.get("cases", s.get("examples", ""))))),
                _cell(s.get("outcomes", s.get("outcome", ""))),
                "" if lost is None else lost,
                _cell(
                    {k: v for k, v in rest.items() if k not in ("trials_each", "cases", "examples")}
                ),
            ]
        )
    runs = [
        [r["command"], r.get("git_commit") or "", r["pytest_exit_status"], r["seconds"]]
        for r in doc.get("runs", [])
    ]
    machine = doc.get("machine", {})
    return (
        "\n\n".join(
            [
                "# Reliability scenarios",
                (
                    f"{len(doc['scenarios'])} scenarios recorded by `tests/reliability` "
                    f"({machine.get('cpus', '?')} CPUs, "
                    f"Python {machine.get('python', '?')}); data lost or wrong over every trial: "
                    f"**{wrong}**."
                ),
                markdown_table(
                    ["scenario", "trials / cases", "outcomes", "wrong data", "other figures"], rows
                ),
                "## Runs that recorded them (later ones re-ran some scenarios with `--merge`)",
                markdown_table(["command", "git", "pytest exit status", "s"], runs),
            ]
        )
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=50, help="FASTCKPT_NIGHTLY_TRIALS (default 50)")
    ap.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="results JSON (replaced unless --merge)"
    )
    ap.add_argument(
        "--merge", action="store_true", help="keep the other scenarios of an existing --out"
    )
    ap.add_argument(
        "--update-docs",
        action="store_true",
        help="rewrite the docs/benchmarks.md block even for another --out",
    )
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = ap.parse_args(argv)
    out: Path = args.out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    previous_runs = []
    if out.exists():
        if args.merge:
            old = json.loads(out.read_text())
            previous_runs = old.get("runs") or ([old["run"]] if "run" in old else [])
        else:
            out.unlink()
    env = dict(
        os.environ, FASTCKPT_NIGHTLY_TRIALS=str(args.trials), FASTCKPT_RELIABILITY_RESULTS=str(out)
    )
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "timeout=3600",
        "tests/reliability",
        *args.pytest_args,
    ]
    t0 = time.time()
    rc = subprocess.call(cmd, cwd=REPO, env=env)
    doc = json.loads(out.read_text()) if out.exists() else {"scenarios": {}}
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                cwd=REPO,
                capture_output=True,
                text=True,
                check=False,
            ).stdout.strip()
            or None
        )
    except OSError:
        commit = None
    doc.pop("run", None)
    doc["runs"] = [
        *previous_runs,
        {
            "command": " ".join(
                [
                    "python -m benchmarks.reliability",
                    f"--trials {args.trials}",
                    *(["--merge"] if args.merge else []),
                    *(["--", *args.pytest_args] if args.pytest_args else []),
                ]
            ),
            "nightly_trials": args.trials,
            "pytest_exit_status": rc,
            "seconds": round(time.time() - t0, 1),
            "git_commit": commit,
        },
    ]
    out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out} (pytest exit status {rc})")
    publish_docs("reliability", doc, render=render, results_path=out, force=args.update_docs)
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
