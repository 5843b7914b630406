"""Fixtures for the reliability tests: trial counts, the figures recorder, GCS behind a proxy.

Trial counts: every randomised test runs a small CI count unless ``FASTCKPT_NIGHTLY_TRIALS``
is set (see :func:`tests.reliability._util.trial_count`). Figures: tests add what they ran
and saw to the session :class:`Recorder`; with ``FASTCKPT_RELIABILITY_RESULTS=<path>`` the
session merges them into that JSON file (``python -m benchmarks.reliability`` does this), and
plain ``pytest`` writes nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ._util import Recorder


@pytest.fixture(scope="session")
def recorder() -> Iterator[Recorder]:
    rec = Recorder()
    yield rec
    path = os.environ.get("FASTCKPT_RELIABILITY_RESULTS")
    if path:
        rec.merge_into(Path(path))
