"""Which steps are committed, in which tier, and their manifests.

Storage is listed by its manifests (a step exists once its manifest is committed); a fast
tier (``writer.tier.Tier``) answers for the steps it holds. ``run`` drives the store's
coroutines from sync code (the manager's ``LoopThread.run``).
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

from fastckpt.errors import CheckpointNotFoundError, NoCheckpointError, NotFoundError
from fastckpt.format.codec import decode_manifest
from fastckpt.format.layout import (
    MANIFEST_PREFIX,
    manifest_key,
    step_data_prefix,
    step_from_manifest_key,
)
from fastckpt.format.manifest import Manifest
from fastckpt.storage import Store
from fastckpt.writer.tier import Tier

__all__ = [
    "Run",
    "delete_step",
    "latest_step",
    "list_manifests",
    "load_manifest",
    "persistent_steps",
    "steps_by_tier",
]

T = TypeVar("T")


class Run(Protocol):
    """Runs a coroutine to its end from sync code (``LoopThread.run``)."""

    def __call__(self, coro: Coroutine[Any, Any, T], /) -> T: ...


async def list_manifests(store: Store) -> list[str]:
    """The committed manifests' keys: one storage listing (the only one a restore makes)."""
    return await store.list(MANIFEST_PREFIX)


def persistent_steps(store: Store, run: Run) -> list[int]:
    """Steps committed to ``store``, ascending."""
    keys = run(list_manifests(store))
    return sorted(s for s in (step_from_manifest_key(k) for k in keys) if s is not None)


def steps_by_tier(store: Store, run: Run, tier: Tier | None) -> dict[int, set[str]]:
    """Every committed step and the tiers holding its manifest: ``"storage"`` and those ``tier``
    names."""
    out: dict[int, set[str]] = {s: {"storage"} for s in persistent_steps(store, run)}
    if tier is not None:
        for s, tiers in tier.steps_by_tier().items():
            out.setdefault(s, set()).update(tiers)
    return dict(sorted(out.items()))


def latest_step(store: Store, run: Run, tier: Tier | None) -> int | None:
    """The newest committed step in any tier, or None."""
    steps = persistent_steps(store, run) if tier is None else list(steps_by_tier(store, run, tier))
    return steps[-1] if steps else None


def load_manifest(store: Store, run: Run, tier: Tier | None, step: int | None) -> Manifest:
    """The manifest of ``step`` (None: the latest in any tier), from storage, else from
    ``tier``. :class:`NoCheckpointError` if nothing is committed, :class:`CheckpointNotFoundError`
    if ``step`` is not."""
    if step is None:
        step = latest_step(store, run, tier)
        if step is None:
            raise NoCheckpointError(f"no committed checkpoint in {store.url}")
    try:
        data = run(store.get(manifest_key(step)))
    except NotFoundError:
        held = tier.manifest(step) if tier is not None else None
        if held is None:
            raise CheckpointNotFoundError(f"step {step} is not committed in {store.url}") from None
        return held
    return decode_manifest(data)


def delete_step(store: Store, run: Run, step: int) -> None:
    """Delete a committed step: the manifest first (un-commit), then its data."""
    run(store.delete(manifest_key(step)))
    for key in run(store.list(step_data_prefix(step))):
        run(store.delete(key))
