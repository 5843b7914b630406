"""``fastckpt gc``, ``convert`` and ``demo``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from fastckpt.cli._util import dump_json, fmt_age, fmt_bytes, open_root, plural, run_on_root
from fastckpt.errors import CheckpointNotFoundError
from fastckpt.format.layout import MANIFEST_PREFIX
from fastckpt.maintenance import collect_garbage_async
from fastckpt.options import RetentionOptions
from fastckpt.storage import Store

__all__ = ["cmd_convert", "cmd_demo", "cmd_gc"]


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
        f"{store.url}: {verb} {plural(len(report.removed), 'leftover object')}{sizes}; kept "
        f"{len(report.kept)} "
        f"recent; {verb} {plural(len(report.retention_steps), 'step')} by retention "
        f"({plural(report.retention_objects, 'object')})\n"
    )
    for e in report.errors:
        sys.stderr.write(f"warning: {e}\n")
    return 1 if report.errors else 0


async def _has_steps(store: Store) -> bool:
    return bool(await store.list(MANIFEST_PREFIX))


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

    if run_on_root(_has_steps, src, gcs_endpoint):
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
    rc = demo_main(list(argv))
    return int(rc) if rc is not None else 0
