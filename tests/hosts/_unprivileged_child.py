"""Child for the unprivileged test: run as an ordinary user (e.g. ``nobody``) by any Python 3.11+.

Usage: ``_unprivileged_child.py REPO check|hold``. Loads ``fastckpt_examples.cluster.hosts``
from REPO without running ``fastckpt/__init__.py`` (whose imports need the project's
virtualenv, which such a user may not be able to read) and creates 2 hosts through one user
namespace. ``check``: checks they talk and keep their RAM tiers apart, closes them, prints one
JSON line of what it saw. ``hold``: starts processes in them, prints one JSON line
(namespaces, pids, shared_dir) and waits to be killed.
"""

from __future__ import annotations

import json
import os
import sys
import time
import types


def main(repo: str, mode: str) -> None:
    package = types.ModuleType("fastckpt")
    package.__path__ = [os.path.join(repo, "fastckpt")]
    sys.modules["fastckpt"] = package
    sys.path.insert(0, os.path.join(repo, "examples"))
    from fastckpt_examples.cluster.hosts import LinkShape, SimulatedHosts, hosts_unavailable_reason

    if mode == "hold":  # report, then wait to be SIGKILLed
        hosts = SimulatedHosts(2, link=LinkShape(rate_mbit=100))
        for host in hosts:
            host.popen(["sh", "-c", "echo x > /dev/shm/tier; sleep 600 & sleep 600"])
        time.sleep(0.2)
        print(
            json.dumps(
                {
                    "netns": [h._netns for h in hosts],
                    "shared_dir": str(hosts.shared_dir),
                    "pids": [p for h in hosts for p in h.pids()],
                }
            ),
            flush=True,
        )
        time.sleep(600)

    report: dict[str, object] = {"uid": os.getuid(), "reason": hosts_unavailable_reason()}
    t0 = time.monotonic()
    with SimulatedHosts(2, link=LinkShape(rate_mbit=200)) as hosts:
        report["start_s"] = time.monotonic() - t0
        report["userns"] = hosts.userns
        a, b = hosts
        server = (
            "import socket; s = socket.socket(); s.bind(('', 7201)); s.listen(); print('up',"
            " flush=True); c, _ = s.accept(); c.sendall(c.recv(64).upper())"
        )
        proc = b.popen([sys.executable, "-I", "-c", server], stdout=-1, text=True)
        assert proc.stdout is not None and proc.stdout.readline() == "up\n"
        client = (
            "import socket, sys; c = socket.create_connection((sys.argv[1], 7201));"
            " c.sendall(b'ping'); print(c.recv(64).decode(), socket.gethostname())"
        )
        out = a.run(
            [sys.executable, "-I", "-c", client, b.hostname],
            timeout=30,
            capture_output=True,
            text=True,
        ).stdout.split()
        proc.wait(timeout=30)
        report["reply"], report["hostname"] = out
        a.run(["sh", "-c", "echo x > /dev/shm/tier"], timeout=30)
        report["shm_apart"] = (
            b.run(["test", "-e", "/dev/shm/tier"], timeout=30, check=False).returncode == 1
        )
        report["netns"] = [h._netns for h in hosts]
        report["pids"] = [p for h in hosts for p in h.pids()]
        report["shared_dir"] = str(hosts.shared_dir)
    report["closed"] = not os.path.exists(str(hosts.shared_dir))
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
