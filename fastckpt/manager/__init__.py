"""The checkpoint manager: :class:`CheckpointManager` and the one-shot :func:`save` /
:func:`restore`."""

from fastckpt.manager.checkpoint_manager import CheckpointManager as CheckpointManager
from fastckpt.manager.oneshot import restore as restore
from fastckpt.manager.oneshot import save as save

__all__ = ["CheckpointManager", "restore", "save"]
