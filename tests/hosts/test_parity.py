"""Parity instead of copies, across hosts that are really apart (fastckpt_examples.cluster.hosts).

A 4-host x 2-device job with ``RamOptions(redundancy="parity", group_size=4)`` (one group,
m = 1) saves step 5 to GCS (the emulator on a host of its own) and steps 10 and 20 to RAM
only. Host 3 is lost with its tmpfs (SIGKILL, ``Host.kill``) and replaced by an empty host:

* a new 4-process job restores step 20 bit for bit with zero chunk bytes from GCS (counted
  at the emulator's own link too): the replacement's share is rebuilt from the survivors'
  data and parity (``bytes_by_tier["rebuilt"]``), the survivors read their own RAM;
* a 3-process job (3 x 2 mesh, a resized job) restores step 20 the same way;
* a byte flipped in a survivor's parity stripe, or in a survivor's own data, of step 20 in
  its tmpfs: the bad bytes are detected (a ``corrupt`` fallback) and never returned: every
  process restores one and the same step, bit for bit (an older RAM step when step 20 cannot
  be rebuilt any more);
* a second host of the group lost (two erasures, m = 1): no RAM step can be rebuilt, the job
  restores storage's step 5, bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fastckpt.options import RamOptions
from fastckpt.testing.gcs_emulator import GcsEmulator
from fastckpt_examples.cluster.hosts import Host, SimulatedHosts

from . import cross_workers as cw
from ._job import Job, ok

pytestmark = [
    pytest.mark.hosts,
    pytest.mark.skipif(
        "redundancy" not in {f.name for f in dataclasses.fields(RamOptions)},
        reason="RamOptions has no redundancy field yet (parity groups, issue #27)",
    ),
]

PARITY = {"redundancy": "parity", "group_size": 4}
PREFIX = "parity"
TIER = f"/dev/shm/fastckpt/{PREFIX}"  # cross_workers' ram_root for this prefix, on every host
FLIP = str(Path(__file__).with_name("_tier_flip.py"))
GCS_CONTROL_BYTES = 64 << 10
"""What a restore may still receive from GCS without reading chunks: listings, metadata."""
LOST = 3


@dataclasses.dataclass
class Lost:
    """The cluster after the loss of host 3: new jobs restore on it, bytes are flipped in it."""

    hosts: SimulatedHosts
    emulator: GcsEmulator
    gcs: Host
    jobs: int = 0

    def restore(self, on: list[Host]) -> list[dict[str, Any]]:
        """A new job on ``on`` restores the newest step; each process's result, checked bit
        for bit against the step it reports."""
        self.jobs += 1
        job = Job(
            self.hosts,
            on,
            f"restore-{self.jobs}",
            self.emulator,
            prefix=PREFIX,
            per_process=[{"ram": PARITY}] * len(on),
        )
        restored = job.do("restore")
        job.finish()  # the processes exit even when a restore failed (it is reported, not raised)
        ok(restored)
        assert len({r["step"] for r in restored}) == 1, restored  # one step, every process
        assert all(r["checked_shards"] > 0 for r in restored), restored
        return restored

    def gcs_sent(self) -> int:
        return self.gcs.link_bytes()[1]  # what the emulator's host sent on its link

    def flip(self, host: int, step: int, kind: str) -> dict[str, Any]:
        """Flip (or flip back) one byte of ``kind`` (``own``, ``parity``) in a host's tier."""
        done = self.hosts[host].run(
            [sys.executable, FLIP, TIER, str(step), kind],
            timeout=30,
            check=True,
            capture_output=True,
            text=True,
        )
        return dict(json.loads(done.stdout))


@pytest.fixture(scope="module")
def lost() -> Iterator[Lost]:
    """Trained (steps 5 in GCS, 10 and 20 in RAM with parity), then host 3 lost and replaced."""
    with SimulatedHosts(4) as hosts:
        gcs = hosts.add_host("gcs")
        with GcsEmulator(host=gcs) as emulator:
            emulator.create_bucket(cw.BUCKET)
            job = Job(
                hosts,
                hosts.hosts[:4],
                "train",
                emulator,
                prefix=PREFIX,
                per_process=[{"ram": PARITY}] * 4,
            )
            ok(job.do("save", step=5, force=True))
            for step in (10, 20):
                assert all(r["tiers"] == ["ram"] for r in ok(job.do("save", step=step)))
            pushed = ok(job.do("replicated"))
            assert all(r["reports"][-1]["step"] == 20 and r["reports"][-1]["ok"] for r in pushed)
            summaries = [o.value for o in job.finish()]
            assert all(s["persistent_steps"] == [5] for s in summaries), summaries
            hosts[LOST].kill()  # the machine is lost with its tmpfs
            hosts[LOST].revive()  # its replacement: same name and address, empty
            yield Lost(hosts, emulator, gcs)


def test_a_lost_host_is_rebuilt_from_parity_with_zero_gcs_bytes(lost: Lost) -> None:
    before = lost.gcs_sent()
    restored = lost.restore(lost.hosts.hosts[:4])
    gcs_bytes = lost.gcs_sent() - before
    for r in restored:
        assert r["step"] == 20 and r["checked_shards"] == 10 and r["bytes_read_storage"] == 0, r
        assert "corrupt" not in r["fallbacks"], r
    replaced = restored[LOST]["bytes_by_tier"]
    assert "ram" not in replaced and replaced.get("rebuilt", 0) > 0, replaced
    assert all(r["bytes_by_tier"].get("ram", 0) > 0 for r in restored[:LOST]), restored
    assert gcs_bytes < GCS_CONTROL_BYTES, gcs_bytes  # listings only: no chunk came from GCS
    print(f"replaced host: {replaced}; GCS bytes sent during the restore: {gcs_bytes}")


def test_a_resized_job_rebuilds_the_lost_share_with_zero_gcs_bytes(lost: Lost) -> None:
    before = lost.gcs_sent()
    restored = lost.restore(lost.hosts.hosts[:3])  # 3 x 2 devices
    gcs_bytes = lost.gcs_sent() - before
    for r in restored:
        assert r["step"] == 20 and r["checked_shards"] == 10 and r["bytes_read_storage"] == 0, r
    # host 3's chunks are now spread over the three survivors: each decodes what it needs
    assert sum(r["bytes_by_tier"].get("rebuilt", 0) for r in restored) > 0, restored
    assert gcs_bytes < GCS_CONTROL_BYTES, gcs_bytes


@pytest.mark.parametrize(("host", "kind"), [(1, "parity"), (0, "own")], ids=["parity", "data"])
def test_a_corrupt_survivor_stripe_is_detected_and_never_returned(
    lost: Lost, host: int, kind: str
) -> None:
    """One byte of step 20 flipped in a survivor's tmpfs: its parity stripe (used to rebuild
    host 3's share) or its own data (needed by itself and by the rebuild). The decoded or read
    chunk fails its crc32c; with host 3 gone nothing else can supply it, so every process
    abandons step 20 together and restores the newest step it can, bit for bit."""
    flipped = lost.flip(host, 20, kind)
    try:
        restored = lost.restore(lost.hosts.hosts[:4])
    finally:
        assert lost.flip(host, 20, kind) == flipped  # flipped back for the next test
    step = restored[0]["step"]
    assert step in (10, 5), restored  # never step 20 with the bad bytes in it
    fallbacks = {k: v for r in restored for k, v in r["fallbacks"].items()}
    assert fallbacks.get("corrupt", 0) > 0, restored  # detected, not silently skipped
    print(
        f"{kind} byte flipped on host{host} ({flipped['chunk']}): step {step} restored; "
        f"fallbacks {[r['fallbacks'] for r in restored]}; "
        f"host{LOST} {restored[LOST]['bytes_by_tier']}"
    )
    if step == 10:  # step 10's stripes are intact: rebuilt from RAM again
        assert all(r["bytes_read_storage"] == 0 for r in restored), restored
        assert restored[LOST]["bytes_by_tier"].get("rebuilt", 0) > 0, restored


def test_two_lost_hosts_of_a_group_restore_the_storage_step(lost: Lost) -> None:
    """m = 1 and a second host of the group lost: nothing in RAM can be rebuilt; the outcome
    is storage's step 5, bit for bit, never a RAM step with holes or wrong bytes."""
    lost.hosts[2].kill()
    lost.hosts[2].revive()
    restored = lost.restore(lost.hosts.hosts[:4])
    for r in restored:
        assert r["step"] == 5 and r["checked_shards"] == 10 and r["bytes_read_storage"] > 0, r
        assert r["bytes_by_tier"].get("rebuilt", 0) == 0, r
