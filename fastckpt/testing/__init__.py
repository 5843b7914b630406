"""Test helpers that ship with fastckpt: the store conformance suite and a GCS emulator.

Import the submodules directly (``fastckpt.testing.store_tests``,
``fastckpt.testing.gcs_emulator``); this package imports nothing on its own so that it
has no side effects and no pytest dependency at import time.
"""

from __future__ import annotations

__all__: list[str] = []
