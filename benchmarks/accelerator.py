"""fastckpt on an accelerator: save and restore beside the device's own copies and Orbax.

Run::

    python -m benchmarks.accelerator                    # 2 and 6 GiB states, 3 reps
    python -m benchmarks.accelerator --deadline-s 230   # the device run: about 5 min on an H200
    JAX_PLATFORMS=cpu python -m benchmarks.accelerator --sizes-gib 0.25 --reps 2 \
        --overhead-gib 0.1 --overhead-d 512 --overhead-batch 256 --overhead-steps 20 \
        --device-copy pinned_host                       # a dry run on the CPU (about 1 min)

Runs on jax's default backend (a GPU or TPU where there is one; the CPU otherwise, as a dry
run), in one process over all its local devices (mesh ``1 x n``), plus helper processes: a
peer serving its own RAM tier and a raw TCP sender. Nothing here is timed in CI.

Per state size (the params + Adam state of :mod:`benchmarks._common`):

1. **limits**: ``jax.device_get`` of fresh arrays (device to host), ``jax.device_put`` of
   the host copy with the same shardings (host to device), numpy memcpy, and raw loopback
   TCP with as many streams as a restore uses, and (where the backend has memory kinds) the
   copy into ``pinned_host`` memory;
2. **RAM saves**: a manager with a RAM tier and one peer saves fresh arrays (a jitted,
   non-donating step between saves) RAM-only; ``blocked_s`` (what the training thread
   waits for) beside the device-to-host time, the RAM commit and the push to the peer;
   and the same saves with ``device_copy="pageable"`` (no pinned host memory), side by side;
3. **own-RAM restores** onto the device, for each ``decode_threads`` in ``--threads``
   (``default_threads()`` is what a manager uses unless told), beside host-to-device;
4. **peer restores**: a manager with an empty tier pulls every byte from the peer;
5. **local disk**: persistent saves for each ``encode_threads`` (zstd level 1), then cold
   restores (the checkpoint's pages evicted first);
6. **Orbax** (``StandardSave``/``StandardRestore``) saves to and restores from /dev/shm.

First, the **step overhead**: a jitted, donated matmul train step on the device, run in
rounds of segments: no checkpoint; a fastckpt RAM checkpoint every 10 steps pushed to the
peer; and ``jax.device_get`` of the state every 10 steps (the device-to-host copy alone,
which any checkpoint of device memory must make). The overhead is the median over rounds
of each segment's time over the round's no-checkpoint segment, with the drain of the last
checkpoint's background work and until the last step. Then the same with a **host-idle
step** (it sleeps for the device step's time: the host CPUs idle, as during a device step)
with and without RAM checkpoints + push.

The JSON's ``checks`` (and the report's *Targets*): the first RAM save blocks at most 1.5x
a steady one; the RAM step is committed within 2x the DMA into pinned host memory; the push
reaches 70% of raw loopback TCP; the host-idle step overhead is under 2% in steady state.

Every restore's first result is checked bit for bit (per-leaf crc32c). Sections past
``--deadline-s`` are skipped (and say so); a section that fails records its error and the
run exits 1 after writing what it has. Writes ``accelerator.{json,md,png}`` to
``--out-dir`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import (
    RESULTS_DIR,
    GiB,
    MiB,
    abstract_like,
    bar_chart,
    build_state,
    evict_page_cache,
    markdown_table,
    measure_memcpy,
    median,
    publish_docs,
    spec_for_bytes,
    tree_nbytes,
    write_json,
)
from benchmarks._tiers import (
    PEER_SECRET,
    make_matmul_step,
    matmul_state,
    measure_loopback_tcp,
    peer_process,
    raw_tcp_process,
    time_restores,
    tree_digest,
)

RAM_EVERY = 10


class Run:
    """Results so far, the deadline, and the sections that failed."""

    def __init__(self, deadline_s: float) -> None:
        self.t0 = time.perf_counter()
        self.deadline_s = deadline_s
        self.errors: list[str] = []

    def section(self, out: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
        """Run ``fn`` into ``out[name]`` unless past the deadline; record a failure and go on."""
        elapsed = time.perf_counter() - self.t0
        if elapsed > self.deadline_s:
            out[name] = {"skipped": f"deadline ({elapsed:.0f}s > {self.deadline_s:.0f}s)"}
            print(f"[accel] {name}: skipped (deadline)", file=sys.stderr, flush=True)
            return
        t0 = time.perf_counter()
        try:
            out[name] = fn()
        except Exception as e:
            traceback.print_exc()
            out[name] = {"error": f"{type(e).__name__}: {e}"}
            self.errors.append(f"{name}: {type(e).__name__}: {e}")
        print(f"[accel] {name}: {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)


def _gbps(nbytes: int, seconds: float | None) -> float | None:
    return nbytes / seconds / 1e9 if seconds else None


def _fresh_step() -> Callable[[Any], Any]:
    """A jitted step returning fresh arrays (floats negated, ints incremented), not donating:
    a save of its output copies new device memory, not a cached host copy."""
    import jax
    import jax.numpy as jnp

    return jax.jit(
        lambda t: jax.tree_util.tree_map(
            lambda x: -x if jnp.issubdtype(x.dtype, jnp.floating) else x + jnp.ones((), x.dtype), t
        )
    )


def measure_limits(state: Any, reps: int) -> dict[str, Any]:
    import jax

    n = tree_nbytes(state)
    step = _fresh_step()
    d2h, h2d = [], []
    host = None
    for _ in range(reps):
        fresh = jax.block_until_ready(step(state))
        t0 = time.perf_counter()
        host = jax.device_get(fresh)
        d2h.append(time.perf_counter() - t0)
        del fresh
    shardings = jax.tree_util.tree_map(lambda x: x.sharding, state)
    for _ in range(reps):
        t0 = time.perf_counter()
        back = jax.block_until_ready(jax.device_put(host, shardings))
        h2d.append(time.perf_counter() - t0)
        del back
    del host
    gc.collect()
    out: dict[str, Any] = {
        "device_get_s": median(d2h),
        "device_get_all_s": d2h,
        "device_put_s": median(h2d),
        "device_put_all_s": h2d,
    }
    # the copy into pinned host memory (where the backend has memory kinds), then its host view
    try:
        pinned = jax.tree_util.tree_map(lambda x: x.sharding.with_memory_kind("pinned_host"), state)
        times, views = [], []
        for _ in range(reps):
            fresh = jax.block_until_ready(step(state))
            t0 = time.perf_counter()
            on_host = jax.block_until_ready(jax.device_put(fresh, pinned))
            t1 = time.perf_counter()
            jax.tree_util.tree_map(np.asarray, on_host)
            views.append(time.perf_counter() - t1)
            times.append(t1 - t0)
            del fresh, on_host
        out.update(
            pinned_host_s=median(times), pinned_host_all_s=times, pinned_view_s=median(views)
        )
    except Exception as e:
        out["pinned_host_error"] = f"{type(e).__name__}: {e}"
    out["device_get_gbps"] = _gbps(n, out["device_get_s"])
    out["device_put_gbps"] = _gbps(n, out["device_put_s"])
    out.update(measure_memcpy(min(n, 1 * GiB)))
    return out


def _restores(
    mgr: Any, target: Any, digest: list[int], reps: int, *, tag: str, expect: str
) -> dict[str, Any]:
    """:func:`~benchmarks._tiers.time_restores`, with medians of the restores after the first."""
    runs = time_restores(mgr, target, digest, reps, tag=tag, expect_tier=expect)
    rest = runs[1:] or runs
    return {
        "first_s": runs[0]["seconds"],
        "seconds": median([r["seconds"] for r in rest]),
        "fetch_s": median([r["fetch_s"] for r in rest]),
        "device_put_s": median([r["device_put_s"] for r in rest]),
        "runs": runs,
    }


def _ram_manager(
    store_root: Path,
    tier: Path,
    nbytes: int,
    *,
    decode_threads: int | None = None,
    device_copy: str = "auto",
) -> Any:
    """``device_copy``: ``SaveOptions.device_copy`` ("pinned_host" exercises the pinned
    path on the CPU backend too)."""
    import fastckpt
    from fastckpt.options import RamOptions, RestoreOptions, SaveOptions

    ram = RamOptions(
        root=str(tier),
        member_id="accel-host",
        interval_steps=1,
        budget_bytes=3 * nbytes + 512 * MiB,
        replicas=1,
        secret=PEER_SECRET,
    )
    restore = (
        RestoreOptions()
        if decode_threads is None
        else RestoreOptions(decode_threads=decode_threads)
    )
    return fastckpt.CheckpointManager(
        str(store_root),
        options=fastckpt.ManagerOptions(
            save_interval_steps=1 << 40,
            ram=ram,
            restore=restore,
            save=SaveOptions(device_copy=device_copy),  # type: ignore[arg-type]
        ),
    )


def pageable_saves(state: Any, *, work: Path, shm: Path, reps: int) -> dict[str, Any]:
    """RAM saves (no peer) with ``device_copy="pageable"``, beside the default's in the same
    run: what staging through pinned host memory changes. Fresh arrays each time."""
    import jax

    import fastckpt
    from fastckpt.options import RamOptions, SaveOptions

    n = tree_nbytes(state)
    step = _fresh_step()
    options = fastckpt.ManagerOptions(
        save_interval_steps=1 << 40,
        save=SaveOptions(device_copy="pageable"),
        ram=RamOptions(
            root=str(shm / "pageable-tier"),
            interval_steps=1,
            replicas=0,
            budget_bytes=3 * n + 512 * MiB,
        ),
    )
    saves = []
    with fastckpt.CheckpointManager(str(work / "pageable-store"), options=options) as mgr:
        for i in range(max(reps, 2) + 1):
            fresh = jax.block_until_ready(step(state))
            mgr.save(i + 1, fresh)
            mgr.wait()
            s = mgr.last_save_stats
            saves.append(
                {
                    "blocked_s": s.blocked_s,
                    "ram_commit_s": s.ram_commit_s,
                    "deferred_copy_s": s.deferred_copy_s,
                }
            )
            del fresh
            print(
                f"[accel] pageable RAM save {i + 1}: blocked {s.blocked_s:.3f}s",
                file=sys.stderr,
                flush=True,
            )
    shutil.rmtree(shm / "pageable-tier", ignore_errors=True)
    return {"saves": saves, "blocked_s": saves[-1]["blocked_s"]}


def ram_and_peer(
    state: Any, *, work: Path, shm: Path, reps: int, threads: list[int], device_copy: str = "auto"
) -> dict[str, Any]:
    """RAM saves (pushed to a peer process), own-RAM restores per decode_threads, then peer
    restores.

    Every save is of fresh arrays (no cached host copy). The manager is made and told the
    state (``prepare``: its first segment is provisioned in the background) while the peer
    process starts, as a restarted trainer's start-up overlaps it; later saves reuse a
    segment (provisioned after each commit, later a recycled one). ``allocate_s`` is the
    part of ``blocked_s`` spent getting the segment. The restores are of the last save,
    whose digest is taken after it (taking it before would cache the host copy the save
    makes).
    """
    import jax

    n = tree_nbytes(state)
    target = abstract_like(state)
    store_root = work / "ram-store"
    store_root.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"saves": [], "own_ram": {}}
    step = _fresh_step()
    mgr = _ram_manager(store_root, shm / "tier", n, device_copy=device_copy)
    mgr.prepare(target)
    with peer_process(
        shm / "peer-tier", str(store_root), member_id="accel-peer", budget_bytes=3 * n + 512 * MiB
    ) as peer:
        peer.port  # noqa: B018 - waits until the peer has published its address
        fresh = None
        for i in range(max(reps, 4) + 1):
            del fresh
            fresh = jax.block_until_ready(step(state))
            t0 = time.perf_counter()
            mgr.save(i + 1, fresh)
            returned = time.perf_counter() - t0
            mgr.wait()
            reports = mgr.wait_replication()
            s = mgr.last_save_stats
            if not reports or not all(r.ok and r.targets for r in reports):
                raise AssertionError(f"push to the peer failed: {reports}")
            out["saves"].append(
                {
                    "returned_s": returned,
                    "blocked_s": s.blocked_s,
                    "allocate_s": s.allocate_s,
                    "ram_commit_s": s.ram_commit_s,
                    "deferred_copy_s": s.deferred_copy_s,
                    "pushed_s": time.perf_counter() - t0,
                    "push_s": max(r.seconds for r in reports),  # the push alone
                    "bytes_pushed": sum(r.bytes_pushed for r in reports),
                }
            )
            print(
                f"[accel] RAM save {i + 1}: blocked {s.blocked_s:.3f}s (segment "
                f"{s.allocate_s:.3f}s), ram commit {s.ram_commit_s:.3f}s, "
                f"pushed {out['saves'][-1]['pushed_s']:.3f}s",
                file=sys.stderr,
                flush=True,
            )
        digest = tree_digest(fresh)
        del fresh
        mgr.close()
        for t in threads:
            mgr = _ram_manager(store_root, shm / "tier", n, decode_threads=t)
            out["own_ram"][str(t)] = _restores(
                mgr, target, digest, reps, tag=f"own RAM, {t} threads", expect="ram"
            )
            mgr.close()
        shutil.rmtree(shm / "tier")  # the host slot loses its RAM: everything comes from the peer
        mgr = _ram_manager(store_root, shm / "tier-new", n)
        out["peer"] = _restores(mgr, target, digest, reps, tag="peer RAM", expect="peer")
        mgr.close()
    shutil.rmtree(shm / "tier-new", ignore_errors=True)
    shutil.rmtree(shm / "peer-tier", ignore_errors=True)
    return out


def raw_tcp(nbytes: int, streams: int, reps: int) -> dict[str, Any]:
    with raw_tcp_process(nbytes) as sender:
        return measure_loopback_tcp(
            sender.port, nbytes, streams=streams, reps=reps, fresh=True, checksum=True
        )


def disk(state: Any, *, work: Path, reps: int, threads: list[int]) -> dict[str, Any]:
    """Persistent saves of fresh arrays per encode_threads, then cold restores of the last."""
    import jax

    import fastckpt
    from fastckpt.options import SaveOptions

    target = abstract_like(state)
    out: dict[str, Any] = {"saves": {}}
    root = work / "disk"
    step = _fresh_step()
    fresh = None
    for t in threads:
        shutil.rmtree(root, ignore_errors=True)
        del fresh
        fresh = jax.block_until_ready(step(state))
        mgr = fastckpt.CheckpointManager(
            str(root),
            options=fastckpt.ManagerOptions(
                save=SaveOptions(encode_threads=t), retention=fastckpt.RetentionOptions(keep_last=1)
            ),
        )
        t0 = time.perf_counter()
        mgr.save(1, fresh)
        mgr.wait()
        s = mgr.last_save_stats
        out["saves"][str(t)] = {
            "committed_s": time.perf_counter() - t0,
            "blocked_s": s.blocked_s,
            "encode_s": s.encode_s,
            "stored_bytes": s.stored_bytes,
            "raw_bytes": s.raw_bytes,
        }
        print(
            f"[accel] disk save, {t} encode threads: {out['saves'][str(t)]['committed_s']:.2f}s",
            file=sys.stderr,
            flush=True,
        )
        if t != threads[-1]:
            mgr.close()
    digest = tree_digest(fresh)
    del fresh
    runs = [
        time_restores(
            mgr,
            target,
            digest,
            0,
            tag="disk",
            expect_tier="storage",  # each one checked
            before=lambda: evict_page_cache(root),
        )[0]
        for _ in range(reps + 1)
    ]
    mgr.close()
    shutil.rmtree(root, ignore_errors=True)
    return {**out, "restore_s": median([r["seconds"] for r in runs[1:] or runs]), "restores": runs}


def orbax(state: Any, *, shm: Path, reps: int) -> dict[str, Any]:
    """Orbax's async manager saves fresh arrays to /dev/shm, then restores them."""
    import jax
    import orbax.checkpoint as ocp

    target = abstract_like(state)
    root = shm / "orbax"
    fresh = jax.block_until_ready(_fresh_step()(state))
    mgr = ocp.CheckpointManager(str(root), options=ocp.CheckpointManagerOptions(max_to_keep=1))
    t0 = time.perf_counter()
    mgr.save(1, args=ocp.args.StandardSave(fresh))
    returned = time.perf_counter() - t0
    mgr.wait_until_finished()
    digest = tree_digest(fresh)
    del fresh
    out: dict[str, Any] = {
        "save_returned_s": returned,
        "save_committed_s": time.perf_counter() - t0,
        "runs": [],
    }
    for i in range(reps + 1):
        gc.collect()
        t0 = time.perf_counter()
        restored = jax.block_until_ready(mgr.restore(1, args=ocp.args.StandardRestore(target)))
        seconds = time.perf_counter() - t0
        if i == 0 and tree_digest(restored) != digest:
            raise AssertionError("Orbax: restored state differs from the saved one")
        del restored
        out["runs"].append(seconds)
        print(f"[accel orbax] restore {i}: {seconds:.3f}s", file=sys.stderr, flush=True)
    mgr.close()
    shutil.rmtree(root, ignore_errors=True)
    out["restore_s"] = median(out["runs"][1:] or out["runs"])
    out["version"] = getattr(ocp, "__version__", None)
    return out


def step_overhead(
    *,
    work: Path,
    shm: Path,
    nbytes: int,
    d: int,
    batch: int,
    steps: int,
    rounds: int,
    device_copy: str = "auto",
) -> dict[str, Any]:
    """Segments of ``steps`` train steps: none / fastckpt RAM + push every 10 / device_get
    every 10."""
    import jax
    import jax.numpy as jnp

    mesh = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(1, -1), ("data", "model"))
    state = matmul_state(nbytes, mesh, d=d)
    n = tree_nbytes(state)
    step = make_matmul_step(batch=batch, d=d)
    x = jax.device_put(
        jnp.ones((batch, d), jnp.float32) * 0.01,
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
    )
    store_root = work / "overhead-store"
    store_root.mkdir(parents=True, exist_ok=True)
    times: dict[str, list[float]] = {
        "none": [],
        "fastckpt": [],
        "device_get": [],
        "idle_none": [],
        "idle_fastckpt": [],
    }
    undrained: dict[str, list[float]] = {
        m: [] for m in times
    }  # until the last step, before the drain
    blocked: list[float] = []
    with peer_process(
        shm / "overhead-peer",
        str(store_root),
        member_id="accel-peer-2",
        budget_bytes=3 * n + 512 * MiB,
    ) as peer:
        peer.port  # noqa: B018
        mgr = _ram_manager(store_root, shm / "overhead-tier", n, device_copy=device_copy)
        counter = 0
        for _ in range(3):  # compile and warm
            state = step(state, x)
        jax.block_until_ready(state)
        idle_step_s = 0.0  # the device step's median, once measured

        def segment(mode: str) -> float:
            """``idle_*``: the step sleeps for the device step's time instead (the host CPUs
            idle while the device would compute; the state is saved unchanged)."""
            nonlocal state, counter
            idle = mode.startswith("idle_")
            ckpt = mode.removeprefix("idle_")
            t0 = time.perf_counter()
            for _ in range(steps):
                counter += 1
                if idle:
                    time.sleep(idle_step_s)
                else:
                    state = step(state, x)
                if counter % RAM_EVERY == 0 and ckpt != "none":
                    jax.block_until_ready(
                        state
                    )  # a checkpoint waits for the step anyway: keep it out of blocked_s
                    if ckpt == "fastckpt":
                        mgr.save(counter, state)
                        if mgr.last_save_stats is not None:
                            blocked.append(mgr.last_save_stats.blocked_s)
                    else:
                        jax.device_get(state)
            jax.block_until_ready(state)
            undrained[mode].append(time.perf_counter() - t0)
            if ckpt == "fastckpt":
                mgr.wait()
                mgr.wait_replication()
            return time.perf_counter() - t0

        for _ in range(5):  # until the tiers reuse spare segments (see ram_and_peer)
            counter += RAM_EVERY
            state = jax.block_until_ready(step(state, x))
            mgr.save(counter, state)
            mgr.wait()
            mgr.wait_replication()
        for r in range(rounds):
            order = ["none", "fastckpt", "device_get"]
            order = order[r % 3 :] + order[: r % 3]
            for mode in order:
                times[mode].append(segment(mode))
            print(
                f"[accel overhead] round {r}: "
                + ", ".join(f"{m} {times[m][-1]:.3f}s" for m in order),
                file=sys.stderr,
                flush=True,
            )
        idle_step_s = median(times["none"]) / steps
        for r in range(rounds):
            order = ["idle_none", "idle_fastckpt"][:: 1 if r % 2 == 0 else -1]
            for mode in order:
                times[mode].append(segment(mode))
            print(
                f"[accel overhead] host-idle round {r}: "
                + ", ".join(
                    f"{m} {times[m][-1]:.3f}s (until the last step {undrained[m][-1]:.3f}s)"
                    for m in order
                ),
                file=sys.stderr,
                flush=True,
            )
        mgr.close()
    shutil.rmtree(shm / "overhead-tier", ignore_errors=True)
    shutil.rmtree(shm / "overhead-peer", ignore_errors=True)

    def ratios(t: dict[str, list[float]]) -> dict[str, float]:
        return {
            m: median([a / b - 1 for a, b in zip(t[m], t[base])])
            for m, base in (
                ("fastckpt", "none"),
                ("device_get", "none"),
                ("idle_fastckpt", "idle_none"),
            )
        }

    return {
        "state_bytes": n,
        "d": d,
        "batch": batch,
        "steps_per_segment": steps,
        "rounds": rounds,
        "step_s": median(times["none"]) / steps,
        "segments_s": times,
        "overhead": ratios(times),
        "undrained_s": undrained,
        "overhead_undrained": ratios(undrained),
        "blocked_s": median(blocked) if blocked else None,
        "idle_step_s": idle_step_s,
        "idle_drain_s": median(
            [a - b for a, b in zip(times["idle_fastckpt"], undrained["idle_fastckpt"])]
        ),
    }


def per_size(
    run: Run, size_gib: float, args: argparse.Namespace, work: Path, shm: Path
) -> dict[str, Any]:
    import jax

    from fastckpt.options import RestoreOptions

    mesh = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(1, -1), ("data", "model"))
    spec = spec_for_bytes(int(size_gib * GiB))
    t0 = time.perf_counter()
    state = build_state(spec, mesh, seed=0)
    out: dict[str, Any] = {
        "state_bytes": tree_nbytes(state),
        "leaves": len(jax.tree_util.tree_leaves(state)),
        "build_s": time.perf_counter() - t0,
    }
    n = out["state_bytes"]
    run.section(out, "limits", lambda: measure_limits(state, args.reps))
    run.section(out, "raw_tcp", lambda: raw_tcp(n, RestoreOptions().decode_threads, args.reps))
    run.section(
        out,
        "ram",
        lambda: ram_and_peer(
            state,
            work=work,
            shm=shm,
            reps=args.reps,
            threads=args.threads,
            device_copy=args.device_copy,
        ),
    )
    run.section(out, "pageable", lambda: pageable_saves(state, work=work, shm=shm, reps=args.reps))
    run.section(out, "disk", lambda: disk(state, work=work, reps=args.reps, threads=args.threads))
    run.section(out, "orbax", lambda: orbax(state, shm=shm, reps=args.reps))
    return out


# --------------------------------------------------------------------------- report


def _get(d: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _f(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def report(doc: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """The markdown report and the plot's panels."""
    env = doc["env"]
    lines = [
        f"# fastckpt on {env['device_kind']} ({env['backend']}, {env['devices']} device(s))",
        "",
        f"jax {env['jax']}, {env['cpus']} CPUs, default_threads() = {env['default_threads']}, "
        f"Orbax {env.get('orbax')}; {doc['finished']}",
        "",
    ]
    saves, rows, groups, own, peer_, orb, h2d = [], [], [], [], [], [], []
    for r in doc["sizes"].values():
        n = r["state_bytes"]
        lim, ram = r.get("limits", {}), r.get("ram", {})
        ram_saves = _get(ram, "saves") or []
        last = ram_saves[-1] if ram_saves else {}  # a reused segment (see ram_and_peer)
        d2h = lim.get("device_get_s")
        dma = lim.get("pinned_host_s")
        push_gbps = _gbps(last.get("bytes_pushed") or 0, last.get("push_s"))
        tcp_gbps = _get(r, "raw_tcp", "gbps")
        saves.append(
            [
                f"{n / GiB:.2f} GiB",
                _f(d2h, ".3f"),
                _f(dma, ".3f"),
                _f(ram_saves[0]["blocked_s"] if ram_saves else None, ".3f")
                + (
                    f" ({ram_saves[0]['allocate_s']:.3f})"
                    if ram_saves and "allocate_s" in ram_saves[0]
                    else ""
                ),
                _f(last.get("blocked_s"), ".3f"),
                _f(_get(r, "pageable", "blocked_s"), ".3f"),
                _f(last.get("deferred_copy_s"), ".3f"),
                _f(last.get("ram_commit_s"), ".3f"),
                _f(last["ram_commit_s"] / dma if dma and "ram_commit_s" in last else None),
                _f(last.get("pushed_s"), ".3f"),
                f"{_f(push_gbps)} / {_f(tcp_gbps)}",
                _f(_get(r, "disk", "saves", str(env["default_threads"]), "blocked_s"), ".3f"),
                _f(_get(r, "orbax", "save_returned_s"), ".3f"),
            ]
        )
        best_own = min((v["seconds"] for v in (_get(ram, "own_ram") or {}).values()), default=None)
        own_default = _get(ram, "own_ram", str(env["default_threads"]), "seconds")
        peer_s = _get(ram, "peer", "seconds")
        orbax_s = _get(r, "orbax", "restore_s")
        tcp = _get(r, "raw_tcp", "gbps")
        rows.append(
            [
                f"{n / GiB:.2f} GiB",
                _f(lim.get("device_put_s"), ".3f"),
                _f(own_default, ".3f"),
                _f(best_own, ".3f"),
                _f(peer_s, ".3f"),
                _f(_gbps(n, peer_s)),
                _f(tcp),
                _f(_gbps(n, peer_s) / tcp if peer_s and tcp else None),
                _f(_get(r, "disk", "restore_s"), ".3f"),
                _f(orbax_s, ".3f"),
                _f(orbax_s / own_default if orbax_s and own_default else None),
            ]
        )
        groups.append(f"{n / GiB:.1f} GiB")
        own.append(_gbps(n, own_default))
        peer_.append(_gbps(n, peer_s))
        orb.append(_gbps(n, orbax_s))
        h2d.append(lim.get("device_put_gbps"))
    lines += [
        "## Save: what the training thread waits for (seconds)",
        "",
        "`device_get` and `to pinned_host` (the DMA) are the limits (fresh arrays, whole state); "
        "RAM saves push to one peer. The first RAM save of the process (its segment provisioned "
        "by `prepare()` while the peer starts; in parentheses the part of it spent getting the "
        "segment) beside a steady one; `RAM commit / DMA`: when the RAM step is committed, over "
        "the DMA time (goal <= 2x); `push / raw TCP`: the push's GB/s beside raw loopback TCP's.",
        "",
        markdown_table(
            [
                "state",
                "device_get",
                "to pinned_host",
                "RAM save blocked (first; segment)",
                "RAM save blocked",
                "same, device_copy=pageable",
                "deferred copy",
                "RAM commit",
                "RAM commit / DMA",
                "pushed",
                "push / raw TCP GB/s",
                "disk save blocked",
                "Orbax save blocked",
            ],
            saves,
        ),
        "",
    ]
    lines += [
        "## Restore onto the device (seconds; medians)",
        "",
        markdown_table(
            [
                "state",
                "device_put (limit)",
                "own RAM (default threads)",
                "own RAM (best threads)",
                "peer",
                "peer GB/s",
                "raw TCP+crc GB/s",
                "peer / TCP",
                "disk (cold)",
                "Orbax /dev/shm",
                "Orbax / own RAM",
            ],
            rows,
        ),
        "",
    ]
    sweep = []
    for r in doc["sizes"].values():
        for t, v in (_get(r, "ram", "own_ram") or {}).items():
            enc = _get(r, "disk", "saves", t) or {}
            sweep.append(
                [
                    f"{r['state_bytes'] / GiB:.2f} GiB",
                    t,
                    _f(v["seconds"], ".3f"),
                    _f(v["fetch_s"], ".3f"),
                    _f(enc.get("committed_s"), ".2f"),
                    _f(enc.get("encode_s"), ".2f"),
                ]
            )
    lines += [
        "## Thread sweep (own-RAM restore by decode_threads; disk save by encode_threads)",
        "",
        markdown_table(
            [
                "state",
                "threads",
                "own RAM restore s",
                "fetch s",
                "disk save committed s",
                "encode s",
            ],
            sweep,
        ),
        "",
    ]
    ov = doc.get("overhead", {})
    if "overhead" in ov:
        interval = RAM_EVERY * ov["step_s"]
        blocked = ov.get("blocked_s")
        und = ov.get("overhead_undrained", {})
        pct = lambda x: "n/a" if x is None else f"{x * 100:+.1f}%"  # noqa: E731
        lines += [
            "## Step overhead (RAM checkpoint every 10 steps)",
            "",
            f"state {ov['state_bytes'] / GiB:.2f} GiB, step {ov['step_s'] * 1e3:.1f} ms, "
            f"{ov['steps_per_segment']} steps x {ov['rounds']} rounds. `segment overhead` includes "
            "draining "
            "the last checkpoint's background work (its push to the peer) after the segment's last "
            "step; "
            "`until last step` stops the clock at the last step (the steady state of a long run); "
            "`blocked share` is what `save()` itself takes of a 10-step interval.",
            "",
            markdown_table(
                [
                    "mode",
                    "segment overhead",
                    "until last step",
                    "blocked per checkpoint s",
                    "blocked share",
                ],
                [
                    [
                        "fastckpt RAM + push",
                        pct(ov["overhead"]["fastckpt"]),
                        pct(und.get("fastckpt")),
                        _f(blocked, ".3f"),
                        f"{blocked / interval * 100:.1f}%" if blocked else "n/a",
                    ],
                    [
                        "device_get alone",
                        pct(ov["overhead"]["device_get"]),
                        pct(und.get("device_get")),
                        "",
                        "",
                    ],
                    [
                        "fastckpt RAM + push, host-idle step "
                        f"(drain {_f(ov.get('idle_drain_s'), '.3f')} s)",
                        pct(ov["overhead"].get("idle_fastckpt")),
                        pct(und.get("idle_fastckpt")),
                        "",
                        "",
                    ],
                ],
            ),
            "",
            "Host-idle step: the step sleeps for the device step's time instead of computing "
            "(the host CPUs idle, the state saved unchanged), in rounds with and without "
            "checkpoints.",
            "",
        ]
    checks = doc.get("checks") or evaluate(doc)
    if checks:
        lines += [
            "## Targets",
            "",
            markdown_table(
                ["target", "state", "value", "bound", "pass", "note"],
                [
                    [
                        c["target"],
                        c.get("state", ""),
                        _f(c["value"], ".3f"),
                        str(c["bound"]),
                        "PASS" if c["pass"] else "FAIL",
                        c.get("note", ""),
                    ]
                    for c in checks
                ],
            ),
            "",
        ]
    if doc.get("errors"):
        lines += ["## Errors", ""] + [f"- {e}" for e in doc["errors"]] + [""]
    panels = [
        {
            "title": "restore GB/s",
            "ylabel": "GB/s",
            "groups": groups,
            "series": {"own RAM": own, "peer": peer_, "Orbax /dev/shm": orb, "device_put": h2d},
        }
    ]
    return "\n".join(lines), panels


FIRST_SAVE_VS_STEADY = 1.5
RAM_COMMIT_VS_DMA = 2.0
PUSH_VS_TCP = 0.7
IDLE_STEP_OVERHEAD = 0.02


def evaluate(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue-28 targets as ``checks`` rows: first vs steady RAM save, RAM commit vs the
    DMA, the push vs raw TCP (per state size), and the host-idle step overhead."""
    checks: list[dict[str, Any]] = []

    def add(
        target: str, state: str, value: float | None, bound: float, ok: bool, note: str
    ) -> None:
        checks.append(
            {
                "target": target,
                "state": state,
                "value": value,
                "bound": bound,
                "pass": bool(ok),
                "note": note,
            }
        )

    for r in doc.get("sizes", {}).values():
        saves = _get(r, "ram", "saves") or []
        if len(saves) < 2:
            continue
        label = f"{r['state_bytes'] / GiB:.2f} GiB"
        tail = saves[-2:]  # steady: the last two (the table's figure is the last)
        first, steady = saves[0], median([s["blocked_s"] for s in tail])
        x = first["blocked_s"] / steady
        add(
            "first RAM save blocks <= 1.5x a steady one",
            label,
            x,
            FIRST_SAVE_VS_STEADY,
            x <= FIRST_SAVE_VS_STEADY,
            f"first {first['blocked_s']:.3f}s"
            + (f" (segment {first['allocate_s']:.3f}s)" if "allocate_s" in first else "")
            + f", steady {steady:.3f}s (median of the last {len(tail)})",
        )
        dma = _get(r, "limits", "pinned_host_s")
        commit = median([s["ram_commit_s"] for s in tail])
        if dma:
            add(
                "RAM step committed <= 2x the DMA time",
                label,
                commit / dma,
                RAM_COMMIT_VS_DMA,
                commit / dma <= RAM_COMMIT_VS_DMA,
                f"RAM commit {commit:.3f}s, DMA to pinned host {dma:.3f}s",
            )
        tcp = _get(r, "raw_tcp", "gbps")
        pushes = [_gbps(s["bytes_pushed"], s.get("push_s")) for s in tail]
        push = median([p for p in pushes if p]) if any(pushes) else None
        if tcp and push:
            add(
                "push to a peer >= 70% of raw TCP",
                label,
                push / tcp,
                PUSH_VS_TCP,
                push / tcp >= PUSH_VS_TCP,
                f"push {push:.2f} GB/s, raw TCP {tcp:.2f} GB/s",
            )
    ov = doc.get("overhead", {})
    und = ov.get("overhead_undrained", {})
    if "idle_fastckpt" in und:
        v = und["idle_fastckpt"]
        add(
            "host-idle step: RAM checkpoint + push every 10 steps adds < 2% step time "
            "(steady state)",
            f"{ov['state_bytes'] / GiB:.2f} GiB",
            v,
            IDLE_STEP_OVERHEAD,
            v < IDLE_STEP_OVERHEAD,
            f"until the last step; with the drain ({ov.get('idle_drain_s', 0.0):.3f}s) "
            f"{100 * ov['overhead'].get('idle_fastckpt', 0.0):+.1f}%",
        )
    return checks


def render(doc: dict[str, Any]) -> str:
    """The markdown report of a results JSON (also the body of its docs/benchmarks.md block)."""
    return report(doc)[0] + "\n"


def _render(doc: dict[str, Any], out_dir: Path, *, update_docs: bool = False) -> str:
    md, panels = report(doc)
    (out_dir / "accelerator.md").write_text(md + "\n")
    bar_chart(
        out_dir / "accelerator.png",
        panels=panels,
        title=f"fastckpt on {doc['env']['device_kind']}",
        ncols=1,
    )
    publish_docs(
        "accelerator",
        doc,
        render=render,
        results_path=out_dir / "accelerator.json",
        force=update_docs,
    )
    return md


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes-gib", default="2,6")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--threads", default=None, help="decode/encode thread counts to sweep (default: 2,4,8)"
    )
    p.add_argument("--overhead-gib", type=float, default=1.5)
    p.add_argument("--overhead-d", type=int, default=8192)
    p.add_argument("--overhead-batch", type=int, default=65536)
    p.add_argument("--overhead-steps", type=int, default=50)
    p.add_argument("--overhead-rounds", type=int, default=3)
    p.add_argument("--deadline-s", type=float, default=1e9)
    p.add_argument(
        "--device-copy",
        default="auto",
        choices=["auto", "pinned_host", "pageable"],
        help="SaveOptions.device_copy of the RAM managers (pinned_host: the pinned path on CPU)",
    )
    p.add_argument("--work-dir", default=None)
    p.add_argument("--shm-dir", default="/dev/shm")
    p.add_argument("--out-dir", default=str(RESULTS_DIR))
    p.add_argument(
        "--from-json", help="re-render the markdown and plot from a results JSON, run nothing"
    )
    p.add_argument(
        "--update-docs",
        action="store_true",
        help="rewrite the docs/benchmarks.md block even for another --out-dir",
    )
    args = p.parse_args(argv)
    if args.from_json:
        print(
            _render(
                json.loads(Path(args.from_json).read_text()),
                Path(args.out_dir),
                update_docs=args.update_docs,
            )
        )
        return 0
    args.threads = [int(t) for t in (args.threads or "2,4,8").split(",")]

    import jax

    from fastckpt.options import default_threads

    run = Run(args.deadline_s)
    dev = jax.devices()[0]
    env = {
        "backend": jax.default_backend(),
        "device_kind": dev.device_kind,
        "devices": len(jax.devices()),
        "jax": jax.__version__,
        "cpus": len(os.sched_getaffinity(0)),
        "default_threads": default_threads(),
        "python": platform.python_version(),
    }
    try:
        import orbax.checkpoint as ocp

        env["orbax"] = getattr(ocp, "__version__", None)
    except ImportError:
        env["orbax"] = None
    print(f"[accel] {env}", file=sys.stderr, flush=True)
    doc: dict[str, Any] = {"env": env, "args": vars(args), "sizes": {}}
    work = Path(tempfile.mkdtemp(prefix="fastckpt-accel-", dir=args.work_dir))
    shm = Path(tempfile.mkdtemp(prefix="fastckpt-accel-", dir=args.shm_dir))
    out_dir = Path(args.out_dir)
    try:
        run.section(
            doc,
            "overhead",
            lambda: step_overhead(
                work=work,
                shm=shm,
                nbytes=int(args.overhead_gib * GiB),
                d=args.overhead_d,
                batch=args.overhead_batch,
                steps=args.overhead_steps,
                rounds=args.overhead_rounds,
                device_copy=args.device_copy,
            ),
        )
        write_json(out_dir / "accelerator.json", doc)
        for size in [float(s) for s in args.sizes_gib.split(",")]:
            run.section(
                doc["sizes"], f"{size:g}", lambda size=size: per_size(run, size, args, work, shm)
            )
            gc.collect()
            doc["errors"] = run.errors
            write_json(out_dir / "accelerator.json", doc)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
        doc["errors"] = run.errors
        doc["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        doc["wall_s"] = time.perf_counter() - run.t0
        doc["checks"] = evaluate(doc)
        write_json(out_dir / "accelerator.json", doc)
    print(_render(doc, out_dir, update_docs=args.update_docs))
    return 1 if run.errors else 0


if __name__ == "__main__":
    sys.exit(main())
