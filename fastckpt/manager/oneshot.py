"""One-shot ``save`` / ``restore`` over a short-lived manager."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastckpt.manager.checkpoint_manager import CheckpointManager
from fastckpt.options import ManagerOptions
from fastckpt.storage import Store

__all__ = ["restore", "save"]


def save(
    root: str | Store,
    step: int,
    state: Any,
    *,
    metadata: Mapping[str, object] | None = None,
    options: ManagerOptions | None = None,
) -> None:
    """Save ``state`` as ``step`` under ``root`` and wait until it is committed."""
    with CheckpointManager(root, options=options) as mgr:
        mgr.save(step, state, metadata=metadata, force=True)
        mgr.wait()


def restore(
    root: str | Store,
    step: int | None = None,
    *,
    target: Any = None,
    partial: bool = False,
    options: ManagerOptions | None = None,
) -> Any:
    """Restore ``step`` (default: latest committed) from ``root`` laid out as ``target``
    (the arguments of :meth:`CheckpointManager.restore`, after ``root``). For the restore's
    figures use a manager (:attr:`CheckpointManager.last_restore_stats`)."""
    with CheckpointManager(root, options=options) as mgr:
        return mgr.restore(step, target=target, partial=partial)
