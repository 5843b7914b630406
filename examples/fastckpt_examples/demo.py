"""``fastckpt demo``: lose a node of a local multi-node Ray cluster mid-training, keep going.

Scenario (defaults): a :class:`~fastckpt_examples.cluster.ray_cluster.LocalRayCluster` of 4
nodes x 2 virtual CPU devices (each node a simulated host with its own network, hostname and RAM
tmpfs where the machine allows it, else separate Ray nodes on one network stack), a GCS
emulator the nodes reach, and the driver (:mod:`fastckpt_examples._demo_driver`:
:func:`fastckpt.elastic.run_elastic` on the example trainer) on the control node. At step
``--kill-step`` one node is lost outright (its raylet, its workers and its tmpfs: ``--fault
kill``) or its link is cut (``--fault cut``); the job resumes on 3 nodes; at
``--rejoin-step`` an empty replacement node joins and the job grows back to 4 and runs to
``--steps``.

Output: a live timeline, a PNG of loss vs step with the events marked, and as the LAST
stdout line one JSON object (``"engine": "ray"``, ``isolation``, ``kill_to_first_step_s``
and its parts, detection times, ``hosts_per_generation``, bytes restored per tier, steps
lost...; see :func:`fastckpt_examples._demo_report.final_json`).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastckpt.errors import FastckptError
from fastckpt_examples._demo_driver import PREFIX
from fastckpt_examples._demo_report import Timeline, final_json, plot_loss

__all__ = ["build_parser", "main", "run_demo"]

FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
"""XLA options of the train step unless ``--full-opt``: on a couple of shared CPU cores
compiling dominates a restart; these trade a slower step for much less compile time."""
BUCKET = "fastckpt-demo"


def build_parser() -> argparse.ArgumentParser:
    """Flags of the demo."""
    p = argparse.ArgumentParser(prog="fastckpt demo", description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--devices-per-node", type=int, default=2)
    p.add_argument(
        "--isolation",
        choices=["auto", "namespaces", "processes"],
        default="auto",
        help="auto: namespaced hosts where the machine allows, else processes",
    )
    p.add_argument("--preset", default="small", help="model preset (tiny, small, bench)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kill-step", type=int, default=20)
    p.add_argument("--rejoin-step", type=int, default=40, help="0: the node never comes back")
    p.add_argument("--fault", choices=["kill", "cut"], default="kill")
    p.add_argument("--kill-node", default=None, help="node name (default: the last rank's)")
    p.add_argument(
        "--standby-wait-s",
        type=float,
        default=30.0,
        help="from --kill-step, wait this long at most for the warm standbys before the fault",
    )
    p.add_argument("--checkpoint-every", type=int, default=20, help="GCS checkpoint cadence")
    p.add_argument("--ram-every", type=int, default=2, help="RAM + peer replica cadence")
    p.add_argument("--step-delay-s", type=float, default=0.0)
    p.add_argument("--workdir", default=None, help="PNG and summary.json (default: a temp dir)")
    p.add_argument("--png", default=None, help="loss plot (default: <workdir>/loss.png)")
    p.add_argument("--compile-cache", default=None, help="JAX compile cache dir to (re)use")
    p.add_argument("--full-opt", action="store_true", help="no fast-compile XLA options")
    p.add_argument("--timeout-s", type=float, default=600.0, help="whole job")
    p.add_argument("--quiet", action="store_true", help="no live timeline")
    return p


def _pythonpath() -> None:
    """Let Ray's workers (started by the nodes, which inherit this environment) import
    ``fastckpt`` and ``fastckpt_examples`` from wherever this process does."""
    import fastckpt
    import fastckpt_examples

    dirs = [str(Path(m.__file__ or "").resolve().parents[1]) for m in (fastckpt, fastckpt_examples)]
    old = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*dirs, *old]))


def _start_cluster(args: argparse.Namespace) -> tuple[Any, str | None]:
    """The cluster, and a note when it is not namespaced although asked for ``auto``."""
    from fastckpt_examples.cluster.hosts import HostsError, hosts_unavailable_reason
    from fastckpt_examples.cluster.ray_cluster import LocalRayCluster, RayClusterError

    kw = {"nodes": args.nodes, "devices_per_node": args.devices_per_node, "name": "fcdemo"}
    if args.isolation != "auto":
        return LocalRayCluster(isolation=args.isolation, **kw), None
    why = hosts_unavailable_reason()
    if why is None:
        try:
            return LocalRayCluster(isolation="namespaces", **kw), None
        except (RayClusterError, HostsError) as e:
            why = f"namespaced cluster failed to start: {str(e)[:300]}"
    return LocalRayCluster(isolation="processes", **kw), f"process mode: {why}"


def _reader(stream: Any, out: queue.Queue[str | None], log: Any) -> None:
    for line in stream:
        if line.startswith(PREFIX):
            out.put(line[len(PREFIX) :])
        else:
            log.write(line)
    out.put(None)


def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    """Run the scenario; returns the final JSON object (also in ``<workdir>/summary.json``)."""
    from fastckpt.testing.gcs_emulator import GcsEmulator

    t_start = time.time()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fastckpt-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    # What the driver and every node share: not /tmp or /dev/shm (private per simulated host).
    scratch = Path(tempfile.mkdtemp(prefix="fastckpt-demo-", dir="/var/tmp"))
    _pythonpath()
    show = Timeline(quiet=args.quiet)
    try:
        show.note(f"starting a local Ray cluster of {args.nodes} nodes ({args.isolation})")
        cluster, note = _start_cluster(args)
        with cluster, GcsEmulator(host=cluster.control_host) as emu:
            emu.create_bucket(BUCKET)
            ids = {n.node_id: n.name for n in cluster.nodes()}
            show.names.update(ids)
            show.note(
                f"Ray cluster up in {cluster.start_s:.1f}s: {len(ids)} nodes x "
                f"{args.devices_per_node} devices, {cluster.isolation}"
                + (f" ({note})" if note else "")
                + f"; GCS emulator at {emu.endpoint}"
            )
            run_id = f"demo-{os.getpid()}-{int(t_start)}"
            cfg = {
                "result": str(scratch / "result.json"),
                "spec": {
                    "root": f"gs://{BUCKET}/{run_id}",
                    "steps": args.steps,
                    "preset": args.preset,
                    "model_axis": args.devices_per_node,
                    "checkpoint_every": args.checkpoint_every,
                    "ram_every": args.ram_every,
                    "step_delay_s": args.step_delay_s,
                    "compiler_options": None if args.full_opt else FAST_COMPILE,
                },
                "job": {
                    "run_id": run_id,
                    "cpu_devices_per_node": args.devices_per_node,
                    "ram_dir": "$FASTCKPT_NODE_SHM/elastic",
                    "compile_cache_dir": args.compile_cache or str(scratch / "jax-cache"),
                    "env": {"STORAGE_EMULATOR_HOST": emu.endpoint},
                    "max_restarts": 3,
                    "min_nodes": 1,
                    # After a collective fails (often ~0.1 s after the loss), wait for the GCS
                    # to mark the node dead (~1.5-3 s here) rather than relaunch onto it.
                    "node_loss_grace_s": 5.0,
                },
            }
            (scratch / "config.json").write_text(json.dumps(cfg))
            chaos = _Chaos(cluster, args, show)
            result = _drive(cluster, scratch, args, chaos, show)
            chaos.finish()
            cluster_info = {"start_s": cluster.start_s, "isolation": cluster.isolation}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    from fastckpt.elastic.timeline import summarize

    events = sorted([*result["events"], *chaos.events], key=lambda e: float(e["t"]))
    summary = summarize(events, result["reports"], result["metrics"])
    png = Path(args.png) if args.png else workdir / "loss.png"
    plot_loss(result["metrics"], summary, png, names=show.names)
    show.recoveries(summary)
    out = final_json(
        args,
        summary,
        result,
        chaos.events,
        cluster_info,
        note=note,
        png=png,
        wall_s=time.time() - t_start,
    )
    (workdir / "summary.json").write_text(json.dumps({"demo": out, "timeline": summary}, indent=1))
    return out


class _Chaos:
    """The faults, injected by this process (it owns the cluster) as the driver reports steps."""

    def __init__(self, cluster: Any, args: argparse.Namespace, show: Timeline) -> None:
        self.cluster, self.args, self.show = cluster, args, show
        self.events: list[dict[str, Any]] = []
        self.victim: str | None = None
        self.fault_gen: int | None = None
        self.t_fault = 0.0
        self.revived = False
        self.died_at: float | None = None
        self._next_poll = 0.0
        self.ready: set[str] = set()
        """Nodes (ids) whose warm standby actor is ready."""
        self.t_due = 0.0

    def progress(self, gen: int, step: int, nodes: list[str]) -> None:
        a = self.args
        if self.victim is None and step >= a.kill_step and nodes:
            warm = all(n in self.ready for n in nodes)
            self.t_due = self.t_due or time.monotonic()
            if not warm and time.monotonic() - self.t_due < a.standby_wait_s:
                return  # lose the node once its job has warm standbys (as in steady state)
            self.victim = a.kill_node or self.show.names.get(nodes[-1], "node0")
            node_id = next((i for i, n in self.show.names.items() if n == self.victim), None)
            if a.fault == "kill":
                self.t_fault = self.cluster.kill_node(self.victim)
            else:
                self.t_fault = self.cluster.cut_link(self.victim)
            self.fault_gen = gen
            self._record(
                "kill",
                generation=gen,
                node=node_id,
                node_name=self.victim,
                fault=a.fault,
                step=step,
                standbys_warm=warm,
                t=self.t_fault,
            )
        elif (
            self.victim is not None
            and not self.revived
            and 0 < a.rejoin_step <= step
            and self.fault_gen is not None
            and gen > self.fault_gen
        ):
            self._dead()
            if self.args.fault == "cut":
                self.cluster.kill_node(self.victim)  # a cut raylet exits when it hears it is dead
            node = self.cluster.revive_node(self.victim)
            self.revived = True
            self.show.names[node.node_id] = self.victim
            self._record(
                "revive", generation=gen, node=node.node_id, node_name=self.victim, step=step
            )

    def _dead(self) -> None:
        if self.victim is not None and self.died_at is None:
            node = self.cluster.node(self.victim)
            self.died_at = node.died_at
            if node.died_at is not None:
                self._record(
                    "ray_node_dead",
                    generation=self.fault_gen,
                    node_name=self.victim,
                    t=node.died_at,
                )

    def poll(self) -> None:
        """While the lost node is not marked dead yet, ask the GCS (a live timeline line)."""
        if self.victim is not None and not self.revived and time.monotonic() > self._next_poll:
            self._next_poll = time.monotonic() + 0.2
            self._dead()

    def finish(self) -> None:
        if not self.revived:
            self._dead()

    def _record(self, name: str, **fields: Any) -> None:
        ev = {"t": fields.pop("t", time.time()), "event": name, **fields}
        self.events.append(ev)
        self.show.event(ev)


def _drive(
    cluster: Any, scratch: Path, args: argparse.Namespace, chaos: _Chaos, show: Timeline
) -> dict[str, Any]:
    """Run the driver to its end, following its lines; its result file's contents."""
    log_path = scratch / "driver.log"
    with open(log_path, "a") as log:  # O_APPEND: the driver's stderr and stray stdout lines
        proc = cluster.driver_popen(
            [sys.executable, "-m", "fastckpt_examples._demo_driver", str(scratch / "config.json")],
            stdout=subprocess.PIPE,
            stderr=log,
            stdin=subprocess.DEVNULL,
            text=True,
            bufsize=1,
        )
        lines: queue.Queue[str | None] = queue.Queue()
        reader = threading.Thread(target=_reader, args=(proc.stdout, lines, log), daemon=True)
        reader.start()
        deadline = time.monotonic() + args.timeout_s
        done = None
        while True:
            try:
                line = lines.get(timeout=0.2)
            except queue.Empty:
                if time.monotonic() > deadline:
                    why = f"the demo job did not finish in {args.timeout_s:.0f} s"
                    raise RuntimeError(why) from None
                chaos.poll()
                continue
            if line is None:
                break
            msg = json.loads(line)
            kind = msg.pop("kind")
            if kind == "event":
                show.event(msg)
                if msg["event"] == "standby_ready":
                    chaos.ready.add(msg["node"])
            elif kind == "progress":
                show.progress(msg["generation"], msg["step"])
                chaos.progress(msg["generation"], msg["step"], msg["nodes"])
            elif kind == "done":
                done = msg
            chaos.poll()
        proc.wait(timeout=60)
    result_path = Path(str(scratch / "result.json"))
    if done is None or not result_path.exists():
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"the demo driver exited ({proc.returncode}) without a result:\n{tail}")
    result: dict[str, Any] = json.loads(result_path.read_text())
    if not result["ok"]:
        raise RuntimeError(f"the elastic job gave up: {result['error']}")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry: run the demo, print the timeline, end with the JSON line."""
    args = build_parser().parse_args(argv)
    try:
        out = run_demo(args)
    except (RuntimeError, OSError, FastckptError) as e:
        print(f"fastckpt demo failed: {e}", file=sys.stderr)
        return 1
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
