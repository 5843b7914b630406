"""Save blocking and restore time vs leaf count: fastckpt vs Orbax on the same states.

Run::

    python -m benchmarks.leaf_scaling            # 100, 1000, 3000 leaves (~5 min)
    python -m benchmarks.leaf_scaling --quick    # 100, 500 leaves (< 2 min)

Real training states have hundreds to thousands of leaves (a transformer without a scanned
layer stack has ~12 parameters per layer, times 3 with Adam's moments), and a host saves 8
shards of each. Costs that grow with leaves and shards, not bytes, then decide how long the
train step is blocked and how long a restore takes. Every state here is made of ``L``
float32 leaves of 64 x 512 (128 KiB; 8 shards of 16 KiB on a 2 x 4 mesh of 8 CPU devices).

Per leaf count, each library runs in its own fresh interpreter (a *cell*):

* **fastckpt** to a local directory on /dev/shm, uncompressed (``compression="none"``: this
  benchmark is about per-leaf costs, not codecs), and the same state's own-RAM restore from a
  RAM tier (``RamOptions``, no peers);
* **Orbax** (async ``CheckpointManager``, ``StandardSave``/``StandardRestore``, its defaults)
  to /dev/shm.

A cell saves ``--saves`` times (a jitted, donated ``x + 1`` over the tree between saves makes
fresh arrays, as a train step does) and reports ``save()``'s blocking time and the time to
committed (median of the saves after the first), then restores the last step ``--reps + 1``
times onto the same shardings (the first is checked bit for bit and reported apart).

Beside them, the **jax floor** measured in the fastckpt cell on the same arrays: the public
jax calls any library must make per shard, without any checkpointing logic — host views of
every shard of fresh arrays (``addressable_data`` + ``np.asarray``) copied into one buffer
(what a blocking save must at least do), and ``make_array_from_callback`` of every leaf
from ready host buffers (what placing a restored state must at least do).

Writes ``benchmarks/results/leaf_scaling.{json,md,png}`` (``_quick`` with ``--quick``).
"""

from __future__ import annotations

from benchmarks._common import configure_host_devices

configure_host_devices(8)  # before anything imports jax

import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks._common import (  # noqa: E402
    RESULTS_DIR,
    MiB,
    abstract_like,
    assert_trees_equal,
    bar_chart,
    cpu_seconds,
    make_mesh,
    markdown_table,
    median,
    publish_docs,
    run_module_json,
    text_table,
    tree_nbytes,
    write_json,
)

MODULE = "benchmarks.leaf_scaling"
LEAF_SHAPE = (64, 512)


def build_state(count: int) -> dict[str, Any]:
    """``count`` float32 leaves of ``LEAF_SHAPE``, sharded ("data", "model") on 2 x 4 devices."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    sharding = NamedSharding(make_mesh((2, 4)), PartitionSpec("data", "model"))
    base = np.random.default_rng(0).standard_normal(LEAF_SHAPE, dtype=np.float32)
    return {f"l{i:05d}": jax.device_put(base + np.float32(i), sharding) for i in range(count)}


def _floor(state: dict[str, Any], step: Any, reps: int) -> tuple[Any, dict[str, float]]:
    """The jax floor (see the module docstring), median of ``reps``; returns the state after
    the steps that made fresh arrays for it."""
    import jax

    def starts(idx: tuple[slice, ...]) -> tuple[int, ...]:
        return tuple(s.start or 0 for s in idx)

    saves, places = [], []
    for _ in range(reps):
        state = jax.block_until_ready(step(state))
        leaves = list(state.values())
        # Every leaf has the same shape and sharding: shard i covers the same box in each.
        probe = jax.device_put(np.zeros(LEAF_SHAPE, np.float32), leaves[0].sharding)
        order = [starts(s.index) for s in probe.addressable_shards]
        buf = np.empty(sum(x.nbytes for x in leaves), np.uint8)
        t0 = time.perf_counter()
        off = 0
        hosts = []
        for x in leaves:
            views = {}
            for i, key in enumerate(order):
                h = np.asarray(x.addressable_data(i))
                np.copyto(buf[off : off + h.nbytes], h.reshape(-1).view(np.uint8))
                views[key] = buf[off : off + h.nbytes].view(h.dtype).reshape(h.shape)
                off += h.nbytes
            hosts.append(views)
        saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        placed = [
            jax.make_array_from_callback(x.shape, x.sharding, lambda idx, v=v: v[starts(idx)])
            for x, v in zip(leaves, hosts)
        ]
        jax.block_until_ready(placed)
        places.append(time.perf_counter() - t0)
        del placed, hosts
    return state, {"save_floor_s": median(saves), "restore_floor_s": median(places)}


def run_cell(args: argparse.Namespace) -> dict[str, Any]:
    import jax

    load_start = os.getloadavg()
    state = build_state(args.leaves)
    nbytes = tree_nbytes(state)
    step = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)
    state = jax.block_until_ready(step(state))  # compile outside the measurements
    work = Path(args.work)
    out: dict[str, Any] = {"lib": args.cell, "leaves": args.leaves, "bytes": nbytes}
    if args.cell == "fastckpt":
        import fastckpt
        from fastckpt.options import RamOptions

        state, out["floor"] = _floor(state, step, 3)
        ram_root = work / "fastckpt-ram"
        options = fastckpt.ManagerOptions(
            save=fastckpt.SaveOptions(compression="none"),
            retention=fastckpt.RetentionOptions(keep_last=2),
        )
        ram_options = fastckpt.ManagerOptions(
            save_interval_steps=1 << 40,
            ram=RamOptions(
                root=str(ram_root),
                member_id="host-a",
                interval_steps=1,
                budget_bytes=4 * nbytes + 256 * MiB,
            ),
        )
        libs = {
            "storage": fastckpt.CheckpointManager(str(work / "fastckpt"), options=options),
            "own RAM": fastckpt.CheckpointManager(
                f"mem://leaf-scaling-{args.leaves}", options=ram_options
            ),
        }
        save = lambda m, k, s: m.save(k, s)  # noqa: E731
        wait = lambda m: m.wait()  # noqa: E731
        restore = lambda m, k, t: m.restore(k, target=t)  # noqa: E731
    else:
        import orbax.checkpoint as ocp

        libs = {
            "storage": ocp.CheckpointManager(
                str(work / "orbax"),
                options=ocp.CheckpointManagerOptions(
                    max_to_keep=2, enable_async_checkpointing=True
                ),
            )
        }
        save = lambda m, k, s: m.save(k, args=ocp.args.StandardSave(s))  # noqa: E731
        wait = lambda m: m.wait_until_finished()  # noqa: E731
        restore = lambda m, k, t: m.restore(k, args=ocp.args.StandardRestore(t))  # noqa: E731
    target = abstract_like(state)
    for tier, mgr in libs.items():
        saves = []
        for k in range(args.saves):
            state = jax.block_until_ready(step(state))
            gc.collect()
            c0 = cpu_seconds()
            t0 = time.perf_counter()
            save(mgr, k, state)
            t1 = time.perf_counter()
            wait(mgr)
            saves.append(
                {
                    "blocked_s": t1 - t0,
                    "committed_s": time.perf_counter() - t0,
                    "cpu_s": cpu_seconds() - c0,
                }
            )
        restores = []
        for i in range(args.reps + 1):
            gc.collect()
            c0 = cpu_seconds()
            t0 = time.perf_counter()
            restored = jax.block_until_ready(restore(mgr, args.saves - 1, target))
            restores.append({"seconds": time.perf_counter() - t0, "cpu_s": cpu_seconds() - c0})
            if i == 0:
                assert_trees_equal(restored, state)
            del restored
        out[tier] = {
            "saves": saves,
            "restores": restores,
            "save_blocked_s": median([s["blocked_s"] for s in saves[1:]]),
            "committed_s": median([s["committed_s"] for s in saves[1:]]),
            "restore_first_s": restores[0]["seconds"],
            "restore_s": median([r["seconds"] for r in restores[1:]]),
        }
        print(
            f"[{args.cell} {tier} {args.leaves} leaves] save blocks "
            f"{out[tier]['save_blocked_s']:.3f} s, "
            f"committed {out[tier]['committed_s']:.3f} s, restore {out[tier]['restore_s']:.3f} s",
            file=sys.stderr,
            flush=True,
        )
        mgr.close()
    out["loadavg"] = [load_start[0], os.getloadavg()[0]]
    return out


# --------------------------------------------------------------------------- report


def _ms_per_leaf(seconds: float | None, leaves: int) -> str:
    return "n/a" if seconds is None else f"{1e3 * seconds:.0f} ({1e3 * seconds / leaves:.3f})"


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None or not b else f"{a / b:.2f}x"


def rows(doc: dict[str, Any]) -> list[list[str]]:
    out = []
    for case in doc["cases"]:
        n = case["leaves"]
        fc, ob = case.get("fastckpt", {}), case.get("orbax", {})
        floor, st, ram, ost = (
            fc.get("floor", {}),
            fc.get("storage", {}),
            fc.get("own RAM", {}),
            ob.get("storage", {}),
        )
        out.append(
            [
                str(n),
                f"{case['bytes'] / MiB:.0f}",
                _ms_per_leaf(floor.get("save_floor_s"), n),
                _ms_per_leaf(st.get("save_blocked_s"), n),
                _ms_per_leaf(ost.get("save_blocked_s"), n),
                _ratio(st.get("save_blocked_s"), ost.get("save_blocked_s")),
                _ms_per_leaf(st.get("committed_s"), n),
                _ms_per_leaf(ost.get("committed_s"), n),
                _ms_per_leaf(floor.get("restore_floor_s"), n),
                _ms_per_leaf(ram.get("restore_s"), n),
                _ms_per_leaf(st.get("restore_s"), n),
                _ms_per_leaf(ost.get("restore_s"), n),
                _ratio(st.get("restore_s"), ost.get("restore_s")),
            ]
        )
    return out


HEADERS = [
    "leaves",
    "MiB",
    "save floor (jax)",
    "fastckpt save() blocks",
    "Orbax save() blocks",
    "fastckpt/Orbax",
    "fastckpt committed",
    "Orbax committed",
    "placement floor (jax)",
    "fastckpt own-RAM restore",
    "fastckpt /dev/shm restore",
    "Orbax /dev/shm restore",
    "fastckpt/Orbax",
]


def render(doc: dict[str, Any]) -> str:
    m = doc["meta"]
    return (
        "\n\n".join(
            [
                "# Save blocking and restore time vs leaf count: fastckpt vs Orbax",
                "Leaves of 64 x 512 float32 (128 KiB, 8 shards of 16 KiB on a 2 x 4 mesh of 8 CPU "
                "devices); "
                f"{m['saves']} saves (median of all but the first) and {m['reps']} restores after "
                "a first one (median) "
                "per cell, each library in a fresh process; /dev/shm for both; fastckpt "
                "uncompressed, Orbax its "
                f"defaults. git `{m['git']}`, {m['date']}, load average {m['loadavg'][0]:.1f} -> "
                f"{m['loadavg'][1]:.1f} "
                "on 2 CPUs (shared machine).",
                "Times in ms, per leaf in parentheses. *Floor (jax)*: the public jax calls any "
                "library must make "
                "per shard, on the same arrays and nothing else (host views of every shard copied "
                "into one buffer; "
                "`make_array_from_callback` of every leaf from ready host buffers). *Committed*: "
                "`save()` until "
                "the checkpoint is durable (`wait()` / `wait_until_finished()`).",
                markdown_table(HEADERS, rows(doc)),
            ]
        )
        + "\n"
    )


def plot(doc: dict[str, Any], path: Path) -> None:
    cases = doc["cases"]
    groups = [str(c["leaves"]) for c in cases]

    def per_leaf(lib: str, tier: str, key: str) -> list[float | None]:
        vals = [c.get(lib, {}).get(tier, {}).get(key) for c in cases]
        return [None if v is None else 1e3 * v / c["leaves"] for v, c in zip(vals, cases)]

    bar_chart(
        path,
        title="Per-leaf cost vs leaf count (8 shards per leaf, /dev/shm)",
        ncols=3,
        panels=[
            {
                "title": "save() blocks (ms per leaf)",
                "ylabel": "ms",
                "groups": groups,
                "series": {
                    "jax floor": per_leaf("fastckpt", "floor", "save_floor_s"),
                    "fastckpt": per_leaf("fastckpt", "storage", "save_blocked_s"),
                    "Orbax": per_leaf("orbax", "storage", "save_blocked_s"),
                },
            },
            {
                "title": "save() to committed (ms per leaf)",
                "ylabel": "ms",
                "groups": groups,
                "series": {
                    "fastckpt": per_leaf("fastckpt", "storage", "committed_s"),
                    "Orbax": per_leaf("orbax", "storage", "committed_s"),
                },
            },
            {
                "title": "restore (ms per leaf)",
                "ylabel": "ms",
                "groups": groups,
                "series": {
                    "jax floor": per_leaf("fastckpt", "floor", "restore_floor_s"),
                    "fastckpt own RAM": per_leaf("fastckpt", "own RAM", "restore_s"),
                    "fastckpt /dev/shm": per_leaf("fastckpt", "storage", "restore_s"),
                    "Orbax /dev/shm": per_leaf("orbax", "storage", "restore_s"),
                },
            },
        ],
    )


def driver(args: argparse.Namespace) -> int:
    counts = (
        [int(c) for c in args.leaves_list.split(",")]
        if args.leaves_list
        else ([100, 500] if args.quick else [100, 1000, 3000])
    )
    saves, reps = (3, 1) if args.quick else (4, 2)
    git = (
        subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
            check=False,
        ).stdout.strip()
        or "unknown"
    )
    load_start = os.getloadavg()[0]
    cases = []
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.shm_dir, prefix="fastckpt-leaf-scaling-") as tmp:
        for n in counts:
            case: dict[str, Any] = {"leaves": n, "bytes": n * int(np.prod(LEAF_SHAPE)) * 4}
            for cell in ("fastckpt", "orbax"):
                work = Path(tmp) / f"{cell}-{n}"
                work.mkdir()
                try:
                    case[cell] = run_module_json(
                        MODULE,
                        [
                            "--cell",
                            cell,
                            "--leaves",
                            str(n),
                            "--saves",
                            str(saves),
                            "--reps",
                            str(reps),
                            "--work",
                            str(work),
                        ],
                        out_path=Path(tmp) / f"{cell}-{n}.json",
                        timeout_s=args.cell_timeout,
                    )
                except Exception as e:
                    print(f"[{cell} {n} leaves] failed: {e}", file=sys.stderr, flush=True)
                    case[cell] = {"error": str(e)[-2000:]}
                shutil.rmtree(work, ignore_errors=True)
            cases.append(case)
    meta = {
        "quick": args.quick,
        "saves": saves,
        "reps": reps,
        "git": git,
        "wall_s": time.perf_counter() - t_start,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "loadavg": [load_start, os.getloadavg()[0]],
    }
    doc = {"meta": meta, "cases": cases}
    name = args.name or ("leaf_scaling_quick" if args.quick else "leaf_scaling")
    write_json(args.results_dir / f"{name}.json", doc)
    (args.results_dir / f"{name}.md").write_text(render(doc))
    if not args.no_plot:
        plot(doc, args.results_dir / f"{name}.png")
    publish_docs(
        "leaf_scaling",
        doc,
        render=render,
        results_path=args.results_dir / f"{name}.json",
        quick=args.quick,
        force=args.update_docs,
    )
    print(text_table(HEADERS, rows(doc)))
    print(
        f"wrote {args.results_dir / name}.{{json,md{'' if args.no_plot else ',png'}}} in "
        f"{meta['wall_s']:.0f}s",
        file=sys.stderr,
    )
    failed = [c for c in cases for cell in ("fastckpt", "orbax") if "error" in c.get(cell, {})]
    return 1 if failed else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="100 and 500 leaves, fewer repetitions (< 2 min)"
    )
    p.add_argument("--leaves-list", help="comma-separated leaf counts (overrides the preset)")
    p.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"))
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--name", help="output file stem (default leaf_scaling, or leaf_scaling_quick)")
    p.add_argument("--cell-timeout", type=float, default=900.0)
    p.add_argument("--no-plot", action="store_true")
    p.add_argument(
        "--update-docs",
        action="store_true",
        help="rewrite the docs/benchmarks.md block even for --quick or another --results-dir",
    )
    p.add_argument(
        "--from-json",
        type=Path,
        metavar="PATH",
        help="only re-render the markdown and plot of a results JSON",
    )
    p.add_argument("--cell", choices=("fastckpt", "orbax"), help=argparse.SUPPRESS)
    p.add_argument("--leaves", type=int, help=argparse.SUPPRESS)
    p.add_argument("--saves", type=int, help=argparse.SUPPRESS)
    p.add_argument("--reps", type=int, help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:  # re-render the markdown and the plot of an earlier run
        doc = json.loads(args.from_json.read_text())
        args.from_json.with_suffix(".md").write_text(render(doc))
        plot(doc, args.from_json.with_suffix(".png"))
        publish_docs(
            "leaf_scaling",
            doc,
            render=render,
            results_path=args.from_json,
            quick=doc["meta"]["quick"],
            force=args.update_docs,
        )
        print(render(doc))
        return 0
    if args.cell:
        write_json(Path(args.out), run_cell(args))
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
