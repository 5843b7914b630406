"""Node-table probe for :mod:`fastckpt_examples.cluster.ray_cluster`: a child process, not a module.

Run as ``python _ray_cluster_probe.py <gcs address>`` where the GCS is reachable (inside the
control host in namespaced mode). It reads one request per line on stdin (any text) and
answers each with one JSON line on stdout: ``{"ok": true, "nodes": [...]}`` with one entry
per node the GCS knows (dead ones included), or ``{"ok": false, "error": "..."}``. It talks
to the GCS directly (no ``ray.init``: no driver, no job, no worker process) and exits at
end of input.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def _table(client: Any) -> list[dict[str, Any]]:
    from ray.core.generated.gcs_pb2 import GcsNodeInfo  # type: ignore[attr-defined]

    rows = []
    for node_id, info in client.get_all_node_info(timeout=5).items():
        rows.append(
            {
                "node_id": node_id.hex(),
                "address": info.node_manager_address,
                "hostname": info.node_manager_hostname,
                "name": info.node_name,
                "state": GcsNodeInfo.GcsNodeState.Name(info.state),
                "labels": dict(info.labels),
                "resources": dict(info.resources_total),
                "start_time_ms": info.start_time_ms,
                "end_time_ms": info.end_time_ms,
                "death_reason": info.death_info.reason_message,
            }
        )
    return rows


def main() -> None:
    from ray._raylet import GcsClient  # type: ignore[attr-defined]

    client = None
    for _ in sys.stdin:
        try:
            if client is None:
                client = GcsClient(address=sys.argv[1])
            answer: dict[str, Any] = {"ok": True, "nodes": _table(client)}
        except Exception as exc:  # reported to the harness, which decides
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
