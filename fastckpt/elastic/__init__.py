"""Elastic training: survive host loss, resize the mesh, rejoin, never lose committed state.

Two halves:

* the **supervisor** (:class:`Supervisor`, ``python -m fastckpt.elastic run``) launches one
  worker process per host, watches exits and heartbeats, kills and relaunches on the hosts
  that remain, and resizes back up at a checkpoint when a host returns;
* the **worker side** (:class:`ElasticContext`) is what a training script wraps its loop
  in ("bring your own trainer"): it initialises ``jax.distributed``, restores the latest
  checkpoint onto whatever mesh this generation has, beats, saves on cadence and stops
  at an agreed step when asked.

:mod:`fastckpt.elastic.worker` is the reference trainer (a small transformer LM with
AdamW over a ``("data", "model")`` mesh, :mod:`~fastckpt.elastic.model`,
:mod:`~fastckpt.elastic.data`, :mod:`~fastckpt.elastic.trainer`) and
:mod:`fastckpt.elastic.demo` the host-loss demo. Needs the ``demo`` extra (optax;
matplotlib for the demo's plot).
"""

from __future__ import annotations

from fastckpt.elastic._protocol import EXIT_DONE as EXIT_DONE
from fastckpt.elastic._protocol import EXIT_STOPPED as EXIT_STOPPED
from fastckpt.elastic._protocol import WorkerEnv as WorkerEnv
from fastckpt.elastic.context import ElasticContext as ElasticContext
from fastckpt.elastic.context import ElasticOptions as ElasticOptions
from fastckpt.elastic.supervisor import ChaosEvent as ChaosEvent
from fastckpt.elastic.supervisor import ElasticRunError as ElasticRunError
from fastckpt.elastic.supervisor import GenerationResult as GenerationResult
from fastckpt.elastic.supervisor import Supervisor as Supervisor
from fastckpt.elastic.supervisor import SupervisorOptions as SupervisorOptions
from fastckpt.elastic.supervisor import SupervisorResult as SupervisorResult
from fastckpt.elastic.supervisor import SupervisorTerminated as SupervisorTerminated
from fastckpt.elastic.timeline import summarize as summarize

__all__ = [
    "EXIT_DONE",
    "EXIT_STOPPED",
    "ChaosEvent",
    "ElasticContext",
    "ElasticOptions",
    "ElasticRunError",
    "GenerationResult",
    "Supervisor",
    "SupervisorOptions",
    "SupervisorResult",
    "SupervisorTerminated",
    "WorkerEnv",
    "summarize",
]
