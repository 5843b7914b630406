"""Retention policy as a pure function over committed step numbers."""

from __future__ import annotations

from collections.abc import Iterable

from fastckpt.options import RetentionOptions

__all__ = ["steps_to_delete"]


def steps_to_delete(steps: Iterable[int], policy: RetentionOptions) -> list[int]:
    """Committed steps that ``policy`` does not keep, oldest first.

    A step is kept if it is among the newest ``keep_last`` steps or divisible by
    ``keep_every``. The newest step is always kept.
    """
    ordered = sorted(set(steps))
    if not ordered:
        return []
    keep: set[int] = {ordered[-1]}
    if policy.keep_last is None:
        keep.update(ordered)
    else:
        keep.update(ordered[-policy.keep_last :])
    if policy.keep_every is not None:
        keep.update(s for s in ordered if s % policy.keep_every == 0)
    return [s for s in ordered if s not in keep]
