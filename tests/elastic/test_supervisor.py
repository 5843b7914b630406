"""Supervisor policy with jax-free fake workers: crash -> relaunch, frozen or stalled
workers -> timeouts, host loss -> smaller generation, host back -> stop and resize, limits."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fastckpt.elastic import (
    ChaosEvent,
    ElasticRunError,
    Supervisor,
    SupervisorOptions,
    SupervisorResult,
)
from fastckpt.elastic._protocol import read_jsonl
from fastckpt.errors import ConfigError

FAKE = str(Path(__file__).with_name("_fake_worker.py"))
FAST = {
    "poll_interval_s": 0.02,
    "heartbeat_timeout_s": 1.0,
    "progress_timeout_s": 1.0,
    "startup_timeout_s": 20.0,
    "warm_standby": False,
}


def supervise(
    tmp_path: Path, spec: dict[str, Any], **options: Any
) -> tuple[Supervisor, SupervisorResult | None]:
    opts = SupervisorOptions(**{"num_hosts": 3, **FAST, **options})
    sup = Supervisor(
        [sys.executable, FAKE, json.dumps(spec)],
        run_dir=tmp_path / "run",
        local_root=tmp_path / "local",
        options=opts,
    )
    return sup, sup.run()


def events(tmp_path: Path, name: str) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["event"] == name]


def shape(result: SupervisorResult) -> list[tuple[tuple[int, ...], str]]:
    return [(g.hosts, g.outcome) for g in result.generations]


def test_clean_run_is_one_generation(tmp_path: Path) -> None:
    _, result = supervise(tmp_path, {"total": 5})
    assert result is not None
    assert shape(result) == [((0, 1, 2), "done")]
    assert result.restarts == 0


def test_crash_kills_the_rest_and_relaunches(tmp_path: Path) -> None:
    spec = {"total": 12, "faults": [{"kind": "crash", "host": 1, "step": 5, "generation": 0}]}
    _, result = supervise(tmp_path, spec)
    assert result is not None
    assert shape(result) == [((0, 1, 2), "failed"), ((0, 1, 2), "done")]
    assert result.restarts == 1
    [fail] = events(tmp_path, "failure_detected")
    assert (fail["host"], fail["rc"]) == (1, 3)
    assert sorted(events(tmp_path, "killed_rest")[0]["hosts"]) == [0, 2]
    assert int((tmp_path / "run" / "fake_ckpt").read_text()) == 12


def test_relaunch_uses_warm_standbys(tmp_path: Path) -> None:
    spec = {
        "total": 60,
        "step_s": 0.02,
        "faults": [{"kind": "crash", "host": 1, "step": 20, "generation": 0}],
    }
    # standbys import jax while the fake workers run: generous timeouts on a loaded machine
    _, result = supervise(
        tmp_path,
        spec,
        num_hosts=2,
        warm_standby=True,
        preload=("json",),
        heartbeat_timeout_s=15.0,
        progress_timeout_s=15.0,
    )
    assert result is not None
    assert shape(result) == [((0, 1), "failed"), ((0, 1), "done")]
    logs = tmp_path / "run" / "logs"
    # generation 1 ran in processes started (and warmed up) during generation 0
    assert (logs / "g1-h0.log").is_symlink()
    assert (logs / "g1-h1.log").is_symlink()
    assert not (logs / "g0-h0.log").is_symlink()
    seen = [r for r in read_jsonl(tmp_path / "run" / "local_seen") if r["generation"] == 1]
    assert len(seen) == 2


def test_restarts_are_bounded(tmp_path: Path) -> None:
    spec = {"total": 12, "faults": [{"kind": "crash", "host": 0, "step": 1, "generation": None}]}
    with pytest.raises(ElasticRunError, match="restarts exhausted"):
        supervise(tmp_path, spec, max_restarts=2)
    assert len(events(tmp_path, "launch")) == 3
    assert events(tmp_path, "give_up")


@pytest.mark.parametrize(
    ("kind", "reason"), [("freeze", "heartbeat stale"), ("stall", "no progress")]
)
def test_hung_worker_is_detected_and_killed(tmp_path: Path, kind: str, reason: str) -> None:
    spec = {"total": 10, "faults": [{"kind": kind, "host": 2, "step": 3, "generation": 0}]}
    t0 = time.monotonic()
    _, result = supervise(tmp_path, spec)
    assert result is not None
    assert shape(result)[0] == ((0, 1, 2), "failed")
    [fail] = events(tmp_path, "failure_detected")
    assert fail["host"] == 2
    assert reason in result.generations[0].reason
    assert time.monotonic() - t0 < 15
    hb = json.loads((tmp_path / "run" / "hb" / "g0-h2.json").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(hb["pid"], 0)  # the hung worker is gone, not left behind


def test_host_loss_shrinks_then_rejoin_grows_back(tmp_path: Path) -> None:
    events_ = (
        ChaosEvent(kind="kill", host=2, at_step=4),
        ChaosEvent(kind="rejoin", host=2, at_step=10),
    )
    _, result = supervise(tmp_path, {"total": 16, "step_s": 0.05}, events=events_)
    assert result is not None
    assert shape(result) == [((0, 1, 2), "failed"), ((0, 1), "stopped"), ((0, 1, 2), "done")]
    assert result.restarts == 1  # the resize is not a failure
    [kill] = events(tmp_path, "kill")
    [fail] = events(tmp_path, "failure_detected")
    assert fail["host"] == 2
    assert fail["rc"] == -9
    assert fail["t"] - kill["t"] < 1.0
    assert events(tmp_path, "stop_requested")[0]["generation"] == 1
    seen = {
        (r["generation"], r["host"]): r["marker"]
        for r in read_jsonl(tmp_path / "run" / "local_seen")
    }
    assert seen[(1, 0)]
    assert seen[(2, 1)]
    assert not seen[(2, 2)]  # the killed host's local dir was wiped
    assert int((tmp_path / "run" / "fake_ckpt").read_text()) == 16


def test_below_min_hosts_gives_up(tmp_path: Path) -> None:
    with pytest.raises(ElasticRunError, match="min_hosts"):
        supervise(
            tmp_path,
            {"total": 50, "step_s": 0.05},
            min_hosts=3,
            events=(ChaosEvent(kind="kill", host=0, at_step=2),),
        )


def test_options_and_event_parsing() -> None:
    assert ChaosEvent.parse("kill", "3@40") == ChaosEvent(kind="kill", host=3, at_step=40)
    with pytest.raises(ConfigError):
        ChaosEvent.parse("kill", "3:40")
    with pytest.raises(ConfigError):
        SupervisorOptions(num_hosts=2, min_hosts=3)
    with pytest.raises(ConfigError):
        SupervisorOptions(num_hosts=2, events=(ChaosEvent(kind="kill", host=2, at_step=1),))


def test_standby_runs_a_preloaded_module_as_main_without_warnings() -> None:
    """A warm standby that preloaded the worker module itself (as the example worker's does)
    runs it as ``__main__`` after the identity line, without runpy's "found in sys.modules"
    warning in the worker's log."""
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-W",
            "always",
            "-m",
            "fastckpt.elastic._standby",
            "json.tool",
            "--",
            sys.executable,
            "-m",
            "json.tool",
            "--sort-keys",
        ],
        input='{"FASTCKPT_TEST_IDENTITY": "7"}\n{"b": 1, "a": 2}\n',
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [
        "{",
        '"a":',
        "2,",
        '"b":',
        "1",
        "}",
    ]  # json.tool ran, on the rest of stdin
    assert "Warning" not in proc.stderr, proc.stderr


def test_a_reused_run_directory_starts_clean(tmp_path: Path) -> None:
    """A second run in the same run directory does not read the first one's heartbeats, stop
    requests or logs as its own (generation numbers restart at 0)."""
    spec = {
        "total": 10,
        "step_s": 0.02,
        "faults": [{"kind": "crash", "host": 1, "step": 4, "generation": 0}],
    }
    _, first = supervise(tmp_path, spec)
    assert first is not None and first.restarts == 1
    (tmp_path / "run" / "control" / "stop-g0").touch()  # as an interrupted resize would leave it
    (tmp_path / "run" / "fake_ckpt").unlink()
    _, second = supervise(tmp_path, {"total": 10, "step_s": 0.02})
    assert second is not None and shape(second) == [((0, 1, 2), "done")] and second.restarts == 0
    assert read_jsonl(tmp_path / "run" / "events.jsonl")[0]["event"] == "launch"


def test_a_stop_nobody_asked_for_is_a_failure(tmp_path: Path) -> None:
    """Workers exiting 75 (stopped) with no stop request count as failures, so a trainer that
    keeps doing it exhausts max_restarts instead of relaunching forever."""
    opts = SupervisorOptions(num_hosts=2, **FAST, max_restarts=1)
    sup = Supervisor(
        [sys.executable, "-c", "import sys; sys.exit(75)"],
        run_dir=tmp_path / "run",
        local_root=tmp_path / "local",
        options=opts,
    )
    t0 = time.monotonic()
    with pytest.raises(ElasticRunError, match="restarts exhausted"):
        sup.run()
    assert time.monotonic() - t0 < 30
    assert {e["reason"] for e in events(tmp_path, "failure_detected")} == {"unrequested_stop"}


def test_standbys_are_not_used_for_commands_they_cannot_run(tmp_path: Path) -> None:
    """``python -u script`` cannot run inside a standby: relaunches spawn afresh (one restart for
    the one crash, not one more per failed activation)."""
    from fastckpt.elastic.supervisor import runs_in_process

    assert runs_in_process([sys.executable, "-m", "mod", "a"]) and runs_in_process(
        [sys.executable, "x.py"]
    )
    assert not runs_in_process([sys.executable, "-u", "x.py"]) and not runs_in_process(
        ["env", "python", "x.py"]
    )
    spec = {
        "total": 30,
        "step_s": 0.02,
        "faults": [{"kind": "crash", "host": 1, "step": 10, "generation": 0}],
    }
    opts = SupervisorOptions(
        num_hosts=2,
        **{**FAST, "warm_standby": True, "heartbeat_timeout_s": 5.0, "progress_timeout_s": 5.0},
        max_restarts=3,
    )
    sup = Supervisor(
        [sys.executable, "-u", FAKE, json.dumps(spec)],
        run_dir=tmp_path / "run",
        local_root=tmp_path / "local",
        options=opts,
    )
    result = sup.run()
    assert [g.outcome for g in result.generations] == ["failed", "done"] and result.restarts == 1
    assert not list((tmp_path / "run" / "logs").glob("standby-*"))


def test_a_failing_event_printer_does_not_orphan_the_workers(tmp_path: Path) -> None:
    """``on_event`` raising (printing to a closed pipe) does not kill the supervisor between
    spawning workers and watching them: the run completes."""

    def broken(event: dict[str, Any]) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    opts = SupervisorOptions(num_hosts=2, **FAST)
    sup = Supervisor(
        [sys.executable, FAKE, json.dumps({"total": 5})],
        run_dir=tmp_path / "run",
        local_root=tmp_path / "local",
        options=opts,
        on_event=broken,
    )
    assert shape(sup.run()) == [((0, 1), "done")]
    assert events(tmp_path, "on_event_failed")


def test_sigterm_ends_the_run_and_kills_every_worker(tmp_path: Path) -> None:
    """SIGTERM (docker stop, systemd) ends the run as Ctrl-C does: no worker outlives it."""
    import signal
    import threading

    from fastckpt.elastic import SupervisorTerminated

    opts = SupervisorOptions(num_hosts=2, **FAST)
    sup = Supervisor(
        [sys.executable, FAKE, json.dumps({"total": 100000, "step_s": 0.05})],
        run_dir=tmp_path / "run",
        local_root=tmp_path / "local",
        options=opts,
    )
    hb = tmp_path / "run" / "hb"
    pids: list[int] = []

    def terminate() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(list(hb.glob("*.json"))) < 2:
            time.sleep(0.05)
        pids.extend(json.loads(p.read_text())["pid"] for p in hb.glob("*.json"))
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate, daemon=True).start()
    with pytest.raises(SupervisorTerminated):
        sup.run()
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(
        signal.getsignal(signal.SIGTERM)
    )
