"""Test helpers that ship with fastckpt, for third parties as for fastckpt's own tests.

* ``store_tests``: the :class:`~fastckpt.storage.Store` conformance suite a backend subclasses.
* ``strategies``: hypothesis strategies (shapes, boxes, tilings, manifests).
* ``gcs_emulator``: fake-gcs-server on a free port, for code that talks to GCS.

Import the submodules directly (e.g. ``fastckpt.testing.store_tests``); this package imports
nothing itself, so it has no side effects and no pytest dependency at import time.
"""

from __future__ import annotations

__all__: list[str] = []
