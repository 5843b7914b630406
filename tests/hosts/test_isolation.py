"""Simulated hosts are apart: own RAM tier and /tmp, own name and address, nothing outside."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from fastckpt_examples.cluster.hosts import SimulatedHosts
from tests.hosts._helpers import eventually, listen, netcat, root_state, sh

pytestmark = pytest.mark.hosts


def test_each_host_has_its_own_dev_shm_and_tmp() -> None:
    name = f"fc-test-{uuid.uuid4().hex}"
    with SimulatedHosts(2) as hosts:
        for where in ("/dev/shm", "/tmp"):
            sh(hosts[0], f"echo hello > {where}/{name}")
            assert sh(hosts[0], f"cat {where}/{name}").stdout == "hello\n"
            assert sh(hosts[1], f"test -e {where}/{name}", check=False).returncode == 1, where
            assert not (Path(where) / name).exists(), where
        # Four file systems of their own (device ids), none of them the machine's.
        devices = [sh(h, "stat -c %d /dev/shm /tmp").stdout.split() for h in hosts]
        mine = {str(os.stat("/dev/shm").st_dev), str(os.stat("/tmp").st_dev)}
        assert len(set(devices[0] + devices[1]) - mine) == 4, (devices, mine)


def test_hosts_talk_by_address_and_by_name_and_know_their_own() -> None:
    with SimulatedHosts(3) as hosts:
        for target in (hosts[1].address, hosts[1].hostname, hosts[2].hostname):
            host = hosts[1] if target != hosts[2].hostname else hosts[2]
            server = listen(host, "recv", 7001)
            netcat(hosts[0], "send", target, 7001, 100_000)
            out, _ = server.communicate(timeout=30)
            assert '"bytes": 100000' in out, (target, out)
        code = (
            "import socket; n = socket.gethostname(); "
            "print(n, socket.gethostbyname(n), socket.getfqdn())"
        )
        for host in hosts:
            out = host.run(
                [sys.executable, "-I", "-c", code], timeout=30, capture_output=True, text=True
            ).stdout.split()
            assert out[:2] == [host.hostname, host.address], out  # what gloo advertises


def test_hosts_reach_nothing_outside_and_the_caller_gets_no_interface() -> None:
    before = root_state()
    listener = socket.socket()
    listener.bind(("0.0.0.0", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    machine = [
        a.split()[3].split("/")[0]
        for a in before["addrs"]
        if " inet " in a and not a.split()[3].startswith("127.")
    ]
    assert machine, before["addrs"]  # the machine's own addresses, reachable from here
    try:
        with SimulatedHosts(2) as hosts:
            during = root_state()
            assert during == before  # no interface, address, route or mount on this side
            inside = sh(hosts[0], "ip -o addr show; echo ROUTES; ip route show; ip -6 route show")
            addrs, _, routes = inside.stdout.partition("ROUTES\n")
            assert sorted(line.split()[1] for line in addrs.splitlines()) == ["eth0", "lo"]
            assert "inet6" not in addrs and " inet " in addrs
            assert [line.split() for line in routes.splitlines()] == [  # no default route
                [
                    str(hosts.subnet),
                    "dev",
                    "eth0",
                    "proto",
                    "kernel",
                    "scope",
                    "link",
                    "src",
                    hosts[0].address,
                ]
            ], routes
            assert hosts.subnet.is_private
            for address in ["127.0.0.1", *machine]:
                code = (
                    f"import socket\ntry:\n socket.create_connection(({address!r}, {port}),"
                    f" timeout=3)\n print('connected')\nexcept OSError as e:\n print(e)"
                )
                out = (
                    hosts[0]
                    .run(
                        [sys.executable, "-I", "-c", code],
                        timeout=30,
                        capture_output=True,
                        text=True,
                    )
                    .stdout
                )
                assert "connected" not in out, (address, out)
            with pytest.raises(BlockingIOError):
                listener.accept()  # nothing ever arrived here
    finally:
        listener.close()
    assert root_state() == before


def test_a_process_runs_in_its_host_with_the_given_environment_and_cwd() -> None:
    with SimulatedHosts(1) as hosts:
        (hosts.shared_dir / "work").mkdir()
        proc = hosts[0].popen(
            ["sh", "-c", 'echo "$FC_X $(pwd) $(hostname)"; sleep 0.2'],
            env={"FC_X": "42", "PATH": "/usr/bin:/bin"},
            cwd=hosts.shared_dir / "work",
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.pid in hosts[0].pids()  # nsenter exec'd: the pid is the program's
        out, _ = proc.communicate(timeout=30)
        assert out.split() == ["42", str(hosts.shared_dir / "work"), hosts[0].hostname]
        assert hosts[0].pids() == [hosts[0]._keeper.pid]  # type: ignore[union-attr]
        with pytest.raises(subprocess.TimeoutExpired):
            hosts[0].run(["sh", "-c", "sleep 30 & sleep 30"], timeout=0.5)
        # The timeout killed the process group, the background child too (SIGKILL is quick,
        # not instant).
        assert eventually(lambda: hosts[0].pids() == [hosts[0]._keeper.pid])  # type: ignore
