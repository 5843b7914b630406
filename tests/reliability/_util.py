"""Helpers shared by the reliability tests: trial counts, figures, deterministic state."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
BUCKET = "fastckpt-test"  # created by the session emulator fixture in tests/conftest.py
NIGHTLY_ENV = "FASTCKPT_NIGHTLY_TRIALS"


def trial_count(ci: int, *, scale: float = 1.0) -> int:
    """``ci`` trials, or ``scale * $FASTCKPT_NIGHTLY_TRIALS`` (at least ``ci``) when it is set."""
    raw = os.environ.get(NIGHTLY_ENV)
    if not raw:
        return ci
    return max(ci, int(int(raw) * scale))


def _load_worker() -> Any:
    spec = importlib.util.spec_from_file_location(
        "_fastckpt_crash_worker", HERE / "_crash_worker.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


worker = _load_worker()
expected = worker.expected
"""``expected(step)``: the deterministic state of a step (host values)."""


def device_state(step: int) -> dict[str, Any]:
    """``expected(step)`` with the largest leaf as a jax array on the default device."""
    import jax

    host = expected(step)
    host["w"] = jax.device_put(host["w"])
    return host


def state_mismatches(got: Any, step: int) -> list[str]:
    """Names of leaves of a restored state that differ (bit for bit) from ``expected(step)``."""
    want = expected(step)
    bad = []
    if set(got) != set(want):
        return [f"keys {sorted(got)} != {sorted(want)}"]
    for k, v in want.items():
        if isinstance(v, np.ndarray):
            g = np.asarray(got[k])
            if g.dtype != v.dtype or g.shape != v.shape or g.tobytes() != v.tobytes():
                bad.append(k)
        elif got[k] != v or type(got[k]) is not type(v):
            bad.append(k)
    return bad


class Recorder:
    """Figures of one test session, by scenario; merged into a JSON file at the end."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.scenarios: dict[str, dict[str, Any]] = {}

    def add(self, scenario: str, **figures: Any) -> None:
        """Accumulate ``figures`` under ``scenario``: ints (counts) and ``seconds`` add up,
        ``max_*`` keep the maximum, other floats and non-numbers are replaced (settings),
        dicts merge recursively, lists extend (without duplicates)."""
        with self._lock:
            cur = self.scenarios.setdefault(scenario, {})
            _accumulate(cur, figures)

    def merge_into(self, path: Path) -> None:
        doc: dict[str, Any] = {}
        if path.exists():
            doc = json.loads(path.read_text())
        doc.setdefault("scenarios", {}).update(self.scenarios)
        doc["machine"] = {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        }
        doc["updated_unix"] = time.time()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


def _accumulate(cur: dict[str, Any], new: dict[str, Any]) -> None:
    for k, v in new.items():
        if isinstance(v, dict):
            _accumulate(cur.setdefault(k, {}), v)
        elif isinstance(v, list):
            old = cur.setdefault(k, [])
            old.extend(x for x in v if x not in old)
        elif isinstance(v, bool) or not isinstance(v, (int, float)):
            cur[k] = v
        elif k.startswith("max_"):
            cur[k] = max(cur.get(k, v), v)
        elif isinstance(v, int) or k == "seconds":
            cur[k] = round(cur.get(k, 0) + v, 3)
        else:
            cur[k] = v
