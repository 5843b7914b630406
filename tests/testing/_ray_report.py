"""Driver for test_ray_cluster: one actor per node (resource ``fastckpt_node``) writes a file
named ``<run>-<node>`` into its node's RAM root, then lists that root; prints one JSON line:
a report per actor."""

from __future__ import annotations

import json
import logging
import os
import socket
import sys

import ray


@ray.remote(resources={"fastckpt_node": 1}, num_cpus=0)
class Reporter:
    def write(self, run: str) -> str:
        node = os.environ["FASTCKPT_NODE_NAME"]
        with open(os.path.join(os.environ["FASTCKPT_NODE_SHM"], f"{run}-{node}"), "w") as f:
            f.write(run)
        return node

    def report(self) -> dict[str, object]:
        shm = os.environ["FASTCKPT_NODE_SHM"]
        return {
            "node": os.environ["FASTCKPT_NODE_NAME"],
            "ip": ray.util.get_node_ip_address(),  # type: ignore[no-untyped-call]
            "hostname": socket.gethostname(),
            "shm": shm,
            "files": sorted(os.listdir(shm)),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "jax_platforms": os.environ.get("JAX_PLATFORMS", ""),
        }


def main() -> None:
    run, nodes = sys.argv[1], int(sys.argv[2])
    ray.init(logging_level=logging.ERROR, log_to_driver=False)
    actors = [Reporter.remote() for _ in range(nodes)]  # type: ignore[attr-defined]
    ray.get([a.write.remote(run) for a in actors], timeout=60)
    reports = ray.get([a.report.remote() for a in actors], timeout=60)
    print(json.dumps(reports), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
