"""LocalRayCluster: real Ray nodes, one actor per node, isolated RAM roots, lost and revived
nodes detected in seconds, nothing left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fastckpt_examples.cluster import _ray_cluster_nodes as _nodes
from fastckpt_examples.cluster.ray_cluster import (
    HealthChecks,
    LocalRayCluster,
    RayClusterError,
    RaySettings,
)

pytest.importorskip("ray")

REPORT = Path(__file__).with_name("_ray_report.py")
DETECT_BOUND_S = 15.0  # tuned health checks detect in ~1-3 s; generous for a loaded machine

namespaces = pytest.param("namespaces", marks=pytest.mark.hosts)


def report(cluster: LocalRayCluster, run: str, nodes: int) -> dict[str, dict[str, Any]]:
    """Run the reporting driver; its reports by node name."""
    driver = cluster.driver_popen(
        [sys.executable, str(REPORT), run, str(nodes)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = driver.communicate(timeout=90)
    assert driver.returncode == 0, err[-3000:]
    reports: list[dict[str, Any]] = json.loads(out.strip().splitlines()[-1])
    return {r["node"]: r for r in reports}


def assert_nothing_left(cluster: LocalRayCluster, shm_before: set[str]) -> None:
    names = [_nodes.CONTROL, *cluster.names]
    assert cluster.closed
    assert _nodes.marked_pids(cluster._token, names) == {n: [] for n in names}
    assert not cluster.log_dir.exists()
    backend = cluster._backend
    if isinstance(backend, _nodes.NamespacedNodes):
        assert backend.hosts.closed and not backend.hosts.shared_dir.exists()
    new = set(os.listdir("/dev/shm")) - shm_before
    assert not [f for f in new if "fastckpt-ray" in f or "plasma" in f or "ray" in f.lower()]


@pytest.mark.parametrize("isolation", [namespaces, "processes"])
def test_nodes_isolated_killed_detected_revived_and_cleaned_up(isolation: str) -> None:
    shm_before = set(os.listdir("/dev/shm"))
    with LocalRayCluster(nodes=2, devices_per_node=2, isolation=isolation) as cluster:  # type: ignore[arg-type]
        assert cluster.isolation == isolation
        nodes = cluster.nodes()
        assert [n.name for n in nodes] == ["node0", "node1"]
        assert all(n.ray_state == "ALIVE" and n.up for n in nodes)

        first = report(cluster, "r1", 2)
        assert sorted(first) == ["node0", "node1"]
        for name, r in first.items():
            assert r["files"] == [f"r1-{name}"]  # each sees only its own node's RAM root
            assert r["xla_flags"].split()[-1] == "--xla_force_host_platform_device_count=2"
            assert r["jax_platforms"] == "cpu"
            assert r["shm"] == cluster.node(name).shm_dir
        if isolation == "namespaces":
            assert {r["ip"] for r in first.values()} == {n.address for n in nodes}
            assert {r["hostname"] for r in first.values()} == {n.hostname for n in nodes}
            assert len({r["ip"] for r in first.values()}) == 2
        else:
            assert first["node0"]["shm"] != first["node1"]["shm"]

        foot = cluster.footprint()
        assert set(foot) == {"control", "node0", "node1"}
        assert all(f.processes >= 2 and f.pss_bytes > 0 and f.rss_bytes > 0 for f in foot.values())

        killed_at = cluster.kill_node("node1")
        assert not cluster.node("node1").up
        dead = cluster.wait_node("node1", "DEAD", timeout_s=DETECT_BOUND_S + 5)
        assert dead.died_at is not None and dead.died_at - killed_at < DETECT_BOUND_S
        assert cluster.footprint()["node1"].processes == 0
        with pytest.raises(RayClusterError):
            cluster.cut_link("node1")  # down

        old_id = dead.node_id
        back = cluster.revive_node("node1")
        assert back.ray_state == "ALIVE" and back.up and back.node_id != old_id
        with pytest.raises(RayClusterError):
            cluster.revive_node("node1")  # up

        second = report(cluster, "r2", 2)
        assert second["node0"]["files"] == ["r1-node0", "r2-node0"]  # survivor kept its tier
        assert second["node1"]["files"] == ["r2-node1"]  # the replacement started empty
    assert_nothing_left(cluster, shm_before)


@pytest.mark.parametrize("isolation", [namespaces, "processes"])
def test_cut_link_is_detected(isolation: str) -> None:
    with LocalRayCluster(nodes=1, isolation=isolation) as cluster:  # type: ignore[arg-type]
        cut_at = cluster.cut_link("node0")
        node = cluster.node("node0")
        assert node.link_cut and node.up
        dead = cluster.wait_node("node0", "DEAD", timeout_s=DETECT_BOUND_S + 5)
        assert dead.died_at is not None and dead.died_at - cut_at < DETECT_BOUND_S
        cluster.heal_link("node0")
        cluster.kill_node("node0")
        assert cluster.revive_node("node0").ray_state == "ALIVE"


@pytest.mark.hosts
def test_close_after_an_exception_leaves_nothing() -> None:
    shm_before = set(os.listdir("/dev/shm"))
    with pytest.raises(RuntimeError, match="boom"):
        with LocalRayCluster(nodes=1, isolation="namespaces") as cluster:
            cluster.driver_popen(["sleep", "600"])
            raise RuntimeError("boom")
    assert_nothing_left(cluster, shm_before)
    with pytest.raises(RayClusterError):
        cluster.nodes()
    cluster.close()  # idempotent


def test_a_failed_start_leaves_nothing() -> None:
    shm_before = set(os.listdir("/dev/shm"))
    bad = RaySettings(object_store_bytes=1, start_timeout_s=30)  # Ray refuses this
    with pytest.raises(RayClusterError, match="ray start of control exited"):
        LocalRayCluster(nodes=1, isolation="processes", settings=bad)
    assert not [f for f in set(os.listdir("/dev/shm")) - shm_before if "fastckpt-ray" in f]


def test_options_validate() -> None:
    assert HealthChecks().system_config() == {
        "health_check_period_ms": 500,
        "health_check_failure_threshold": 3,
        "health_check_timeout_ms": 500,
        "health_check_initial_delay_ms": 0,
    }
    assert HealthChecks.ray_defaults().period_ms == 3000
    with pytest.raises(ValueError):
        HealthChecks(period_ms=0)
    with pytest.raises(ValueError):
        LocalRayCluster(nodes=0)
    with pytest.raises(ValueError):
        LocalRayCluster(nodes=1, isolation="vm")  # type: ignore[arg-type]


def test_node_env_sets_devices_and_keeps_other_xla_flags() -> None:
    base = {"XLA_FLAGS": "--a=1 --xla_force_host_platform_device_count=8", "RAY_ADDRESS": "x:1"}
    env = _nodes.node_env(base, devices=2, extra={"FASTCKPT_NODE_NAME": "node0"})
    assert env["XLA_FLAGS"] == "--a=1 --xla_force_host_platform_device_count=2"
    assert env["JAX_PLATFORMS"] == "cpu" and env["RAY_USAGE_STATS_ENABLED"] == "0"
    assert "RAY_ADDRESS" not in env and env["FASTCKPT_NODE_NAME"] == "node0"
