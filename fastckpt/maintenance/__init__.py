"""Maintenance of a checkpoint root: garbage collection and retention.

Works on any :class:`~fastckpt.storage.Store` through its declared listing with metadata
(:meth:`~fastckpt.storage.Store.list_info`) and :meth:`~fastckpt.storage.Store.sweep`.
See ``docs/cli.md`` (``fastckpt gc``).
"""

from __future__ import annotations

from fastckpt.maintenance.gc import DEFAULT_GRACE_S as DEFAULT_GRACE_S
from fastckpt.maintenance.gc import GcReport as GcReport
from fastckpt.maintenance.gc import Leftover as Leftover
from fastckpt.maintenance.gc import collect_garbage as collect_garbage
from fastckpt.maintenance.gc import collect_garbage_async as collect_garbage_async
from fastckpt.maintenance.gc import find_leftovers as find_leftovers
from fastckpt.maintenance.gc import read_manifests as read_manifests
from fastckpt.maintenance.gc import steps_to_delete as steps_to_delete

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
