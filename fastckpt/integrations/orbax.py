"""Orbax interop: read Orbax checkpoints onto any sharding, convert both ways, Orbax-style manager.

The ``orbax`` extra (``pip install 'fastckpt[orbax]'``) brings orbax-checkpoint, gcsfs and
tensorstore. Reading an Orbax checkpoint (:func:`restore_orbax`, :func:`convert_orbax_to_fastckpt`)
needs only tensorstore (a :class:`ConfigError` naming the extra without it); writing one
(:func:`convert_fastckpt_to_orbax`) imports orbax lazily. The manager surface
(:class:`OrbaxStyleCheckpointManager`) imports orbax only when it is handed Orbax objects.

Example::

    from fastckpt.integrations.orbax import restore_orbax

    state = restore_orbax("/ckpts/orbax_run", abstract_state)   # newest step, any mesh
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

from fastckpt.errors import (
    AlreadyExistsError,
    CheckpointNotFoundError,
    ConfigError,
    FastckptError,
    PermissionDeniedError,
    SaveError,
    StepAlreadyCommittedError,
    StorageError,
)
from fastckpt.integrations._orbax_layout import is_orbax_dir as is_orbax_dir
from fastckpt.integrations._orbax_manager import (
    OrbaxStyleCheckpointManager as OrbaxStyleCheckpointManager,
)
from fastckpt.integrations._orbax_manager import OrbaxStyleOptions as OrbaxStyleOptions
from fastckpt.integrations._orbax_manager import OrbaxStyleStepMetadata as OrbaxStyleStepMetadata
from fastckpt.options import ManagerOptions
from fastckpt.storage import Store

__all__ = [
    "OrbaxStyleCheckpointManager",
    "OrbaxStyleOptions",
    "OrbaxStyleStepMetadata",
    "convert_fastckpt_to_orbax",
    "convert_orbax_to_fastckpt",
    "is_orbax_dir",
    "restore_orbax",
]


def _path(p: str | os.PathLike[str]) -> str:
    if isinstance(p, os.PathLike):
        return os.fspath(p)
    if not isinstance(p, str) or not p:
        raise ConfigError(f"path must be a non-empty str or os.PathLike, got {p!r}")
    return p


def restore_orbax(
    path: str | os.PathLike[str],
    target: Any = None,
    *,
    step: int | None = None,
    item: str | None = None,
    partial: bool = False,
    allow_dtype_cast: bool = False,
    max_inflight_bytes: int = 1 << 30,
) -> Any:
    """Read a checkpoint written by orbax-checkpoint, laid out as ``target`` says.

    Reads with tensorstore directly (OCDBT or per-array kvstores, zarr v2 or zarr3, local or
    ``gs://``); each process reads only the boxes its devices need, so any target mesh works.
    Legacy (pre-``_METADATA``) checkpoints go through Orbax's handler stack.

    Args:
        path: An Orbax item directory (``StandardCheckpointer`` output), a step directory
            (``<root>/<step>``) or a ``CheckpointManager`` root.
        target: A pytree of ``jax.ShapeDtypeStruct`` (with ``.sharding``), concrete arrays,
            numpy arrays or Python scalars. Leaves are matched by Orbax parameter name, so a
            ``TrainState``, an NNX ``State`` or nested dicts all match what Orbax saved from
            them. ``None`` restores everything as nested dicts/lists with the saved
            sharding (when this job's device count matches; else one device).
        step: On a manager root, the step to read (default: the newest finalized one).
        item: The item name inside a step directory (default: ``default`` or the only one).
        partial: Restore only the target's leaves (a subtree of the checkpoint).
        allow_dtype_cast: Convert stored dtypes to the target's instead of raising.
        max_inflight_bytes: Host memory bound for read-but-not-yet-placed data.

    Raises:
        CheckpointNotFoundError: no Orbax checkpoint, step or item at ``path``.
        TreeStructureError, ShapeMismatchError, DtypeMismatchError: the target disagrees.
        CorruptionError: tensorstore could not decode an array.
    """
    from fastckpt.integrations._orbax_layout import load_item, resolve_item_dir
    from fastckpt.integrations._orbax_read import read_item

    item_url, _ = resolve_item_dir(_path(path), step=step, item=item)
    try:
        parsed = load_item(item_url)
    except CheckpointNotFoundError:
        return _restore_legacy_with_orbax(item_url, target)
    return read_item(
        parsed,
        target,
        partial=partial,
        allow_dtype_cast=allow_dtype_cast,
        max_inflight_bytes=max_inflight_bytes,
    )


def _restore_legacy_with_orbax(item_url: str, target: Any) -> Any:
    """Fallback for item directories without ``_METADATA`` (old msgpack-based Orbax)."""
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise CheckpointNotFoundError(
            f"{item_url} has no _METADATA; reading legacy Orbax checkpoints needs orbax-checkpoint"
        ) from e
    with ocp.PyTreeCheckpointer() as ckptr:
        if target is None:
            return ckptr.restore(item_url)
        restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        return ckptr.restore(
            item_url, args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args)
        )


def convert_orbax_to_fastckpt(
    orbax_path: str | os.PathLike[str],
    fastckpt_root: str | Store,
    step: int | None = None,
    *,
    orbax_step: int | None = None,
    item: str | None = None,
    target: Any = None,
    metadata: Mapping[str, object] | None = None,
    options: ManagerOptions | None = None,
) -> int:
    """Copy one Orbax checkpoint into a fastckpt root as a committed step; returns that step.

    The state passes through this process's host memory and devices (one restore, one
    save). Without ``target`` the fastckpt tree is nested dicts/lists keyed by Orbax's key
    names; pass the real abstract state (e.g. an abstract ``TrainState``) to get the same
    key paths as a fastckpt save of that state.

    Args:
        orbax_path: Orbax item dir, step dir or manager root.
        fastckpt_root: Destination root URL/path or Store.
        step: fastckpt step to write (default: the Orbax step number).
        orbax_step: On a manager root, the Orbax step to read (default: newest).
        item: Orbax item name in a step dir.
        target: Optional abstract state to restore into before saving.
        metadata: Extra user metadata for the fastckpt manifest.
        options: fastckpt manager options for the save.
    """
    import fastckpt
    from fastckpt.integrations._orbax_layout import resolve_item_dir

    src = _path(orbax_path)
    item_url, found_step = resolve_item_dir(src, step=orbax_step, item=item)
    step = found_step if step is None else step
    if step is None:
        raise ConfigError(f"cannot tell the step of {src}; pass step=")
    tree = restore_orbax(item_url, target)
    meta = {"converted_from": {"format": "orbax", "path": item_url}, **(metadata or {})}
    fastckpt.save(fastckpt_root, step, tree, metadata=meta, options=options)
    return step


def convert_fastckpt_to_orbax(
    fastckpt_root: str | Store,
    step: int | None,
    orbax_path: str | os.PathLike[str],
    *,
    target: Any = None,
    layout: Literal["manager", "item"] = "manager",
    options: ManagerOptions | None = None,
) -> int:
    """Write fastckpt step ``step`` (default: latest) as an Orbax checkpoint; returns the step.

    Args:
        fastckpt_root: Source root URL/path or Store.
        step: Step to convert (None: latest committed).
        orbax_path: With ``layout="manager"`` an Orbax ``CheckpointManager`` directory (the
            step lands in ``<orbax_path>/<step>/default``); with ``layout="item"`` the item
            directory itself (what ``StandardCheckpointer.save`` writes). Must not exist yet.
        target: Optional restore target (default: nested dicts/lists, saved shardings).
        layout: See ``orbax_path``.
        options: fastckpt manager options for the restore.

    Raises:
        CheckpointNotFoundError: no such (or no committed) fastckpt step.
        AlreadyExistsError: ``layout="item"`` and ``orbax_path`` exists, or it is a file.
        StepAlreadyCommittedError: the Orbax manager directory already holds ``step``.
        StorageError: the destination cannot be written (a parent is a file, no permission...).
        ConfigError: orbax-checkpoint is not installed, or the state holds leaves Orbax
            cannot store (complex Python scalars, Python ints beyond int64, zero-size arrays).
        SaveError: Orbax failed otherwise (``__cause__`` is its exception).
    """
    import fastckpt

    try:
        import orbax.checkpoint as ocp
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ConfigError(
            "writing Orbax checkpoints needs orbax-checkpoint (pip install fastckpt[orbax])"
        ) from e
    if layout not in ("manager", "item"):
        raise ConfigError(f"layout must be 'manager' or 'item', got {layout!r}")
    dst = _path(orbax_path)
    dst = dst if dst.startswith("gs://") else os.path.abspath(dst)
    with fastckpt.CheckpointManager(fastckpt_root, options=options) as mgr:
        if step is None:
            step = mgr.latest_step()
            if step is None:
                raise CheckpointNotFoundError(f"no committed checkpoint in {mgr.store.url}")
        _check_orbax_destination(dst, step, layout)
        tree = mgr.restore(step, target=target)
    _check_orbax_leaves(tree)
    try:
        _write_orbax(ocp, tree, dst, step, layout)
    except FastckptError:
        raise
    except Exception as e:  # Orbax and the OS raise plain exceptions: give them fastckpt types
        raise _orbax_write_error(e, dst, step) from e
    return step


def _check_orbax_destination(dst: str, step: int, layout: str) -> None:
    """Refuse a local destination Orbax would not write to, before any data is read:
    StorageError (a parent is not a directory), AlreadyExistsError (``dst`` is a file, or
    exists for ``layout="item"``), StepAlreadyCommittedError (``dst/<step>`` exists)."""
    if dst.startswith("gs://"):
        return  # Orbax's own errors are translated by _orbax_write_error
    parent = os.path.dirname(dst)
    while parent and not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        raise StorageError(
            f"cannot write the Orbax checkpoint at {dst}: {parent} is not a directory"
        )
    if not os.path.lexists(dst):
        return
    if not os.path.isdir(dst):
        raise AlreadyExistsError(
            f"cannot write the Orbax checkpoint at {dst}: it exists and is not a directory"
        )
    if layout == "item":
        raise AlreadyExistsError(
            f"Orbax item directory {dst} already exists (layout='item' needs a new path)"
        )
    if os.path.lexists(os.path.join(dst, str(step))):
        raise StepAlreadyCommittedError(f"Orbax step {step} already exists in {dst}")


def _check_orbax_leaves(tree: Any) -> None:
    """:class:`ConfigError` for a leaf fastckpt holds but Orbax cannot save (a complex Python
    scalar, a Python int outside int64, a zero-size array), before Orbax fails late on it."""
    import jax

    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        why = None
        if isinstance(x, complex):
            why = "is a complex Python scalar"
        elif isinstance(x, int) and not isinstance(x, bool) and not -(2**63) <= x < 2**63:
            why = "is a Python int outside int64"
        elif getattr(x, "size", None) == 0 and hasattr(x, "shape"):
            why = f"is a zero-size array {tuple(x.shape)}"
        if why is not None:
            raise ConfigError(f"leaf {jax.tree_util.keystr(path)} {why}, which Orbax cannot save")


def _write_orbax(ocp: Any, tree: Any, dst: str, step: int, layout: str) -> None:
    """Write ``tree`` with Orbax: a bare item directory, or ``step`` of a manager directory."""
    import jax

    # StandardSave refuses str leaves; PyTreeSave writes them (to _strings.json).
    has_str = any(isinstance(x, str) for x in jax.tree_util.tree_leaves(tree))
    args = ocp.args.PyTreeSave(tree) if has_str else ocp.args.StandardSave(tree)
    if layout == "item":
        handler = ocp.PyTreeCheckpointHandler() if has_str else ocp.StandardCheckpointHandler()
        with ocp.Checkpointer(handler) as ckptr:
            ckptr.save(dst, args=args)
    else:
        with ocp.CheckpointManager(dst) as omgr:
            omgr.save(step, args=args, force=True)
            omgr.wait_until_finished()


def _orbax_write_error(e: Exception, dst: str, step: int) -> FastckptError:
    """The fastckpt error for an exception Orbax (or the OS under it) raised writing ``dst``."""
    what = f"writing the Orbax checkpoint at {dst}"
    if type(e).__name__ == "StepAlreadyExistsError":  # orbax.checkpoint.checkpoint_manager's
        return StepAlreadyCommittedError(f"Orbax step {step} already exists in {dst}")
    if isinstance(e, FileExistsError) or (isinstance(e, ValueError) and "already exists" in str(e)):
        return AlreadyExistsError(f"{what}: {e}")
    if isinstance(e, PermissionError):
        return PermissionDeniedError(f"{what}: {e}")
    if isinstance(e, OSError):
        return StorageError(f"{what}: {e}")
    return SaveError(f"{what} failed: {type(e).__name__}: {e}")
