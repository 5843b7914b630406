"""Warm standby launcher: import the heavy modules now, become a worker later.

``python -m fastckpt.elastic._standby MODULES -- WORKER_ARGV...`` imports ``MODULES``
(comma-separated, e.g. ``jax,fastckpt.elastic.context``), then blocks reading one JSON line
from stdin: the environment variables that make it a worker (its
:class:`~fastckpt.elastic._protocol.WorkerEnv`). It applies them and runs the worker
command in-process, as ``python`` would have: ``-m module args`` through
``runpy.run_module``, ``script.py args`` through ``runpy.run_path``. The worker's exit code
is this process's exit code.

The supervisor keeps one standby per host ready while a generation trains, so a relaunch
skips interpreter start-up and ``import jax`` (seconds on a loaded machine). Nothing that
depends on the identity happens before activation: ``jax.distributed`` and the XLA backend
are initialised by the worker itself. EOF on stdin (the supervisor went away) exits 0.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str]) -> int:
    """Preload, wait for the identity, run the worker. Returns the worker's exit code."""
    argv = list(argv)
    if "--" not in argv or argv.index("--") != 1 or len(argv) < 3:
        print(
            "usage: python -m fastckpt.elastic._standby MODULES -- python [-m mod | script] args",
            file=sys.stderr,
        )
        return 2
    for name in filter(None, argv[0].split(",")):
        importlib.import_module(name)
    line = sys.stdin.readline()
    if not line:
        return 0
    os.environ.update({str(k): str(v) for k, v in json.loads(line).items()})
    cmd = argv[2:]
    if cmd[0] == sys.executable or os.path.basename(cmd[0]).startswith("python"):
        cmd = cmd[1:]
    try:
        if cmd[0] == "-m":
            sys.argv = [cmd[1], *cmd[2:]]
            # The worker runs as __main__ either way; a preloaded copy of its module left in
            # sys.modules only makes runpy warn (what that copy imported stays loaded).
            sys.modules.pop(cmd[1], None)
            runpy.run_module(cmd[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(cmd)
            runpy.run_path(cmd[0], run_name="__main__")
    except SystemExit as e:
        code = e.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
