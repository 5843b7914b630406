"""Elastic training on Ray: survive node loss, resize the mesh, grow back, never lose state.

Two halves:

* the **driver** (:func:`run_elastic` with :class:`ElasticJobOptions`) runs the user's
  ``train(worker)`` in one Ray actor per node, detects a dead worker process or a lost node,
  kills the rest at once, relaunches on the nodes alive with a resized mesh, and grows back
  at a checkpoint when a node returns (:mod:`fastckpt.elastic.job`);
* the **worker side** (:class:`ElasticContext`) is what ``train`` wraps its loop in ("bring
  your own trainer"): it initialises ``jax.distributed``, restores the latest checkpoint
  (each chunk from this node's RAM, a peer's, then storage) onto whatever mesh this
  generation has, saves on cadence and stops at an agreed step when asked.

Needs Ray (the ``ray`` extra). The example trainer and the demo live in the
``fastckpt_examples`` package (``examples/`` in the source tree).
"""

from __future__ import annotations

from fastckpt.elastic._options import ElasticJobOptions as ElasticJobOptions
from fastckpt.elastic._options import ElasticResult as ElasticResult
from fastckpt.elastic._options import ElasticRunError as ElasticRunError
from fastckpt.elastic._options import GenerationResult as GenerationResult
from fastckpt.elastic._options import JobStatus as JobStatus
from fastckpt.elastic._options import WorkerInfo as WorkerInfo
from fastckpt.elastic._worker import Worker as Worker
from fastckpt.elastic._worker import WorkerIdentity as WorkerIdentity
from fastckpt.elastic.context import ElasticContext as ElasticContext
from fastckpt.elastic.context import ElasticOptions as ElasticOptions
from fastckpt.elastic.job import run_elastic as run_elastic
from fastckpt.elastic.timeline import summarize as summarize

__all__ = [
    "ElasticContext",
    "ElasticJobOptions",
    "ElasticOptions",
    "ElasticResult",
    "ElasticRunError",
    "GenerationResult",
    "JobStatus",
    "Worker",
    "WorkerIdentity",
    "WorkerInfo",
    "run_elastic",
    "summarize",
]
