"""Shared pytest fixtures and hooks.

Devices: in-process tests run on 8 virtual CPU devices. XLA reads the device count when the
CPU backend is created (the first ``jax.devices()``), not at ``import jax``: setting the flag
here, at collection time, is early enough as long as nothing touches devices while
collecting. Every in-process jax test in this repository shares the one backend, so all of
them see 8 devices; subprocess-based tests (multiprocess, elastic, replicas) set their own
count in the child environment.

Checkpoint roots: ``root`` (a MemoryStore or a local directory) and ``shm_dir`` (tmpfs).
Storage: a session-wide GCS emulator and a fresh GcsStore per test. Simulated hosts: tests
marked ``hosts`` are deselected (not skipped) where simulated hosts cannot be created here,
and the run's summary says how many and why.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from fastckpt.storage import GcsOptions, GcsStore
from fastckpt.testing.gcs_emulator import GcsEmulator
from fastckpt_examples.cluster.hosts import hosts_unavailable_reason

N_DEVICES = 8
_FLAG = "--xla_force_host_platform_device_count"
_flags = re.sub(rf"{_FLAG}=\S+", "", os.environ.get("XLA_FLAGS", "")).strip()
os.environ["XLA_FLAGS"] = f"{_flags} {_FLAG}={N_DEVICES}".strip()

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


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
) -> None:
    """One line per reason tests marked ``hosts`` were deselected."""
    for reason, count in config.stash.get(_HOSTS_DESELECTED, {}).items():
        terminalreporter.write_line(
            f"{count} test(s) marked 'hosts' deselected: simulated hosts unavailable: {reason}",
            yellow=True,
        )


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


@pytest.fixture(scope="session", autouse=True)
def eight_devices() -> None:
    """Fails the session if the backend started before this file set ``XLA_FLAGS``."""
    import jax

    n = len(jax.devices())
    if n != N_DEVICES:
        pytest.fail(
            f"in-process tests need {N_DEVICES} CPU devices but the backend has {n}: something "
            "initialised "
            "jax before tests/conftest.py set XLA_FLAGS"
        )


@pytest.fixture(params=["memory", "local"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[object]:
    """Where checkpoints go: a fresh MemoryStore, or a local directory opened by path (the
    public ``open_store`` route: RetryingStore over a durable LocalStore)."""
    if request.param == "memory":
        from fastckpt.storage import MemoryStore

        yield MemoryStore()
    else:
        yield str(tmp_path / "ckpt")


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A fresh directory on tmpfs (``/dev/shm``), removed after the test."""
    d = Path("/dev/shm") / f"fastckpt-test-{uuid.uuid4().hex[:12]}"
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)
