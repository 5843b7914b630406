"""Examples for fastckpt (installed beside the library, not part of it).

* :mod:`fastckpt_examples.model`, :mod:`~fastckpt_examples.data`,
  :mod:`~fastckpt_examples.trainer`: a small transformer LM with AdamW over a
  ``("data", "model")`` mesh and a deterministic synthetic token stream;
* :mod:`fastckpt_examples.elastic_train`: that trainer made elastic on Ray with the few
  lines of :class:`fastckpt.elastic.ElasticContext` (``train(worker)``);
* :mod:`fastckpt_examples.demo`: ``fastckpt demo``, that trainer on a local Ray cluster;
* :mod:`fastckpt_examples.cluster`: simulated hosts, multi-process jobs and a local Ray
  cluster on one machine (what the demo, the benchmarks and the tests run on).

Needs the ``demo`` extra (optax, ray; matplotlib for plots).
"""
