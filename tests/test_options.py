"""Option defaults that depend on the machine."""

from __future__ import annotations

import os

import pytest

from fastckpt.errors import ConfigError
from fastckpt.options import RestoreOptions, SaveOptions, default_threads, host_threads


@pytest.mark.parametrize(
    ("cpus", "threads"), [(1, 2), (2, 2), (8, 2), (12, 3), (16, 4), (31, 7), (32, 8), (224, 8)]
)
def test_default_threads_is_a_quarter_of_the_cpus_within_2_to_8(cpus: int, threads: int) -> None:
    assert default_threads(cpus) == threads


def test_thread_options_default_to_the_cpus_this_process_may_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    expected = default_threads(len(os.sched_getaffinity(0)))
    assert SaveOptions().encode_threads == expected
    assert RestoreOptions().decode_threads == expected
    # read when the options are made, from the process's CPU set (a pod host's, here)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert SaveOptions().encode_threads == 8
    assert RestoreOptions().decode_threads == 8
    assert SaveOptions(encode_threads=5).encode_threads == 5  # an explicit count is kept
    with pytest.raises(ConfigError, match="decode_threads"):
        RestoreOptions(decode_threads=0)


@pytest.mark.parametrize(("cpus", "threads"), [(1, 2), (2, 2), (16, 16), (224, 16)])
def test_pinned_copy_threads_default_to_the_hosts_cpus_within_2_to_16(
    cpus: int, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert host_threads(cpus) == threads
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert SaveOptions().pinned_copy_threads == threads
    with pytest.raises(ConfigError, match="pinned_copy_threads"):
        SaveOptions(pinned_copy_threads=0)
