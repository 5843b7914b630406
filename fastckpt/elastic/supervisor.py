"""The elastic supervisor: launch one worker per host, watch, kill, relaunch, resize.

One *generation* is one set of worker processes sharing a fresh ``jax.distributed``
coordinator (process 0 of the generation, on a fresh loopback port). The supervisor runs
generations until a worker finishes, following these rules:

* **Watch.** Every ``poll_interval_s``: reap exits (``waitpid``), read heartbeat files.
  A generation fails when a worker exits non-zero (other than 75), its heartbeat is older
  than ``heartbeat_timeout_s`` (a frozen process), it sits in one train step longer than
  ``progress_timeout_s`` (a hung collective), or it has not reached training within
  ``startup_timeout_s``.
* **Kill promptly.** On failure every other worker gets SIGTERM, then SIGKILL after
  ``kill_grace_s``; nobody waits on a collective whose peer is dead.
* **Relaunch** on the hosts still available (a smaller mesh, same global batch); workers
  restore the latest committed checkpoint. More than ``max_restarts`` failures, or fewer
  than ``min_hosts`` hosts, end the run with an error.
* **Rejoin at a safe boundary.** When a host becomes available again, the supervisor
  writes a stop request; the workers agree on a step, checkpoint it, exit 75, and the
  supervisor relaunches on the larger host set. No step is lost.

Committed state is never at risk: the supervisor never touches the checkpoint root, and a
killed save leaves earlier committed steps intact (the core's commit protocol).

Host availability is simulated by :class:`ChaosEvent` s (the demo's SIGKILL of a host and
its return); in a real deployment it would come from the cluster manager.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Literal

from fastckpt.elastic._protocol import (
    EXIT_DONE,
    EXIT_STOPPED,
    RunPaths,
    WorkerEnv,
    append_jsonl,
    now,
    read_json,
)
from fastckpt.errors import ConfigError, FastckptError
from fastckpt.replicas import SECRET_ENV, new_peer_secret

__all__ = [
    "EXAMPLE_WORKER_PRELOAD",
    "ChaosEvent",
    "ElasticRunError",
    "GenerationResult",
    "Supervisor",
    "SupervisorOptions",
    "SupervisorResult",
    "default_worker_cmd",
]


class ElasticRunError(FastckptError):
    """The elastic run gave up: too many restarts or too few hosts."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChaosEvent:
    """A scheduled change of host availability, triggered when training reaches a step."""

    kind: Literal["kill", "rejoin"]
    """``kill``: SIGKILL the host's worker and wipe its local dir; ``rejoin``: the host is
    back, resize up at the next safe boundary."""
    host: int
    """Host id (0 .. num_hosts - 1)."""
    at_step: int
    """Trigger once some worker's heartbeat reports at least this step."""

    @classmethod
    def parse(cls, kind: Literal["kill", "rejoin"], spec: str) -> ChaosEvent:
        """From ``"HOST@STEP"`` (the CLI form)."""
        host, _, step = spec.partition("@")
        try:
            return cls(kind=kind, host=int(host), at_step=int(step))
        except ValueError:
            raise ConfigError(f"expected HOST@STEP, got {spec!r}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class SupervisorOptions:
    """Shape of the job and the failure-handling policy."""

    num_hosts: int = 4
    """Hosts (worker processes) at full size."""
    devices_per_host: int = 2
    """Virtual CPU devices per worker (``--xla_force_host_platform_device_count``)."""
    min_hosts: int = 1
    """Fewest hosts to train on; below it the run fails."""
    max_restarts: int = 3
    """Failed generations tolerated (resizes on rejoin do not count)."""
    heartbeat_timeout_s: float = 10.0
    """A heartbeat older than this fails the generation (the worker is frozen)."""
    progress_timeout_s: float = 60.0
    """Seconds one train step may take before the worker is considered hung."""
    startup_timeout_s: float = 180.0
    """Seconds from launch to the train phase (init + restore + compile)."""
    exit_timeout_s: float = 60.0
    """After one worker exits cleanly, how long the others get to follow."""
    kill_grace_s: float = 0.2
    """SIGTERM-to-SIGKILL grace when killing a generation. Kept short on purpose: the
    survivors are usually blocked in a collective with a dead peer, and ``jax.distributed``
    catches SIGTERM (its preemption notifier), so in practice SIGKILL ends them. Nothing is
    lost: an interrupted save never becomes a committed step."""
    poll_interval_s: float = 0.05
    """Watch-loop period (bounds the detection latency of a process death)."""
    events: tuple[ChaosEvent, ...] = ()
    """Scheduled host losses and returns."""
    warm_standby: bool = True
    """Keep one pre-started worker per host (interpreter up, ``preload`` imported) while a
    generation trains, and relaunch into those: a restart skips ``import jax``. The pool is
    topped up once every worker of a generation finished its first step."""
    preload: tuple[str, ...] = ("jax", "fastckpt.elastic.context")
    """Modules a standby imports before it knows its identity (must have no side effects)."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_hosts <= self.num_hosts:
            raise ConfigError(
                f"need 1 <= min_hosts <= num_hosts, got {self.min_hosts}, {self.num_hosts}"
            )
        if self.devices_per_host <= 0 or self.max_restarts < 0:
            raise ConfigError("devices_per_host must be > 0 and max_restarts >= 0")
        for ev in self.events:
            if not 0 <= ev.host < self.num_hosts:
                raise ConfigError(f"event host {ev.host} outside 0..{self.num_hosts - 1}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationResult:
    """What happened to one generation."""

    generation: int
    hosts: tuple[int, ...]
    outcome: Literal["done", "stopped", "failed"]
    reason: str
    t_launch: float
    t_end: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class SupervisorResult:
    """The whole run: every generation in order and the failures survived."""

    generations: tuple[GenerationResult, ...]
    restarts: int
    run_dir: Path


@dataclasses.dataclass
class _Worker:
    host: int
    proc: subprocess.Popen[bytes]
    log: IO[bytes]


@dataclasses.dataclass
class _Standby:
    proc: subprocess.Popen[bytes]
    log_path: Path
    log: IO[bytes]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _xla_flags(existing: str, devices: int) -> str:
    kept = [
        f for f in existing.split() if not f.startswith("--xla_force_host_platform_device_count")
    ]
    return " ".join([*kept, f"--xla_force_host_platform_device_count={devices}"])


class Supervisor:
    """Runs ``worker_cmd`` elastically. Single use: build, then :meth:`run` once.

    ``worker_cmd`` is the argv of one worker (e.g. ``[sys.executable, "-m",
    "fastckpt.elastic.worker", "--root", ...]``); the supervisor adds the identity through
    the environment (:class:`~fastckpt.elastic._protocol.WorkerEnv`). ``local_root`` holds
    one directory per host (``host<i>``), the host-local RAM tier's home, wiped when a
    host is killed. ``env`` (default ``os.environ``) is the base environment of the
    workers; ``on_event`` sees every timeline record as it is written.
    """

    def __init__(
        self,
        worker_cmd: Sequence[str],
        *,
        run_dir: str | Path,
        local_root: str | Path,
        options: SupervisorOptions | None = None,
        env: Mapping[str, str] | None = None,
        on_event: Callable[[dict[str, object]], None] | None = None,
    ) -> None:
        self.on_event = on_event
        self.worker_cmd = list(worker_cmd)
        self.paths = RunPaths(Path(run_dir))
        self.local_root = Path(local_root)
        self.options = options or SupervisorOptions()
        self.base_env = dict(os.environ if env is None else env)
        self._secret = new_peer_secret()
        self._available = set(range(self.options.num_hosts))
        self._pending_events = sorted(self.options.events, key=lambda e: e.at_step)
        self._pool: list[_Standby] = []
        self._standbys_started = 0
        self._standby_ok = runs_in_process(self.worker_cmd)
        """Whether standbys can run the worker command (else every launch spawns afresh)."""

    # ------------------------------------------------------------------ public
    def run(self) -> SupervisorResult:
        """Run generations until a worker finishes. Raises :class:`ElasticRunError` on giving up.

        The run directory starts empty of an earlier run's state (``RunPaths.reset``). Called
        from the main thread, SIGTERM and SIGHUP end the run like Ctrl-C: every worker and
        standby is killed before this returns (raising :class:`SupervisorTerminated`).
        """
        with _terminating_signals():
            return self._run()

    def _run(self) -> SupervisorResult:
        self.paths.reset()
        self.paths.make_dirs()
        self._secret = (
            new_peer_secret()
        )  # a new one per run, handed to workers in their environment
        for h in range(self.options.num_hosts):
            self._local_dir(h).mkdir(parents=True, exist_ok=True)
        try:
            return self._run_generations()
        finally:
            self._drain_pool()

    def _run_generations(self) -> SupervisorResult:
        results: list[GenerationResult] = []
        restarts = 0
        generation = 0
        while True:
            hosts = tuple(sorted(self._available))
            if len(hosts) < self.options.min_hosts:
                self._event(
                    "give_up", reason=f"{len(hosts)} hosts < min_hosts {self.options.min_hosts}"
                )
                raise ElasticRunError(
                    f"only {len(hosts)} hosts available, min_hosts={self.options.min_hosts}"
                )
            result = self._run_generation(generation, hosts)
            results.append(result)
            if result.outcome == "done":
                self._event("done", generation=generation)
                return SupervisorResult(
                    generations=tuple(results), restarts=restarts, run_dir=self.paths.root
                )
            if result.outcome == "failed":
                restarts += 1
                if restarts > self.options.max_restarts:
                    self._event(
                        "give_up",
                        reason=f"{restarts} failures > max_restarts {self.options.max_restarts}",
                    )
                    raise ElasticRunError(
                        f"generation {generation} failed ({result.reason}); restarts exhausted"
                    )
            generation += 1

    # ------------------------------------------------------------------ one generation
    def _run_generation(self, generation: int, hosts: tuple[int, ...]) -> GenerationResult:
        coordinator = f"127.0.0.1:{_free_port()}"
        t_launch = now()
        workers: list[_Worker] = []
        try:  # (spawning inside: a failure part-way kills those already started)
            for rank, host in enumerate(hosts):
                workers.append(self._spawn(generation, rank, host, hosts, coordinator, t_launch))
            self._event(
                "launch",
                generation=generation,
                hosts=list(hosts),
                coordinator=coordinator,
                t=t_launch,
            )
            outcome, reason = self._watch(generation, workers)
        finally:
            self._kill(workers)
            for w in workers:
                w.log.close()
        result = GenerationResult(
            generation=generation,
            hosts=hosts,
            outcome=outcome,
            reason=reason,
            t_launch=t_launch,
            t_end=now(),
        )
        self._event("generation_end", generation=generation, outcome=outcome, reason=reason)
        return result

    def _spawn(
        self,
        generation: int,
        rank: int,
        host: int,
        hosts: tuple[int, ...],
        coordinator: str,
        t_launch: float,
    ) -> _Worker:
        ident = WorkerEnv(
            coordinator=coordinator,
            num_processes=len(hosts),
            process_id=rank,
            host_id=host,
            generation=generation,
            run_dir=str(self.paths.root),
            local_dir=str(self._local_dir(host)),
            launch_time=t_launch,
            supervisor_pid=os.getpid(),
        )
        while self._pool:
            standby = self._pool.pop(0)
            try:
                assert standby.proc.stdin is not None
                standby.proc.stdin.write((json.dumps(ident.to_environ()) + "\n").encode())
                standby.proc.stdin.close()
            except (BrokenPipeError, OSError):  # it died while waiting: use the next one
                standby.proc.kill()
                standby.proc.wait()
                standby.log.close()
                continue
            worker = _Worker(host=host, proc=standby.proc, log=standby.log)
            try:
                link = self.paths.log(generation, host)
                link.unlink(missing_ok=True)
                link.symlink_to(standby.log_path.name)
            except OSError as e:  # only the log's second name: the worker runs all the same
                self._event("log_link_failed", generation=generation, host=host, error=repr(e))
            return worker
        env = self._child_env()
        env.update(ident.to_environ())
        log = open(self.paths.log(generation, host), "wb")
        proc = subprocess.Popen(
            self.worker_cmd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        return _Worker(host=host, proc=proc, log=log)

    def _child_env(self) -> dict[str, str]:
        env = dict(self.base_env)
        env["XLA_FLAGS"] = _xla_flags(env.get("XLA_FLAGS", ""), self.options.devices_per_host)
        env["JAX_PLATFORMS"] = "cpu"
        env[SECRET_ENV] = self._secret
        pkg_parent = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, env.get("PYTHONPATH", "")) if p)
        return env

    def _fill_pool(self) -> None:
        """Start standbys until there is one per host (for the next generation)."""
        cmd = [
            sys.executable,
            "-m",
            "fastckpt.elastic._standby",
            ",".join(self.options.preload),
            "--",
            *self.worker_cmd,
        ]
        while len(self._pool) < self.options.num_hosts:
            path = self.paths.root / "logs" / f"standby-{self._standbys_started}.log"
            self._standbys_started += 1
            log = open(path, "wb")
            proc = subprocess.Popen(
                cmd,
                env=self._child_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.PIPE,
                start_new_session=True,
            )
            self._pool.append(_Standby(proc=proc, log_path=path, log=log))

    def _drain_pool(self) -> None:
        for standby in self._pool:
            _signal_group(standby.proc.pid, signal.SIGKILL)
            standby.proc.wait()
            standby.log.close()
        self._pool.clear()

    def _watch(
        self, generation: int, workers: list[_Worker]
    ) -> tuple[Literal["done", "stopped", "failed"], str]:
        opts = self.options
        t_start = now()
        progress: dict[int, tuple[int, float]] = {}
        first_train_step: dict[int, int] = {}
        first_exit: float | None = None
        clean: Literal["done", "stopped"] | None = None
        stop_requested = False
        while True:
            time.sleep(opts.poll_interval_s)
            t = now()
            running = []
            for w in workers:
                rc = w.proc.poll()
                if rc is None:
                    running.append(w)
                elif rc == EXIT_STOPPED and not (
                    stop_requested or self.paths.stop_request(generation).exists()
                ):
                    self._event(
                        "failure_detected",
                        generation=generation,
                        host=w.host,
                        rc=rc,
                        reason="unrequested_stop",
                    )
                    return (
                        "failed",
                        f"host {w.host} exited {rc} (stopped) though no stop was requested",
                    )
                elif rc in (EXIT_DONE, EXIT_STOPPED):
                    first_exit = first_exit or t
                    clean = clean or ("done" if rc == EXIT_DONE else "stopped")
                else:
                    self._event(
                        "failure_detected",
                        generation=generation,
                        host=w.host,
                        rc=rc,
                        reason="signal" if rc < 0 else "exit",
                    )
                    return "failed", f"host {w.host} exited with {rc}"
            if not running:
                assert clean is not None
                return clean, "all workers exited cleanly"
            if first_exit is not None and t - first_exit > opts.exit_timeout_s:
                self._event(
                    "failure_detected",
                    generation=generation,
                    host=running[0].host,
                    reason="exit_timeout",
                )
                return "failed", "workers did not exit after the first clean exit"
            max_step = 0
            stepped = 0  # workers past their first step of this generation
            for w in running:
                hb = read_json(self.paths.heartbeat(generation, w.host))
                if hb is not None and hb.get("phase") == "train":
                    first = first_train_step.setdefault(w.host, int(hb["step"]))
                    stepped += int(hb["step"]) > first
                problem = self._check_heartbeat(hb, t, t_start, progress, w.host)
                if problem:
                    self._event(
                        "failure_detected", generation=generation, host=w.host, reason=problem
                    )
                    return "failed", f"host {w.host}: {problem}"
                if hb is not None:
                    max_step = max(max_step, int(hb["step"]))
            if (
                opts.warm_standby
                and self._standby_ok
                and first_exit is None
                and stepped == len(workers)
            ):
                # Only now: standbys importing jax during the restore, the compile or the
                # first step would slow this restart down. Tops up what the relaunch used.
                self._fill_pool()
            if first_exit is None:
                stop_requested = self._fire_events(generation, workers, max_step, stop_requested)

    def _check_heartbeat(
        self,
        hb: dict[str, object] | None,
        t: float,
        t_start: float,
        progress: dict[int, tuple[int, float]],
        host: int,
    ) -> str | None:
        opts = self.options
        if hb is None:
            return (
                "no heartbeat after startup_timeout_s"
                if t - t_start > opts.startup_timeout_s
                else None
            )
        if t - float(hb["t"]) > opts.heartbeat_timeout_s:  # type: ignore[arg-type]
            return f"heartbeat stale for {t - float(hb['t']):.1f}s"  # type: ignore[arg-type]
        phase, step = str(hb["phase"]), int(hb["step"])  # type: ignore[call-overload]
        if phase in ("launch", "init", "restore") and t - t_start > opts.startup_timeout_s:
            return f"still in phase {phase!r} after {t - t_start:.0f}s"
        if phase == "train":
            last = progress.get(host)
            if last is None or last[0] != step:
                progress[host] = (step, t)
            elif t - last[1] > opts.progress_timeout_s:
                return f"no progress past step {step} for {t - last[1]:.0f}s"
        return None

    def _fire_events(
        self, generation: int, workers: list[_Worker], max_step: int, stop_requested: bool
    ) -> bool:
        while self._pending_events and self._pending_events[0].at_step <= max_step:
            ev = self._pending_events.pop(0)
            if ev.kind == "kill":
                victim = next(
                    (w for w in workers if w.host == ev.host and w.proc.poll() is None), None
                )
                if victim is None:
                    continue
                os.kill(victim.proc.pid, signal.SIGKILL)
                self._event(
                    "kill", generation=generation, host=ev.host, step=max_step, pid=victim.proc.pid
                )
                shutil.rmtree(self._local_dir(ev.host), ignore_errors=True)
                self._local_dir(ev.host).mkdir(parents=True)
                self._available.discard(ev.host)
            else:
                if ev.host in self._available:
                    continue
                self._available.add(ev.host)
                self._event("host_back", generation=generation, host=ev.host, step=max_step)
                if not stop_requested:
                    self.paths.stop_request(generation).touch()
                    self._event("stop_requested", generation=generation, step=max_step)
                    stop_requested = True
        return stop_requested

    def _kill(self, workers: list[_Worker]) -> None:
        alive = [w for w in workers if w.proc.poll() is None]
        if not alive:
            return
        for w in alive:
            _signal_group(w.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.options.kill_grace_s
        while time.monotonic() < deadline and any(w.proc.poll() is None for w in alive):
            time.sleep(0.01)
        for w in alive:
            if w.proc.poll() is None:
                _signal_group(w.proc.pid, signal.SIGKILL)
        for w in alive:
            w.proc.wait()
        self._event("killed_rest", hosts=[w.host for w in alive])

    # ------------------------------------------------------------------ helpers
    def _local_dir(self, host: int) -> Path:
        return self.local_root / f"host{host}"

    def _event(self, name: str, **fields: object) -> None:
        record = {"t": now(), "event": name, **fields}
        append_jsonl(self.paths.events, record)
        if self.on_event is not None:
            try:
                self.on_event(record)
            except (
                Exception
            ) as e:  # e.g. printing to a closed pipe: the run must go on (or clean up)
                self.on_event = None
                append_jsonl(
                    self.paths.events, {"t": now(), "event": "on_event_failed", "error": repr(e)}
                )


class SupervisorTerminated(BaseException):
    """SIGTERM or SIGHUP reached the supervisor: the run ends (workers and standbys killed)."""


@contextlib.contextmanager
def _terminating_signals() -> Iterator[None]:
    """In the main thread: SIGTERM and SIGHUP raise :class:`SupervisorTerminated` (so that the
    cleanup in ``finally`` blocks runs, as for Ctrl-C); the previous handlers come back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise SupervisorTerminated(f"received {signal.Signals(signum).name}")

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def runs_in_process(cmd: Sequence[str]) -> bool:
    """Whether a standby can run the worker command ``cmd`` in-process: ``python -m module
    args`` or ``python script args`` (an interpreter without options of its own). Anything
    else (``python -u ...``, ``env python ...``, a wrapper script) must be spawned afresh."""
    cmd = list(cmd)
    if not cmd or not (cmd[0] == sys.executable or os.path.basename(cmd[0]).startswith("python")):
        return False
    rest = cmd[1:]
    return bool(rest) and ((rest[0] == "-m" and len(rest) >= 2) or not rest[0].startswith("-"))


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


EXAMPLE_WORKER_PRELOAD = ("jax", "optax", "fastckpt.elastic.worker")
"""What a standby of the example worker imports before activation."""


def default_worker_cmd(worker_args: Sequence[str]) -> list[str]:
    """argv of the example worker (``python -m fastckpt.elastic.worker ...``)."""
    return [sys.executable, "-m", "fastckpt.elastic.worker", *worker_args]
