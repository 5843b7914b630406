"""Ray connection and node discovery for the driver."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import ray

__all__ = ["HEALTH_CHECK_FAST", "alive_nodes", "connect"]

HEALTH_CHECK_FAST: dict[str, Any] = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
}
"""Ray ``_system_config`` that marks a lost node dead in ~1.5 s (default: ~15 s). The GCS
then pings every raylet twice a second: fine for tens of nodes, worth raising on
thousands. Only a cluster's head takes it (``ray start --system-config`` / the embedded
cluster); a driver connecting to an existing cluster cannot change it."""


def connect(address: str | None, *, resource: str, init_kwargs: Mapping[str, Any]) -> bool:
    """Connect this process to Ray unless it already is. Returns whether it connected (and so
    should disconnect at the end).

    ``address`` (or ``RAY_ADDRESS``) names an existing cluster; with neither, an embedded
    local single-node cluster starts, offering one unit of ``resource`` and the tuned
    health checks (``init_kwargs`` go to ``ray.init`` in both cases).
    """
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
    if address is None and not os.environ.get("RAY_ADDRESS"):
        kwargs.update(resources={resource: 1}, _system_config=dict(HEALTH_CHECK_FAST))
    kwargs.update(init_kwargs)
    ray.init(address=address, **kwargs)
    return True


def alive_nodes(resource: str) -> dict[str, str]:
    """``{node_id: address}`` of the live nodes that offer ``resource``."""
    out: dict[str, str] = {}
    for node in ray.nodes():
        if node.get("Alive") and node.get("Resources", {}).get(resource, 0) > 0:
            out[str(node["NodeID"])] = str(node["NodeManagerAddress"])
    return out
