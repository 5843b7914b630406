"""Test helpers that ship with fastckpt (the store conformance suite, a GCS emulator,
multi-process jobs, simulated hosts, ...).

Import the submodules directly (e.g. ``fastckpt.testing.store_tests``,
``fastckpt.testing.gcs_emulator``, ``fastckpt.testing.hosts``); this package imports nothing
itself, so it has no side effects and no pytest dependency at import time.
"""

from __future__ import annotations

__all__: list[str] = []
