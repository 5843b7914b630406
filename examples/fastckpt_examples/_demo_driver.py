"""The demo's Ray driver: ``python -m fastckpt_examples._demo_driver CONFIG.json``.

Started by :mod:`fastckpt_examples.demo` through
:meth:`~fastckpt_examples.cluster.ray_cluster.LocalRayCluster.driver_popen` (inside the control host
when the cluster is namespaced; ``RAY_ADDRESS`` names the cluster). It runs the example
trainer with :func:`fastckpt.elastic.run_elastic` and reports on stdout, one line each,
prefixed with :data:`PREFIX`:

* ``{"kind": "event", ...}``: every driver timeline event as it is recorded;
* ``{"kind": "progress", "generation", "step", "nodes"}``: whenever the running
  generation's step (steps completed by its fastest worker) or workers change;
* ``{"kind": "done", "ok", "error"}`` last; the whole result (events, worker reports,
  metrics, restarts) is in the ``result`` file the config names.

The parent follows these lines and injects the faults (it owns the cluster).
"""

from __future__ import annotations

import functools
import json
import logging
import sys
from typing import Any

PREFIX = "FASTCKPT-DEMO "
"""Marks the driver's report lines (anything else on its stdout is Ray's or JAX's)."""


def emit(kind: str, **fields: Any) -> None:
    """Print one report line."""
    sys.stdout.write(PREFIX + json.dumps({"kind": kind, **fields}, default=str) + "\n")
    sys.stdout.flush()


class _Progress:
    """The ``monitor``: one progress line per change of (generation, step, workers)."""

    def __init__(self) -> None:
        self.last: tuple[int, int, tuple[str, ...]] | None = None

    def __call__(self, status: Any) -> None:
        nodes = tuple(w.node_id for w in status.workers)
        key = (status.generation, status.step, nodes)
        if key != self.last:
            self.last = key
            emit("progress", generation=status.generation, step=status.step, nodes=list(nodes))


def main(argv: list[str] | None = None) -> int:
    """Run the job the config file describes; exit 0 when it finished."""
    args = sys.argv[1:] if argv is None else argv
    with open(args[0]) as f:
        cfg = json.load(f)
    from fastckpt.elastic import ElasticJobOptions, ElasticRunError, run_elastic
    from fastckpt_examples.elastic_train import PRELOAD, TrainSpec, train

    spec = TrainSpec(**cfg["spec"])
    options = ElasticJobOptions(
        ray_init_kwargs={"log_to_driver": False, "logging_level": logging.ERROR},
        preload=PRELOAD,
        monitor=_Progress(),
        on_event=lambda ev: emit("event", **ev),
        **cfg["job"],
    )
    ok, error, result = True, None, None
    try:
        result = run_elastic(functools.partial(train, spec=spec), options=options)
    except ElasticRunError as e:
        ok, error, result = False, str(e), e.result
    doc: dict[str, Any] = {"ok": ok, "error": error}
    if result is not None:
        doc.update(
            value=result.value,
            restarts=result.restarts,
            events=list(result.events),
            reports=list(result.reports),
            metrics=list(result.metrics),
            generations=[
                {
                    "generation": g.generation,
                    "nodes": list(g.nodes),
                    "outcome": g.outcome,
                    "cause": g.cause,
                    "reason": g.reason,
                }
                for g in result.generations
            ],
        )
    with open(cfg["result"], "w") as f:
        json.dump(doc, f, default=str)
    emit("done", ok=ok, error=error)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
