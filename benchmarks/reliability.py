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

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "results" / "reliability.json"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=50, help="FASTCKPT_NIGHTLY_TRIALS (default 50)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON (replaced unless --merge)")
    ap.add_argument("--merge", action="store_true", help="keep the other scenarios of an existing --out")
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
    env = dict(os.environ, FASTCKPT_NIGHTLY_TRIALS=str(args.trials), FASTCKPT_RELIABILITY_RESULTS=str(out))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "timeout=3600",
           "tests/reliability", *args.pytest_args]
    t0 = time.time()
    rc = subprocess.call(cmd, cwd=REPO, env=env)
    doc = json.loads(out.read_text()) if out.exists() else {"scenarios": {}}
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, check=False).stdout.strip() or None
    except OSError:
        commit = None
    doc.pop("run", None)
    doc["runs"] = [*previous_runs, {
        "command": " ".join(["python -m benchmarks.reliability", f"--trials {args.trials}",
                             *(["--merge"] if args.merge else []), *(["--", *args.pytest_args] if args.pytest_args else [])]),
        "nightly_trials": args.trials,
        "pytest_exit_status": rc,
        "seconds": round(time.time() - t0, 1),
        "git_commit": commit,
    }]
    out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out} (pytest exit status {rc})")
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
