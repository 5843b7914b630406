"""The supervisor <-> worker contract: environment, exit codes, files in the run directory.

A worker learns who it is from environment variables the supervisor sets (read once, at
the worker's entry point, by :meth:`WorkerEnv.from_environ`), and talks back through small
files in the run directory, all written atomically (temp file + ``os.replace``)::

    <run_dir>/
      events.jsonl              supervisor timeline (one JSON object a line)
      metrics.jsonl             per-step metrics, appended by process 0 of each generation
      hb/g<gen>-h<host>.json    heartbeat: {"t", "step", "phase", "pid"}
      report/g<gen>-h<host>.json  phase timestamps + restore stats of one worker
      control/stop-g<gen>       exists => stop at the next agreed step, checkpoint, exit 75
      logs/g<gen>-h<host>.log   the worker's stdout + stderr

Exit codes: 0 done, :data:`EXIT_STOPPED` stopped at a checkpoint on request (the supervisor
relaunches with a new host set), anything else is a failure (:data:`EXIT_ORPHANED`: the
worker noticed its supervisor died and ended itself).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "ENV_PREFIX",
    "EXIT_DONE",
    "EXIT_ORPHANED",
    "EXIT_STOPPED",
    "RunPaths",
    "WorkerEnv",
    "append_jsonl",
    "read_json",
    "read_jsonl",
    "write_json_atomic",
]

ENV_PREFIX = "FASTCKPT_ELASTIC_"
EXIT_DONE = 0
"""The worker reached the final step."""
EXIT_STOPPED = 75
"""The worker stopped at a checkpoint because the supervisor asked (``EX_TEMPFAIL``)."""
EXIT_ORPHANED = 70
"""The worker's parent (the supervisor) died; the heartbeat thread ends the process."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerEnv:
    """Identity of one worker process in one generation, as the supervisor assigned it."""

    coordinator: str
    """``host:port`` of the ``jax.distributed`` coordinator of this generation."""
    num_processes: int
    """Processes in this generation."""
    process_id: int
    """This process's rank in this generation (0 hosts the coordinator)."""
    host_id: int
    """Stable host identity across generations (names the host's local directory)."""
    generation: int
    """Launch counter; every relaunch (failure or resize) increments it."""
    run_dir: str
    """The supervisor's run directory (heartbeats, reports, control files)."""
    local_dir: str
    """Host-local scratch (the RAM tier's home); wiped when the host is lost."""
    launch_time: float
    """``time.time()`` when the supervisor spawned this process."""
    supervisor_pid: int = 0
    """The supervisor's pid (0: none, e.g. standalone): a worker whose parent is another
    process (the supervisor died, the worker was re-parented) exits with EXIT_ORPHANED."""

    def to_environ(self) -> dict[str, str]:
        """The environment variables that encode this identity."""
        return {
            ENV_PREFIX + f.name.upper(): str(getattr(self, f.name))
            for f in dataclasses.fields(self)
        }

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> WorkerEnv:
        """Parse :meth:`to_environ` output. Raises ``KeyError`` naming a missing variable."""
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if ENV_PREFIX + f.name.upper() not in environ and f.default is not dataclasses.MISSING:
                continue
            raw = environ[ENV_PREFIX + f.name.upper()]
            kwargs[f.name] = (
                int(raw) if f.type == "int" else float(raw) if f.type == "float" else raw
            )
        return cls(**kwargs)

    @classmethod
    def standalone(cls, run_dir: str, *, local_dir: str | None = None) -> WorkerEnv:
        """A one-process identity for running a worker without a supervisor (debugging)."""
        return cls(
            coordinator="",
            num_processes=1,
            process_id=0,
            host_id=0,
            generation=0,
            run_dir=run_dir,
            local_dir=local_dir or os.path.join(run_dir, "local"),
            launch_time=now(),
        )

    @property
    def paths(self) -> RunPaths:
        """Paths in this worker's run directory."""
        return RunPaths(Path(self.run_dir))


@dataclasses.dataclass(frozen=True)
class RunPaths:
    """File names inside a run directory (see the module docstring)."""

    root: Path

    @property
    def events(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    def heartbeat(self, generation: int, host: int) -> Path:
        return self.root / "hb" / f"g{generation}-h{host}.json"

    def report(self, generation: int, host: int) -> Path:
        return self.root / "report" / f"g{generation}-h{host}.json"

    def stop_request(self, generation: int) -> Path:
        return self.root / "control" / f"stop-g{generation}"

    def log(self, generation: int, host: int) -> Path:
        return self.root / "logs" / f"g{generation}-h{host}.log"

    def make_dirs(self) -> None:
        for sub in ("hb", "report", "control", "logs"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def reset(self) -> None:
        """Remove an earlier run's state (heartbeats, reports, stop requests, logs, events,
        metrics): generation numbers restart at 0, so a new run would read them as
        its own. The checkpoints live elsewhere and are kept."""
        for sub in ("hb", "report", "control", "logs"):
            shutil.rmtree(self.root / sub, ignore_errors=True)
        for f in (self.events, self.metrics):
            with contextlib.suppress(FileNotFoundError):
                f.unlink()


def write_json_atomic(path: Path, obj: object) -> None:
    """Write ``obj`` as JSON to ``path`` so that readers never see a partial file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None if it does not exist (yet) or is not valid JSON."""
    try:
        return dict(json.loads(path.read_text()))
    except (FileNotFoundError, ValueError):
        return None


def append_jsonl(path: Path, obj: object) -> None:
    """Append one JSON line (a single ``write`` on an ``O_APPEND`` fd, so lines never
    interleave)."""
    line = (json.dumps(obj) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """All complete JSON lines of ``path`` (empty if missing; a torn last line is skipped)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(dict(json.loads(line)))
        except ValueError:
            continue
    return out


def now() -> float:
    """Wall-clock seconds; comparable across the processes of one machine."""
    return time.time()
