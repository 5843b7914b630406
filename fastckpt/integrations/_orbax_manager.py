"""An Orbax-``CheckpointManager``-shaped facade over :class:`fastckpt.CheckpointManager`.

Migrating a trainer means changing the import and the constructor; the calls (``save``,
``restore``, ``should_save``, ``latest_step``, ``wait_until_finished``...) stay. Arguments:
plain pytrees, or ``StandardSave``/``StandardRestore``, ``PyTreeSave``/``PyTreeRestore``
(``item`` only), ``JsonSave``/``JsonRestore`` (stored in the manifest's metadata) and
``Composite`` of those. Storage layout and guarantees are fastckpt's (manifest commit,
crc32c on every chunk), not Orbax's: an Orbax-style manager reads only fastckpt roots.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Iterable, Sequence
from typing import Any

from fastckpt._tree import unflatten_from_paths
from fastckpt.errors import (
    CheckpointNotFoundError,
    ConfigError,
    FastckptError,
    StepAlreadyCommittedError,
    TreeStructureError,
)
from fastckpt.format.manifest import ValueLeaf
from fastckpt.manager import CheckpointManager
from fastckpt.options import ManagerOptions, RetentionOptions
from fastckpt.storage import Store

__all__ = ["OrbaxStyleCheckpointManager", "OrbaxStyleOptions", "OrbaxStyleStepMetadata"]

_META_KEY = "orbax_style"
#: Orbax ``CheckpointManagerOptions`` fields that change behaviour fastckpt does not offer.
_UNSUPPORTED = (
    "best_fn",
    "keep_time_interval",
    "should_save_fn",
    "save_decision_policy",
    "preservation_policy",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OrbaxStyleOptions:
    """The Orbax ``CheckpointManagerOptions`` fields fastckpt honours, plus fastckpt's own."""

    max_to_keep: int | None = None
    """Keep the newest N steps (None: keep all). Maps to ``RetentionOptions.keep_last``."""
    keep_period: int | None = None
    """Also keep every step divisible by this. Maps to ``RetentionOptions.keep_every``."""
    save_interval_steps: int = 1
    """``should_save(step)`` is True when ``step % save_interval_steps == 0``."""
    save_on_steps: frozenset[int] | None = None
    """Steps that are always saved."""
    enable_async_checkpointing: bool = True
    """False: ``save`` returns only once the step is committed."""
    read_only: bool = False
    """Skip every save and delete."""
    manager_options: ManagerOptions = dataclasses.field(default_factory=ManagerOptions)
    """fastckpt save/restore/distributed options (its retention and interval are replaced)."""

    def __post_init__(self) -> None:
        if not isinstance(self.save_interval_steps, int) or self.save_interval_steps <= 0:
            raise ConfigError(
                f"save_interval_steps must be a positive int, got {self.save_interval_steps!r}"
            )
        if self.save_on_steps is not None and not isinstance(self.save_on_steps, frozenset):
            object.__setattr__(self, "save_on_steps", frozenset(int(s) for s in self.save_on_steps))
        RetentionOptions(keep_last=self.max_to_keep, keep_every=self.keep_period)  # validates

    def to_manager_options(self) -> ManagerOptions:
        """The :class:`fastckpt.ManagerOptions` this facade runs its manager with."""
        return dataclasses.replace(
            self.manager_options,
            retention=RetentionOptions(keep_last=self.max_to_keep, keep_every=self.keep_period),
            save_interval_steps=1,
        )

    @classmethod
    def from_orbax(
        cls, options: Any, *, manager_options: ManagerOptions | None = None
    ) -> OrbaxStyleOptions:
        """Translate an ``orbax.checkpoint.CheckpointManagerOptions`` (:class:`ConfigError` if it
        sets an option with no fastckpt equivalent: ``best_fn``, ``keep_time_interval``,
        ``should_save_fn``, custom save/preservation policies)."""
        bad = [f for f in _UNSUPPORTED if getattr(options, f, None) is not None]
        if bad:
            raise ConfigError(f"Orbax options {bad} have no fastckpt equivalent")
        steps: Iterable[int] | None = getattr(options, "save_on_steps", None)
        return cls(
            max_to_keep=options.max_to_keep,
            keep_period=options.keep_period,
            save_interval_steps=options.save_interval_steps,
            save_on_steps=frozenset(steps) if steps is not None else None,
            enable_async_checkpointing=options.enable_async_checkpointing,
            read_only=options.read_only,
            manager_options=manager_options or ManagerOptions(),
        )


@dataclasses.dataclass(frozen=True)
class OrbaxStyleStepMetadata:
    """What :meth:`OrbaxStyleCheckpointManager.metadata` reports for one step."""

    step: int
    custom_metadata: dict[str, Any]
    metrics: dict[str, Any] | None
    item_names: tuple[str, ...] | None
    """Names of the saved items for a ``Composite`` save; None for a single tree."""


def _is_orbax(obj: Any) -> bool:
    return type(obj).__module__.startswith("orbax.")


def _unpack_save(obj: Any) -> tuple[Any, list[str] | None, dict[str, Any]]:
    """``(tree, item names or None, json items)`` of a save argument."""
    if obj is None:
        raise ConfigError("save needs a state: args=StandardSave(state) or a pytree")
    if not _is_orbax(obj):
        return obj, None, {}
    import orbax.checkpoint as ocp

    a = ocp.args
    if isinstance(obj, (a.StandardSave, a.PyTreeSave)):
        return obj.item, None, {}
    if isinstance(obj, a.Composite):
        trees: dict[str, Any] = {}
        json_items: dict[str, Any] = {}
        for name, sub in obj.items():
            if isinstance(sub, (a.StandardSave, a.PyTreeSave)):
                trees[name] = sub.item
            elif isinstance(sub, a.JsonSave):
                json_items[name] = sub.item
            else:
                raise ConfigError(
                    f"Composite item {name!r}: unsupported Orbax args {type(sub).__name__}"
                )
        return trees, sorted(trees), json_items
    raise ConfigError(
        f"unsupported Orbax save args {type(obj).__name__} (use StandardSave, PyTreeSave, "
        "Composite)"
    )


def _restore_target(obj: Any) -> Any:
    import orbax.checkpoint as ocp

    if isinstance(obj, (ocp.args.StandardRestore, ocp.args.PyTreeRestore)):
        return obj.item
    raise ConfigError(f"unsupported Orbax restore args {type(obj).__name__}")


class OrbaxStyleCheckpointManager:
    """Orbax ``CheckpointManager`` calls, fastckpt underneath.

    Example::

        mngr = OrbaxStyleCheckpointManager("/tmp/run", options=OrbaxStyleOptions(max_to_keep=3))
        mngr.save(step, args=ocp.args.StandardSave(state))     # or mngr.save(step, state)
        state = mngr.restore(mngr.latest_step(), args=ocp.args.StandardRestore(abstract))

    Args:
        directory: Root URL/path (``gs://``, local, ``mem://``) or a fastckpt Store.
        options: :class:`OrbaxStyleOptions` or an ``orbax.checkpoint.CheckpointManagerOptions``.
        item_names: Accepted for signature compatibility; not needed.
        manager_options: fastckpt options used when ``options`` is an Orbax object.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | Store,
        options: OrbaxStyleOptions | Any = None,
        *,
        item_names: Sequence[str] | None = None,
        manager_options: ManagerOptions | None = None,
    ) -> None:
        del item_names
        if options is None:
            options = OrbaxStyleOptions(manager_options=manager_options or ManagerOptions())
        elif not isinstance(options, OrbaxStyleOptions):
            if not _is_orbax(options):
                raise ConfigError(
                    f"options must be OrbaxStyleOptions or Orbax CheckpointManagerOptions, "
                    f"got {type(options).__name__}"
                )
            options = OrbaxStyleOptions.from_orbax(options, manager_options=manager_options)
        self.options: OrbaxStyleOptions = options
        root = directory if isinstance(directory, Store) else os.fspath(directory)
        self._mgr = CheckpointManager(root, options=options.to_manager_options())
        self._inflight: int | None = None
        """The step whose background save was started and not yet waited for."""
        self._committed: int | None = None
        """The newest committed step, as last listed or seen committed by this manager."""
        self.reload()

    @property
    def directory(self) -> str:
        """The root's URL."""
        return self._mgr.store.url

    @property
    def fastckpt_manager(self) -> CheckpointManager:
        """The underlying :class:`fastckpt.CheckpointManager` (stats, manifests, RAM tiers)."""
        return self._mgr

    @property
    def _last(self) -> int | None:
        """The newest step committed or being saved (a failed save is dropped once seen)."""
        steps = [s for s in (self._committed, self._inflight) if s is not None]
        return max(steps) if steps else None

    def _settle(self, *, committed: bool) -> None:
        """Account for the end of the in-flight save: fold it into the committed step when it
        committed; else drop it and re-list (so a failed step is never reported)."""
        if committed:
            self._committed, self._inflight = self._last, None
            return
        self._inflight = None
        with contextlib.suppress(FastckptError):  # keep the cached step: it was committed
            self.reload()

    # ------------------------------------------------------------------ save
    def should_save(self, step: int) -> bool:
        """Orbax's default decision: a new step on the interval or in ``save_on_steps``, or the
        first save."""
        last, opts = self._last, self.options
        if opts.read_only or (last is not None and last >= step):
            return False
        return (
            last is None
            or step in (opts.save_on_steps or ())
            or step % opts.save_interval_steps == 0
        )

    def save(
        self,
        step: int,
        items: Any = None,
        *,
        args: Any = None,
        metrics: dict[str, Any] | None = None,
        force: bool = False,
        custom_metadata: dict[str, Any] | None = None,
    ) -> bool:
        """Save ``args`` (Orbax args or a pytree; ``items`` is the legacy spelling) as ``step``.

        Returns False when skipped (``should_save`` said no, unless ``force``; or another
        save is in flight and fastckpt's ``if_busy="skip"`` is set). Raises
        :class:`~fastckpt.errors.StepAlreadyCommittedError` for an existing step, and the
        previous background save's :class:`~fastckpt.errors.SaveError` (that step is then
        no longer listed: ``latest_step()`` names the newest committed one).
        """
        if self.options.read_only or not (force or self.should_save(step)):
            return False
        if step == self._inflight or step in self._mgr.all_steps():
            raise StepAlreadyCommittedError(f"step {step} already exists in {self.directory}")
        tree, names, json_items = _unpack_save(args if args is not None else items)
        style = {"items": names, "json": json_items, "metrics": metrics}
        style["custom_metadata"] = dict(custom_metadata or {})
        try:
            started = self._mgr.save(step, tree, metadata={_META_KEY: style}, force=True)
        except BaseException:
            self._settle(committed=False)  # the previous save failed, or this one never started
            raise
        if not started:
            return False  # if_busy="skip": the previous save is still in flight
        self._settle(committed=True)  # fastckpt's save waited for the previous one
        self._inflight = step
        if not self.options.enable_async_checkpointing:
            self.wait_until_finished()
        return True

    def wait_until_finished(self) -> None:
        """Block until the in-flight save is committed; re-raise its error (the failed step
        is then dropped from ``all_steps``/``latest_step``)."""
        try:
            self._mgr.wait()
        except BaseException:
            self._settle(committed=False)
            raise
        self._settle(committed=True)

    # ------------------------------------------------------------------ listing
    def all_steps(self, read: bool = False) -> list[int]:
        """Committed steps plus the one being saved, ascending (``read`` is ignored)."""
        del read
        inflight = [] if self._inflight is None else [self._inflight]
        return sorted(set(self._mgr.all_steps() + inflight))

    def latest_step(self) -> int | None:
        """The newest step committed or being saved, or None (as Orbax: the in-flight step
        is named at once; it stays named once committed and is dropped if its save fails)."""
        return self._last

    def reload(self) -> None:
        """Re-read the committed steps from storage (an in-flight save stays accounted for)."""
        self._committed = max(self._mgr.all_steps(), default=None)

    def reached_preemption(self, step: int) -> bool:
        """Always False (no preemption sync point; kept for signature compatibility)."""
        del step
        return False

    def _style_meta(self, step: int) -> dict[str, Any]:
        raw = self._mgr.metadata(step).get(_META_KEY)
        return raw if isinstance(raw, dict) else {}

    def metadata(self, step: int | None = None) -> OrbaxStyleStepMetadata:
        """Custom metadata, metrics and item names saved with ``step`` (default: latest)."""
        step = self._resolve(step)
        m = self._style_meta(step)
        names = m.get("items")
        return OrbaxStyleStepMetadata(
            step,
            dict(m.get("custom_metadata") or {}),
            m.get("metrics"),
            tuple(names) if names is not None else None,
        )

    def item_metadata(self, step: int | None = None) -> Any:
        """The saved tree as nested dicts/lists of ``jax.ShapeDtypeStruct`` (no shardings) and
        values."""
        import jax
        import jax.numpy as jnp

        items: dict[Any, Any] = {}
        for leaf in self._mgr.manifest(self._resolve(step)).leaves:
            if isinstance(leaf, ValueLeaf):
                items[leaf.path] = complex(*leaf.value) if leaf.vtype == "complex" else leaf.value  # type: ignore[misc]
                continue
            items[leaf.path] = jax.ShapeDtypeStruct(leaf.shape, jnp.dtype(leaf.dtype))
            if leaf.kind == "prng_key":
                wrap = functools.partial(jax.random.wrap_key_data, impl=leaf.key_impl)
                items[leaf.path] = jax.eval_shape(wrap, items[leaf.path])
        return unflatten_from_paths(items)

    # ------------------------------------------------------------------ restore
    def _resolve(self, step: int | None) -> int:
        if step is None:
            step = self._mgr.latest_step() if self._inflight is None else self._last
        if step is None:
            raise CheckpointNotFoundError(f"no checkpoint in {self.directory}")
        if self._inflight is not None:
            self.wait_until_finished()
        return step

    def restore(self, step: int | None = None, items: Any = None, *, args: Any = None) -> Any:
        """Restore ``step`` (default: latest) as ``args`` says.

        ``args`` is ``StandardRestore(abstract)``, ``PyTreeRestore(item=abstract)``, a
        ``Composite`` of those and ``JsonRestore``, a plain target pytree, or None (the whole
        tree with saved shardings). A ``Composite`` restore returns an Orbax ``Composite``.
        """
        step = self._resolve(step)
        spec = args if args is not None else items
        meta = self._style_meta(step)
        saved_items: list[str] | None = meta.get("items")
        if _is_orbax(spec):
            import orbax.checkpoint as ocp

            if isinstance(spec, ocp.args.Composite):
                return self._restore_composite(step, spec, saved_items, meta.get("json") or {})
            spec = _restore_target(spec)
        if saved_items is None:
            return self._mgr.restore(step, target=spec)
        if "default" in saved_items:
            return self._mgr.restore(step, target={"default": spec}, partial=True)["default"]
        if spec is None:
            return self._mgr.restore(step)
        raise TreeStructureError(
            f"step {step} holds items {saved_items}; restore it with a Composite"
        )

    def _restore_composite(
        self, step: int, spec: Any, saved_items: list[str] | None, json_items: dict[str, Any]
    ) -> Any:
        import orbax.checkpoint as ocp

        results: dict[str, Any] = {}
        trees: dict[str, Any] = {}
        for name, sub in spec.items():
            if isinstance(sub, ocp.args.JsonRestore):
                if name not in json_items:
                    raise CheckpointNotFoundError(f"step {step} has no JSON item {name!r}")
                results[name] = json_items[name]
            else:
                trees[name] = _restore_target(sub)
        if trees and saved_items is None:
            if set(trees) != {"default"}:
                raise TreeStructureError(
                    f"step {step} holds one unnamed tree; restore it as 'default'"
                )
            results["default"] = self._mgr.restore(step, target=trees["default"])
        elif trees:
            unknown = sorted(set(trees) - set(saved_items or ()))
            if unknown:
                raise TreeStructureError(
                    f"step {step} has no items {unknown} (items: {saved_items})"
                )
            if any(t is None for t in trees.values()):
                full = self._mgr.restore(step)
                results.update({n: full[n] for n in trees})
            else:
                results.update(self._mgr.restore(step, target=trees, partial=True))
        return ocp.args.Composite(**results)

    # ------------------------------------------------------------------ deletion / lifecycle
    def delete(self, step: int) -> None:
        """Delete a committed step (no-op when ``read_only``); the in-flight save of this
        very step is finished first. A save of another step stays in flight."""
        if self.options.read_only:
            return
        if step == self._inflight:
            self.wait_until_finished()
        self._mgr.delete_step(step)
        self.reload()

    def close(self) -> None:
        """Wait for the in-flight save and release the manager. Idempotent."""
        self._inflight = None
        self._mgr.close()

    def __enter__(self) -> OrbaxStyleCheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
