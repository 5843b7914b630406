"""Real multi-host jobs on simulated hosts: jax.distributed across the switch, GCS as a host."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest

from fastckpt.testing.gcs_emulator import GcsEmulator
from fastckpt_examples.cluster.hosts import SimulatedHosts
from fastckpt_examples.cluster.multiprocess import run_processes

pytestmark = pytest.mark.hosts

WORKERS = str(Path(__file__).with_name("workers.py"))


def test_a_jax_job_spans_hosts_and_reruns_on_the_survivors() -> None:
    with SimulatedHosts(3) as hosts:
        t0 = time.monotonic()
        outcomes = run_processes(
            f"{WORKERS}:global_sum",
            num_processes=2,
            devices_per_process=2,
            hosts=hosts,
            timeout_s=90,
        )
        first_job_s = time.monotonic() - t0
        values = [o.value for o in outcomes]
        assert [(v["hostname"], v["address"]) for v in values] == [
            (h.hostname, h.address) for h in hosts.hosts[:2]
        ]
        for v in values:
            assert v["sum"] == v["expected"] and v["devices"] == 4 and v["local_devices"] == 2
        assert [v["process"] for v in values] == [0, 1]
        hosts[1].kill()  # lost; the job restarts on an explicit list of the hosts left
        outcomes = run_processes(
            f"{WORKERS}:global_sum",
            num_processes=2,
            devices_per_process=2,
            hosts=[hosts[0], hosts[2]],
            timeout_s=90,
        )
        assert [o.value["hostname"] for o in outcomes] == ["fc-host0", "fc-host2"]
        assert all(o.value["sum"] == o.value["expected"] for o in outcomes)
        assert [p.name for p in hosts.shared_dir.iterdir()] == [".etc-hosts"]  # jobs cleaned up
        print(f"2-host JAX job: {first_job_s:.1f} s")


def test_the_gcs_emulator_runs_as_a_host_that_jobs_reach() -> None:
    with SimulatedHosts(2) as hosts, GcsEmulator(host=hosts.add_host("gcs")) as emulator:
        assert emulator.endpoint.startswith(f"http://{hosts[2].address}:")
        emulator.create_bucket("fc-bucket")
        emulator.create_bucket("fc-bucket")  # idempotent
        code = f"""
import asyncio
from fastckpt.storage import GcsOptions, GcsStore

async def main():
    store = GcsStore("fc-bucket", "p", options=GcsOptions(endpoint={emulator.endpoint!r}))
    try:
        import sys
        if sys.argv[1] == "put":
            await store.put("k", b"from " + sys.argv[2].encode(), mode="create")
        print(bytes(await store.get("k")).decode())
    finally:
        await store.close()

asyncio.run(main())
"""
        put = hosts[0].run(
            [sys.executable, "-c", code, "put", hosts[0].hostname],
            timeout=60,
            capture_output=True,
            text=True,
        )
        got = hosts[1].run(
            [sys.executable, "-c", code, "get"], timeout=60, capture_output=True, text=True
        )
        assert put.stdout.strip() == got.stdout.strip() == "from fc-host0", (put, got)
        port = int(emulator.endpoint.rsplit(":", 1)[1])
        with pytest.raises(OSError):  # this namespace has no route to the hosts
            socket.create_connection((hosts[2].address, port), timeout=3).close()
