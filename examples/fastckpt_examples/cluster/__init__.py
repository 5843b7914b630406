"""A simulated multi-host cluster on one Linux machine, for the demo, benchmarks and tests.

* :mod:`~fastckpt_examples.cluster.hosts`: :class:`SimulatedHosts` (network, mount and UTS
  namespaces per host; link shaping, partitions, loss and revival of a host);
* :mod:`~fastckpt_examples.cluster.multiprocess`: :func:`run_processes`, a function run in N
  real ``jax.distributed`` processes, on this machine's loopback or one per simulated host;
* :mod:`~fastckpt_examples.cluster.ray_cluster`: :class:`LocalRayCluster`, a real multi-node
  Ray cluster (on simulated hosts, or as separate Ray nodes on one network stack).

Orchestration, not checkpointing: it ships beside the library (not in it). Import the
submodules directly; this package imports nothing itself.
"""
