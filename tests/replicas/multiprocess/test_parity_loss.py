"""Host loss with parity (``RamOptions(redundancy="parity", group_size=4)``) in real
``jax.distributed`` jobs (4 processes x 2 CPU devices): one group of four hosts.

The training job saves RAM steps 10 and 20 (step 5 also to storage); each host keeps its own
chunks and a parity of the others' (no copies). Once step 20's parity is complete, process 2
is SIGKILLed and its tier wiped. New jobs then restore the newest step bit-exact with zero
bytes from storage, host2's chunks rebuilt from the three survivors' data and parity:

* 4 processes (host2 replaced by an empty tier), the same mesh;
* 3 processes on a 3 x 2 mesh (every survivor reads parts of host2's chunks);
* host0 lost too (two hosts of one group): no RAM step can be rebuilt, the job restores
  storage's step 5 (never wrong data).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from fastckpt.testing.multiprocess import run_processes

from . import workers as w
from .test_host_loss import RESTORED_SHARDS, SavedJob, _dead, _describe

WORKERS = str(Path(__file__).with_name("workers.py"))
HOSTS = 4
VICTIM = 2


def _train_then_lose_host(tiers: Path, persist_root: Path, signals: Path) -> SavedJob:
    kwargs = [
        {
            "ram_root": str(tiers / f"host{k}"),
            "member": f"host{k}",
            "persist_root": str(persist_root),
            "signals": str(signals),
            "redundancy": "parity",
        }
        for k in range(HOSTS)
    ]
    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(
            run_processes,
            f"{WORKERS}:train",
            num_processes=HOSTS,
            devices_per_process=2,
            kwargs=kwargs,
            timeout_s=150,
            check=False,
        )
        try:
            deadline = time.monotonic() + 150
            markers = [signals / f"replicated-{k}.json" for k in range(HOSTS)]
            progress = signals / f"progress-{VICTIM}"
            while not (all(m.exists() for m in markers) and progress.exists()):
                if job.done() or any(signals.glob("failed-*")):
                    (signals / "stop").touch()
                    pytest.fail("the training job failed:\n" + _describe(job.result()))
                assert time.monotonic() < deadline, "training job did not reach step 20"
                time.sleep(0.01)
            pid = json.loads(markers[VICTIM].read_text())["pid"]
            killed_at = json.loads(progress.read_text())["step"]
            os.kill(pid, signal.SIGKILL)
            while not _dead(pid):
                time.sleep(0.005)
            shutil.rmtree(tiers / f"host{VICTIM}")
        finally:
            (signals / "stop").touch()
        outcomes = job.result()
    return SavedJob(tiers, persist_root, killed_at, outcomes)


@pytest.fixture(scope="module")
def saved_job(module_shm: Path, tmp_path_factory: pytest.TempPathFactory) -> SavedJob:
    work = tmp_path_factory.mktemp("parity_loss")
    (work / "signals").mkdir()
    return _train_then_lose_host(module_shm / "lost", work / "ckpt", work / "signals")


def _restore(tiers: Path, persist_root: Path, hosts: list[int], layout: str) -> list[Any]:
    kwargs = [
        {
            "ram_root": str(tiers / f"host{k}"),
            "member": f"host{k}",
            "persist_root": str(persist_root),
            "layout": layout,
            "redundancy": "parity",
        }
        for k in hosts
    ]
    outs = run_processes(
        f"{WORKERS}:restore",
        num_processes=len(hosts),
        devices_per_process=2,
        kwargs=kwargs,
        timeout_s=120,
    )
    return [o.value for o in outs]


def _copy(saved: SavedJob, dest: Path) -> Path:
    shutil.copytree(saved.tiers, dest)
    return dest


def _assert_rebuilt_ram_only(results: list[Any]) -> None:
    for r in results:
        assert r["step"] == w.LAST_RAM_STEP, r
        assert r["checked_shards"] > 0, r
        assert r["bytes_by_tier"].get("storage", 0) == 0 and r["bytes_read_storage"] == 0, r
        assert all(t is not None and t != "storage" for t in r["provenance"].values()), r
        assert r["fallbacks"] == [], r
    assert sum(r["bytes_by_tier"].get("rebuilt", 0) for r in results) > 0, results


def test_training_job_pushed_parity_not_copies(saved_job: SavedJob) -> None:
    outs = saved_job.outcomes
    assert outs[VICTIM].returncode == -signal.SIGKILL, _describe(outs)
    for o in outs:
        if o.process_id != VICTIM:
            assert o.ok, _describe(outs)
            member = o.value["member"]
            # the manifest to the ring successor, the parity parts to the other three
            assert o.value["pushed_to"] == sorted(
                f"host{k}" for k in range(HOSTS) if k != int(member[-1])
            )
    for host in ("host0", "host1", "host3"):
        d = saved_job.tiers / host / f"step-{w.LAST_RAM_STEP}"
        docs = [json.loads(p.read_text()) for p in d.glob("*.index.json")]
        parity = [c[0] for doc in docs for c in doc["chunks"] if c[0].startswith("parity#")]
        assert len(parity) == 1, (host, docs)  # own segment + one complete parity, no replicas
        assert len(docs) == 2, (host, docs)


def test_restore_after_host_loss_rebuilds_same_size(saved_job: SavedJob, shm_dir: Path) -> None:
    tiers = _copy(saved_job, shm_dir / "tiers")
    results = _restore(tiers, saved_job.persist_root, [0, 1, 2, 3], "save4x2")
    _assert_rebuilt_ram_only(results)
    new = results[VICTIM]
    assert new["own_ram_steps_before"] == [] and new["checked_shards"] == RESTORED_SHARDS, new
    assert new["bytes_by_tier"].get("rebuilt", 0) > 0, new
    # what the replacement received is what it restored: the lost share, not 3x of it
    assert new["fetched_whole_bytes"].get("rebuilt") == new["bytes_by_tier"]["rebuilt"], new


def test_restore_after_host_loss_rebuilds_onto_three_hosts(
    saved_job: SavedJob, shm_dir: Path
) -> None:
    tiers = _copy(saved_job, shm_dir / "tiers")
    results = _restore(tiers, saved_job.persist_root, [3, 0, 1], "resize3x2")
    _assert_rebuilt_ram_only(results)


def test_two_lost_in_a_group_restore_storage_never_wrong_data(
    saved_job: SavedJob, shm_dir: Path
) -> None:
    tiers = _copy(saved_job, shm_dir / "tiers")
    shutil.rmtree(tiers / "host0")
    results = _restore(tiers, saved_job.persist_root, [3, 1], "resize3x2")
    for r in results:  # shards checked bit-exact against step 5 by the worker
        assert r["step"] == w.PERSIST_STEP and r["checked_shards"] > 0, r
        assert r["bytes_read_storage"] > 0, r
