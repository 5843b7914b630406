"""Hosts die and come back; a cluster leaves nothing behind, however it ends; no root needed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fastckpt_examples.cluster import _hosts_procs
from fastckpt_examples.cluster.hosts import HostDownError, HostsError, LinkShape, SimulatedHosts
from tests.hosts._helpers import (
    alive,
    eventually,
    listen,
    netcat,
    result,
    root_state,
    sh,
    wait_for_nothing_left,
)

pytestmark = pytest.mark.hosts

HERE = Path(__file__).parent
REPO = HERE.parent.parent


def test_kill_loses_the_machine_and_revive_brings_an_empty_one() -> None:
    with SimulatedHosts(2) as hosts:
        a, b = hosts
        sh(b, "echo tier > /dev/shm/step1; echo t > /tmp/t")
        sleeper = b.popen(["sh", "-c", "sleep 600 & sleep 600"])
        assert eventually(lambda: len(b.pids()) == 4)  # keeper, sh, 2 sleeps
        victims = b.pids()
        b.kill()
        assert not b.is_up and b.pids() == []
        assert sleeper.wait(timeout=5) == -signal.SIGKILL
        assert not [p for p in victims if alive(p)]
        with pytest.raises(HostDownError):
            b.popen(["true"])
        b.kill()  # idempotent
        with pytest.raises(HostsError):
            a.revive()  # a is up
        b.revive()
        assert b.is_up and len(b.pids()) == 1
        kept = sorted(
            {p.split("/")[2] for p in _hosts_procs.caller_paths() if p.startswith("/tmp/")}
        )
        assert sh(b, "ls -A /dev/shm; echo --; ls -A /tmp").stdout.split() == ["--", *kept]
        assert sh(b, "hostname").stdout.strip() == b.hostname
        server = listen(b, "recv", 7301)  # same name and address: peers reach it at once
        netcat(a, "send", b.hostname, 7301, 1000)
        assert result(server)["bytes"] == 1000


def test_add_host_joins_the_switch_and_every_hosts_file() -> None:
    with SimulatedHosts(1, link=LinkShape(rate_mbit=300)) as hosts:
        extra = hosts.add_host("gcs")
        assert extra.hostname == "fc-gcs" and extra.index == 1 and extra.link == hosts[0].link
        assert hosts[1] is extra
        with pytest.raises(ValueError):
            hosts.add_host("gcs")
        assert sh(hosts[0], "getent hosts fc-gcs").stdout.split() == [extra.address, "fc-gcs"]
        server = listen(extra, "recv", 7302)
        netcat(hosts[0], "send", "fc-gcs", 7302, 1000)
        assert result(server)["bytes"] == 1000


def test_an_exception_or_ctrl_c_inside_with_leaves_nothing_behind() -> None:
    before = root_state()
    for error in (RuntimeError, KeyboardInterrupt):
        with pytest.raises(error):
            with SimulatedHosts(3, link=LinkShape(rate_mbit=100)) as hosts:
                for host in hosts:
                    host.popen(["sh", "-c", "echo x > /dev/shm/x; sleep 600 & sleep 600"])
                hosts[1].partition()
                seen: dict[str, Any] = {
                    "netns": [h._netns for h in hosts],
                    "shared_dir": str(hosts.shared_dir),
                }
                assert eventually(lambda: all(len(h.pids()) == 4 for h in hosts))
                seen["pids"] = [p for h in hosts for p in h.pids()]
                raise error()
        # close() is synchronous: nothing left at once, no grace period.
        assert wait_for_nothing_left(0, **seen) == []
        assert root_state() == before
        assert hosts.closed and not any(h.is_up for h in hosts)
        with pytest.raises(HostDownError):
            hosts[0].popen(["true"])


def test_a_sigkilled_controller_leaves_nothing_behind() -> None:
    before = root_state()
    child = subprocess.Popen(
        [sys.executable, str(HERE / "_sigkill_child.py")],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'examples'}"),
    )
    try:
        assert child.stdout is not None
        seen = json.loads(child.stdout.readline())
        assert len(seen["pids"]) == 2 * 4 and os.path.isdir(seen["shared_dir"])
        assert root_state() == before  # while it runs, too
    finally:
        child.kill()
        child.wait()
    assert wait_for_nothing_left(5.0, **seen) == []
    assert root_state() == before


def _python_for(user: list[str]) -> str:
    """A Python 3.11+ that ``user`` can run, and that can run itself again (the harness starts
    keepers with ``sys.executable``). The project's venv may live in root's home."""
    probe = (
        "import subprocess, sys; assert sys.version_info >= (3, 11);"
        " subprocess.run([sys.executable, '-I', '-S', '-c', ''], check=True)"
    )
    candidates = [sys.executable, "/usr/bin/python3", shutil.which("python3") or ""]
    for python in candidates:
        if (
            python
            and subprocess.run(
                [*user, python, "-I", "-c", probe], capture_output=True, timeout=60, cwd="/"
            ).returncode
            == 0
        ):
            return python
    pytest.fail(f"no Python 3.11+ that an unprivileged user can run among {candidates}")


def test_an_unprivileged_user_gets_hosts_through_a_user_namespace() -> None:
    nobody = (
        [] if os.geteuid() != 0 else ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    )
    python = _python_for(nobody)
    child = [*nobody, python, "-I", "-B", str(HERE / "_unprivileged_child.py"), str(REPO)]
    before = root_state()
    done = subprocess.run([*child, "check"], capture_output=True, text=True, timeout=120, cwd="/")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["uid"] != 0 and report["reason"] is None and report["userns"] is True
    assert report["reply"] == "PING" and report["hostname"] == "fc-host0"
    assert report["shm_apart"] and report["closed"]
    assert (
        wait_for_nothing_left(
            5.0, netns=report["netns"], pids=report["pids"], shared_dir=report["shared_dir"]
        )
        == []
    )
    # Its controller SIGKILLed: the keepers (uid nobody) still sweep their hosts.
    held = subprocess.Popen([*child, "hold"], stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        assert held.stdout is not None
        seen = json.loads(held.stdout.readline())
        assert len(seen["pids"]) == 2 * 4
    finally:
        held.kill()
        held.wait()
    assert wait_for_nothing_left(5.0, **seen) == []
    assert root_state() == before
