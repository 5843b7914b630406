"""Crash consistency: SIGKILL a writer at a random moment, then check what it left.

A writer process (``_crash_worker.py``) saves steps 1, 2, 3, ... (keep_last=2, so old steps
are also being deleted) and prints ``committed <step>`` after each acknowledged save. The
parent kills it with SIGKILL at a uniformly random time and then checks, every trial:

* **durable**: the newest step any tier lists is >= the last acknowledged step;
* **no phantom**: nothing newer than the acknowledged step + 1 (the save in flight, whose
  manifest may have landed just before the kill) is listed;
* **complete**: every listed persistent step, and the latest step in any tier, restores
  bit-exact (a listed step is never a partial one);
* **cleanable**: ``fastckpt.maintenance.collect_garbage(grace_s=0)`` removes every unreferenced and
  uncommitted object it may (on GCS, where object age is unknown, data of a step newer than
  the newest committed one is kept by design) and every temp file of a killed local put; the
  listing is unchanged and the latest step still restores bit-exact.

Backends: a local directory, the GCS emulator, and local storage + RAM tier (RAM checkpoint
every step, persistent every second step). Plus a 2-process ``jax.distributed`` save where a
random process SIGKILLs itself at a random moment.

CI runs a few trials; ``FASTCKPT_NIGHTLY_TRIALS=N`` runs N in the nightly test.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from fastckpt import CheckpointManager
from fastckpt.maintenance import collect_garbage, find_leftovers
from fastckpt.storage import Store, open_store
from fastckpt.storage._local import TEMP_SUFFIX
from fastckpt.testing.gcs_emulator import GcsEmulator
from fastckpt_examples.cluster.multiprocess import run_processes

from ._util import BUCKET, HERE, Recorder, state_mismatches, trial_count, worker

KILL_WINDOW_S = 1.5
STEADY_WINDOW_S = 0.5
BACKENDS = ("local", "gcs", "ram")


def _child_env(devices: int) -> dict[str, str]:
    env = dict(os.environ)
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")
    ).strip()
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _open(spec: dict[str, Any]) -> Store:
    return open_store(spec["root"], gcs_endpoint=spec.get("endpoint"), local_durable=True)


def verify_after_crash(spec: dict[str, Any], acknowledged: list[int]) -> dict[str, Any]:
    """Check a checkpoint root after its writer died; returns figures and problems found."""
    problems: list[str] = []
    last_ack = max(acknowledged, default=0)
    options = worker.options(spec.get("ram_root"))
    with CheckpointManager(_open(spec), options=options) as mgr:
        persistent = mgr.persistent_steps()
        listed = mgr.all_steps()
        latest = mgr.latest_step()
        if last_ack and (latest is None or latest < last_ack):
            problems.append(f"acknowledged step {last_ack} lost (latest listed {latest})")
        if any(s > last_ack + 1 for s in listed):
            problems.append(f"phantom steps listed {listed} (last acknowledged {last_ack})")
        restored = 0
        for s in persistent:
            bad = state_mismatches(mgr.restore(s), s)
            restored += 1
            if bad:
                problems.append(f"step {s} restored wrong leaves {bad}")
        if latest is not None:
            bad = state_mismatches(mgr.restore(), latest)
            if bad:
                problems.append(f"latest step {latest} restored wrong leaves {bad}")
    store = _open(spec)
    try:
        report = collect_garbage(store, grace_s=0)
        left = asyncio.run(find_leftovers(store))
    finally:
        asyncio.run(store.close())
    newest = max(persistent, default=None)
    removable = [
        lo.key
        for lo in left
        if lo.reason == "unreferenced"
        or lo.age_s is not None
        or (newest is not None and lo.step is not None and lo.step < newest)
    ]
    if removable:
        problems.append(f"gc left removable objects {removable[:5]}")
    temp_files = 0
    if not spec["root"].startswith("gs://"):
        temp_files = sum(1 for p in Path(spec["root"]).rglob(f"*{TEMP_SUFFIX}"))
        if temp_files:
            problems.append(f"gc left {temp_files} temp files of killed puts")
    with CheckpointManager(_open(spec), options=options) as mgr:
        if mgr.persistent_steps() != persistent:
            problems.append(f"gc changed the listing: {persistent} -> {mgr.persistent_steps()}")
        if latest is not None and state_mismatches(mgr.restore(), latest):
            problems.append("latest step differs after gc")
    return {
        "problems": problems,
        "acknowledged": last_ack,
        "listed": listed,
        "restored_steps": restored,
        "gc_removed": len(report.removed),
        "gc_kept": len(report.kept),
        "temp_files_left": temp_files,
        "gc_temp_files_removed": len(report.temp_files),
    }


def crash_trial(
    tmp: Path, *, backend: str, seed: int, emulator: GcsEmulator | None
) -> dict[str, Any]:
    """One single-process trial: start a writer, SIGKILL it at a random time, verify."""
    rng = random.Random(seed)
    name = f"crash-{seed}-{uuid.uuid4().hex[:6]}"
    spec: dict[str, Any] = {
        "root": str(tmp / name),
        "endpoint": None,
        "ram_root": None,
        "max_steps": 100_000,
    }
    if backend == "gcs":
        assert emulator is not None
        spec.update(root=f"gs://{BUCKET}/{name}", endpoint=emulator.endpoint)
    elif backend == "ram":
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp
        spec["ram_root"] = str(shm / f"fastckpt-{name}")
    err = (tmp / f"{name}.stderr").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-u", str(HERE / "_crash_worker.py"), json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=err,
        stdin=subprocess.DEVNULL,
        env=_child_env(2),
        text=True,
        start_new_session=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.strip())
        lines.put(None)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    # One trial in four kills anywhere from the start (first save included); the others kill
    # during the steady state, after the first acknowledged save, where saves follow each other.
    early = rng.random() < 0.25
    wait_for = "ready" if early else "committed 1"
    delay = rng.uniform(0.0, KILL_WINDOW_S if early else STEADY_WINDOW_S)
    out: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while wait_for not in out:
            line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
            if line is None:
                raise AssertionError(
                    f"writer exited early: {(tmp / f'{name}.stderr').read_text()[-2000:]}"
                )
            out.append(line)
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        err.close()
    reader.join(timeout=10)
    while (line := lines.get()) is not None:
        out.append(line)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, out[-3:])
    acknowledged = [int(x.split()[1]) for x in out if x.startswith("committed ")]
    try:
        result = verify_after_crash(spec, acknowledged)
    finally:
        if spec["ram_root"]:
            import shutil

            shutil.rmtree(spec["ram_root"], ignore_errors=True)
    result.update(backend=backend, seed=seed, kill_after_s=round(delay, 3), early=early)
    return result


def _record(recorder: Recorder, scenario: str, results: list[dict[str, Any]]) -> None:
    recorder.add(
        scenario,
        trials=len(results),
        trials_by_backend={
            b: sum(r["backend"] == b for r in results) for b in {r["backend"] for r in results}
        },
        acknowledged_steps=sum(r["acknowledged"] for r in results),
        trials_killed_before_first_commit=sum(r["acknowledged"] == 0 for r in results),
        trials_killed_in_first_save_window=sum(bool(r.get("early")) for r in results),
        trials_listing_an_unacknowledged_step=sum(
            any(s > r["acknowledged"] for s in r["listed"]) for r in results
        ),
        restored_steps_checked=sum(r["restored_steps"] for r in results),
        gc_objects_removed=sum(r["gc_removed"] for r in results),
        gc_objects_kept_in_flight=sum(r["gc_kept"] for r in results),
        gc_temp_files_removed=sum(r["gc_temp_files_removed"] for r in results),
        temp_files_left_after_gc=sum(r["temp_files_left"] for r in results),
        trials_with_problems=sum(bool(r["problems"]) for r in results),
        lost_or_wrong_data=sum(bool(r["problems"]) for r in results),
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_sigkilled_writer_leaves_a_consistent_root(
    tmp_path: Path, gcs_emulator: GcsEmulator, recorder: Recorder, backend: str
) -> None:
    result = crash_trial(
        tmp_path, backend=backend, seed=BACKENDS.index(backend), emulator=gcs_emulator
    )
    _record(recorder, "crash_single_process_ci", [result])
    assert result["problems"] == [], result


@pytest.mark.nightly
def test_sigkill_trials_nightly(
    tmp_path: Path, gcs_emulator: GcsEmulator, recorder: Recorder
) -> None:
    """``FASTCKPT_NIGHTLY_TRIALS`` trials (default 1) over random backends and kill times."""
    n = trial_count(1)
    rng = random.Random(12345)
    results = [
        crash_trial(tmp_path, backend=rng.choice(BACKENDS), seed=100 + i, emulator=gcs_emulator)
        for i in range(n)
    ]
    _record(recorder, "crash_single_process", results)
    bad = [r for r in results if r["problems"]]
    assert not bad, bad


def mp_crash_trial(tmp: Path, *, seed: int) -> dict[str, Any]:
    """2 processes x 2 devices save together; a random one SIGKILLs itself at a random time."""
    rng = random.Random(seed)
    victim, kill_after = rng.randrange(2), rng.uniform(0.0, KILL_WINDOW_S)
    trial_dir = tmp / f"mp-{seed}"
    trial_dir.mkdir()
    spec = {"root": str(trial_dir / "ckpt"), "endpoint": None, "ram_root": None}
    outcomes = run_processes(
        f"{HERE / '_mp_crash.py'}:save_until_killed",
        num_processes=2,
        devices_per_process=2,
        check=False,
        kwargs={
            "root": spec["root"],
            "progress_dir": str(trial_dir),
            "victim": victim,
            "kill_after_s": kill_after,
            "barrier_timeout_s": 3.0,
        },
        timeout_s=120,
        exit_wait_s=2.0,
    )
    assert outcomes[victim].returncode == -signal.SIGKILL, outcomes[victim]
    acknowledged = []
    for p in trial_dir.glob("progress*.txt"):
        acknowledged += [
            int(x.split()[1]) for x in p.read_text().split("\n") if x.startswith("committed ")
        ]
    result = verify_after_crash(spec, acknowledged)
    survivor = outcomes[1 - victim]
    result.update(
        backend="local-2proc",
        seed=seed,
        kill_after_s=round(kill_after, 3),
        victim=victim,
        survivor=(survivor.value or {}).get("error") or f"returncode {survivor.returncode}",
    )
    return result


def test_sigkill_one_of_two_jax_processes(tmp_path: Path, recorder: Recorder) -> None:
    n = trial_count(1, scale=0.2)
    results = [mp_crash_trial(tmp_path, seed=500 + i) for i in range(n)]
    _record(recorder, "crash_two_process", results)
    bad = [r for r in results if r["problems"]]
    assert not bad, bad


def test_gc_removes_temp_files_of_a_killed_put(tmp_path: Path) -> None:
    """A put killed between writing its temp file and publishing it leaves
    ``.<name>.<hex>.fastckpt-tmp`` next to the key (``LocalStore`` documents this). ``list``
    hides such files; gc must still remove them (it did not, until the crash trials here
    found 14 of them over 60 trials)."""
    root = tmp_path / "ckpt"
    fastckpt_save(root)
    debris = [
        root
        / "steps"
        / "000000000002"
        / "abc"
        / f".p00000-00000.fck.0123456789abcdef{TEMP_SUFFIX}",
        root / "manifests" / f".000000000002.json.0123456789abcdef{TEMP_SUFFIX}",
    ]
    for d in debris:
        d.parent.mkdir(parents=True, exist_ok=True)
        d.write_bytes(b"x" * 1000)
        os.utime(d, (time.time() - 7200, time.time() - 7200))  # older than any grace period
    store = open_store(str(root))
    collect_garbage(store, grace_s=0)
    asyncio.run(store.close())
    assert [d for d in debris if d.exists()] == []


def fastckpt_save(root: Path) -> None:
    import fastckpt

    fastckpt.save(str(root), 1, {"x": worker.expected(1)["n"]})
