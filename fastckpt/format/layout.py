"""Object key naming under a checkpoint root. The only module that knows key shapes.

Layout::

    manifests/<step:012d>.json          commit markers (create-only, written last)
    steps/<step:012d>/<save_id>/p<process:05d>-<n:05d>.fck    data objects
    steps/<step:012d>/<save_id>/p<process:05d>.fragment  per-process chunk lists
    ram/<step:012d>/w-<member>          a RAM-only step's chunks (names no object: the
                                        member that wrote them, in the manifest only)

Committed steps are found by listing ``manifests/`` only (cheap on GCS even with many data
objects). Data keys carry a per-save random ``save_id``, so a retried or concurrent save of
the same step never overwrites objects another attempt's manifest could reference.
"""

from __future__ import annotations

import re
from urllib.parse import quote, unquote

import numpy as np

from fastckpt.errors import ConfigError

__all__ = [
    "MANIFEST_PREFIX",
    "STEPS_PREFIX",
    "check_step",
    "data_key",
    "fragment_key",
    "manifest_key",
    "ram_object_key",
    "ram_writer",
    "step_data_prefix",
    "step_from_data_key",
    "step_from_manifest_key",
]

MANIFEST_PREFIX = "manifests/"
STEPS_PREFIX = "steps/"
MAX_STEP = 10**18 - 1  # the largest step a key names (12 to 18 digits: Unix-ms steps fit)
_MANIFEST_RE = re.compile(r"^manifests/(\d{12,18})\.json$")
_DATA_RE = re.compile(r"^steps/(\d{12,18})/")


def check_step(step: object) -> int:
    """``step`` as an int if a key can name it, else ConfigError (a bool, a float, a str, out of
    range)."""
    if (
        not isinstance(step, (int, np.integer))
        or isinstance(step, bool)
        or not 0 <= step <= MAX_STEP
    ):
        raise ConfigError(f"step must be an int in [0, {MAX_STEP}], got {step!r}")
    return int(step)


def manifest_key(step: int) -> str:
    """Key of the manifest (commit marker) of ``step``."""
    return f"{MANIFEST_PREFIX}{step:012d}.json"


def step_data_prefix(step: int) -> str:
    """Prefix of every data object of ``step`` (all save attempts)."""
    return f"{STEPS_PREFIX}{step:012d}/"


def data_key(step: int, save_id: str, process: int, n: int) -> str:
    """Key of the ``n``-th data object written by ``process`` in save ``save_id``."""
    return f"{step_data_prefix(step)}{save_id}/p{process:05d}-{n:05d}.fck"


def fragment_key(step: int, save_id: str, process: int) -> str:
    """Key of the per-process fragment (its chunk list) of save ``save_id``."""
    return f"{step_data_prefix(step)}{save_id}/p{process:05d}.fragment"


def step_from_manifest_key(key: str) -> int | None:
    """The step a manifest key names, or None if ``key`` is not a (canonical) manifest key."""
    m = _MANIFEST_RE.match(key)
    return int(m.group(1)) if m and m.group(1) == f"{int(m.group(1)):012d}" else None


def step_from_data_key(key: str) -> int | None:
    """The step a (canonical) data/fragment key belongs to, or None."""
    m = _DATA_RE.match(key)
    return int(m.group(1)) if m and m.group(1) == f"{int(m.group(1)):012d}" else None


def ram_object_key(step: int, writer: str | None) -> str:
    """``ram/<step>/w-<writer, percent-encoded>`` (``ram/<step>`` without a writer)."""
    return f"ram/{step:012d}" + ("" if writer is None else "/w-" + quote(writer, safe=""))


def ram_writer(step: int, key: str) -> str | None:
    """The writer :func:`ram_object_key` put in ``key`` for ``step``, else None."""
    prefix = f"ram/{step:012d}/w-"
    return unquote(key[len(prefix) :]) if key.startswith(prefix) else None
