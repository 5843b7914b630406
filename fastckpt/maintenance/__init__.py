"""Maintenance of a checkpoint root (any :class:`~fastckpt.storage.Store`): remove data no
committed manifest references (garbage collection), and apply retention; see ``docs/cli.md``.

A save writes its data objects under ``steps/<step>/<save_id>/`` first and commits by
writing ``manifests/<step>.json`` last. A save that died, a retried attempt that lost, and
the per-process fragment files of a committed multi-process save all leave objects that no
manifest references. :func:`collect_garbage` finds them:

* **unreferenced**: under a committed step, not referenced by its manifest. Always safe to
  remove (a committed step is immutable; a competing attempt can no longer commit).
* **uncommitted**: under a step without a manifest. It may belong to a save in flight, so
  it is removed only when it is at least ``grace_s`` old (``grace_s == 0``: the caller
  asserts that nothing is writing).

Ages and sizes come from the store's listing (:meth:`~fastckpt.storage.Store.list_info`;
age = ``now`` - the listed ``mtime``, so keep ``grace_s`` well above the clock skew between
this host and a remote store's servers); debris that is no object (a local store's temp files
of killed puts, empty directories) goes through :meth:`~fastckpt.storage.Store.sweep`.

Order of deletion: for retention, a step's manifest is deleted before its data (un-commit
first, like :meth:`fastckpt.CheckpointManager.delete_step`). A manifest that cannot be read
protects its whole step (reported in ``GcReport.errors``), never the reverse. A step whose
manifest appears while collection runs keeps its data (the manifests are checked again
before deleting "uncommitted" data); one that commits in the moment between that check and
the deletion is only protected by ``grace_s``: keep it above the longest save.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterable, Sequence
from typing import Literal

from fastckpt.errors import ConfigError, FastckptError
from fastckpt.format.codec import decode_manifest
from fastckpt.format.layout import (
    MANIFEST_PREFIX,
    STEPS_PREFIX,
    manifest_key,
    step_data_prefix,
    step_from_data_key,
    step_from_manifest_key,
)
from fastckpt.format.manifest import Manifest
from fastckpt.options import RetentionOptions
from fastckpt.storage import Store

__all__ = [
    "DEFAULT_GRACE_S",
    "GcReport",
    "Leftover",
    "collect_garbage",
    "collect_garbage_async",
    "find_leftovers",
    "read_manifests",
    "steps_to_delete",
]

#: Default grace period: one hour (no sane save stays in flight that long).
DEFAULT_GRACE_S = 3600.0
_CONCURRENCY = 16


@dataclasses.dataclass(frozen=True, slots=True)
class Leftover:
    """One data object no committed manifest references."""

    key: str
    step: int | None
    reason: Literal["unreferenced", "uncommitted"]
    """``unreferenced``: its step is committed; ``uncommitted``: its step has no manifest."""
    age_s: float
    """Seconds since it was written (``now`` - its listed ``mtime``, at least 0)."""
    size: int
    """Bytes, as listed."""


@dataclasses.dataclass
class GcReport:
    """What :func:`collect_garbage` removed (or would remove, with ``dry_run``)."""

    dry_run: bool
    committed_steps: list[int]
    removed: list[Leftover] = dataclasses.field(default_factory=list)
    """Leftovers deleted (dry run: that would be deleted)."""
    kept: list[Leftover] = dataclasses.field(default_factory=list)
    """Uncommitted leftovers kept because they may belong to a save in flight."""
    retention_steps: list[int] = dataclasses.field(default_factory=list)
    """Committed steps the retention policy deleted (dry run: would delete)."""
    retention_objects: int = 0
    """Objects (manifests + data) of ``retention_steps``."""
    errors: list[str] = dataclasses.field(default_factory=list)
    temp_files: list[str] = dataclasses.field(default_factory=list)
    """What :meth:`~fastckpt.storage.Store.sweep` removed (dry run: would remove): temp files
    of killed local puts."""

    @property
    def removed_bytes(self) -> int:
        """Bytes of ``removed``."""
        return sum(lo.size for lo in self.removed)

    def to_json(self) -> dict[str, object]:
        """A JSON-serialisable summary (the CLI's ``--json`` output)."""
        return {**dataclasses.asdict(self), "removed_bytes": self.removed_bytes}


async def read_manifests(store: Store) -> tuple[dict[int, Manifest | None], list[str]]:
    """Every committed step's manifest (``None`` where it cannot be read), plus error notes."""
    out: dict[int, Manifest | None] = {}
    errors: list[str] = []
    for key in await store.list(MANIFEST_PREFIX):
        step = step_from_manifest_key(key)
        if step is None:
            continue
        try:
            out[step] = decode_manifest(await store.get(key))
        except (FastckptError, ValueError) as e:
            errors.append(f"step {step}: unreadable manifest ({e}); its data is left alone")
            out[step] = None
    return out, errors


async def find_leftovers(
    store: Store, *, manifests: dict[int, Manifest | None] | None = None, now: float | None = None
) -> list[Leftover]:
    """Data objects no committed manifest references (no deletion).

    ``manifests`` (from :func:`read_manifests`) saves re-reading them. Objects of a step
    whose manifest is unreadable are never reported.
    """
    if manifests is None:
        manifests, _ = await read_manifests(store)
    referenced = {key for m in manifests.values() if m is not None for key in m.object_keys()}
    protected = {s for s, m in manifests.items() if m is None}
    now = time.time() if now is None else now
    leftovers = []
    for info in await store.list_info(STEPS_PREFIX):
        step = step_from_data_key(info.key)
        if info.key in referenced or step in protected:
            continue
        reason: Literal["unreferenced", "uncommitted"] = (
            "unreferenced" if step in manifests else "uncommitted"
        )
        leftovers.append(Leftover(info.key, step, reason, max(0.0, now - info.mtime), info.size))
    return leftovers


def steps_to_delete(steps: Iterable[int], policy: RetentionOptions) -> list[int]:
    """Committed steps that ``policy`` does not keep, oldest first: a step is kept if it is
    among the newest ``keep_last`` or divisible by ``keep_every``; the newest is always kept."""
    ordered = sorted(set(steps))
    keep = set(ordered if policy.keep_last is None else ordered[-policy.keep_last :])
    keep.update(ordered[-1:])
    if policy.keep_every is not None:
        keep.update(s for s in ordered if s % policy.keep_every == 0)
    return [s for s in ordered if s not in keep]


async def _delete_all(store: Store, keys: Sequence[str]) -> None:
    sem = asyncio.Semaphore(_CONCURRENCY)

    async def one(k: str) -> None:
        async with sem:
            await store.delete(k)

    await asyncio.gather(*(one(k) for k in keys))


async def collect_garbage_async(
    store: Store,
    *,
    grace_s: float = DEFAULT_GRACE_S,
    dry_run: bool = False,
    retention: RetentionOptions | None = None,
    now: float | None = None,
) -> GcReport:
    """Async form of :func:`collect_garbage` (run it on the loop that owns ``store``)."""
    if not grace_s >= 0:  # (NaN too)
        raise ConfigError(f"grace_s must be >= 0, got {grace_s}")
    now = time.time() if now is None else now
    committed, errors = await read_manifests(store)
    leftovers = await find_leftovers(store, manifests=committed, now=now)
    report = GcReport(dry_run=dry_run, committed_steps=sorted(committed), errors=errors)
    # A step may have committed since the manifests were read (a save that ran longer than
    # grace_s): its data is no leftover. Checked again right before deleting.
    old = [lo for lo in leftovers if lo.reason == "unreferenced" or lo.age_s >= grace_s]
    late = {lo.step for lo in old if lo.reason == "uncommitted"}
    late = {s for s in late if s is not None and await store.exists(manifest_key(s))}
    report.kept = [lo for lo in leftovers if lo.reason == "uncommitted" and lo.age_s < grace_s]
    report.kept += [lo for lo in old if lo.reason == "uncommitted" and lo.step in late]
    report.removed = [lo for lo in old if not (lo.reason == "uncommitted" and lo.step in late)]
    if retention is not None:
        report.retention_steps = steps_to_delete(committed, retention)
    if not dry_run:
        await _delete_all(store, [lo.key for lo in report.removed])
    for step in report.retention_steps:
        keys = await store.list(step_data_prefix(step))
        report.retention_objects += 1 + len(keys)
        if not dry_run:
            await store.delete(manifest_key(step))  # un-commit first
            await _delete_all(store, keys)
    report.temp_files = await store.sweep(older_than=now - grace_s, dry_run=dry_run)
    return report


def collect_garbage(
    store: Store,
    *,
    grace_s: float = DEFAULT_GRACE_S,
    dry_run: bool = False,
    retention: RetentionOptions | None = None,
    now: float | None = None,
) -> GcReport:
    """Remove leftovers no committed manifest references; optionally apply ``retention``.

    Blocking; runs its own event loop (call :func:`collect_garbage_async` from async code
    or a manager's loop). See the module docstring for what counts as a leftover.

    Args:
        store: The checkpoint root.
        grace_s: Uncommitted data younger than this is kept (it may be a save in flight).
        dry_run: Report only; delete nothing.
        retention: Also delete committed steps this policy does not keep.
        now: Current UNIX time (tests inject it).
    """
    return asyncio.run(
        collect_garbage_async(store, grace_s=grace_s, dry_run=dry_run, retention=retention, now=now)
    )
