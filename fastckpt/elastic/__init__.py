"""Elastic training on Ray: survive node loss, resize the mesh, grow back, never lose state.

The driver (:func:`run_elastic`, :mod:`fastckpt.elastic.job`) runs the user's
``train(worker)`` in one Ray actor per node and relaunches on failure or growth; the worker
side (:class:`ElasticContext`) is what ``train`` wraps its loop in. Needs Ray (the ``ray``
extra); the example trainer and the demo live in ``fastckpt_examples`` (``examples/``).
"""

from __future__ import annotations

from fastckpt.elastic._options import ElasticJobOptions as ElasticJobOptions
from fastckpt.elastic._options import ElasticResult as ElasticResult
from fastckpt.elastic._options import ElasticRunError as ElasticRunError
from fastckpt.elastic._options import GenerationResult as GenerationResult
from fastckpt.elastic._options import JobStatus as JobStatus
from fastckpt.elastic._options import Worker as Worker
from fastckpt.elastic._options import WorkerIdentity as WorkerIdentity
from fastckpt.elastic._options import WorkerInfo as WorkerInfo
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
