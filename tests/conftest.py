"""Shared pytest fixtures and hooks.

Storage: a session-wide GCS emulator and a fresh GcsStore per test. Simulated hosts: tests
marked ``hosts`` are deselected (not skipped) where simulated hosts cannot be created here,
and the run's summary says how many and why.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator

import pytest

from fastckpt.storage import GcsOptions, GcsStore
from fastckpt.testing.gcs_emulator import GcsEmulator
from fastckpt.testing.hosts import hosts_unavailable_reason

_GCS_TEST_BUCKET = "fastckpt-test"
_prefix_counter = itertools.count()
_HOSTS_DESELECTED = pytest.StashKey[dict[str, int]]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect tests marked ``hosts`` (``hosts(delay=True)``: also netem) that cannot run here."""
    marked = [(item, m) for item in items if (m := item.get_closest_marker("hosts")) is not None]
    if not marked:
        return
    reasons: dict[bool, str | None] = {False: hosts_unavailable_reason()}
    if reasons[False] is None and any(m.kwargs.get("delay") for _, m in marked):
        reasons[True] = hosts_unavailable_reason(delay=True)
    deselected: dict[str, int] = {}
    out = []
    for item, marker in marked:
        reason = reasons[False] or reasons.get(bool(marker.kwargs.get("delay")))
        if reason is not None:
            out.append(item)
            deselected[reason] = deselected.get(reason, 0) + 1
    if out:
        config.hook.pytest_deselected(items=out)
        gone = set(map(id, out))
        items[:] = [item for item in items if id(item) not in gone]
    config.stash[_HOSTS_DESELECTED] = deselected


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int,
                            config: pytest.Config) -> None:
    """One line per reason tests marked ``hosts`` were deselected."""
    for reason, count in config.stash.get(_HOSTS_DESELECTED, {}).items():
        terminalreporter.write_line(
            f"{count} test(s) marked 'hosts' deselected: simulated hosts unavailable: {reason}",
            yellow=True)


@pytest.fixture(scope="session")
def gcs_emulator() -> Iterator[GcsEmulator]:
    """A fake-gcs-server (memory backend) for the whole session; fails if it cannot start."""
    with GcsEmulator(backend="memory") as emulator:
        emulator.create_bucket(_GCS_TEST_BUCKET)
        yield emulator


@pytest.fixture
def gcs_store(gcs_emulator: GcsEmulator) -> Iterator[GcsStore]:
    """A GcsStore on the emulator under a fresh prefix, closed after the test."""
    store = GcsStore(
        _GCS_TEST_BUCKET,
        f"t{next(_prefix_counter):05d}",
        options=GcsOptions(endpoint=gcs_emulator.endpoint, max_workers=8),
    )
    yield store
    asyncio.run(store.close())
