"""Child for the SIGKILL test: creates shaped hosts with processes in them, reports, waits.

Prints one JSON line (shared_dir, each host's netns id, every pid inside the hosts) once
everything runs, then sleeps until it is killed.
"""

from __future__ import annotations

import json
import time

from fastckpt_examples.cluster.hosts import LinkShape, SimulatedHosts


def main() -> None:
    hosts = SimulatedHosts(2, link=LinkShape(rate_mbit=100))
    for host in hosts:
        host.popen(["sh", "-c", "echo x > /dev/shm/ram-tier; sleep 600 & sleep 600"])
    time.sleep(0.2)  # the background sleeps start
    print(
        json.dumps(
            {
                "shared_dir": str(hosts.shared_dir),
                "netns": [h._netns for h in hosts],
                "pids": [p for h in hosts for p in h.pids()],
            }
        ),
        flush=True,
    )
    time.sleep(600)


if __name__ == "__main__":
    main()
