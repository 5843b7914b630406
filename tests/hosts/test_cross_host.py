"""RAM replicas and peer restore across hosts that are really apart (network + mount
namespaces, fastckpt_examples.cluster.hosts), with the GCS emulator as one more host on the switch.

* A 4-host x 2-device job saves step 5 to GCS and steps 10 and 20 to RAM only; host 3 is
  lost with its tmpfs; a new 4-process job (host 3 empty) and a 3-process job restore step
  20 bit for bit with zero chunk bytes from GCS, counted at the emulator's own link.
* A host partitioned during a RAM save and in the commit round of a persistent save, for
  four times ``barrier_timeout_s``: every process's save fails with a typed error within
  the bound (the partitioned host included), nothing is committed without it, no process
  is aborted, and after healing the newest complete step restores and the job saves again.
* A host that advertises loopback (the old default) makes every process fail at start,
  naming the address, instead of silently losing its replicas.

Every host's peer address is the default (the route to the jax.distributed coordinator):
nothing here sets ``RamOptions.host`` except the misconfigured host.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fastckpt.testing.gcs_emulator import GcsEmulator
from fastckpt_examples.cluster.hosts import SimulatedHosts

from . import cross_workers as cw
from ._job import Job
from ._job import ok as _ok

pytestmark = pytest.mark.hosts

STATE_BYTES = 2_700_000  # tests/replicas/multiprocess/workers.py ARRAYS, ~2.6 MiB in all
GCS_CONTROL_BYTES = 64 << 10
"""What a restore may still receive from GCS without reading chunks: listings, metadata."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[SimulatedHosts, GcsEmulator]]:
    with SimulatedHosts(4) as hosts, GcsEmulator(host=hosts.add_host("gcs")) as emulator:
        emulator.create_bucket(cw.BUCKET)
        yield hosts, emulator


def _gcs_sent(hosts: SimulatedHosts) -> int:
    return hosts[4].link_bytes()[1]  # what the emulator's host sent on its link


def test_a_lost_host_is_restored_from_peers_with_zero_gcs_bytes(
    cluster: tuple[SimulatedHosts, GcsEmulator],
) -> None:
    hosts, emulator = cluster
    job = Job(hosts, hosts.hosts[:4], "loss-train", emulator, prefix="loss")
    _ok(job.do("save", step=5, force=True))
    for step in (10, 20):
        assert all(r["tiers"] == ["ram"] for r in _ok(job.do("save", step=step)))
    pushed = _ok(job.do("replicated"))
    assert all(r["reports"][-1]["step"] == 20 and r["reports"][-1]["ok"] for r in pushed), pushed
    summaries = [o.value for o in job.finish()]
    for i, s in enumerate(
        summaries
    ):  # each host advertised its own switch address, found by default
        assert s["advertised"][0] == hosts[i].address, s
        assert s["hostname"] == hosts[i].hostname
    hosts[3].kill()  # the machine is lost with its tmpfs
    hosts[3].revive()  # its replacement: same name and address, empty

    before = _gcs_sent(hosts)
    job = Job(hosts, hosts.hosts[:4], "loss-restore4", emulator, prefix="loss")
    restored = _ok(job.do("restore"))
    job.finish()
    gcs_bytes = _gcs_sent(hosts) - before
    for r in restored:
        assert r["step"] == 20 and r["checked_shards"] == 10 and r["bytes_read_storage"] == 0, r
    replaced = restored[3]["bytes_by_tier"]
    assert "ram" not in replaced and replaced.get("peer:host0", 0) > 0, (
        replaced
    )  # from its ring successor
    assert all("ram" in r["bytes_by_tier"] for r in restored[:3]), restored
    assert gcs_bytes < GCS_CONTROL_BYTES, gcs_bytes  # listings only: no chunk came from GCS

    before = _gcs_sent(hosts)
    job = Job(
        hosts, hosts.hosts[:3], "loss-restore3", emulator, prefix="loss"
    )  # resized: 3 x 2 devices
    restored = _ok(job.do("restore"))
    job.finish()
    gcs_bytes = _gcs_sent(hosts) - before
    assert all(
        r["step"] == 20 and r["bytes_read_storage"] == 0 and r["checked_shards"] == 10
        for r in restored
    )
    assert gcs_bytes < GCS_CONTROL_BYTES, gcs_bytes
    print(f"GCS bytes sent during the restores: {gcs_bytes} (state {STATE_BYTES})")


BARRIER_S = 3.0
MARGIN_S = 2.5
PARTITION_S = 4 * BARRIER_S


def _failed_in_time(results: list[dict[str, Any]], t_cut: float) -> list[float]:
    """Every process's save failed with a typed timeout within the bound; the seconds each took."""
    took = []
    for i, r in enumerate(results):
        assert not r["ok"], (i, r)
        assert r["error"] == "SaveError" and any(
            c in ("BarrierTimeoutError", "DistributedError") for c in r["causes"]
        ), (i, r)
        took.append(r["t_end"] - max(t_cut, r["t_start"]))
    assert max(took) < BARRIER_S + MARGIN_S, took
    return took


def _sync(job: Job) -> float:
    """Seconds until every process passed a coordination barrier again (TCP's retransmission
    backoff after a long partition can keep the healed host's connection silent for seconds)."""
    t0 = time.monotonic()
    _ok(job.do("sync", timeout_s=70, wait_s=60))
    return time.monotonic() - t0


def test_a_partitioned_host_fails_every_save_in_time_and_the_job_goes_on(
    cluster: tuple[SimulatedHosts, GcsEmulator],
) -> None:
    hosts, emulator = cluster
    victim = hosts[2]
    job = Job(
        hosts,
        hosts.hosts[:4],
        "partition",
        emulator,
        prefix="partition",
        barrier_s=BARRIER_S,
        per_process=[{"hold_process": 2}] * 4,
    )
    _ok(job.do("save", step=5, force=True))
    _ok(job.do("save", step=10))
    _ok(job.do("replicated"))

    # 1. Cut off before a RAM save: its seal is local, its key-value write cannot get through.
    victim.partition()
    t_cut = time.time()
    ram_took = _failed_in_time(job.do("save", step=20, timeout_s=BARRIER_S + 30), t_cut)
    time.sleep(max(0.0, t_cut + PARTITION_S - time.time()))
    victim.heal()
    recovered = [_sync(job)]

    # 2. Cut off in the commit round of a persistent save: after its fragment reached GCS,
    # before it reports it (the worker holds there until the test has cut the link).
    (job.control / "hold").touch()
    n = job.send("save", step=25, force=True)
    deadline = time.monotonic() + 60
    while not (job.control / "held").exists():
        assert time.monotonic() < deadline, "the victim never reached its commit round"
        time.sleep(0.01)
    victim.partition()
    t_cut = time.time()
    (job.control / "hold").unlink()
    (job.control / "go").touch()
    commit_took = _failed_in_time(job.results(n, timeout_s=BARRIER_S + 30), t_cut)
    time.sleep(max(0.0, t_cut + PARTITION_S - time.time()))
    victim.heal()
    recovered.append(_sync(job))

    # Healed. Step 20 was committed nowhere; step 25 is not in GCS (its RAM copy, which every
    # host sealed and agreed on before the cut, is complete). The newest complete step
    # restores on every process, and the job saves again, to RAM and to GCS.
    restored = _ok(job.do("restore"))
    assert [r["step"] for r in restored] == [25] * 4, restored
    assert all(r["bytes_read_storage"] == 0 for r in restored), restored
    _ok(job.do("save", step=30))
    _ok(job.do("save", step=35, force=True))
    summaries = [o.value for o in job.finish()]  # every process exited 0: none hung or was aborted
    assert all(s["persistent_steps"] == [5, 35] for s in summaries), summaries
    assert all(20 not in s["ram_steps"] and 30 in s["ram_steps"] for s in summaries), summaries
    print(
        f"partitioned RAM save failed after {[round(t, 2) for t in ram_took]} s; commit round "
        "after "
        f"{[round(t, 2) for t in commit_took]} s (barrier_timeout_s {BARRIER_S}); the coordinator "
        "answered "
        f"the healed host again after {[round(t, 2) for t in recovered]} s"
    )


def test_a_host_advertising_loopback_fails_the_start_on_every_process(
    cluster: tuple[SimulatedHosts, GcsEmulator],
) -> None:
    hosts, emulator = cluster
    per = [{"host": "127.0.0.1"} if i == 2 else {} for i in range(4)]
    t0 = time.monotonic()
    job = Job(hosts, hosts.hosts[:4], "loopback", emulator, prefix="loopback", per_process=per)
    outcomes = job.future.result(timeout=120)
    took = time.monotonic() - t0
    errors = [o.value.get("start_error") for o in outcomes]
    assert all(e is not None and e["type"] == "PeersUnreachableError" for e in errors), errors
    assert "cannot reach host2 at 127.0.0.1:" in errors[0]["message"], errors[0]
    assert all(e["message"] == errors[0]["message"] for e in errors), errors
    assert took < 60, took


MITM = str(Path(__file__).with_name("_mitm.py"))
VICTIM_PORT = 47101


def test_a_man_in_the_middle_on_the_switch_never_changes_restored_state(
    cluster: tuple[SimulatedHosts, GcsEmulator],
) -> None:
    """Every peer's connection to host1 goes through a man-in-the-middle host (host1's record
    names the mitm's address; the mitm relays to host1). It rewrites pushed chunks, then
    chunk and manifest replies, keeping every crc32c valid. With k=2, host0's chunks also
    live on host2: the pushes the mitm forged are refused by host1, and when host0 is lost
    its restore refuses the forged replies and takes each chunk from host2, bit for bit."""
    hosts, emulator = cluster
    mitm = hosts.add_host("mitm")
    control = hosts.shared_dir / "mitm"
    control.mkdir()
    relay = mitm.popen(
        [
            sys.executable,
            MITM,
            mitm.address,
            str(VICTIM_PORT),
            hosts[1].address,
            str(VICTIM_PORT),
            str(control),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert relay.stdout is not None and relay.stdout.readline() == "listening\n"
        per = [
            {
                "replicas": 2,
                **({"port": VICTIM_PORT, "advertise_via": mitm.address} if i == 1 else {}),
            }
            for i in range(4)
        ]
        job = Job(hosts, hosts.hosts[:4], "mitm-train", emulator, prefix="mitm", per_process=per)
        _ok(job.do("save", step=5, force=True))
        _ok(job.do("save", step=10))
        _ok(job.do("replicated"))
        (control / "tamper-pushes").touch()
        _ok(job.do("save", step=20))
        reports = [r["reports"][-1] for r in _ok(job.do("replicated"))]
        (control / "tamper-pushes").unlink()
        for i in (0, 3):  # host0 and host3 push to host1 (through the mitm) and to one more host
            assert reports[i]["step"] == 20 and not reports[i]["ok"], reports[i]
            assert set(reports[i]["errors"]) == {"host1"}, reports[i]
        _ok(job.do("save", step=30))
        assert all(r["reports"][-1]["ok"] for r in _ok(job.do("replicated")))
        job.finish()
        forged_pushes = json.loads((control / "mitm.json").read_text())["forged_pushes"]
        assert forged_pushes >= 2, forged_pushes

        hosts[0].kill()
        hosts[0].revive()
        (control / "tamper-replies").touch()
        job = Job(hosts, hosts.hosts[:4], "mitm-restore", emulator, prefix="mitm", per_process=per)
        restored = _ok(job.do("restore"))
        job.finish()
        counts = json.loads((control / "mitm.json").read_text())
        assert counts["forged_replies"] >= 1, (
            counts
        )  # host0 asked host1 (its first successor) first
        for r in restored:
            assert r["step"] == 30 and r["checked_shards"] == 10 and r["bytes_read_storage"] == 0, r
        assert restored[0]["bytes_by_tier"].get("peer:host2", 0) > 0, restored[0]
        print(f"man in the middle: {counts}")
    finally:
        relay.kill()
        relay.wait()
