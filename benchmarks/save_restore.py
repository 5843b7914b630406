"""Save/restore benchmark: fastckpt vs Orbax on the same state and destinations.

Run::

    python -m benchmarks.save_restore            # ~1 GiB state, 10 saves + 10 restores per cell
    python -m benchmarks.save_restore --quick    # ~256 MiB state, fewer repetitions (< 2 min)

What it does (all in one run):

1. Starts fake-gcs-server (filesystem backend, on the disk directory).
2. Measures machine limits in a fresh process: ``jax.device_get`` of the state (first call
   in the process, then fresh arrays), numpy memcpy, raw write+fsync / cold read on the
   disk directory and on /dev/shm, and the emulator's PUT/GET throughput with
   google-cloud-storage.
3. Runs every (library, destination) *cell* in its own fresh interpreter, so neither
   library pays the other's warm-up and the first save is a true first save. A cell builds
   the state (8 virtual CPU devices, 2x4 mesh) and, as a training loop starts, tells the
   library (fastckpt: ``prepare(state)``, which provisions the first save's staging memory
   in the background), runs the jitted step for a save interval (10 steps), then saves N
   times (a step before each save makes fresh arrays), then restores the last step N times
   onto the same mesh and a few times onto a 2x2 mesh of 4 devices, checking the first of
   each bit for bit. The ``fastckpt:shm`` cell then makes N RAM-tier saves (no peer) in a
   fresh RAM manager the same way: the first RAM save beside the steady ones.
   Timing: ``save()`` return (blocked), ``wait()`` return (committed), restore until
   ``block_until_ready``. Memory: peak RSS during each save/restore (``VmHWM`` reset per
   phase plus a 5 ms sampling thread) minus RSS just before it; RSS after each phase.
   Before each local-disk restore the checkpoint's files are evicted from the page cache
   (fsync + ``POSIX_FADV_DONTNEED`` on those files only), so disk restores are cold.
   Bytes read: ``rchar`` of the benchmark process (disk, /dev/shm) or of the emulator
   process (GCS) during the restore.
4. Writes ``benchmarks/results/save_restore.{json,md,png}`` and prints the table with
   ratios and target pass/fail.

Orbax runs as its async ``CheckpointManager`` with ``StandardSave``/``StandardRestore``;
for ``gs://`` its cell (only) gets the emulator environment variables
(``TENSORSTORE_GCS_HTTP_URL``, ``GOOGLE_AUTH_TOKEN_FOR_TESTING``, ``STORAGE_EMULATOR_HOST``,
``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``). fastckpt gets the endpoint explicitly through
``fastckpt.storage.open_store(..., gcs_endpoint=...)``. Both keep the last 2 steps.
"""

from __future__ import annotations

from benchmarks._common import configure_host_devices

configure_host_devices(8)  # before anything imports jax (cells and the limits process)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks._common import (  # noqa: E402
    RESULTS_DIR,
    MiB,
    RssSampler,
    abstract_like,
    assert_trees_equal,
    bar_chart,
    build_state,
    cpu_seconds,
    dir_bytes,
    emulator_pid,
    evict_page_cache,
    fmt_ratio,
    fmt_s,
    is_tmpfs,
    make_mesh,
    make_step_fn,
    markdown_table,
    measure_device_get,
    measure_file_io,
    measure_gcs_raw,
    measure_memcpy,
    median,
    proc_io,
    publish_docs,
    rss_bytes,
    run_module_json,
    spec_for_bytes,
    text_table,
    tree_nbytes,
    write_json,
)

MODULE = "benchmarks.save_restore"
BUCKET = "bench"
LIBS = ("fastckpt", "orbax")
KNOWN_LIBS = ("fastckpt", "orbax", "fastckpt-raw")
"""``fastckpt-raw``: fastckpt with ``SaveOptions(compression="none")`` (optional variant)."""
DESTS = ("disk", "shm", "gcs")
DEST_LABEL = {"disk": "local disk", "shm": "/dev/shm", "gcs": "GCS emulator"}

# Targets (fastckpt): see docs/benchmarks.md.
SAVE_BLOCK_VS_DEVICE_GET = 1.2
RESTORE_SPEEDUP_VS_ORBAX = 2.0
SAVE_PEAK_VS_STATE = 1.1
RESTORE_PEAK_VS_STATE = 1.1
FIRST_SAVE_VS_STEADY = 1.5
STEPS_BEFORE_FIRST_SAVE = 10  # a save interval: the steps a training loop runs before its first
RSS_GROWTH_TOLERANCE = 0.05  # of the state size, over all saves of a cell


# =========================================================================== cell (child)


class _FastckptLib:
    def __init__(
        self, dest: str, root: str, endpoint: str | None, *, compression: str = "zstd"
    ) -> None:
        import fastckpt
        from fastckpt.storage import open_store

        store_root: Any = open_store(root, gcs_endpoint=endpoint) if dest == "gcs" else root
        options = fastckpt.ManagerOptions(
            save=fastckpt.SaveOptions(compression=compression),  # type: ignore[arg-type]
            retention=fastckpt.RetentionOptions(keep_last=2),
        )
        self.mgr = fastckpt.CheckpointManager(store_root, options=options)

    def prepare(self, state: Any) -> None:
        self.mgr.prepare(state)

    def save(self, step: int, state: Any) -> None:
        self.mgr.save(step, state)

    def wait(self) -> dict[str, Any]:
        self.mgr.wait()
        stats = self.mgr.last_save_stats
        return dataclasses.asdict(stats) if stats is not None else {}

    def restore(self, step: int, target: Any) -> tuple[Any, dict[str, Any]]:
        state = self.mgr.restore(step, target=target)
        stats = self.mgr.last_restore_stats
        return state, dataclasses.asdict(stats)

    def close(self) -> None:
        self.mgr.close()


class _OrbaxLib:
    def __init__(self, dest: str, root: str, endpoint: str | None) -> None:
        import orbax.checkpoint as ocp

        self.ocp = ocp
        options = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True)
        self.mgr = ocp.CheckpointManager(root, options=options)

    def prepare(self, state: Any) -> None:
        pass  # nothing to provision ahead

    def save(self, step: int, state: Any) -> None:
        self.mgr.save(step, args=self.ocp.args.StandardSave(state))

    def wait(self) -> dict[str, Any]:
        self.mgr.wait_until_finished()
        return {}

    def restore(self, step: int, target: Any) -> tuple[Any, dict[str, Any]]:
        return self.mgr.restore(step, args=self.ocp.args.StandardRestore(target)), {}

    def close(self) -> None:
        self.mgr.close()


def _orbax_gcs_env(endpoint: str) -> dict[str, str]:
    return {
        "TENSORSTORE_GCS_HTTP_URL": endpoint,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "x",
        "STORAGE_EMULATOR_HOST": endpoint,
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    }


def run_cell(args: argparse.Namespace) -> dict[str, Any]:
    lib_name, dest = args.cell.split(":")
    if lib_name == "orbax" and dest == "gcs":
        os.environ.update(_orbax_gcs_env(args.endpoint))  # this cell's process only
    import jax

    load_start = os.getloadavg()
    mesh8 = make_mesh((2, 4))
    mesh4 = make_mesh((2, 2))
    spec = spec_for_bytes(args.size_mib * MiB)
    t0 = time.perf_counter()
    state = build_state(spec, mesh8, seed=0)
    build_s = time.perf_counter() - t0
    nbytes = tree_nbytes(state)
    gc.collect()
    sampler = RssSampler(0.005)
    io_pid: int | str = args.emu_pid if dest == "gcs" else "self"
    rss_start = rss_bytes()
    lib: _FastckptLib | _OrbaxLib
    if lib_name == "orbax":
        lib = _OrbaxLib(dest, args.root, args.endpoint)
    else:
        lib = _FastckptLib(
            dest,
            args.root,
            args.endpoint,
            compression="none" if lib_name == "fastckpt-raw" else "zstd",
        )

    saves: list[dict[str, Any]] = []
    # As a training loop starts: the state is known (restored or initialised: prepare()
    # provisions the first save's staging memory in the background), the step is compiled
    # and run for a save interval, then the first save.
    lib.prepare(state)
    step_fn = make_step_fn()
    for _ in range(STEPS_BEFORE_FIRST_SAVE - 1):
        state = jax.block_until_ready(step_fn(state))
    for i in range(args.saves):
        state = jax.block_until_ready(step_fn(state))
        gc.collect()
        c0, e0 = cpu_seconds(), cpu_seconds(args.emu_pid) if dest == "gcs" else 0.0
        with sampler.window() as w:
            t0 = time.perf_counter()
            lib.save(i, state)
            t1 = time.perf_counter()
            extra = lib.wait()
            t2 = time.perf_counter()
        c1, e1 = cpu_seconds(), cpu_seconds(args.emu_pid) if dest == "gcs" else 0.0
        saves.append(
            {
                "step": i,
                "blocked_s": t1 - t0,
                "committed_s": t2 - t0,
                "cpu_s": c1 - c0,
                "emulator_cpu_s": e1 - e0,
                "rss_before": w.before,
                "rss_after": w.after,
                "peak_delta": w.delta,
                "sampled_peak_delta": w.sampled_peak - w.before,
                "samples": w.samples,
                "lib_stats": extra,
            }
        )
        print(
            f"[{args.cell}] save {i}: blocked {t1 - t0:.3f}s committed {t2 - t0:.3f}s "
            f"peak +{w.delta / MiB:.0f} MiB",
            file=sys.stderr,
            flush=True,
        )
    last = args.saves - 1
    kept = min(2, args.saves)  # both libraries keep the last 2 steps
    stored = dir_bytes(args.storage_dir) // kept if args.storage_dir else None

    def restores(target: Any, n: int, tag: str) -> list[dict[str, Any]]:
        out_list = []
        for i in range(n):
            if dest == "disk":
                evict_page_cache(args.storage_dir)
            gc.collect()
            io0 = proc_io(io_pid)
            c0, e0 = cpu_seconds(), cpu_seconds(args.emu_pid) if dest == "gcs" else 0.0
            with sampler.window() as w:
                t0 = time.perf_counter()
                restored, extra = lib.restore(last, target)
                jax.block_until_ready(restored)
                t1 = time.perf_counter()
            c1, e1 = cpu_seconds(), cpu_seconds(args.emu_pid) if dest == "gcs" else 0.0
            io1 = proc_io(io_pid)
            verified = None
            if i == 0:
                assert_trees_equal(restored, state)
                mismatched = [
                    a.sharding != t.sharding
                    for a, t in zip(
                        jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(target)
                    )
                ]
                if any(mismatched):
                    raise AssertionError(f"{tag}: restored shardings differ from the target")
                verified = True
            del restored  # nothing else may keep the restored arrays alive
            gc.collect()
            out_list.append(
                {
                    "seconds": t1 - t0,
                    "cpu_s": c1 - c0,
                    "emulator_cpu_s": e1 - e0,
                    "rss_before": w.before,
                    "rss_after": rss_bytes(),
                    "peak_delta": w.delta,
                    "sampled_peak_delta": w.sampled_peak - w.before,
                    "rchar": io1["rchar"] - io0["rchar"],
                    "read_bytes": io1["read_bytes"] - io0["read_bytes"],
                    "verified": verified,
                    "lib_stats": extra,
                }
            )
            print(
                f"[{args.cell}] restore {tag} {i}: {t1 - t0:.3f}s peak +{w.delta / MiB:.0f} MiB "
                f"read {(io1['rchar'] - io0['rchar']) / MiB:.0f} MiB",
                file=sys.stderr,
                flush=True,
            )
        return out_list

    target8 = abstract_like(state)
    target4 = abstract_like(state, mesh4)
    same = restores(target8, args.restores, "2x4")
    four = restores(target4, args.restores_4dev, "2x2")
    lib.close()
    sampler.close()
    ram = ram_saves(state, step_fn, args) if args.cell == "fastckpt:shm" else None
    return {
        "ram_saves": ram,
        "lib": lib_name,
        "dest": dest,
        "state_bytes": nbytes,
        "spec": dataclasses.asdict(spec),
        "num_leaves": len(jax.tree_util.tree_leaves(state)),
        "build_s": build_s,
        "rss_start": rss_start,
        "stored_bytes": stored,
        "saves": saves,
        "restores": same,
        "restores_4dev": four,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
    }


def ram_saves(state: Any, step_fn: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """RAM-tier saves (no peer) of ``state`` in this process's first RAM manager, each after
    a step, as a training loop makes them: ``prepare`` once the state is known, then the
    saves. The first one's blocking time beside the steady ones'."""
    import jax

    import fastckpt
    from fastckpt.options import RamOptions

    root = Path("/dev/shm") / f"fastckpt-bench-ram-{os.getpid()}"
    n = tree_nbytes(state)
    options = fastckpt.ManagerOptions(
        save_interval_steps=1 << 40,
        ram=RamOptions(root=str(root), interval_steps=1, replicas=0, budget_bytes=4 * n + 64 * MiB),
    )
    out = []
    try:
        with fastckpt.CheckpointManager("mem://bench-ram", options=options) as mgr:
            mgr.prepare(state)
            for _ in range(STEPS_BEFORE_FIRST_SAVE - 1):
                state = jax.block_until_ready(step_fn(state))
            for i in range(1, args.saves + 1):
                state = jax.block_until_ready(step_fn(state))
                t0 = time.perf_counter()
                mgr.save(i, state)
                t1 = time.perf_counter()
                mgr.wait()
                stats = mgr.last_save_stats
                out.append(
                    {
                        "blocked_s": t1 - t0,
                        "committed_s": time.perf_counter() - t0,
                        "allocate_s": stats.allocate_s if stats is not None else None,
                        "tiers": list(stats.tiers) if stats is not None else [],
                    }
                )
                print(
                    f"[{args.cell}] RAM save {i - 1}: blocked {t1 - t0:.3f}s",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def run_limits(args: argparse.Namespace) -> dict[str, Any]:
    import jax

    load_start = os.getloadavg()
    spec = spec_for_bytes(args.size_mib * MiB)
    state = build_state(spec, make_mesh((2, 4)), seed=0)
    nbytes = tree_nbytes(state)
    out: dict[str, Any] = {"state_bytes": nbytes}
    out.update(measure_device_get(state, reps=args.limit_reps + 2))
    del state
    jax.clear_caches()
    gc.collect()
    out.update(measure_memcpy(nbytes, reps=args.limit_reps))
    out.update(
        {
            f"disk_{k}": v
            for k, v in measure_file_io(args.disk_dir, nbytes, reps=args.limit_reps).items()
        }
    )
    out.update(
        {
            f"shm_{k}": v
            for k, v in measure_file_io(args.shm_dir, nbytes, reps=args.limit_reps).items()
        }
    )
    out.update(
        {
            f"gcs_{k}": v
            for k, v in measure_gcs_raw(args.endpoint, BUCKET, nbytes, reps=args.limit_reps).items()
        }
    )
    out["loadavg_start"], out["loadavg_end"] = load_start, os.getloadavg()
    return out


# =========================================================================== driver


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in (
        "fastckpt",
        "jax",
        "jaxlib",
        "orbax-checkpoint",
        "tensorstore",
        "numpy",
        "zstandard",
        "google-cloud-storage",
        "gcsfs",
    ):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "n/a"
    return out


def summarize(cell: dict[str, Any]) -> dict[str, Any]:
    """Headline figures of one cell."""
    if "error" in cell:
        return {"error": cell["error"]}
    saves, same, four = cell["saves"], cell["restores"], cell["restores_4dev"]
    steady = saves[1:] or saves
    rest = same[1:] or same
    four_rest = four[1:] or four
    n = cell["state_bytes"]
    return {
        "state_bytes": n,
        "save_first_blocked_s": saves[0]["blocked_s"],
        "save_first_allocate_s": saves[0]["lib_stats"].get("allocate_s"),
        "save_blocked_s": median([s["blocked_s"] for s in steady]),
        "save_first_committed_s": saves[0]["committed_s"],
        "save_committed_s": median([s["committed_s"] for s in steady]),
        "save_cpu_s": median([s["cpu_s"] for s in steady]),
        "save_emulator_cpu_s": median([s["emulator_cpu_s"] for s in steady]),
        "restore_cpu_s": median([r["cpu_s"] for r in rest]),
        "restore_emulator_cpu_s": median([r["emulator_cpu_s"] for r in rest]),
        "restore_4dev_cpu_s": median([r["cpu_s"] + r["emulator_cpu_s"] for r in four_rest]),
        "restore_first_s": same[0]["seconds"],
        "restore_s": median([r["seconds"] for r in rest]),
        "restore_4dev_s": median([r["seconds"] for r in four_rest]),
        "restore_read_bytes": median([r["rchar"] for r in same]),
        "restore_disk_read_bytes": median([r["read_bytes"] for r in same]),
        "stored_bytes": cell["stored_bytes"],
        "save_peak_delta": max(s["peak_delta"] for s in saves),
        "save_first_peak_delta": saves[0]["peak_delta"],
        "restore_peak_delta": max(r["peak_delta"] for r in same + four),
        # From the first steady save: the first one allocates what later saves reuse.
        "save_rss_growth": saves[-1]["rss_after"] - steady[0]["rss_after"],
        "save_retained": saves[-1]["rss_after"] - saves[0]["rss_before"],
        "restore_rss_growth": same[-1]["rss_after"] - same[0]["rss_after"],
        "restore_first_peak_delta": same[0]["peak_delta"],
        "n_saves": len(saves),
        **(
            {
                "ram_first_blocked_s": cell["ram_saves"][0]["blocked_s"],
                "ram_blocked_s": median([r["blocked_s"] for r in cell["ram_saves"][1:]]),
                "ram_first_allocate_s": cell["ram_saves"][0].get("allocate_s"),
            }
            if cell.get("ram_saves") and len(cell["ram_saves"]) > 1
            else {}
        ),
        "n_restores": len(same),
        "verified": all(r["verified"] for r in (same[0], four[0])),
    }


def evaluate(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Target checks for fastckpt, one row per (target, destination)."""
    lim = results["limits"]
    checks: list[dict[str, Any]] = []

    def add(target: str, dest: str, value: float, bound: float, ok: bool, note: str = "") -> None:
        checks.append(
            {
                "target": target,
                "dest": dest,
                "value": value,
                "bound": bound,
                "pass": bool(ok),
                "note": note,
            }
        )

    for dest in results["dests"]:
        f = results["summary"].get(f"fastckpt:{dest}", {})
        o = results["summary"].get(f"orbax:{dest}", {})
        if "error" in f or not f:
            checks.append(
                {
                    "target": "all",
                    "dest": dest,
                    "value": None,
                    "bound": None,
                    "pass": False,
                    "note": "fastckpt cell failed",
                }
            )
            continue
        n = f["state_bytes"]
        r = f["save_blocked_s"] / lim["device_get_s"]
        add(
            "save() blocks <= 1.2x device_get (steady)",
            dest,
            r,
            SAVE_BLOCK_VS_DEVICE_GET,
            r <= SAVE_BLOCK_VS_DEVICE_GET,
        )
        r = f["save_first_blocked_s"] / lim["device_get_first_s"]
        add(
            "first save() blocks <= 1.2x first device_get",
            dest,
            r,
            SAVE_BLOCK_VS_DEVICE_GET,
            r <= SAVE_BLOCK_VS_DEVICE_GET,
            f"vs steady device_get: {f['save_first_blocked_s'] / lim['device_get_s']:.2f}x",
        )
        r = f["save_first_blocked_s"] / f["save_blocked_s"]
        add(
            "first save() blocks <= 1.5x a steady one",
            dest,
            r,
            FIRST_SAVE_VS_STEADY,
            r <= FIRST_SAVE_VS_STEADY,
            f"first {f['save_first_blocked_s']:.3f}s (staging memory provisioned by prepare(); "
            f"getting it {f.get('save_first_allocate_s') or 0.0:.3f}s), "
            f"steady {f['save_blocked_s']:.3f}s",
        )
        if "ram_first_blocked_s" in f:
            r = f["ram_first_blocked_s"] / f["ram_blocked_s"]
            add(
                "first RAM save blocks <= 1.5x a steady one",
                "ram",
                r,
                FIRST_SAVE_VS_STEADY,
                r <= FIRST_SAVE_VS_STEADY,
                f"first {f['ram_first_blocked_s']:.3f}s (segment provisioned by prepare(); "
                f"getting it {f.get('ram_first_allocate_s') or 0.0:.3f}s), "
                f"steady {f['ram_blocked_s']:.3f}s (RAM tier, no peer)",
            )
        if dest in ("disk", "gcs") and o and "error" not in o:
            cpus = {
                "restore_s": lambda x: x["restore_cpu_s"] + x["restore_emulator_cpu_s"],
                "restore_4dev_s": lambda x: x["restore_4dev_cpu_s"],
            }
            for key, label in (("restore_s", "same mesh"), ("restore_4dev_s", "4 devices")):
                r = o[key] / f[key]
                add(
                    f"restore >= 2x faster than Orbax ({label})",
                    dest,
                    r,
                    RESTORE_SPEEDUP_VS_ORBAX,
                    r >= RESTORE_SPEEDUP_VS_ORBAX,
                    f"CPU s per restore, Orbax/fastckpt: {cpus[key](o) / cpus[key](f):.2f}x",
                )
        r = f["save_peak_delta"] / n
        add(
            "save peak RSS delta <= 1.1x state",
            dest,
            r,
            SAVE_PEAK_VS_STATE,
            r <= SAVE_PEAK_VS_STATE,
        )
        r = f["restore_peak_delta"] / n
        add(
            "restore peak RSS delta <= 1.1x state",
            dest,
            r,
            RESTORE_PEAK_VS_STATE,
            r <= RESTORE_PEAK_VS_STATE,
        )
        r = f["save_rss_growth"] / n
        add(
            f"no RSS growth over {f['n_saves']} saves (<= {RSS_GROWTH_TOLERANCE:.0%} of state)",
            dest,
            r,
            RSS_GROWTH_TOLERANCE,
            r <= RSS_GROWTH_TOLERANCE,
            f"{f['save_rss_growth'] / MiB:+.0f} MiB",
        )
    return checks


def _mib(x: float | None) -> str:
    return "n/a" if x is None else f"{x / MiB:.0f}"


def tables(
    results: dict[str, Any],
) -> tuple[list[str], list[list[str]], list[str], list[list[str]]]:
    """Main table (one row per cell, plus a fastckpt/Orbax ratio row per destination) and the
    limits table."""
    lim = results["limits"]
    headers = [
        "destination",
        "library",
        "save() blocks s (first)",
        "committed s (first)",
        "restore s (first)",
        "restore 4-dev s",
        "CPU s save / restore",
        "read MiB",
        "stored MiB/step",
        "save peak ΔRSS (x state)",
        "restore peak ΔRSS (x state)",
        "RSS growth saves / restores MiB",
    ]
    rows: list[list[str]] = []
    for dest in results["dests"]:
        summ = {
            lib: results["summary"].get(f"{lib}:{dest}", {"error": "not run"})
            for lib in results["libs"]
        }
        for lib, s in summ.items():
            if "error" in s:
                rows.append(
                    [DEST_LABEL[dest], lib, "ERROR: " + s["error"].splitlines()[0][:60]]
                    + [""] * (len(headers) - 3)
                )
                continue
            n = s["state_bytes"]
            rows.append(
                [
                    DEST_LABEL[dest],
                    lib,
                    f"{fmt_s(s['save_blocked_s'])} ({fmt_s(s['save_first_blocked_s'])})",
                    f"{fmt_s(s['save_committed_s'])} ({fmt_s(s['save_first_committed_s'])})",
                    f"{fmt_s(s['restore_s'])} ({fmt_s(s['restore_first_s'])})",
                    fmt_s(s["restore_4dev_s"]),
                    f"{fmt_s(s['save_cpu_s'])} / {fmt_s(s['restore_cpu_s'])}"
                    + (
                        f" (+emu {fmt_s(s['save_emulator_cpu_s'])} / "
                        f"{fmt_s(s['restore_emulator_cpu_s'])})"
                        if dest == "gcs"
                        else ""
                    ),
                    _mib(s["restore_read_bytes"]),
                    _mib(s["stored_bytes"]),
                    f"{s['save_peak_delta'] / n:.2f}",
                    f"{s['restore_peak_delta'] / n:.2f}",
                    f"{s['save_rss_growth'] / MiB:+.0f} / {s['restore_rss_growth'] / MiB:+.0f}",
                ]
            )
        f, o = summ.get("fastckpt", {}), summ.get("orbax", {})
        if f and o and "error" not in f and "error" not in o:

            def q(k: str, f: dict[str, Any] = f, o: dict[str, Any] = o) -> str:
                return fmt_ratio(f[k] / o[k]) if o[k] else "n/a"

            rows.append(
                [
                    DEST_LABEL[dest],
                    "fastckpt/Orbax",
                    f"{q('save_blocked_s')} ({q('save_first_blocked_s')})",
                    f"{q('save_committed_s')} ({q('save_first_committed_s')})",
                    f"{q('restore_s')} ({q('restore_first_s')})",
                    q("restore_4dev_s"),
                    f"{q('save_cpu_s')} / {q('restore_cpu_s')}",
                    q("restore_read_bytes"),
                    q("stored_bytes") if f["stored_bytes"] and o["stored_bytes"] else "n/a",
                    q("save_peak_delta"),
                    q("restore_peak_delta"),
                    "",
                ]
            )
    n = lim["state_bytes"]
    lheaders = ["machine limit", "figure", "implied time for the state"]
    lrows = [
        [
            "jax.device_get, first call in a process",
            f"{fmt_s(lim['device_get_first_s'])} s",
            f"{fmt_s(lim['device_get_first_s'])} s",
        ],
        [
            "jax.device_get, fresh arrays (median)",
            f"{fmt_s(lim['device_get_s'])} s ({n / lim['device_get_s'] / 1e9:.2f} GB/s)",
            f"{fmt_s(lim['device_get_s'])} s",
        ],
        [
            "numpy memcpy, 1 thread / 2 threads",
            f"{lim['memcpy_1t_gbps']:.1f} / {lim['memcpy_2t_gbps']:.1f} GB/s",
            f"{fmt_s(n / lim['memcpy_1t_gbps'] / 1e9)} / {fmt_s(n / lim['memcpy_2t_gbps'] / 1e9)} "
            "s",
        ],
        [
            "numpy memcpy into fresh memory",
            f"{lim['memcpy_fresh_gbps']:.1f} GB/s",
            f"{fmt_s(n / lim['memcpy_fresh_gbps'] / 1e9)} s",
        ],
    ]
    for d in ("disk", "shm"):
        lrows.append(
            [
                f"{DEST_LABEL[d]} write+fsync / {'cold ' if d == 'disk' else ''}read",
                f"{lim[f'{d}_write_fsync_gbps']:.2f} / {lim[f'{d}_read_gbps']:.2f} GB/s",
                f"{fmt_s(n / lim[f'{d}_write_fsync_gbps'] / 1e9)} / "
                f"{fmt_s(n / lim[f'{d}_read_gbps'] / 1e9)} s",
            ]
        )
    lrows.append(
        [
            "GCS emulator PUT / GET, 4 streams (google-cloud-storage)",
            f"{lim['gcs_put_4x_gbps']:.2f} / {lim['gcs_get_4x_gbps']:.2f} GB/s",
            f"{fmt_s(n / lim['gcs_put_4x_gbps'] / 1e9)} / "
            f"{fmt_s(n / lim['gcs_get_4x_gbps'] / 1e9)} s",
        ]
    )
    lrows.append(
        [
            "GCS emulator PUT / GET, 1 stream",
            f"{lim['gcs_put_1x_gbps']:.2f} / {lim['gcs_get_1x_gbps']:.2f} GB/s",
            "",
        ]
    )
    return headers, rows, lheaders, lrows


def vs_limits(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Each library's figures as multiples of the matching machine limit."""
    lim = results["limits"]
    n = lim["state_bytes"]
    write_gbps = {
        "disk": lim["disk_write_fsync_gbps"],
        "shm": lim["shm_write_fsync_gbps"],
        "gcs": lim["gcs_put_4x_gbps"],
    }
    read_gbps = {
        "disk": lim["disk_read_gbps"],
        "shm": lim["shm_read_gbps"],
        "gcs": lim["gcs_get_4x_gbps"],
    }
    headers = [
        "destination",
        "library",
        "save() blocks / device_get",
        "first save() / first device_get",
        "committed / raw write",
        "restore / raw read",
        "restore GB/s",
    ]
    rows = []
    for dest in results["dests"]:
        for lib in results["libs"]:
            s = results["summary"].get(f"{lib}:{dest}", {})
            if not s or "error" in s:
                continue
            raw_w = n / write_gbps[dest] / 1e9
            raw_r = n / read_gbps[dest] / 1e9
            rows.append(
                [
                    DEST_LABEL[dest],
                    lib,
                    fmt_ratio(s["save_blocked_s"] / lim["device_get_s"]),
                    fmt_ratio(s["save_first_blocked_s"] / lim["device_get_first_s"]),
                    fmt_ratio(s["save_committed_s"] / raw_w),
                    fmt_ratio(s["restore_s"] / raw_r),
                    f"{s['state_bytes'] / s['restore_s'] / 1e9:.2f}",
                ]
            )
    return headers, rows


def memory_table(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Memory details per cell (MiB, and multiples of the state size)."""
    headers = [
        "destination",
        "library",
        "save peak ΔRSS: first / max",
        "RSS kept after saves",
        f"RSS growth, saves 2..{results['meta']['saves']}",
        "restore peak ΔRSS: first / max",
        f"RSS growth over {results['meta']['restores']} restores",
    ]
    rows = []
    for dest in results["dests"]:
        for lib in results["libs"]:
            s = results["summary"].get(f"{lib}:{dest}", {})
            if not s or "error" in s:
                continue
            n = s["state_bytes"]

            def x(v: float, n: int = n) -> str:
                return f"{v / MiB:+.0f} MiB ({v / n:.2f}x)"

            rows.append(
                [
                    DEST_LABEL[dest],
                    lib,
                    f"{x(s['save_first_peak_delta'])} / {x(s['save_peak_delta'])}",
                    x(s["save_retained"]),
                    x(s["save_rss_growth"]),
                    f"{x(s['restore_first_peak_delta'])} / {x(s['restore_peak_delta'])}",
                    x(s["restore_rss_growth"]),
                ]
            )
    return headers, rows


def checks_table(results: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    cheaders = ["target (fastckpt)", "destination", "measured", "bound", "result", "note"]
    crows = [
        [
            c["target"],
            DEST_LABEL.get(c["dest"], c["dest"]),
            "n/a" if c["value"] is None else f"{c['value']:.2f}",
            "" if c["bound"] is None else f"{c['bound']}",
            "PASS" if c["pass"] else "FAIL",
            c["note"],
        ]
        for c in results["checks"]
    ]
    return cheaders, crows


def header(results: dict[str, Any]) -> str:
    meta = results["meta"]
    head = (
        f"State: {meta['state_bytes'] / MiB:.0f} MiB, {meta['num_leaves']} leaves, 8 CPU devices "
        "(2x4 mesh); "
        f"restore 4-dev = 2x2 mesh. {meta['saves']} saves, {meta['restores']} same-mesh restores, "
        f"{meta['restores_4dev']} 4-device restores per cell. Mode: {meta['mode']}. "
        f"Load average during run: {meta['loadavg_start'][0]:.2f} -> {meta['loadavg_end'][0]:.2f} "
        f"({meta['cpus']} CPUs)."
    )
    load = max(meta["loadavg_start"][0], meta["loadavg_end"][0])
    if meta["cpus"] and load > meta["cpus"]:
        head += (
            f"\n\n**Ran under contention** (load average {load:.1f} on {meta['cpus']} CPUs): wall "
            "times "
            "are noisy and the wall-time targets cannot be judged reliably; CPU seconds and memory "
            "figures "
            "are the trustworthy comparison."
        )
    return head


def render(results: dict[str, Any]) -> str:
    """The markdown report of a results JSON (also the body of its docs/benchmarks.md block)."""
    headers, rows, lheaders, lrows = tables(results)
    vheaders, vrows = vs_limits(results)
    mheaders, mrows = memory_table(results)
    cheaders, crows = checks_table(results)
    meta = results["meta"]
    head = header(results)
    legend = (
        "Times in seconds: steady-state median (first in a fresh process in parentheses). "
        "CPU s: user+system CPU seconds of the benchmark process per save (to committed) and per "
        "restore (median), plus the emulator's for GCS; it is much less affected than wall time by "
        "other processes competing for the cores. "
        "`read MiB`: bytes returned by read syscalls during one restore, in the benchmark process "
        "(disk, /dev/shm) or in the emulator (GCS). Peak ΔRSS: highest RSS during the phase minus "
        "RSS "
        "just before it (the restored state itself counts: 1.0x is the floor for restore). "
        "RSS growth: RSS after the last save minus after the second (the first precedes the jitted "
        "step's compilation); after the last restore minus after the first. `stored MiB/step`: "
        "bytes "
        "under the checkpoint root divided by the 2 steps kept."
    )
    md = (
        "\n\n".join(
            [
                "# Save/restore benchmark: fastckpt vs Orbax",
                head,
                legend,
                markdown_table(headers, rows),
                "## Machine limits (same run)",
                markdown_table(lheaders, lrows),
                "## Memory",
                markdown_table(mheaders, mrows),
                "## Versus machine limits",
                markdown_table(vheaders, vrows),
                "## Targets",
                markdown_table(cheaders, crows),
                f"Versions: {', '.join(f'{k} {v}' for k, v in meta['versions'].items())}.",
            ]
        )
        + "\n"
    )
    return md


def write_outputs(
    results: dict[str, Any], results_dir: Path, *, plot: bool, update_docs: bool = False
) -> str:
    headers, rows, lheaders, lrows = tables(results)
    vheaders, vrows = vs_limits(results)
    mheaders, mrows = memory_table(results)
    cheaders, crows = checks_table(results)
    head = header(results)
    (results_dir / "save_restore.md").write_text(render(results))
    write_json(results_dir / "save_restore.json", results)
    if plot:
        plot_results(results, results_dir / "save_restore.png")
    publish_docs(
        "save_restore",
        results,
        render=render,
        results_path=results_dir / "save_restore.json",
        quick=results["meta"]["mode"] == "quick",
        force=update_docs,
    )
    text = "\n\n".join(
        [
            head,
            text_table(headers, rows),
            text_table(mheaders, mrows),
            text_table(lheaders, lrows),
            text_table(vheaders, vrows),
            text_table(cheaders, crows),
        ]
    )
    return text


def plot_results(results: dict[str, Any], path: Path) -> None:
    lim = results["limits"]
    n = lim["state_bytes"]
    dests = results["dests"]
    groups = [DEST_LABEL[d] for d in dests]

    def series(key: str, scale: float = 1.0) -> dict[str, list[float | None]]:
        out: dict[str, list[float | None]] = {}
        for lib in results["libs"]:
            vals = []
            for d in dests:
                s = results["summary"].get(f"{lib}:{d}", {})
                vals.append(None if not s or "error" in s or s.get(key) is None else s[key] / scale)
            out[lib] = vals
        return out

    def cpu_series(phase: str) -> dict[str, list[float | None]]:
        own, emu = series(f"{phase}_cpu_s"), series(f"{phase}_emulator_cpu_s")
        return {
            lib: [None if a is None else a + (b or 0.0) for a, b in zip(own[lib], emu[lib])]
            for lib in own
        }

    raw_write = [
        n / lim[k] / 1e9
        for k in ("disk_write_fsync_gbps", "shm_write_fsync_gbps", "gcs_put_4x_gbps")
    ]
    raw_read = [n / lim[k] / 1e9 for k in ("disk_read_gbps", "shm_read_gbps", "gcs_get_4x_gbps")]
    order = {d: i for i, d in enumerate(DESTS)}

    def with_limit(
        ser: dict[str, list[float | None]], values: list[float], label: str
    ) -> dict[str, list[float | None]]:
        return {**ser, label: [values[order[d]] for d in dests]}

    panels = [
        {
            "title": "save() blocks, steady (s)",
            "ylabel": "s",
            "groups": groups,
            "series": series("save_blocked_s"),
            "lines": {
                "device_get": lim["device_get_s"],
                "1.2x device_get": SAVE_BLOCK_VS_DEVICE_GET * lim["device_get_s"],
            },
        },
        {
            "title": "first save() blocks (s)",
            "ylabel": "s",
            "groups": groups,
            "series": series("save_first_blocked_s"),
            "lines": {"first device_get": lim["device_get_first_s"]},
        },
        {
            "title": "save committed, steady (s)",
            "ylabel": "s",
            "groups": groups,
            "series": with_limit(series("save_committed_s"), raw_write, "raw write (limit)"),
        },
        {
            "title": "restore, same 2x4 mesh (s)",
            "ylabel": "s",
            "groups": groups,
            "series": with_limit(series("restore_s"), raw_read, "raw read (limit)"),
        },
        {
            "title": "restore onto 4 devices (s)",
            "ylabel": "s",
            "groups": groups,
            "series": with_limit(series("restore_4dev_s"), raw_read, "raw read (limit)"),
        },
        {
            "title": "CPU s per save (process; + emulator for GCS)",
            "ylabel": "CPU s",
            "groups": groups,
            "series": cpu_series("save"),
        },
        {
            "title": "CPU s per restore (process; + emulator for GCS)",
            "ylabel": "CPU s",
            "groups": groups,
            "series": cpu_series("restore"),
        },
        {
            "title": "peak ΔRSS, save (x state)",
            "ylabel": "x state",
            "groups": groups,
            "series": series("save_peak_delta", n),
            "lines": {"target 1.1x": SAVE_PEAK_VS_STATE},
        },
        {
            "title": "peak ΔRSS, restore (x state)",
            "ylabel": "x state",
            "groups": groups,
            "series": series("restore_peak_delta", n),
            "lines": {"target 1.1x": RESTORE_PEAK_VS_STATE},
        },
        {
            "title": f"RSS growth, saves 2..{results['meta']['saves']} (MiB)",
            "ylabel": "MiB",
            "groups": groups,
            "series": series("save_rss_growth", MiB),
        },
        {
            "title": f"RSS growth over {results['meta']['restores']} restores (MiB)",
            "ylabel": "MiB",
            "groups": groups,
            "series": series("restore_rss_growth", MiB),
        },
    ]
    bar_chart(
        path,
        panels=panels,
        ncols=3,
        title=(
            f"fastckpt vs Orbax 0.12.8, {n / MiB:.0f} MiB state, 8 CPU devices "
            f"({results['meta']['mode']})"
        ),
    )


def driver(args: argparse.Namespace) -> int:
    from fastckpt.testing.gcs_emulator import GcsEmulator

    libs = tuple(args.libs.split(","))
    dests = tuple(args.dests.split(","))
    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    if is_tmpfs(args.disk_dir):
        print(
            f"warning: --disk-dir {args.disk_dir} is on tmpfs; 'local disk' will not be a disk",
            file=sys.stderr,
        )
    work = Path(tempfile.mkdtemp(prefix="fastckpt-bench-", dir=args.disk_dir))
    shm = Path(tempfile.mkdtemp(prefix="fastckpt-bench-", dir=args.shm_dir))
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    common = ["--size-mib", str(args.size_mib)]
    results: dict[str, Any] = {"libs": libs, "dests": dests, "cells": {}, "summary": {}}
    try:
        with GcsEmulator(backend="filesystem", root=work / "gcs") as emu:
            emu.create_bucket(BUCKET)
            epid = emulator_pid(emu)
            print(
                f"emulator at {emu.endpoint} (pid {epid}); scratch {work}, {shm}",
                file=sys.stderr,
                flush=True,
            )
            t0 = time.perf_counter()
            results["limits"] = run_module_json(
                MODULE,
                [
                    "--limits",
                    *common,
                    "--disk-dir",
                    str(work),
                    "--shm-dir",
                    str(shm),
                    "--endpoint",
                    emu.endpoint,
                    "--limit-reps",
                    str(args.limit_reps),
                ],
                out_path=work / "limits.json",
            )
            print(
                f"limits measured in {time.perf_counter() - t0:.0f}s: device_get "
                f"{results['limits']['device_get_s']:.3f}s (first "
                f"{results['limits']['device_get_first_s']:.3f}s)",
                file=sys.stderr,
                flush=True,
            )
            for k, dest in enumerate(dests):
                order = libs if k % 2 == 0 else tuple(reversed(libs))  # alternate who goes first
                for lib in order:
                    cell = f"{lib}:{dest}"
                    if dest == "disk":
                        root = storage_dir = work / f"{lib}-ckpt"
                        root_arg = str(root)
                    elif dest == "shm":
                        root = storage_dir = shm / f"{lib}-ckpt"
                        root_arg = str(root)
                    else:
                        storage_dir = work / "gcs" / BUCKET / f"{lib}-ckpt"
                        root_arg = f"gs://{BUCKET}/{lib}-ckpt"
                    cell_args = [
                        "--cell",
                        cell,
                        *common,
                        "--root",
                        root_arg,
                        "--storage-dir",
                        str(storage_dir),
                        "--endpoint",
                        emu.endpoint,
                        "--emu-pid",
                        str(epid),
                        "--saves",
                        str(args.saves),
                        "--restores",
                        str(args.restores),
                        "--restores-4dev",
                        str(args.restores_4dev),
                    ]
                    t0 = time.perf_counter()
                    try:
                        results["cells"][cell] = run_module_json(
                            MODULE,
                            cell_args,
                            out_path=work / f"{lib}-{dest}.json",
                            timeout_s=args.cell_timeout,
                        )
                    except Exception as e:  # keep going: report the failure in the table
                        results["cells"][cell] = {"error": f"{type(e).__name__}: {e}"}
                        print(f"[{cell}] FAILED: {e}", file=sys.stderr, flush=True)
                    results["summary"][cell] = summarize(results["cells"][cell])
                    print(
                        f"[{cell}] done in {time.perf_counter() - t0:.0f}s",
                        file=sys.stderr,
                        flush=True,
                    )
                    if dest != "gcs":
                        shutil.rmtree(storage_dir, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    first_ok = next((c for c in results["cells"].values() if "error" not in c), None)
    results["meta"] = {
        "mode": "quick" if args.quick else "full",
        "state_bytes": results["limits"]["state_bytes"],
        "num_leaves": first_ok["num_leaves"] if first_ok else None,
        "spec": first_ok["spec"] if first_ok else None,
        "saves": args.saves,
        "restores": args.restores,
        "restores_4dev": args.restores_4dev,
        "cpus": os.cpu_count(),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "wall_s": time.perf_counter() - t_start,
        "versions": _versions(),
        "disk_dir": args.disk_dir,
        "shm_dir": args.shm_dir,
        "unix_time": time.time(),
        "command": " ".join(["python -m", MODULE, *sys.argv[1:]]),
    }
    results["checks"] = evaluate(results)
    text = write_outputs(results, results_dir, plot=not args.no_plot, update_docs=args.update_docs)
    print(text)
    print(
        f"\nwrote {results_dir}/save_restore.{{json,md{',png' if not args.no_plot else ''}}} "
        f"in {results['meta']['wall_s']:.0f}s"
    )
    return 0 if all(c["pass"] for c in results["checks"]) else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="~256 MiB state, 3 saves, 3+1 restores, 1 rep of each limit",
    )
    p.add_argument(
        "--size-mib", type=int, default=None, help="state size (default 1024, quick 256)"
    )
    p.add_argument("--saves", type=int, default=None, help="saves per cell (default 10, quick 3)")
    p.add_argument(
        "--restores",
        type=int,
        default=None,
        help="same-mesh restores per cell (default 10, quick 3)",
    )
    p.add_argument(
        "--restores-4dev",
        type=int,
        default=None,
        help="4-device restores per cell (default 3, quick 1)",
    )
    p.add_argument(
        "--libs",
        default=",".join(LIBS),
        help=f"comma-separated, of {', '.join(KNOWN_LIBS)} (fastckpt-raw: compression='none')",
    )
    p.add_argument("--dests", default=",".join(DESTS))
    p.add_argument(
        "--disk-dir",
        default=os.environ.get("FASTCKPT_BENCH_DISK", "/tmp"),
        help="directory on a real disk (not tmpfs) for the 'local disk' cells and the emulator",
    )
    p.add_argument("--shm-dir", default="/dev/shm")
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    p.add_argument(
        "--update-docs",
        action="store_true",
        help="rewrite the docs/benchmarks.md block even for --quick or another --results-dir",
    )
    p.add_argument("--limit-reps", type=int, default=None)
    p.add_argument("--cell-timeout", type=float, default=1200.0)
    p.add_argument("--no-plot", action="store_true")
    p.add_argument(
        "--from-json",
        metavar="PATH",
        help="only re-render the table, markdown and plot from an earlier save_restore.json",
    )
    # internal (child processes)
    p.add_argument("--cell", help=argparse.SUPPRESS)
    p.add_argument("--limits", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--storage-dir", help=argparse.SUPPRESS)
    p.add_argument("--endpoint", help=argparse.SUPPRESS)
    p.add_argument("--emu-pid", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    q = args.quick
    args.size_mib = args.size_mib or (256 if q else 1024)
    args.saves = args.saves or (3 if q else 10)
    args.restores = args.restores or (3 if q else 10)
    args.restores_4dev = args.restores_4dev or (1 if q else 3)
    args.limit_reps = args.limit_reps or (1 if q else 3)
    bad = [x for x in args.libs.split(",") if x not in KNOWN_LIBS] + [
        x for x in args.dests.split(",") if x not in DESTS
    ]
    if bad:
        p.error(f"unknown --libs/--dests entries: {bad}")
    if args.saves < 2 or args.restores < 1 or args.restores_4dev < 1:
        p.error("need --saves >= 2, --restores >= 1, --restores-4dev >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cell or args.limits:
        doc = run_cell(args) if args.cell else run_limits(args)
        write_json(Path(args.out), doc)
        return 0
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
        results["summary"] = {k: summarize(v) for k, v in results["cells"].items()}
        results["checks"] = evaluate(results)
        results_dir = Path(args.results_dir)
        results_dir.mkdir(parents=True, exist_ok=True)
        print(
            write_outputs(results, results_dir, plot=not args.no_plot, update_docs=args.update_docs)
        )
        return 0 if all(c["pass"] for c in results["checks"]) else 1
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
