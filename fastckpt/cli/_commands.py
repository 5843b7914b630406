"""``fastckpt ls`` and ``inspect`` (what a root holds, read from manifests only), ``gc``,
``convert`` and ``demo``."""

from __future__ import annotations

import datetime
import json
import sys
from collections.abc import Sequence
from typing import Any

from fastckpt.cli._util import (
    dump_json,
    fmt_age,
    fmt_bytes,
    jsonable,
    open_root,
    plural,
    run_on_root,
)
from fastckpt.errors import CheckpointNotFoundError, NotFoundError
from fastckpt.format.codec import decode_manifest, leaf_to_json
from fastckpt.format.layout import MANIFEST_PREFIX, manifest_key, step_from_manifest_key
from fastckpt.format.manifest import (
    FORMAT_VERSION,
    ArrayLeaf,
    Manifest,
    ShardingSpec,
    ValueLeaf,
    keypath_str,
)
from fastckpt.maintenance import collect_garbage_async, find_leftovers, read_manifests
from fastckpt.options import RetentionOptions
from fastckpt.storage import Store

__all__ = ["cmd_convert", "cmd_demo", "cmd_gc", "cmd_inspect", "cmd_ls", "load_manifest"]


def _when(unix: float) -> str:
    return datetime.datetime.fromtimestamp(unix).strftime("%Y-%m-%d %H:%M:%S") if unix else "-"


def _ratio(stored: int, logical: int) -> float | None:
    return round(stored / logical, 4) if logical else None


def _ratio_str(r: float | None) -> str:
    return f"{r:.2f}" if r is not None else "-"


def _table(rows: list[list[str]], out: Any) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        out.write("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + "\n")


async def cmd_ls(store: Store, *, as_json: bool) -> int:
    """List committed steps (sizes from manifests) and uncommitted leftovers."""
    manifests, errors = await read_manifests(store)
    leftovers = await find_leftovers(store, manifests=manifests)
    rows: list[dict[str, Any]] = []
    for step, m in sorted(manifests.items()):
        extra = [lo for lo in leftovers if lo.step == step]
        if m is None:
            rows.append({"step": step, "state": "unreadable", "leftover_objects": len(extra)})
            continue
        rows.append(
            {
                "step": step,
                "state": "committed",
                "stored_bytes": m.stored_bytes,
                "logical_bytes": m.nbytes,
                "ratio": _ratio(m.stored_bytes, m.nbytes),
                "leaves": len(m.leaves),
                "arrays": len(m.arrays()),
                "objects": len(m.object_keys()),
                "num_processes": m.num_processes,
                "created_unix": m.created_unix,
                "leftover_objects": len(extra),
            }
        )
    by_step: dict[int | None, list[Any]] = {}
    for lo in leftovers:
        if lo.reason == "uncommitted":
            by_step.setdefault(lo.step, []).append(lo)
    for lstep, los in sorted(by_step.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
        rows.append(
            {
                "step": lstep,
                "state": "uncommitted",
                "objects": len(los),
                "stored_bytes": sum(lo.size for lo in los),
                "youngest_age_s": min(lo.age_s for lo in los),
            }
        )
    rows.sort(key=lambda r: (r["step"] if r["step"] is not None else -1, r["state"]))
    if as_json:
        dump_json({"root": store.url, "steps": rows, "errors": errors})
        return 0
    if not rows:
        sys.stdout.write(f"{store.url}: no checkpoints\n")
        return 0
    table = [
        ["STEP", "STATE", "STORED", "LOGICAL", "RATIO", "LEAVES", "PROCS", "CREATED / AGE", "NOTE"]
    ]
    for r in rows:
        if r["state"] == "committed":
            n = r["leftover_objects"]
            table.append(
                [
                    str(r["step"]),
                    "committed",
                    fmt_bytes(r["stored_bytes"]),
                    fmt_bytes(r["logical_bytes"]),
                    _ratio_str(r["ratio"]),
                    str(r["leaves"]),
                    str(r["num_processes"]),
                    _when(r["created_unix"]),
                    f"+{plural(n, 'unreferenced object')}" if n else "",
                ]
            )
        elif r["state"] == "uncommitted":
            size, age = fmt_bytes(r["stored_bytes"]), fmt_age(r["youngest_age_s"])
            note = f"{plural(r['objects'], 'object')} (gc removes them)"
            table.append([str(r["step"]), "uncommitted", size, *["-"] * 4, age, note])
        else:
            table.append([str(r["step"]), "unreadable", *["-"] * 6, "manifest cannot be decoded"])
    sys.stdout.write(f"{store.url}\n")
    _table(table, sys.stdout)
    for e in errors:
        sys.stderr.write(f"warning: {e}\n")
    return 0


async def load_manifest(store: Store, step: int | None) -> Manifest:
    """The manifest of ``step`` (default: latest committed)."""
    if step is None:
        steps = map(step_from_manifest_key, await store.list(MANIFEST_PREFIX))
        step = max((s for s in steps if s is not None), default=None)
        if step is None:
            raise CheckpointNotFoundError(f"no committed checkpoint in {store.url}")
    try:
        return decode_manifest(await store.get(manifest_key(step)))
    except NotFoundError:
        raise CheckpointNotFoundError(f"step {step} is not committed in {store.url}") from None


def _sharding_str(s: ShardingSpec | None) -> str:
    if s is None:
        return "-"
    mesh = ",".join(f"{n}={k}" for n, k in zip(s.mesh_axis_names, s.mesh_shape))
    spec = ", ".join(
        repr(p) if p is None or isinstance(p, str) else "(" + ",".join(map(repr, p)) + ")"
        for p in s.partition_spec
    )
    return f"mesh({mesh}) P({spec})"


def _leaf_json(leaf: ArrayLeaf | ValueLeaf) -> dict[str, Any]:
    doc = leaf_to_json(leaf)  # as the manifest has it, with the key path as a string too
    doc["path_entries"], doc["path"] = doc["path"], keypath_str(leaf.path)
    if isinstance(leaf, ValueLeaf):
        return doc
    return {
        **doc,
        "logical_bytes": leaf.nbytes,
        "stored_bytes": leaf.stored_bytes,
        "ratio": _ratio(leaf.stored_bytes, leaf.nbytes),
        "chunks": len(leaf.chunks),
        "objects": len(leaf.chunks.object_keys()),
    }


def _dtype_str(leaf: ArrayLeaf) -> str:
    if leaf.kind == "prng_key":
        return f"key<{leaf.key_impl}> ({leaf.dtype} data)"
    return leaf.dtype + (" (numpy)" if leaf.kind == "numpy" else "")


async def cmd_inspect(store: Store, step: int | None, *, as_json: bool) -> int:
    """Print one step's tree: shapes, dtypes, shardings, stored vs logical size."""
    m = await load_manifest(store, step)
    if as_json:
        dump_json(
            {
                "root": store.url,
                "step": m.step,
                "format_version": FORMAT_VERSION,
                "created_unix": m.created_unix,
                "writer_version": m.writer_version,
                "num_processes": m.num_processes,
                "metadata": m.metadata,
                "logical_bytes": m.nbytes,
                "stored_bytes": m.stored_bytes,
                "ratio": _ratio(m.stored_bytes, m.nbytes),
                "objects": len(m.object_keys()),
                "leaves": [_leaf_json(leaf) for leaf in m.leaves],
            }
        )
        return 0
    out = sys.stdout
    out.write(
        f"{store.url}  step {m.step}  (format {FORMAT_VERSION}, "
        f"written by fastckpt {m.writer_version or '?'}, "
        f"{m.num_processes} process{'es' if m.num_processes != 1 else ''}, "
        f"{_when(m.created_unix)})\n"
    )
    if m.metadata:
        out.write(f"metadata: {json.dumps(jsonable(m.metadata), sort_keys=True)[:400]}\n")
    table = [["PATH", "SHAPE", "DTYPE", "SHARDING", "STORED", "LOGICAL", "RATIO", "CHUNKS"]]
    for leaf in m.leaves:
        name = keypath_str(leaf.path)
        if isinstance(leaf, ValueLeaf):
            table.append([name, "-", leaf.vtype, "-", "-", "-", "-", f"= {leaf.value!r:.40}"])
            continue
        table.append(
            [
                name,
                str(tuple(leaf.shape)),
                _dtype_str(leaf),
                _sharding_str(leaf.sharding),
                fmt_bytes(leaf.stored_bytes),
                fmt_bytes(leaf.nbytes),
                _ratio_str(_ratio(leaf.stored_bytes, leaf.nbytes)),
                str(len(leaf.chunks)),
            ]
        )
    _table(table, out)
    ratio = f" (ratio {_ratio_str(_ratio(m.stored_bytes, m.nbytes))})" if m.nbytes else ""
    out.write(
        f"total: {plural(len(m.arrays()), 'array')}, "
        f"{plural(len(m.leaves) - len(m.arrays()), 'value')}, "
        f"{plural(len(m.object_keys()), 'object')}; stored {fmt_bytes(m.stored_bytes)} of "
        f"{fmt_bytes(m.nbytes)} logical{ratio}\n"
    )
    return 0


async def cmd_gc(
    store: Store,
    *,
    grace_s: float,
    dry_run: bool,
    keep_last: int | None,
    keep_every: int | None,
    as_json: bool,
) -> int:
    """Remove uncommitted leftovers (and steps retention drops, if asked)."""
    keep = keep_last is not None or keep_every is not None
    retention = RetentionOptions(keep_last=keep_last, keep_every=keep_every) if keep else None
    report = await collect_garbage_async(
        store, grace_s=grace_s, dry_run=dry_run, retention=retention
    )
    if as_json:
        dump_json({"root": store.url, **report.to_json()})
        return 1 if report.errors else 0
    verb = "would remove" if dry_run else "removed"
    out = sys.stdout
    for lo in report.removed:
        out.write(
            f"{verb} {lo.key}  ({lo.reason}, {fmt_bytes(lo.size)}, age {fmt_age(lo.age_s)})\n"
        )
    for lo in report.kept:
        out.write(
            f"kept {lo.key}  (uncommitted, age {fmt_age(lo.age_s)}: may be a save in flight)\n"
        )
    for step in report.retention_steps:
        out.write(f"{verb} step {step} (retention)\n")
    sizes = f", {fmt_bytes(report.removed_bytes)}" if report.removed_bytes else ""
    out.write(
        f"{store.url}: {verb} {plural(len(report.removed), 'leftover object')}{sizes}; "
        f"kept {len(report.kept)} recent; {verb} {plural(len(report.retention_steps), 'step')} "
        f"by retention ({plural(report.retention_objects, 'object')})\n"
    )
    for e in report.errors:
        sys.stderr.write(f"warning: {e}\n")
    return 1 if report.errors else 0


def cmd_convert(
    src: str,
    dst: str,
    *,
    step: int | None,
    to_step: int | None,
    item: str | None,
    layout: str,
    gcs_endpoint: str | None,
) -> int:
    """Convert between Orbax and fastckpt; the direction is detected from ``src``."""
    from fastckpt.integrations.orbax import (
        convert_fastckpt_to_orbax,
        convert_orbax_to_fastckpt,
        is_orbax_dir,
    )

    if run_on_root(lambda store: store.list(MANIFEST_PREFIX), src, gcs_endpoint):
        src_store = open_root(src, gcs_endpoint=gcs_endpoint)  # the reading manager owns it
        written = convert_fastckpt_to_orbax(src_store, step, dst, layout=layout)  # type: ignore[arg-type]
        sys.stdout.write(
            f"converted fastckpt step {written} of {src_store.url} -> Orbax at {dst} ({layout})\n"
        )
        return 0
    if not is_orbax_dir(src):
        raise CheckpointNotFoundError(
            f"{src} holds neither a committed fastckpt step nor an Orbax checkpoint"
        )
    dst_store = open_root(dst, gcs_endpoint=gcs_endpoint)
    written = convert_orbax_to_fastckpt(src, dst_store, to_step, orbax_step=step, item=item)
    sys.stdout.write(
        f"converted Orbax checkpoint {src} -> fastckpt step {written} at {dst_store.url}\n"
    )
    return 0


def cmd_demo(argv: Sequence[str]) -> int:
    """Run the elastic demo: ``fastckpt_examples.demo.main(argv)`` (imported only here)."""
    try:
        from fastckpt_examples.demo import main as demo_main
    except ImportError as e:
        sys.stderr.write(f"fastckpt demo: the elastic demo is not available: {e}\n")
        return 1
    return int(demo_main(list(argv)) or 0)
