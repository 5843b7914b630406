"""fastckpt across simulated hosts that are really apart (network + mount namespaces).

Run (as root, or where unprivileged user namespaces work)::

    python -m benchmarks.hosts            # full run (~10 min on the 2-core VM)
    python -m benchmarks.hosts --quick    # small sizes (< 3 min)

One cluster (:class:`fastckpt_examples.cluster.hosts.SimulatedHosts`): up to 8 job hosts, the GCS
emulator on a host of its own (filesystem backend on the disk) and a relay host; the job
hosts' links are shaped with tbf (``LinkShape(rate_mbit=...)``, both directions), the
emulator's and the relay's are not. Every job is ``fastckpt_examples.cluster.multiprocess`` (one JAX
process per host, ``jax.distributed`` across the switch) running :mod:`benchmarks._hosts_job`;
the peer secret reaches the processes as ``FASTCKPT_PEER_SECRET``. Sections, in one run:

1. **Lost host** (4 hosts x 2 devices, ``--share-mib`` per host): a RAM step (one replica per host;
   also saved to GCS with ``force=True``; over unshaped links); per link rate (``--rates``,
   ``0``: unshaped) host 3 is killed and revived empty, a new 4-process job restores
   (``--repeats`` times, each after a new loss), and the replaced host's ``restore``
   time and bytes per tier are recorded. Beside it, over the same link between the same two hosts
   (the replaced one and the peer it pulled from), the same byte count: raw TCP (1 and 4 streams;
   1 into new memory) and ``PeerClient.get_chunks`` from a ``PeerServer`` (16 MiB chunks) with
   ``frame_mac`` on (1 and 2 connections; 1 into new memory) and off
   (:mod:`benchmarks._hosts_wire`), interleaved, median of ``--repeats`` after a warm-up; CPU
   seconds of both ends per GiB.
2. **Wire protection cost**: from 1, plus GMAC and crc32c alone on one thread
   (``benchmarks.wire_mac.measure_macs``).
3. **Resize 4 -> 3** at the last shaped rate: restore from RAM + peers, then the same step
   from the emulator (a manager without ``ram=``), per host.
4. **Link rates**: section 1's figures side by side per rate.
5. **Scaling** (``--scale-hosts``, 1 device per host, ``--scale-share-mib`` per host, the
   last shaped rate): save, lose the last host, restore; its restore time split into
   selection, fetch and device placement, and the managers' start-up (discovery + peer check).
6. **GCS at a distance**: ``benchmarks/_delay_relay.py`` on the relay host delays every byte
   ``--delays-ms`` each way; one process (2 devices) saves and restores ``--remote-mib`` with
   ``upload_concurrency`` 1/4/16 and ``read_concurrency`` 1/8/32 (16 MiB objects), each
   ``--repeats`` times in rotating order.

Every restore is checked bit for bit (a difference fails the run). Writes
``hosts.{json,md,png}`` to ``--out-dir`` (default ``benchmarks/results``; ``hosts_quick.*``
with ``--quick``); exits 1 if a check failed. Speed targets are JSON ``checks``; ``goals``
are reported, not enforced.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks._common import RESULTS_DIR, MiB, median, run_header, write_results
from benchmarks._hosts_job import BUCKET
from benchmarks._hosts_report import plot, report, summarise

render = report  # the markdown page of a results JSON (benchmarks._common.render_block calls it)

if TYPE_CHECKING:
    from fastckpt.testing.gcs_emulator import GcsEmulator
    from fastckpt_examples.cluster.hosts import Host, SimulatedHosts

JOB = str(Path(__file__).with_name("_hosts_job.py"))
RELAY = str(Path(__file__).with_name("_delay_relay.py"))
CHUNK = 16 * MiB
GIB = float(1 << 30)


@dataclasses.dataclass(frozen=True)
class Config:
    """What one run measures (see the module docstring)."""

    share_mib: int
    scale_share_mib: int
    remote_mib: int
    rates: tuple[int, ...]
    """Link rates in Mbit/s; 0 is unshaped."""
    scale_hosts: tuple[int, ...]
    delays_ms: tuple[int, ...]
    repeats: int
    quick: bool
    uploads: tuple[int, ...] = (1, 4, 16)
    reads: tuple[int, ...] = (1, 8, 32)

    @property
    def shaped(self) -> tuple[int, ...]:
        """The shaped link rates, in order (the last one serves the resize and scaling)."""
        return tuple(r for r in self.rates if r)


_FIRST_GCS_REQUEST = """
import asyncio, json, sys, time
from fastckpt.storage import GcsOptions, GcsStore
store = GcsStore(sys.argv[2], options=GcsOptions(endpoint=sys.argv[1]))
times = []
for _ in range(2):
    t0 = time.perf_counter()
    asyncio.run(store.list("no-such-prefix/"))
    times.append(time.perf_counter() - t0)
print(json.dumps({"first_s": times[0], "next_s": times[1]}))
"""
"""Seconds of a fresh process's first GCS request (it creates the client) and of the next."""


class BenchError(RuntimeError):
    """A helper process failed or did not answer in time."""


def _line(proc: subprocess.Popen[str], timeout_s: float, what: str) -> str:
    """The next line ``proc`` prints, or BenchError after ``timeout_s``."""
    out: list[str] = []
    assert proc.stdout is not None
    stdout = proc.stdout
    reader = threading.Thread(target=lambda: out.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not out or not out[0]:
        raise BenchError(f"{what}: no answer within {timeout_s:.0f} s (exit status {proc.poll()})")
    return out[0]


def _stop(proc: subprocess.Popen[str]) -> None:
    """Close ``proc``'s stdin (helpers exit then) and reap it; SIGKILL after 30 s."""
    if proc.stdin is not None and not proc.stdin.closed:
        proc.stdin.close()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _peer_bytes(tiers: dict[str, int]) -> tuple[int, str | None]:
    """Bytes a restore got from peers (``bytes_by_tier``), and the peer that sent the most."""
    peers = {k.removeprefix("peer:"): v for k, v in tiers.items() if k.startswith("peer:")}
    return sum(peers.values()), max(peers, key=lambda k: peers[k]) if peers else None


class Bench:
    """The cluster and the sections run on it (see the module docstring)."""

    def __init__(
        self, hosts: SimulatedHosts, emulator: GcsEmulator, relay: Host, config: Config
    ) -> None:
        import fastckpt

        self.hosts, self.emu, self.relay, self.cfg = hosts, emulator, relay, config
        self.job_hosts = hosts.hosts[: max(4, *config.scale_hosts)]
        self.env = {"FASTCKPT_PEER_SECRET": fastckpt.new_peer_secret()}
        self.checked_shards = 0
        """Restored shards compared with the saved values (a difference raises)."""
        self.checked_wire_bytes = 0
        """Bytes received by get_chunks compared with the served ones."""

    def job(self, fn: str, on: list[Host], devices: int, **kwargs: Any) -> list[dict[str, Any]]:
        """``_hosts_job.<fn>`` on the hosts ``on`` (one process each, ``member``: its name)."""
        from fastckpt_examples.cluster.multiprocess import run_processes

        outcomes = run_processes(
            f"{JOB}:{fn}",
            num_processes=len(on),
            devices_per_process=devices,
            kwargs=[{**kwargs, "member": h.name} for h in on],
            hosts=on,
            env=self.env,
            timeout_s=600,
        )
        values = [o.value for o in outcomes]
        for v in values if fn == "restore" else []:
            self.checked_shards += sum(v[t]["checked_shards"] for t in ("ram", "storage") if t in v)
        return values

    def shape(self, on: list[Host], rate: int) -> None:
        from fastckpt_examples.cluster.hosts import LinkShape

        for h in on:
            h.shape(LinkShape(rate_mbit=rate or None))

    def replace(self, host: Host) -> None:
        """Lose ``host`` (its processes and tmpfs) and bring up an empty one in its place."""
        host.kill()
        host.revive()

    # ------------------------------------------------------------------ sections 1, 2, 4
    def lost_host(self) -> dict[str, Any]:
        on = self.hosts.hosts[:4]
        total = self.cfg.share_mib * MiB * 4
        common = {
            "endpoint": self.emu.endpoint,
            "prefix": "lost",
            "ram_root": "/dev/shm/fastckpt-bench/lost",
            "total_bytes": total,
        }
        self.shape(on, 0)
        saved = self.job("save", on, 2, step=10, force=True, **common)
        state = sum(v["staged_bytes"] for v in saved)  # each box is staged by one process
        out: dict[str, Any] = {"save": saved, "state_bytes": state, "rates": {}}
        for rate in self.cfg.rates:
            self.shape(on, rate)
            runs = []
            for _ in range(self.cfg.repeats):
                self.replace(on[3])
                runs.append(self.job("restore", on, 2, tiers=["ram"], **common))
            restored = sorted(runs, key=lambda v: v[3]["ram"]["seconds"])[len(runs) // 2]
            nbytes, source = _peer_bytes(restored[3]["ram"]["bytes_by_tier"])
            if source is None:
                raise BenchError(f"the replaced host read nothing from peers: {restored[3]}")
            src = next(h for h in on if h.name == source)
            out["rates"][str(rate)] = {
                "restore": restored,  # the run with the replaced host's median time
                "runs": runs,
                "source": source,
                "peer_bytes": nbytes,
                "link": self.link(src, on[3], nbytes - nbytes % 8),
            }
            probe = on[3].run(
                [sys.executable, "-c", _FIRST_GCS_REQUEST, self.emu.endpoint, BUCKET],
                timeout=60,
                capture_output=True,
                text=True,
            )
            out["rates"][str(rate)]["first_gcs_request"] = json.loads(probe.stdout)
            took = ", ".join(f"{v[3]['ram']['seconds']:.2f}" for v in runs)
            print(f"  rate {rate or 'unshaped'}: replaced host {took} s", flush=True)
        return out

    def link(self, server_host: Host, client_host: Host, nbytes: int) -> dict[str, Any]:
        """Raw TCP and get_chunks from ``server_host`` to ``client_host`` (the modes of
        ``_hosts_wire``), interleaved after a warm-up round: per mode the median GB/s and the
        CPU seconds per GiB of each end; ``raw``: the faster raw TCP stream count."""
        py = [sys.executable, "-m", "benchmarks._hosts_wire"]
        env = {**os.environ, **self.env}
        pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True, "env": env}
        server = server_host.popen(
            [
                *py,
                "serve",
                server_host.address,
                str(nbytes),
                str(CHUNK),
                "/dev/shm/fastckpt-bench-wire",
            ],
            **pipes,
        )
        client = None
        try:
            cfg = _line(server, 120, "wire server")
            client = client_host.popen(
                [*py, "client", server_host.address, str(server.pid)], **pipes
            )
            assert client.stdin is not None
            client.stdin.write(cfg)
            modes = {
                "raw1": ("raw", 1),
                "raw4": ("raw", 4),
                "rawfresh": ("rawfresh", 1),
                "on": ("on", 1),
                "on2": ("on", 2),
                "off": ("off", 1),
                "fresh": ("fresh", 1),
            }
            keys = list(modes)
            runs: dict[str, list[dict[str, Any]]] = {}
            for r in range(self.cfg.repeats + 1):  # round 0: warm-up (connections, handshakes)
                for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
                    mode, streams = modes[key]
                    client.stdin.write(json.dumps({"mode": mode, "streams": streams}) + "\n")
                    client.stdin.flush()
                    res = json.loads(_line(client, 300, "wire client"))
                    self.checked_wire_bytes += res.get("checked_bytes", 0)
                    if r:
                        runs.setdefault(key, []).append(res)
        finally:
            for p in (client, server):
                if p is not None:
                    _stop(p)
        out: dict[str, Any] = {"nbytes": nbytes}
        for key, rs in runs.items():
            gib = rs[0]["bytes"] / GIB
            out[key] = {
                "gbps": rs[0]["bytes"] / median([x["seconds"] for x in rs]) / 1e9,
                "client_cpu_s_per_gib": median([x["client_cpu_s"] for x in rs]) / gib,
                "server_cpu_s_per_gib": median([x["server_cpu_s"] for x in rs]) / gib,
                "seconds": [x["seconds"] for x in rs],
            }
        out["raw"] = max(("raw1", "raw4"), key=lambda k: out[k]["gbps"])
        return out

    # ------------------------------------------------------------------ section 3
    def resize(self) -> dict[str, Any]:
        on = self.hosts.hosts[:3]
        self.shape(self.hosts.hosts[:4], self.cfg.shaped[-1] if self.cfg.shaped else 0)
        return {
            "rate": self.cfg.shaped[-1] if self.cfg.shaped else 0,
            "hosts": self.job(
                "restore",
                on,
                2,
                endpoint=self.emu.endpoint,
                prefix="lost",
                ram_root="/dev/shm/fastckpt-bench/lost",
                total_bytes=self.cfg.share_mib * MiB * 4,
                tiers=["ram", "storage"],
            ),
        }

    # ------------------------------------------------------------------ section 5
    def scaling(self) -> dict[str, Any]:
        rate = self.cfg.shaped[-1] if self.cfg.shaped else 0
        out: dict[str, Any] = {"rate": rate, "share_bytes": self.cfg.scale_share_mib * MiB}
        for n in self.cfg.scale_hosts:
            on = self.hosts.hosts[:n]
            for h in self.job_hosts:
                self.replace(h)  # empty tiers: only this configuration's data in RAM
            self.shape(on, rate)
            common = {
                "endpoint": self.emu.endpoint,
                "prefix": f"scale{n}",
                "ram_root": f"/dev/shm/fastckpt-bench/scale{n}",
                "total_bytes": self.cfg.scale_share_mib * MiB * n,
            }
            saved = self.job("save", on, 1, step=10, force=False, **common)
            self.replace(on[-1])
            restored = self.job("restore", on, 1, tiers=["ram"], **common)
            out[str(n)] = {"save": saved, "restore": restored}
            print(f"  {n} hosts: replaced host {restored[-1]['ram']['seconds']:.2f} s", flush=True)
        return out

    # ------------------------------------------------------------------ section 6
    def remote(self) -> dict[str, Any]:
        for h in self.job_hosts:
            self.replace(h)  # their RAM tiers are not needed any more
        relays, endpoints = [], {"0": self.emu.endpoint}
        try:
            for d in self.cfg.delays_ms:
                port = self.relay.free_port()
                p = self.relay.popen(
                    [
                        sys.executable,
                        RELAY,
                        self.relay.address,
                        str(port),
                        self.emu.address,
                        str(self.emu.port),
                        str(d),
                    ],
                    stdout=subprocess.PIPE,
                    text=True,
                )
                relays.append(p)
                if _line(p, 30, "delay relay").strip() != "listening":
                    raise BenchError("the delay relay did not start")
                endpoints[str(d)] = f"http://{self.relay.address}:{port}"
            total = self.cfg.remote_mib * MiB
            values = self.job(
                "remote_storage",
                [self.hosts[0]],
                2,
                endpoints=endpoints,
                total_bytes=total,
                uploads=list(self.cfg.uploads),
                reads=list(self.cfg.reads),
                object_bytes=CHUNK,
                repeats=self.cfg.repeats,
            )
        finally:
            for p in relays:
                p.kill()
                p.wait()
        for by_delay in values[0].values():
            for runs in by_delay["restore"].values():
                self.checked_shards += sum(r["checked_shards"] for r in runs)
        return {"total_bytes": total, "object_bytes": CHUNK, "delays": values[0]}


def _parse(argv: list[str] | None) -> tuple[Config, Path, bool]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="small sizes (< 3 min)")
    p.add_argument("--share-mib", type=int)
    p.add_argument("--scale-share-mib", type=int)
    p.add_argument("--remote-mib", type=int)
    p.add_argument("--rates", default="2000,4000,0", help="Mbit/s per host link; 0: unshaped")
    p.add_argument("--scale-hosts", default="2,4,8")
    p.add_argument("--delays-ms", default="10,25", help="relay delay each way")
    p.add_argument("--repeats", type=int)
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument(
        "--update-docs",
        action="store_true",
        help="rewrite the docs/benchmarks.md block even for --quick or another --out-dir",
    )
    a = p.parse_args(argv)

    def ints(s: str) -> tuple[int, ...]:
        return tuple(int(x) for x in s.split(",") if x)

    cfg = Config(
        share_mib=a.share_mib or (48 if a.quick else 512),
        scale_share_mib=a.scale_share_mib or (32 if a.quick else 256),
        remote_mib=a.remote_mib or (64 if a.quick else 256),
        rates=ints(a.rates),
        scale_hosts=ints(a.scale_hosts),
        delays_ms=ints(a.delays_ms),
        repeats=a.repeats or (2 if a.quick else 3),
        quick=a.quick,
    )
    if (
        not cfg.rates
        or not cfg.scale_hosts
        or not 2 <= min(cfg.scale_hosts) <= max(cfg.scale_hosts) <= 64
    ):
        p.error("--rates and --scale-hosts must not be empty; cluster sizes are 2..64")
    return cfg, a.out_dir, a.update_docs


def main(argv: list[str] | None = None) -> int:
    from benchmarks.wire_mac import measure_macs
    from fastckpt.testing.gcs_emulator import GcsEmulator
    from fastckpt_examples.cluster.hosts import LinkShape, SimulatedHosts

    cfg, out_dir, update_docs = _parse(argv)
    t0 = time.monotonic()
    doc = run_header("benchmarks.hosts", argv, cfg)
    print("GMAC / crc32c alone ...", flush=True)
    doc["macs"] = measure_macs(3)
    with SimulatedHosts(max(4, *cfg.scale_hosts), name="bench") as hosts:
        gcs = hosts.add_host("gcs", link=LinkShape())
        relay = hosts.add_host("relay", link=LinkShape())
        with GcsEmulator(host=gcs, backend="filesystem", root=str(hosts.shared_dir / "gcs")) as emu:
            emu.create_bucket(BUCKET)
            bench = Bench(hosts, emu, relay, cfg)
            for name, section in (
                ("lost_host", bench.lost_host),
                ("resize", bench.resize),
                ("scaling", bench.scaling),
                ("remote", bench.remote),
            ):
                print(f"{name} ...", flush=True)
                doc[name] = section()
            doc["checked_shards"], doc["checked_wire_bytes"] = (
                bench.checked_shards,
                bench.checked_wire_bytes,
            )
    doc["machine"]["load_end"] = os.getloadavg()
    doc["seconds"] = time.monotonic() - t0
    summarise(doc)
    return write_results(
        "hosts", doc, out_dir, report=report, plot=plot, quick=cfg.quick, update_docs=update_docs
    )


if __name__ == "__main__":
    sys.exit(main())
