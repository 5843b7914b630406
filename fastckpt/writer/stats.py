"""Figures of one save, as the manager reports them (``CheckpointManager.last_save_stats``)."""

from __future__ import annotations

import dataclasses

__all__ = ["SaveStats"]


@dataclasses.dataclass
class SaveStats:
    """Figures of one save on this process."""

    step: int
    blocked_s: float = 0.0
    """Time ``save()`` blocked the caller (device-to-host staging)."""
    staged_bytes: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    objects: int = 0
    encode_s: float = 0.0
    upload_s: float = 0.0
    commit_s: float = 0.0
    total_s: float = 0.0
    """From the start of ``save()`` to the commit."""
    tiers: tuple[str, ...] = ()
    """Where this step was committed: ``"ram"`` and/or ``"storage"``."""
    ram_commit_s: float = 0.0
    """From the start of ``save()`` until the RAM step was sealed (RAM steps only)."""
    deferred_copy_s: float = 0.0
    """Background copy of shards from pinned host memory into the staging buffer (the part
    of staging that ``save()`` did not wait for; ``SaveOptions.device_copy``), including
    reserving and pre-faulting a new RAM segment's pages when ``save()`` left that to it."""
    allocate_s: float = 0.0
    """Of ``blocked_s``: getting the staging memory (the RAM segment, or a staging buffer),
    including waiting for its provisioning (``CheckpointManager.prepare``) to finish;
    near zero when that memory was ready."""
    push_wait_s: float = 0.0
    """How long ``save()`` waited, before staging, for this host's push of the previous RAM
    step to its peers (RAM steps only; non-zero only when pushes are slower than the RAM
    interval). Not part of ``blocked_s``."""
