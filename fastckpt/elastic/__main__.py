"""``python -m fastckpt.elastic {run,demo}``: the elastic supervisor's command line.

``run`` supervises any worker command (everything after ``--``)::

    python -m fastckpt.elastic run --hosts 4 --run-dir /tmp/run -- \\
        python -m fastckpt.elastic.worker --root /tmp/ckpt --steps 500

``demo`` runs the host-loss scenario of :mod:`fastckpt.elastic.demo`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence

__all__ = ["main"]


def _run(argv: Sequence[str]) -> int:
    from fastckpt.elastic.supervisor import (
        EXAMPLE_WORKER_PRELOAD,
        ChaosEvent,
        ElasticRunError,
        Supervisor,
        SupervisorOptions,
        SupervisorTerminated,
    )
    from fastckpt.elastic.timeline import summarize

    argv = list(argv)
    if "--" not in argv:
        print("usage: python -m fastckpt.elastic run [options] -- WORKER_CMD ...", file=sys.stderr)
        return 2
    split = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m fastckpt.elastic run")
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--devices-per-host", type=int, default=2)
    p.add_argument("--min-hosts", type=int, default=1)
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--heartbeat-timeout-s", type=float, default=10.0)
    p.add_argument("--progress-timeout-s", type=float, default=60.0)
    p.add_argument("--startup-timeout-s", type=float, default=180.0)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--local-root", default=None)
    p.add_argument(
        "--kill", action="append", default=[], metavar="HOST@STEP", help="SIGKILL a host at a step"
    )
    p.add_argument(
        "--rejoin", action="append", default=[], metavar="HOST@STEP", help="bring a host back"
    )
    p.add_argument("--no-standby", action="store_true", help="no warm standby workers")
    p.add_argument(
        "--preload",
        default=None,
        help="comma-separated modules standbys import early (default: jax + the example worker's)",
    )
    args = p.parse_args(argv[:split])
    worker = argv[split + 1 :]
    if not worker:
        p.error("no worker command after --")
    events = tuple(ChaosEvent.parse("kill", s) for s in args.kill) + tuple(
        ChaosEvent.parse("rejoin", s) for s in args.rejoin
    )
    options = SupervisorOptions(
        num_hosts=args.hosts,
        devices_per_host=args.devices_per_host,
        min_hosts=args.min_hosts,
        max_restarts=args.max_restarts,
        heartbeat_timeout_s=args.heartbeat_timeout_s,
        progress_timeout_s=args.progress_timeout_s,
        startup_timeout_s=args.startup_timeout_s,
        events=events,
        warm_standby=not args.no_standby,
        preload=tuple(filter(None, args.preload.split(",")))
        if args.preload is not None
        else EXAMPLE_WORKER_PRELOAD,
    )
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="fastckpt-run-")
    # the hosts' RAM tiers: tmpfs (memory until removed), removed after the run unless given
    local_root = args.local_root or tempfile.mkdtemp(
        prefix="fastckpt-local-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    )
    sup = Supervisor(
        worker,
        run_dir=run_dir,
        local_root=local_root,
        options=options,
        on_event=lambda ev: print(json.dumps(ev), flush=True),
    )
    try:
        sup.run()
    except ElasticRunError as e:
        print(f"elastic run failed: {e}", file=sys.stderr)
        return 1
    except SupervisorTerminated as e:
        print(f"elastic run terminated: {e}", file=sys.stderr)
        return 143
    finally:
        if args.local_root is None:
            shutil.rmtree(local_root, ignore_errors=True)
    print(json.dumps(summarize(run_dir)), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch ``run`` / ``demo``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("run", "demo"):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "demo":
        from fastckpt.elastic.demo import main as demo_main

        return demo_main(argv[1:])
    return _run(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
