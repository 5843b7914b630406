"""Run a function in N real JAX processes on this machine, like a small multi-host job.

Each process is a fresh ``python -m fastckpt_examples.cluster.multiprocess`` child with ``M``
virtual CPU devices (``--xla_force_host_platform_device_count``), gloo CPU collectives, and
``jax.distributed.initialize`` against a coordinator on a free loopback port. It imports
the target function, calls it with the given keyword arguments and writes what it returns
(JSON) back to the parent. Example::

    outcomes = run_processes(
        "tests/multiprocess/workers.py:save_state",   # or "package.module:function"
        num_processes=4, devices_per_process=2, kwargs={"root": str(tmp_path)}, timeout_s=60,
    )
    values = [o.value for o in outcomes]

On simulated hosts (:mod:`fastckpt_examples.cluster.hosts`), ``hosts=`` puts process ``i`` on the
``i``-th host: the coordinator listens on the first host's address, gloo talks across the
virtual switch, and the job's files live under the hosts' shared directory (each host's
``/tmp`` is its own)::

    with SimulatedHosts(2) as hosts:
        outcomes = run_processes(target, num_processes=2, devices_per_process=2, hosts=hosts)
        hosts[1].kill()
        run_processes(target, num_processes=1, devices_per_process=2, hosts=[hosts[0]])

Guarantees: nothing outlives the call (every child is killed at the timeout, and the
call then raises); with ``check=True`` any child that exits non-zero or raises makes
the call raise :class:`MultiprocessError` carrying every child's error and stderr tail.
With ``check=False`` (fault-injection tests: a child that kills itself) the outcomes are
returned for the caller to judge.

Children skip ``jax.distributed.shutdown()`` (its barrier would wait for dead peers) and
leave with ``os._exit``. Process 0 hosts the coordination service: if it left while a peer
is still connected, that peer's coordination agent would abort it, so process 0 waits
until the parent has seen every other child exit (or ``exit_wait_s`` passed).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastckpt_examples.cluster._hosts_procs import kill_group

if TYPE_CHECKING:
    from fastckpt_examples.cluster.hosts import Host, SimulatedHosts

__all__ = ["MultiprocessError", "ProcessOutcome", "free_port", "run_processes"]

_TAIL = 4000


class MultiprocessError(AssertionError):
    """A child process failed, raised or timed out (the message holds their stderr)."""


@dataclasses.dataclass(frozen=True)
class ProcessOutcome:
    """What one child did."""

    process_id: int
    returncode: int | None
    """Exit status; negative for a signal (``-9``: SIGKILL); None if killed at the timeout."""
    value: Any = None
    """The function's JSON return value (None if it raised or died)."""
    error: dict[str, str] | None = None
    """``{"type", "message", "traceback"}`` if the function raised."""
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Exited 0 with a value."""
        return self.returncode == 0 and self.error is None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_devices_env(base: Mapping[str, str], devices: int) -> dict[str, str]:
    """``base`` with JAX on ``devices`` virtual CPU devices (any other ``XLA_FLAGS`` kept)."""
    env = dict(base)
    flag = "--xla_force_host_platform_device_count"
    kept = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(flag + "=")]
    env["XLA_FLAGS"] = " ".join([*kept, f"{flag}={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("JAX_NUM_CPU_DEVICES", None)
    return env


def _child_env(devices: int, extra: Mapping[str, str] | None) -> dict[str, str]:
    """The children's environment; they import this module (``-m``) from where the caller did."""
    env = cpu_devices_env(os.environ, devices)
    env["PYTHONUNBUFFERED"] = "1"
    here = str(Path(__file__).resolve().parents[2])  # the directory holding fastckpt_examples
    old = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([here, *old]))
    env.update(extra or {})
    return env


def _tail(path: Path) -> str:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return ""
    return data[-_TAIL:].decode(errors="replace")


def _report(outcomes: Sequence[ProcessOutcome], why: str) -> str:
    lines = [why]
    for o in outcomes:
        lines.append(
            f"--- process {o.process_id}: returncode={o.returncode} after {o.seconds:.1f}s"
        )
        if o.error:
            lines.append(f"raised {o.error['type']}: {o.error['message']}\n{o.error['traceback']}")
        if o.stderr.strip():
            lines.append("stderr (tail):\n" + o.stderr.rstrip())
    return "\n".join(lines)


def run_processes(
    target: str,
    *,
    num_processes: int,
    devices_per_process: int,
    kwargs: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    timeout_s: float = 60.0,
    check: bool = True,
    init_timeout_s: int = 30,
    exit_wait_s: float = 20.0,
    fail_fast_s: float = 10.0,
    env: Mapping[str, str] | None = None,
    hosts: SimulatedHosts | Sequence[Host] | None = None,
) -> list[ProcessOutcome]:
    """Run ``target`` (``"pkg.mod:fn"`` or ``"path/file.py:fn"``) in ``num_processes`` processes.

    Args:
        target: The function to call as ``fn(**kwargs)`` in every process (after
            ``jax.distributed.initialize``); it returns JSON-serialisable data.
        num_processes: Number of processes (``jax.process_count()``).
        devices_per_process: Virtual CPU devices per process.
        kwargs: Keyword arguments for every process, or one mapping per process.
        timeout_s: Wall-clock limit for the whole job; children still running then are
            killed and :class:`MultiprocessError` is raised, whatever ``check`` says.
        check: Raise :class:`MultiprocessError` unless every child succeeded.
        init_timeout_s: ``jax.distributed.initialize`` timeout.
        exit_wait_s: How long process 0 keeps the coordinator up for the others at exit.
        fail_fast_s: With ``check``, once a child has failed, how long the others get to
            finish before they are killed.
        env: Extra environment variables for the children.
        hosts: Run process ``i`` inside ``hosts[i]`` (a cluster, or a list of its hosts, e.g.
            the survivors of a lost host); there must be at least ``num_processes``, all up
            and of one cluster. Children start in the caller's working directory, which must
            not be under ``/tmp`` or ``/dev/shm`` (those are each host's own). None: on this
            machine's loopback.

    Returns:
        One :class:`ProcessOutcome` per process, in process order.
    """
    if num_processes < 1 or devices_per_process < 1:
        raise ValueError("num_processes and devices_per_process must be >= 1")
    per_process = (
        [dict(kwargs or {})] * num_processes
        if not isinstance(kwargs, Sequence)
        else [dict(k) for k in kwargs]
    )
    if len(per_process) != num_processes:
        raise ValueError(f"{len(per_process)} kwargs mappings for {num_processes} processes")
    placed = None if hosts is None else list(hosts)[:num_processes]
    if placed is None:
        coordinator = f"127.0.0.1:{free_port()}"
        work_parent = None
    else:
        if len(placed) < num_processes:
            raise ValueError(f"{len(placed)} hosts for {num_processes} processes")
        if len({h.shared_dir for h in placed}) != 1:
            raise ValueError("the hosts must belong to one cluster")
        coordinator = f"{placed[0].address}:{placed[0].free_port()}"
        work_parent = str(placed[0].shared_dir)
    child_env = _child_env(devices_per_process, env)
    with tempfile.TemporaryDirectory(prefix="fastckpt-mp-", dir=work_parent) as tmp:
        work = Path(tmp)
        procs: list[subprocess.Popen[bytes]] = []
        files = []
        t0 = time.monotonic()
        try:
            for i in range(num_processes):
                spec = {
                    "target": target,
                    "process_id": i,
                    "num_processes": num_processes,
                    "coordinator": coordinator,
                    "kwargs": per_process[i],
                    "result": str(work / f"result{i}.json"),
                    "init_timeout_s": init_timeout_s,
                    "exit_wait_s": exit_wait_s,
                    "cwd": os.getcwd(),
                    "release": str(work / "release"),
                }
                spec_path = work / f"spec{i}.json"
                spec_path.write_text(json.dumps(spec))
                out, err = open(work / f"out{i}", "wb"), open(work / f"err{i}", "wb")
                files += [out, err]
                argv = [
                    sys.executable,
                    "-m",
                    "fastckpt_examples.cluster.multiprocess",
                    str(spec_path),
                ]
                popen = subprocess.Popen if placed is None else placed[i].popen
                procs.append(
                    popen(
                        argv,
                        stdout=out,
                        stderr=err,
                        stdin=subprocess.DEVNULL,
                        env=child_env,
                        start_new_session=True,
                    )
                )
            ended: dict[int, float] = {}
            timed_out = False
            kill_at: float | None = None
            released = False
            while len(ended) < num_processes:
                now = time.monotonic()
                for i, p in enumerate(procs):
                    if i not in ended and p.poll() is not None:
                        ended[i] = now - t0
                        if check and p.returncode != 0 and kill_at is None:
                            kill_at = now + fail_fast_s
                if len(ended) == num_processes:
                    break
                if not released and all(i in ended for i in range(1, num_processes)):
                    (work / "release").touch()  # process 0 may now take the coordinator down
                    released = True
                if now - t0 > timeout_s or (kill_at is not None and now > kill_at):
                    timed_out = now - t0 > timeout_s
                    break
                time.sleep(0.02)
        finally:
            for p in procs:
                if p.poll() is None:
                    kill_group(p)
            for f in files:
                f.close()
        outcomes = []
        for i, p in enumerate(procs):
            result_path = work / f"result{i}.json"
            value = error = None
            if result_path.exists():
                doc = json.loads(result_path.read_text())
                value, error = doc.get("value"), doc.get("error")
            rc = p.returncode if i in ended else None
            outcomes.append(
                ProcessOutcome(
                    i,
                    rc,
                    value,
                    error,
                    _tail(work / f"out{i}"),
                    _tail(work / f"err{i}"),
                    ended.get(i, time.monotonic() - t0),
                )
            )
    if timed_out:
        raise MultiprocessError(
            _report(outcomes, f"{target}: timed out after {timeout_s:.0f}s; killed")
        )
    if check and not all(o.ok for o in outcomes):
        raise MultiprocessError(_report(outcomes, f"{target}: a process failed"))
    return outcomes


# ---------------------------------------------------------------------------- child side


def _load(target: str) -> Callable[..., Any]:
    where, _, name = target.rpartition(":")
    if not where or not name:
        raise ValueError(f"target must be 'module:function' or 'file.py:function', got {target!r}")
    if where.endswith(".py"):
        path = Path(where).resolve()
        spec = importlib.util.spec_from_file_location(f"_fastckpt_mp_{path.stem}", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)  # type: ignore[no-any-return]


def _write_result(path: str, doc: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def _child_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    os.chdir(spec["cwd"])
    pid, n = spec["process_id"], spec["num_processes"]
    code = 1
    try:
        import jax

        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=spec["coordinator"],
            num_processes=n,
            process_id=pid,
            initialization_timeout=spec["init_timeout_s"],
        )
        fn = _load(spec["target"])
        try:
            value = fn(**spec["kwargs"])
            doc: dict[str, Any] = {"value": value}
            code = 0
        except BaseException as e:  # reported to the parent
            doc = {
                "error": {
                    "type": type(e).__name__,
                    "message": str(e),
                    "traceback": traceback.format_exc(),
                }
            }
            traceback.print_exc()
        _write_result(spec["result"], doc)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        if pid == 0 and n > 1:
            deadline = time.monotonic() + spec["exit_wait_s"]
            while not os.path.exists(spec["release"]) and time.monotonic() < deadline:
                time.sleep(0.01)
        os._exit(code)


if __name__ == "__main__":
    _child_main(sys.argv[1])
