"""Parity instead of copies: what a RAM checkpoint's redundancy costs, replicas=1 beside
parity over groups of 4 hosts (m = 1), in one run on the same simulated hosts.

Run (as root, or where unprivileged user namespaces work)::

    python -m benchmarks.ram_redundancy            # full run (~3 min on the 2-core VM)
    python -m benchmarks.ram_redundancy --quick    # small sizes (~1 min)

One cluster (:class:`fastckpt_examples.cluster.hosts.SimulatedHosts`) of 4 hosts, one JAX
process per host with 2 CPU devices (``fastckpt_examples.cluster.multiprocess``,
``jax.distributed`` across the switch), each holding ``--share-mib`` of the state; every
host's link shaped to ``--rate-mbit`` (2 Gbit/s: the network, not the two CPUs every host
shares here, bounds a transfer, as on a cluster; ``0``: unshaped). Every job runs
:mod:`benchmarks._redundancy_job`. Per mode (``replicas``: ``RamOptions(replicas=1)``;
``parity``: ``RamOptions(redundancy="parity", group_size=4)``), one training job measures:

1. **Step overhead**: a loop of ``--steps`` host-idle steps (each sleeps ``--step-s``; every
   10th then makes a new state with a jitted update) without and with a RAM checkpoint
   every 10 steps, alternately, ``--repeats`` times each.
2. **Bytes on the wire**: ``--ckpts`` RAM checkpoints, each between two barriers: the bytes
   each host's link sent (its namespace's ``eth0``), per checkpoint.
3. **RAM held**: after the last step's push, the bytes of the data files of that step in each
   host's tier directory, as a multiple of the host's own share (the bytes it staged).

Then host 3 is lost with its tmpfs and replaced by an empty host, and one job restores the
newest step ``--repeats`` times per mode (fresh managers, modes in rotating order), every
shard checked bit for bit: the replaced host's share comes from a replica (``replicas``) or
is rebuilt from the survivors' data and parity (``parity``). Beside it, in the same run:
the peer link between two hosts (raw TCP and ``PeerClient.get_chunks``, one stream,
``benchmarks._hosts_wire``), and XOR (the decode) and memcpy on this machine.

Writes ``ram_redundancy.{json,md,png}`` to ``--results-dir`` (default
``benchmarks/results``; ``ram_redundancy_quick.*`` with ``--quick``) and, for the committed
full run, the block of ``docs/benchmarks.md``; exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from benchmarks._common import RESULTS_DIR, MiB, measure_memcpy, run_header, write_results
from benchmarks._redundancy_report import plot, report, summarise
from benchmarks.hosts import BenchError, _line, _stop

render = report  # the markdown page of a results JSON (benchmarks._common.render_block calls it)

if TYPE_CHECKING:
    from fastckpt_examples.cluster.hosts import Host

JOB = str(Path(__file__).with_name("_redundancy_job.py"))
GROUP = 4
INTERVAL = 10
LOST = 3
MODES: dict[str, dict[str, Any]] = {
    "replicas": {"replicas": 1},
    "parity": {"redundancy": "parity", "group_size": GROUP},
}
"""The ``RamOptions`` fields of each mode (m = 1: one lost host per group)."""


@dataclasses.dataclass(frozen=True)
class Config:
    """What one run measures (see the module docstring)."""

    share_mib: int
    steps: int
    step_s: float
    repeats: int
    ckpts: int
    rate_mbit: int
    """Each host's link rate in Mbit/s; 0 is unshaped."""
    quick: bool
    interval: int = INTERVAL
    group_size: int = GROUP


def _job(
    fn: str, on: list[Host], env: dict[str, str], kwargs: dict[str, Any]
) -> list[dict[str, Any]]:
    """``_redundancy_job.<fn>`` on the hosts ``on`` (one process each, ``member``: its name)."""
    from fastckpt_examples.cluster.multiprocess import run_processes

    outcomes = run_processes(
        f"{JOB}:{fn}",
        num_processes=len(on),
        devices_per_process=2,
        kwargs=[{**kwargs, "member": h.name} for h in on],
        hosts=on,
        env=env,
        timeout_s=900,
    )
    return [o.value for o in outcomes]


def measure_link(
    server_host: Host, client_host: Host, nbytes: int, env: dict[str, str], repeats: int
) -> dict[str, Any]:
    """Raw TCP and ``get_chunks`` (frame MACs on) from ``server_host`` into ``client_host``,
    one stream, ``nbytes`` (``benchmarks._hosts_wire``): GB/s, median after a warm-up."""
    py = [sys.executable, "-m", "benchmarks._hosts_wire"]
    pipes = {
        "stdin": subprocess.PIPE,
        "stdout": subprocess.PIPE,
        "text": True,
        "env": {**os.environ, **env},
    }
    wire = "/dev/shm/fastckpt-bench-redundancy-wire"
    args = [*py, "serve", server_host.address, str(nbytes), str(16 * MiB), wire]
    server = server_host.popen(args, **pipes)
    client = None
    seconds: dict[str, list[float]] = {"raw": [], "on": []}
    try:
        cfg = _line(server, 120, "wire server")
        client = client_host.popen([*py, "client", server_host.address, str(server.pid)], **pipes)
        assert client.stdin is not None
        client.stdin.write(cfg)
        for r in range(repeats + 1):  # round 0: warm-up (connections, handshakes)
            for mode in ("raw", "on") if r % 2 else ("on", "raw"):
                client.stdin.write(json.dumps({"mode": mode, "streams": 1}) + "\n")
                client.stdin.flush()
                res = json.loads(_line(client, 300, "wire client"))
                if r:
                    seconds[mode].append(res["seconds"])
    finally:
        for p in (client, server):
            if p is not None:
                _stop(p)
    return {
        "nbytes": nbytes,
        **{f"{m}_gbps": nbytes / float(np.median(s)) / 1e9 for m, s in seconds.items()},
        "seconds": seconds,
    }


def measure_decode(nbytes: int, reps: int = 5) -> dict[str, float]:
    """The rebuild's XOR (``xor_into``: one buffer into another, what each parity holder and
    the restorer do per byte) and memcpy, on one thread, ``nbytes`` each, best of ``reps``
    (GB/s of output)."""
    from fastckpt.replicas._parity_layout import xor_into

    a = np.ones(nbytes, np.uint8)
    b = np.full(nbytes, 7, np.uint8)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        xor_into(a, b)
        best = min(best, time.perf_counter() - t0)
    return {"xor_gbps": nbytes / best / 1e9, **measure_memcpy(nbytes, reps=reps)}


def run(cfg: Config) -> dict[str, Any]:
    """Every section on one cluster; the raw figures (see :mod:`benchmarks._redundancy_report`)."""
    import fastckpt
    from fastckpt_examples.cluster.hosts import LinkShape, SimulatedHosts

    share = cfg.share_mib * MiB
    total = share * GROUP
    env = {"FASTCKPT_PEER_SECRET": fastckpt.new_peer_secret()}
    out: dict[str, Any] = {"share_bytes": share, "state_bytes": total, "train": {}}
    link = LinkShape(rate_mbit=cfg.rate_mbit or None)
    with SimulatedHosts(GROUP, name="bench", link=link) as hosts:
        on = hosts.hosts[:GROUP]
        storage = str(hosts.shared_dir / "storage")
        common = {"storage": storage, "total_bytes": total, "interval": cfg.interval}
        final = 1_000_000  # past every loop's step: the newest step of both modes
        for mode, ram in MODES.items():
            print(f"train, {mode} ...", flush=True)
            out["train"][mode] = _job(
                "train",
                on,
                env,
                {
                    **common,
                    "mode": mode,
                    "ram": ram,
                    "steps": cfg.steps,
                    "step_s": cfg.step_s,
                    "repeats": cfg.repeats,
                    "ckpts": cfg.ckpts,
                    "final": final,
                },
            )
        print(f"host {LOST} lost; restore ...", flush=True)
        on[LOST].kill()  # the machine is lost with its tmpfs: every mode's tier
        on[LOST].revive()
        out["restore"] = _job(
            "restore", on, env, {**common, "modes": MODES, "repeats": cfg.repeats}
        )
        if any(r["step"] != final for v in out["restore"] for rs in v["runs"].values() for r in rs):
            raise BenchError(f"a restore did not restore step {final}: {out['restore']}")
        print("peer link ...", flush=True)
        out["link"] = measure_link(on[0], on[LOST], share - share % 8, env, cfg.repeats)
    print("XOR and memcpy ...", flush=True)
    out["decode"] = measure_decode(share)
    return out


def _parse(argv: list[str] | None) -> tuple[Config, Path, bool]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="small sizes (~1 min)")
    p.add_argument("--share-mib", type=int, help="state per host (default 64, quick 8)")
    p.add_argument("--steps", type=int, help="steps per overhead loop (default 40, quick 20)")
    p.add_argument("--step-s", type=float, help="idle seconds per step (default 0.2, quick 0.1)")
    p.add_argument("--repeats", type=int, help="loops and restores per mode (default 3, quick 1)")
    p.add_argument("--ckpts", type=int, help="checkpoints counted on the wire (default 3)")
    p.add_argument(
        "--rate-mbit",
        type=int,
        default=2000,
        help="each host's link rate (default 2000); 0: unshaped",
    )
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument(
        "--update-docs",
        action="store_true",
        help="rewrite the docs/benchmarks.md block even for --quick or another --results-dir",
    )
    a = p.parse_args(argv)
    q = a.quick
    cfg = Config(
        share_mib=a.share_mib or (8 if q else 64),
        steps=a.steps or (20 if q else 40),
        step_s=a.step_s or (0.1 if q else 0.2),
        repeats=a.repeats or (1 if q else 3),
        ckpts=a.ckpts or (2 if q else 3),
        rate_mbit=a.rate_mbit,
        quick=q,
    )
    if cfg.steps < cfg.interval or cfg.share_mib < 1:
        p.error(f"--steps must be >= {cfg.interval} and --share-mib >= 1")
    return cfg, a.results_dir, a.update_docs


def main(argv: list[str] | None = None) -> int:
    cfg, out_dir, update_docs = _parse(argv)
    t0 = time.monotonic()
    doc = run_header("benchmarks.ram_redundancy", argv, cfg)
    doc["modes"] = MODES
    doc.update(run(cfg))
    doc["machine"]["load_end"] = os.getloadavg()
    doc["seconds"] = time.monotonic() - t0
    summarise(doc)
    return write_results(
        "ram_redundancy",
        doc,
        out_dir,
        report=report,
        plot=plot,
        quick=cfg.quick,
        update_docs=update_docs,
    )


if __name__ == "__main__":
    sys.exit(main())
