"""fastckpt: fast, elastic, sharded checkpoints for JAX.

Public API: :class:`CheckpointManager`, :func:`save`, :func:`restore`, option dataclasses
and the :mod:`fastckpt.errors` exception tree. Importing fastckpt has no side effects.
"""

from fastckpt import errors as errors
from fastckpt._api import restore as restore, save as save
from fastckpt._manager import CheckpointManager as CheckpointManager, SaveStats as SaveStats
from fastckpt.errors import FastckptError as FastckptError
from fastckpt.options import (
    DistributedOptions as DistributedOptions,
    ManagerOptions as ManagerOptions,
    RamOptions as RamOptions,
    RestoreOptions as RestoreOptions,
    RetentionOptions as RetentionOptions,
    SaveOptions as SaveOptions,
)
from fastckpt.reader.fetch import RestoreStats as RestoreStats

__version__ = "0.1.0"

__all__ = [
    "CheckpointManager",
    "DistributedOptions",
    "FastckptError",
    "ManagerOptions",
    "RamOptions",
    "RestoreOptions",
    "RestoreStats",
    "RetentionOptions",
    "SaveOptions",
    "SaveStats",
    "errors",
    "restore",
    "save",
]
