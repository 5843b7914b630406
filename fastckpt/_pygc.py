"""Pausing Python's cyclic garbage collector around a bulk allocation phase."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["paused_gc"]


@contextlib.contextmanager
def paused_gc(enabled: bool = True) -> Iterator[None]:
    """Disable the cyclic collector for the block, if ``enabled`` and it is enabled on entry
    (a save or restore of thousands of leaves would trigger full collections, each walking
    every tracked object of the process). Cycles wait for the next collection meanwhile.

    Hazards: the process-wide switch is shared. A thread that disables the collector inside
    this block has it re-enabled when the block ends; a block entered while the collector
    is off (another thread's block, or the program's choice) leaves it alone.
    """
    if not enabled or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
