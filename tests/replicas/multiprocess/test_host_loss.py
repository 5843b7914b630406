"""Host loss with RAM replicas, in real ``jax.distributed`` jobs (4 processes x 2 CPU devices).

One training job (module fixture) checkpoints on a 4 x 2 mesh: step 5 persistently (forced),
steps 10 and 20 to the RAM tiers only (``/dev/shm/.../host<k>`` per simulated host, each
pushing its chunks to its ring successor, k=1). Once step 20 is committed and replicated,
process 2 is SIGKILLed while it keeps training and its shared-memory folder is wiped (the
host is gone); the rest of the job is stopped. Every test then starts a *new* job (fresh
coordinator) on a private copy of the surviving tiers and restores the newest step, which
exists in RAM only, bit for bit and with zero bytes from persistent storage:

* 4 processes, the replacement host with an empty tier (its chunks come from its successor),
  and a flipped byte in one survivor's own RAM copy of a chunk (that chunk comes from the
  peer holding its replica); the replacement also checks that a client with a wrong secret
  is refused by every live peer server of the job and reads nothing;
* 3 processes on a 3 x 2 mesh (the three surviving hosts hold everything between them).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from fastckpt.testing.multiprocess import ProcessOutcome, run_processes

from . import workers as w

WORKERS = str(Path(__file__).with_name("workers.py"))
HOSTS = 4
VICTIM = 2
"""Process (and host slot) killed; not 0, whose process runs the job's coordinator."""
RESTORED_SHARDS = len(w.ARRAYS) * 2  # every array has one shard per local device


@dataclasses.dataclass(frozen=True)
class SavedJob:
    tiers: Path
    """``host<k>`` tier directories as the loss left them (``host2`` gone)."""
    persist_root: Path
    killed_at_step: int
    """The victim's last reported training step when it was killed."""
    outcomes: list[ProcessOutcome]


def _describe(outcomes: list[ProcessOutcome]) -> str:
    return "\n".join(
        f"p{o.process_id} rc={o.returncode} value={o.value} error={o.error}\n{o.stderr[-2000:]}"
        for o in outcomes
    )


def _dead(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie not yet reaped by the launcher counts)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _train_then_lose_host(
    tiers: Path, persist_root: Path, signals: Path, redundancy: str = "replicas"
) -> SavedJob:
    kwargs = [
        {
            "ram_root": str(tiers / f"host{k}"),
            "member": f"host{k}",
            "persist_root": str(persist_root),
            "signals": str(signals),
            "redundancy": redundancy,
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
            # Step 20 committed and pushed everywhere, and the victim is back in its training loop.
            while not (all(m.exists() for m in markers) and progress.exists()):
                if job.done() or any(signals.glob("failed-*")):
                    (signals / "stop").touch()
                    pytest.fail(
                        "the training job failed before the kill:\n" + _describe(job.result())
                    )
                assert time.monotonic() < deadline, "training job did not reach step 20"
                time.sleep(0.01)
            pid = json.loads(markers[VICTIM].read_text())["pid"]
            killed_at = json.loads(progress.read_text())["step"]
            os.kill(pid, signal.SIGKILL)
            while not _dead(pid):
                time.sleep(0.005)
            shutil.rmtree(tiers / f"host{VICTIM}")  # host loss: its shared memory is gone too
        finally:
            (signals / "stop").touch()
        outcomes = job.result()
    return SavedJob(tiers, persist_root, killed_at, outcomes)


@pytest.fixture(scope="module")
def saved_job(module_shm: Path, tmp_path_factory: pytest.TempPathFactory) -> SavedJob:
    work = tmp_path_factory.mktemp("host_loss")
    (work / "signals").mkdir()
    return _train_then_lose_host(module_shm / "lost", work / "ckpt", work / "signals")


def _copy_tiers(saved: SavedJob, dest: Path) -> Path:
    shutil.copytree(saved.tiers, dest)
    return dest


def _restore(
    tiers: Path,
    persist_root: Path,
    hosts: list[int],
    layout: str,
    *,
    probe: int | None = None,
    redundancy: str = "replicas",
) -> list[dict[str, Any]]:
    kwargs = [
        {
            "ram_root": str(tiers / f"host{k}"),
            "member": f"host{k}",
            "persist_root": str(persist_root),
            "layout": layout,
            "probe_wrong_secret": i == probe,
            "redundancy": redundancy,
        }
        for i, k in enumerate(hosts)
    ]
    outs = run_processes(
        f"{WORKERS}:restore",
        num_processes=len(hosts),
        devices_per_process=2,
        kwargs=kwargs,
        timeout_s=120,
    )
    return [o.value for o in outs]


def _assert_ram_only_restore(results: list[dict[str, Any]], saved: SavedJob) -> None:
    for r in results:
        assert r["step"] == w.LAST_RAM_STEP, r
        assert r["checked_shards"] == RESTORED_SHARDS, r
        # Zero bytes from persistent storage, although storage holds step 5.
        assert r["bytes_by_tier"].get("storage", 0) == 0 and r["bytes_read_storage"] == 0, r
        assert set(r["bytes_by_tier"]) <= {"ram"} | {f"peer:host{k}" for k in range(HOSTS)}, r
        assert sum(r["bytes_by_tier"].values()) > 0
        assert all(t is not None and t != "storage" for t in r["provenance"].values()), r
        assert r["persistent_steps"] == [w.PERSIST_STEP]
    assert [r["storage_listings"] for r in results] == [1] + [0] * (len(results) - 1), results
    manifests = sorted(p.name for p in (saved.persist_root / "manifests").iterdir())
    assert manifests == [f"{w.PERSIST_STEP:012d}.json"]  # step 20 never reached storage


def _flip_byte_of_own_chunk(tier: Path, step: int) -> str:
    """Flip one byte inside a chunk of the host's own segment (the one holding most chunks;
    pushed replicas are one chunk per segment). Returns that chunk's id."""
    docs = [json.loads(p.read_text()) for p in (tier / f"step-{step}").glob("*.index.json")]
    doc = max(docs, key=lambda d: len(d["chunks"]))
    assert len(doc["chunks"]) > 1
    cid = str(doc["chunks"][0][0])
    _flip_byte_of_chunk(tier, step, cid)
    return cid


def _flip_byte_of_chunk(tier: Path, step: int, cid: str) -> None:
    """Flip one byte inside chunk ``cid`` of ``step`` wherever ``tier`` holds it."""
    for p in (tier / f"step-{step}").glob("*.index.json"):
        doc = json.loads(p.read_text())
        for c, offset, length, _ in doc["chunks"]:
            if c == cid:
                with open(tier / f"step-{step}" / doc["data"], "r+b") as f:
                    f.seek(offset + length // 2)
                    b = f.read(1)
                    f.seek(offset + length // 2)
                    f.write(bytes([b[0] ^ 0x20]))
                return
    raise AssertionError(f"{tier} holds no chunk {cid} of step {step}")


def test_training_job_lost_a_host_after_replicating(saved_job: SavedJob) -> None:
    """The setup itself: one SIGKILL mid-training, survivors stopped cleanly, host2's tier gone."""
    outs = saved_job.outcomes
    assert outs[VICTIM].returncode == -signal.SIGKILL, _describe(outs)
    for o in outs:
        if o.process_id != VICTIM:
            assert o.ok and o.value["last_step"] > w.LAST_RAM_STEP, _describe(outs)
            # keep_steps=1 with peers: the previous RAM step is held too (it is what stays
            # complete if a host dies before its push of the last step finished).
            assert o.value["ram_steps"] == [w.RAM_STEPS[-2], w.LAST_RAM_STEP], o.value
    assert saved_job.killed_at_step > w.LAST_RAM_STEP
    pushed = {o.value["member"]: o.value["pushed_to"] for o in outs if o.ok}
    assert pushed == {"host0": ["host1"], "host1": ["host2"], "host3": ["host0"]}
    assert sorted(p.name for p in saved_job.tiers.iterdir()) == ["host0", "host1", "host3"]
    for tier in saved_job.tiers.iterdir():  # the last two RAM steps, nothing older
        assert sorted(p.name for p in tier.glob("step-*")) == [
            f"step-{s}" for s in w.RAM_STEPS[-2:]
        ], tier
    # A RAM step's manifest is held by process 0 (host0), which built it, and by its ring
    # successor (host1), which its push reached; host3 holds a commit record only: the
    # manifest did not go to every process through the coordinator.
    for host, holds in (("host0", True), ("host1", True), ("host3", False)):
        for s in w.RAM_STEPS[-2:]:
            d = saved_job.tiers / host / f"step-{s}"
            assert ((d / "manifest.json").exists(), (d / "commit.json").exists()) == (
                holds,
                not holds,
            ), (host, s)


def test_restore_after_host_loss_same_size(saved_job: SavedJob, shm_dir: Path) -> None:
    """New 4-process job, the replacement host with an empty tier, and (one job for two
    faults) a flipped byte in survivor host3's own RAM copy of one chunk.

    Everything comes from RAM and peers: the replacement's shards from its ring successor
    host3, host3's corrupt chunk from host0 (which holds host3's replicas).
    """
    tiers = _copy_tiers(saved_job, shm_dir / "tiers")
    bad = _flip_byte_of_own_chunk(tiers / "host3", w.LAST_RAM_STEP)
    results = _restore(tiers, saved_job.persist_root, [0, 1, 2, 3], "save4x2", probe=VICTIM)
    _assert_ram_only_restore(results, saved_job)
    for r in results[:3]:
        assert r["fallbacks"] == [] and r["dead_peers"] == [], r
    new = results[VICTIM]
    assert new["own_ram_steps_before"] == [] and "ram" not in new["bytes_by_tier"], new
    assert new["bytes_by_tier"].get("peer:host3", 0) > 0, new
    assert new["fetched_ranged_bytes"] == new["fetched_whole_bytes"], (
        new
    )  # the same mesh: whole chunks
    # It asks its ring successor first (where the host it replaces pushed its chunks), then
    # the holder of what process 0 wrote once (host0's chunks are on host0 and host1).
    assert new["listed_peers"][0] == "host3" and len(new["listed_peers"]) <= 2, new
    for r in results[:VICTIM] + results[VICTIM + 1 :]:
        assert (
            r["own_ram_steps_before"] == list(w.RAM_STEPS[-2:]) and r["bytes_by_tier"]["ram"] > 0
        ), r
    # The corrupt own copy was detected (crc32c) and the chunk came from the peer holding the
    # replica.
    r3 = results[3]
    assert r3["fallbacks"] == [["ram", bad, "corrupt"]] and r3["dead_peers"] == [], r3
    assert r3["provenance"][bad] == "peer:host0", r3
    # A client with a wrong secret is refused by every live server of the job and reads nothing.
    refused = new["wrong_secret"]
    assert sorted(refused) == ["host0", "host1", "host3"], refused
    for probe in refused.values():
        assert len(probe["client"]) == 3 and all(
            c.startswith("AuthenticationError") for c in probe["client"]
        ), refused
        assert probe["impostor"] == {
            "reply": "ERROR",
            "code": "auth_failed",
            "bytes_after_auth": 0,
        }, refused


def test_restore_after_host_loss_onto_three_hosts(saved_job: SavedJob, shm_dir: Path) -> None:
    """New 3-process job (3 x 2 mesh) on the surviving hosts: everything is still in RAM.
    Process 0 of the new job is host3, whose tier holds commit records but no manifest: it
    chooses the step with the manifest fetched from a peer that holds it, and keeps a copy."""
    tiers = _copy_tiers(saved_job, shm_dir / "tiers")
    assert not (tiers / "host3" / f"step-{w.LAST_RAM_STEP}" / "manifest.json").exists()
    results = _restore(tiers, saved_job.persist_root, [3, 0, 1], "resize3x2")
    _assert_ram_only_restore(results, saved_job)
    for r in results:
        assert r["fallbacks"] == [] and r["dead_peers"] == [], r
    assert any(t.startswith("peer:") for r in results for t in r["bytes_by_tier"])
    # The 3 x 2 layout uses parts of the 4 x 2 chunks: peers sent only those parts (GET_RANGES).
    peer_whole = sum(
        v for r in results for t, v in r["fetched_whole_bytes"].items() if t.startswith("peer:")
    )
    peer_sent = sum(
        v for r in results for t, v in r["fetched_ranged_bytes"].items() if t.startswith("peer:")
    )
    assert peer_sent < peer_whole, results
    # host3 kept the copy it fetched: it serves the manifest to the next restore too.
    assert (tiers / "host3" / f"step-{w.LAST_RAM_STEP}" / "manifest.json").exists()


def test_restore_after_also_losing_the_host_that_built_the_manifests(
    saved_job: SavedJob, shm_dir: Path
) -> None:
    """host0 — process 0 of the saving job, which built and holds every RAM manifest — is
    lost too (its tier wiped). host1 still holds step 20's manifest and host0's chunks (host0's
    push), host3 host2's chunks: a 2-process job on host3 and host1, whose process 0 (host3)
    holds commit records only, restores step 20 bit-exact from RAM and peers alone."""
    tiers = _copy_tiers(saved_job, shm_dir / "tiers")
    shutil.rmtree(tiers / "host0")
    results = _restore(tiers, saved_job.persist_root, [3, 1], "resize3x2")
    _assert_ram_only_restore(results, saved_job)
    assert results[0]["bytes_by_tier"].get("peer:host1", 0) > 0, results[0]


def test_every_ram_tier_lost_restores_storage_step_listed_once(
    saved_job: SavedJob, shm_dir: Path
) -> None:
    """Every host lost (a new job on new hosts, empty tiers): no RAM step to agree on, so
    the job restores storage's latest step, bit-exact; process 0 alone listed storage and
    the others took the step it published (one listing per restore, not one per host; and
    all restore the same step even if a commit landed between two listings)."""
    empty = shm_dir / "empty"
    results = _restore(empty, saved_job.persist_root, [0, 1, 2, 3], "save4x2")
    for r in results:
        assert r["step"] == w.PERSIST_STEP and r["checked_shards"] == RESTORED_SHARDS, r
        assert set(r["bytes_by_tier"]) == {"storage"} and r["bytes_read_storage"] > 0, r
    assert [r["storage_listings"] for r in results] == [1, 0, 0, 0], results


def test_step_corrupt_in_every_ram_copy_falls_back_to_the_previous_ram_step(
    saved_job: SavedJob, shm_dir: Path
) -> None:
    """One chunk of step 20 corrupt in both copies (host3's own, host0's replica): host3
    cannot complete step 20, so all three processes abandon it together and restore step 10
    (held by every tier: the previous step stays with peers), still with zero storage reads."""
    tiers = _copy_tiers(saved_job, shm_dir / "tiers")
    bad = _flip_byte_of_own_chunk(tiers / "host3", w.LAST_RAM_STEP)
    _flip_byte_of_chunk(tiers / "host0", w.LAST_RAM_STEP, bad)  # host3 pushes to host0
    results = _restore(tiers, saved_job.persist_root, [0, 1, 3], "resize3x2")
    for r in results:
        assert r["step"] == w.RAM_STEPS[-2] and r["checked_shards"] > 0, r
        assert r["bytes_by_tier"].get("storage", 0) == 0 and r["bytes_read_storage"] == 0, r
    assert any(f[1] == bad and f[2] == "corrupt" for r in results for f in r["fallbacks"]), results
