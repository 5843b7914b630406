"""The elastic loop on a local multi-node Ray cluster (2 nodes x 1 CPU device, ``tiny``):
a SIGKILLed worker resumes bit-exact on the same node count; a lost node resumes on fewer
nodes with the same loss curve and grows back when a node returns; give-ups are typed."""

from __future__ import annotations

import functools
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("ray")
pytest.importorskip("optax")

import fastckpt
from fastckpt.elastic import ElasticResult, ElasticRunError, JobStatus, run_elastic
from fastckpt_examples.elastic_train import TrainSpec, train

from ._ray import FAST_COMPILE, NODE, Chaos, job_options, start_cluster

STEPS = 10
# Ray's subprocesses fork from this (JAX-using) test process; JAX warns about any fork.
pytestmark = [
    pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    yield from start_cluster(2)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ray-job")


def _spec(root: Path, **kw: Any) -> TrainSpec:
    base: dict[str, Any] = {
        "root": str(root),
        "steps": STEPS,
        "dropout": 0.1,
        "checkpoint_every": 5,
        "ram_every": 2,
        "step_delay_s": 0.15,
        "compiler_options": FAST_COMPILE,
    }
    return TrainSpec(**{**base, **kw})


def _run(
    work: Path, name: str, chaos: Chaos | None = None, spec: dict[str, Any] | None = None, **kw: Any
) -> ElasticResult:
    spec_ = _spec(work / name / "ckpt", **(spec or {}))
    return run_elastic(
        functools.partial(train, spec=spec_),
        options=job_options(work / name, monitor=chaos, **kw),
    )


def _losses(result: ElasticResult) -> dict[int, float]:
    return {int(m["step"]): float(m["loss"]) for m in result.metrics}  # last generation wins


def _final_params(work: Path, name: str) -> Any:
    return fastckpt.restore(str(work / name / "ckpt"), STEPS)["params"]


@pytest.fixture(scope="module")
def reference(cluster: Any, work: Path) -> ElasticResult:
    result = _run(work, "reference")
    assert [len(g.nodes) for g in result.generations] == [2]
    assert sorted(_losses(result)) == list(range(1, STEPS + 1))
    return result


def test_sigkilled_worker_resumes_bit_exact_on_the_same_nodes(
    cluster: Any, work: Path, reference: ElasticResult
) -> None:
    def kill_rank1(status: JobStatus) -> None:
        victim = status.workers[1]
        os.kill(victim.pid, signal.SIGKILL)
        status.record("kill", node=victim.node_id, pid=victim.pid)

    result = _run(work, "sigkill", Chaos().at(0, 4, kill_rank1))
    gens = result.generations
    assert [(g.outcome, g.cause, len(g.nodes)) for g in gens] == [
        ("failed", "process", 2),
        ("done", None, 2),
    ]
    assert gens[0].nodes == gens[1].nodes  # relaunched on the node whose worker died
    summary = result.summary()
    (rec,) = summary["recoveries"]
    assert rec["cause"] == "process" and rec["restored_step"] >= 4
    assert rec["steps_lost"] <= 2  # at most the RAM interval
    assert rec["restore_bytes_read_storage"] == 0  # own RAM and peers only
    print("sigkill recovery:", {k: rec[k] for k in ("total_s", "parts", "relaunch_detail")})
    want, got = _final_params(work, "reference"), _final_params(work, "sigkill")
    import jax

    jax.tree.map(np.testing.assert_array_equal, got, want)
    ref = _losses(reference)
    assert _losses(result) == ref


def test_lost_node_resumes_on_fewer_nodes_then_grows_back(
    cluster: Any, work: Path, reference: ElasticResult
) -> None:
    head = cluster.head_node.node_id
    removed: list[Any] = []

    def remove_node(status: JobStatus) -> None:
        victim = next(w for w in status.workers if w.node_id != head)
        node = next(n for n in cluster.worker_nodes if n.node_id == victim.node_id)
        cluster.remove_node(node, allow_graceful=False)
        removed.append(node)
        status.record("kill", node=victim.node_id)

    def add_node(status: JobStatus) -> None:
        cluster.add_node(**NODE)

    # Ray adds a node in ~1-2 s (from this thread, blocking the driver loop): run longer,
    # compare the steps the reference ran.
    chaos = Chaos().at(0, 3, remove_node).at(1, 3, add_node)
    result = _run(work, "lose-node", chaos, spec={"steps": 16, "step_delay_s": 0.25})
    shape = [(g.outcome, g.cause, len(g.nodes)) for g in result.generations]
    print(
        "node-loss generations:",
        shape,
        [e for e in result.events if e["event"] == "failure_detected"],
    )
    assert shape == [("failed", "node", 2), ("stopped", None, 1), ("done", None, 2)]
    summary = result.summary()
    (rec,) = summary["recoveries"]
    (resize,) = summary["resizes"]
    print("node-loss recovery:", {k: rec[k] for k in ("total_s", "parts", "relaunch_detail")})
    print("grow-back:", resize["stop_to_first_step_s"], resize["parts"])
    ref, got = _losses(reference), _losses(result)
    assert sorted(got) == list(range(1, 17))
    steps = sorted(ref)
    np.testing.assert_allclose([got[s] for s in steps], [ref[s] for s in steps], rtol=2e-4)


def test_too_few_nodes_is_a_typed_error(cluster: Any, work: Path) -> None:
    with pytest.raises(ElasticRunError, match="min_nodes") as info:
        _run(work, "min-nodes", min_nodes=3)
    assert info.value.result is not None and info.value.result.generations == ()


def test_restarts_exhausted_is_a_typed_error(cluster: Any, work: Path) -> None:
    spec = _spec(work / "broken" / "ckpt", preset="no-such-preset")  # train raises KeyError
    with pytest.raises(ElasticRunError, match="max_restarts") as info:
        run_elastic(
            functools.partial(train, spec=spec),
            options=job_options(work / "broken", max_restarts=1, warm_standby=False),
        )
    result = info.value.result
    assert result is not None
    assert [(g.outcome, g.cause) for g in result.generations] == [("failed", "error")] * 2
    errors = [e["error"] for e in result.events if e["event"] == "failure_detected"]
    assert all("KeyError" in e for e in errors)
