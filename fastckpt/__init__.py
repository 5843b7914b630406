"""fastckpt: fast, elastic, sharded checkpoints for JAX.

Public API: :class:`CheckpointManager`, :func:`save`, :func:`restore`, option dataclasses
and the :mod:`fastckpt.errors` exception tree. Importing fastckpt has no side effects and
does not import jax until the manager, ``save``/``restore`` or ``RestoreStats`` is used.
"""

from typing import TYPE_CHECKING, Any

from fastckpt import errors as errors
from fastckpt.errors import FastckptError as FastckptError
from fastckpt.options import DistributedOptions as DistributedOptions
from fastckpt.options import ManagerOptions as ManagerOptions
from fastckpt.options import RamOptions as RamOptions
from fastckpt.options import RestoreOptions as RestoreOptions
from fastckpt.options import RetentionOptions as RetentionOptions
from fastckpt.options import SaveOptions as SaveOptions

if TYPE_CHECKING:
    from fastckpt.manager import CheckpointManager as CheckpointManager
    from fastckpt.manager import restore as restore
    from fastckpt.manager import save as save
    from fastckpt.reader.units import RestoreStats as RestoreStats
    from fastckpt.replicas import new_peer_secret as new_peer_secret
    from fastckpt.replicas import peer_secret_from_env as peer_secret_from_env
    from fastckpt.writer.stats import SaveStats as SaveStats

# Imported on first use: they pull in jax, which the CLI and code building options do not need.
_LAZY = {
    "CheckpointManager": "fastckpt.manager",
    "SaveStats": "fastckpt.writer.stats",
    "RestoreStats": "fastckpt.reader.units",
    "save": "fastckpt.manager",
    "restore": "fastckpt.manager",
    "peer_secret_from_env": "fastckpt.replicas",
    "new_peer_secret": "fastckpt.replicas",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fastckpt' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


from fastckpt._version import __version__ as __version__  # noqa: E402 (after the lazy table it sits beside)

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
    "new_peer_secret",
    "peer_secret_from_env",
    "restore",
    "save",
]
