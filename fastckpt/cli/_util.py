"""CLI plumbing: opening roots (pointing tensorstore at a GCS emulator) and running a command
on one, human-readable sizes and durations, a stderr progress line, JSON output."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TextIO, TypeVar

from fastckpt.errors import ConfigError
from fastckpt.storage import Store, open_store

__all__ = [
    "Progress",
    "dump_json",
    "fmt_bytes",
    "fmt_rate",
    "jsonable",
    "open_root",
    "parse_duration",
    "plural",
    "run_on_root",
]

_EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
_T = TypeVar("_T")


def open_root(url: str, *, gcs_endpoint: str | None) -> Store:
    """Open a checkpoint root for the CLI; a ``gs://`` root's endpoint (``gcs_endpoint``, else
    ``STORAGE_EMULATOR_HOST``) is also given to tensorstore (Orbax reads)."""
    if url.startswith("gs://"):
        endpoint = gcs_endpoint or os.environ.get(_EMULATOR_ENV) or None
        if endpoint:
            os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", endpoint)
            os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
        return open_store(url, gcs_endpoint=gcs_endpoint)
    return open_store(url)


def run_on_root(
    fn: Callable[..., Coroutine[Any, Any, _T]], root: str, gcs_endpoint: str | None, **kwargs: Any
) -> _T:
    """Open ``root`` and run ``fn(store, **kwargs)`` on an event loop of its own, which also
    closes the store; the command's one loop (the store is used from no other)."""
    store = open_root(root, gcs_endpoint=gcs_endpoint)

    async def go() -> _T:
        try:
            return await fn(store, **kwargs)
        finally:
            await store.close()

    return asyncio.run(go())


def fmt_bytes(n: float | None) -> str:
    """``1536`` -> ``"1.50 KiB"``; None -> ``"-"``."""
    if n is None:
        return "-"
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "TiB":
            break
    return f"{n:.2f} {unit}"


def plural(n: int, word: str) -> str:
    """``plural(1, "object")`` -> ``"1 object"``, ``plural(2, "object")`` -> ``"2 objects"``."""
    return f"{n} {word}" + ("" if n == 1 else "s")


def fmt_rate(nbytes: float, seconds: float) -> str:
    """Bytes per second, human-readable."""
    return fmt_bytes(nbytes / seconds) + "/s" if seconds > 0 else "-"


def fmt_age(seconds: float | None) -> str:
    """``3725`` -> ``"1h02m"``."""
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")


def parse_duration(text: str) -> float:
    """``"90"``, ``"90s"``, ``"15m"``, ``"2h"``, ``"1d"`` -> seconds."""
    m = _DURATION.match(text)
    if m is None:
        raise ConfigError(f"bad duration {text!r} (use e.g. 30s, 15m, 2h, 1d)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def jsonable(x: Any) -> Any:
    """Make manifest values JSON-safe (non-finite floats as strings, tuples as lists)."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def dump_json(doc: Any, stream: TextIO | None = None) -> None:
    """Write ``doc`` as indented JSON plus a newline."""
    stream = stream or sys.stdout
    stream.write(json.dumps(jsonable(doc), indent=2, sort_keys=True, allow_nan=False) + "\n")


class Progress:
    """A single stderr progress line: ``label: 1.2 GiB / 3.4 GiB (35%)  410 MiB/s``.

    On a terminal the line is redrawn in place (at most 5 times a second); otherwise a line
    is printed at most every 5 seconds. Thread-safe. Disabled: does nothing.
    """

    def __init__(
        self, label: str, total_bytes: int, *, enabled: bool, stream: TextIO | None = None
    ) -> None:
        self.label = label
        self.total = total_bytes
        self.done_bytes = 0
        self.enabled = enabled
        self._stream = stream or sys.stderr
        self._tty = bool(getattr(self._stream, "isatty", lambda: False)())
        self._t0 = time.perf_counter()
        self._last = self._t0
        self._drawn = False
        self._lock = threading.Lock()

    @property
    def elapsed(self) -> float:
        """Seconds since creation."""
        return time.perf_counter() - self._t0

    def _line(self) -> str:
        pct = 100.0 * self.done_bytes / self.total if self.total else 100.0
        return (
            f"{self.label}: {fmt_bytes(self.done_bytes)} / {fmt_bytes(self.total)} ({pct:.0f}%)  "
            f"{fmt_rate(self.done_bytes, self.elapsed)}"
        )

    def _draw(self, end: str) -> None:
        self._stream.write(f"\r{self._line()}\x1b[K{end}" if self._tty else self._line() + "\n")
        self._stream.flush()

    def add(self, nbytes: int) -> None:
        """Record ``nbytes`` more done; redraw if due."""
        with self._lock:
            self.done_bytes += nbytes
            now = time.perf_counter()
            if self.enabled and now - self._last >= (0.2 if self._tty else 5.0):
                self._last = now
                self._draw("")
                self._drawn = True

    def close(self) -> None:
        """Finish the line (only if something was drawn)."""
        with self._lock:
            if self.enabled and self._drawn:
                self._draw("\n")
