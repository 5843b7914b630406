"""What runs inside the simulated hosts for :mod:`benchmarks.hosts`: one JAX process per host.

Loaded by file path in fresh child processes (``fastckpt_examples.cluster.multiprocess``) after
``jax.distributed.initialize``; each entry point is one phase of a job and returns JSON:

* :func:`save`: build the state of ``step`` on the job's mesh and save it (RAM tier with one
  replica per host, and with ``force`` also to the GCS emulator); wait for the commit and
  for this host's push to its peer;
* :func:`restore`: restore the newest step from each tier in ``tiers`` in turn (``"ram"``: a
  manager with a RAM tier, own RAM then peers; ``"storage"``: a manager without one, every
  byte from the emulator), each onto this job's mesh, and check every local shard bit for bit;
* :func:`remote_storage`: one process saving and restoring through endpoints at a distance
  with several ``upload_concurrency`` / ``read_concurrency`` settings.

The state (:func:`arrays`) is a deterministic function of every element's flat global index
and the step (a uint32 hash, the generator of ``tests/replicas/multiprocess/workers.py``):
computed on device by a jitted elementwise function, and in numpy for exactly the box of each
restored shard, so a restore is checked bit for bit without materialising the global arrays. A shard
that differs raises :class:`BitExactError`, which fails the job.

The peer secret comes from the launcher: ``FASTCKPT_PEER_SECRET`` in the environment, read
with ``fastckpt.peer_secret_from_env()``. Each host's RAM tier is ``<ram_root>/<member>``
(``member``: the host's name, its stable id in the replica ring; ``ram_root`` under
``/dev/shm``, the host's own tmpfs); the peer address is the default (the route to the
``jax.distributed`` coordinator).
"""

from __future__ import annotations

import math
import time
from typing import Any

import ml_dtypes
import numpy as np

BUCKET = "fastckpt-bench"
COLS = 1536
"""Columns of ``w`` (float32 rows of 6 KiB)."""
M_ROWS = 512
_ALIGN = 24  # dimensions split across devices: divisible by 2, 3 x 2, 4 x 2 and 8
_M1, _M2, _M3 = 0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35
MiB = 1 << 20


class BitExactError(AssertionError):
    """A restored shard differs from the values that were saved."""


def arrays(total_bytes: int) -> dict[str, tuple[tuple[int, ...], Any, tuple[Any, ...]]]:
    """``name -> (shape, dtype, partition spec)`` of a state of about ``total_bytes``.

    ``w`` (float32, 3/4 of the bytes) is split by rows and ``m`` (bfloat16, 1/4) by columns
    over every device of the mesh (axes ``a``: hosts, ``b``: devices of a host), so every
    host holds the same share and every box is written once; ``r`` is small and replicated
    (process 0 writes it, every host reads it).
    """
    rows = max(_ALIGN, round(total_bytes * 3 / 4 / (4 * COLS) / _ALIGN) * _ALIGN)
    cols = max(_ALIGN, round(total_bytes / 4 / (2 * M_ROWS) / _ALIGN) * _ALIGN)
    return {
        "w": ((rows, COLS), np.float32, (("a", "b"), None)),
        "m": ((M_ROWS, cols), ml_dtypes.bfloat16, (None, ("a", "b"))),
        "r": ((48, 64), np.float16, ()),
    }


def _uint(bits: int) -> Any:
    return {16: np.uint16, 32: np.uint32}[bits]


def expected_box(
    shape: tuple[int, ...], dtype: Any, index: tuple[slice, ...], step: int
) -> np.ndarray:
    """The saved values of the box ``index`` of an array (its bits, as unsigned integers)."""
    flat = np.zeros((1,) * len(shape), np.uint32)
    stride = 1
    for dim in reversed(range(len(shape))):
        start, stop, _ = index[dim].indices(shape[dim])
        ax = np.arange(start, stop, dtype=np.uint32) * np.uint32(stride)
        flat = flat + ax.reshape([-1 if d == dim else 1 for d in range(len(shape))])
        stride *= shape[dim]
    h = flat
    h += np.uint32((step * _M1) % 2**32)
    h *= np.uint32(_M2)
    h ^= h >> np.uint32(13)
    h *= np.uint32(_M3)
    h ^= h >> np.uint32(16)
    bits = np.dtype(dtype).itemsize * 8
    return h if bits == 32 else (h & np.uint32(2**bits - 1)).astype(_uint(bits))


def _mesh() -> Any:
    import jax
    from jax.sharding import Mesh

    devices = np.asarray(jax.devices()).reshape(jax.process_count(), jax.local_device_count())
    return Mesh(devices, ("a", "b"))


def _shardings(total_bytes: int) -> dict[str, Any]:
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = _mesh()
    return {
        n: NamedSharding(mesh, PartitionSpec(*spec))
        for n, (_, _, spec) in arrays(total_bytes).items()
    }


def _make_state(total_bytes: int, step: int) -> dict[str, Any]:
    """The state of ``step`` on this job's mesh (a jitted elementwise generator)."""
    import jax
    import jax.numpy as jnp

    layout = arrays(total_bytes)

    def gen(name: str, step: jax.Array) -> jax.Array:
        shape, dtype, _ = layout[name]
        bits = np.dtype(dtype).itemsize * 8
        i = jax.lax.iota(jnp.uint32, math.prod(shape)).reshape(shape)
        h = (i + step * jnp.uint32(_M1)) * jnp.uint32(_M2)
        h = h ^ (h >> 13)
        h = h * jnp.uint32(_M3)
        h = h ^ (h >> 16)
        u = (h & jnp.uint32(2**bits - 1)).astype(_uint(bits))
        return jax.lax.bitcast_convert_type(u, dtype)

    fn = jax.jit(lambda s: {n: gen(n, s) for n in layout}, out_shardings=_shardings(total_bytes))
    return jax.block_until_ready(fn(jnp.uint32(step)))


def _check(got: dict[str, Any], total_bytes: int, step: int) -> int:
    """Compare every local shard with :func:`expected_box`; the number of shards checked."""
    checked = 0
    for name, (shape, dtype, _) in arrays(total_bytes).items():
        bits = np.dtype(dtype).itemsize * 8
        for shard in got[name].addressable_shards:
            data = np.asarray(shard.data).view(_uint(bits))
            if not np.array_equal(data, expected_box(shape, dtype, shard.index, step)):
                raise BitExactError(f"step {step}: {name} shard {shard.index} differs")
            checked += 1
    return checked


def _barrier(name: str, timeout_s: float = 300.0) -> None:
    """Wait until every process of the job got here (the coordination service's barrier): a
    host keeps serving its peers until every push to it and every fetch from it is done."""
    import jax
    from jax._src import distributed

    if jax.process_count() > 1:
        assert distributed.global_state.client is not None
        distributed.global_state.client.wait_at_barrier(name, int(timeout_s * 1000))


def _store(endpoint: str, prefix: str, workers: int = 16) -> Any:
    from fastckpt.storage import GcsOptions, GcsStore

    return GcsStore(BUCKET, prefix, options=GcsOptions(endpoint=endpoint, max_workers=workers))


def _options(
    ram_root: str | None,
    member: str = "",
    *,
    save: dict[str, Any] | None = None,
    restore: dict[str, Any] | None = None,
) -> Any:
    import fastckpt
    from fastckpt.options import (
        ManagerOptions,
        RamOptions,
        RestoreOptions,
        RetentionOptions,
        SaveOptions,
    )

    ram = None
    if ram_root is not None:
        ram = RamOptions(
            root=f"{ram_root}/{member}",
            member_id=member,
            replicas=1,
            secret=fastckpt.peer_secret_from_env(),
        )
    return ManagerOptions(
        save_interval_steps=1_000_000,  # persistent only when forced
        save=SaveOptions(**(save or {})),
        restore=RestoreOptions(**(restore or {})),
        retention=RetentionOptions(keep_last=None),
        ram=ram,
    )


def save(
    *,
    endpoint: str,
    prefix: str,
    ram_root: str,
    member: str,
    total_bytes: int,
    step: int,
    force: bool,
) -> dict[str, Any]:
    """Save the state of ``step`` to RAM (pushed to one peer) and, with ``force``, to GCS."""
    from fastckpt import CheckpointManager

    t0 = time.perf_counter()
    mgr = CheckpointManager(_store(endpoint, prefix), options=_options(ram_root, member))
    startup_s = time.perf_counter() - t0
    with mgr:
        state = _make_state(total_bytes, step)
        t0 = time.perf_counter()
        mgr.save(step, state, force=force)
        mgr.wait()
        saved_s = time.perf_counter() - t0
        reports = mgr.wait_replication(300)
        pushed_s = time.perf_counter() - t0
        stats = mgr.last_save_stats
        assert stats is not None
        if not reports or not all(r.ok for r in reports):
            raise RuntimeError(f"the push of step {step} to the peers failed: {reports}")
        _barrier(f"bench-saved-{step}")
        return {
            "startup_s": startup_s,
            "saved_s": saved_s,
            "pushed_s": pushed_s,
            "tiers": list(stats.tiers),
            "staged_bytes": stats.staged_bytes,
            "targets": [list(r.targets) for r in reports],
        }


def _restore_once(mgr: Any, total_bytes: int) -> dict[str, Any]:
    import jax

    shardings = _shardings(total_bytes)
    target: dict[str, Any] = {
        n: jax.ShapeDtypeStruct(shape, dtype, sharding=shardings[n])
        for n, (shape, dtype, _) in arrays(total_bytes).items()
    }
    c0 = time.process_time()
    got = mgr.restore(target=target)
    stats = mgr.last_restore_stats
    jax.block_until_ready(got)
    cpu_s = time.process_time() - c0
    checked = _check(got, total_bytes, int(stats.step))
    return {
        "step": stats.step,
        "seconds": stats.seconds,
        "select_s": stats.select_s,
        "fetch_s": stats.fetch_s,
        "device_put_s": stats.device_put_s,
        "cpu_s": cpu_s,
        "bytes_by_tier": dict(stats.bytes_by_tier),
        "bytes_read_storage": stats.bytes_read_storage,
        "restored_bytes": stats.restored_bytes,
        "fallbacks": dict(stats.fallbacks),
        "checked_shards": checked,
    }


def restore(
    *, endpoint: str, prefix: str, ram_root: str, member: str, total_bytes: int, tiers: list[str]
) -> dict[str, Any]:
    """Restore the newest step once per entry of ``tiers`` (a fresh manager each); the
    stats of each, with the manager's start-up time (discovery and peer check with RAM)."""
    import socket

    from fastckpt import CheckpointManager

    out: dict[str, Any] = {"member": member, "hostname": socket.gethostname()}
    for tier in tiers:
        t0 = time.perf_counter()
        mgr = CheckpointManager(
            _store(endpoint, prefix), options=_options(ram_root if tier == "ram" else None, member)
        )
        startup_s = time.perf_counter() - t0
        with mgr:
            out[tier] = {"startup_s": startup_s, **_restore_once(mgr, total_bytes)}
            _barrier(f"bench-restored-{tier}")
    return out


def _rotations(values: list[int], repeats: int) -> list[int]:
    """``values`` ``repeats`` times, each round starting one further (drift spreads evenly)."""
    return [values[(r + i) % len(values)] for r in range(repeats) for i in range(len(values))]


def remote_storage(
    *,
    endpoints: dict[str, str],
    member: str,
    total_bytes: int,
    uploads: list[int],
    reads: list[int],
    object_bytes: int,
    repeats: int,
) -> dict[str, Any]:
    """Per endpoint (label -> URL; prefix ``remote-<member>-<label>``): ``repeats`` saves per
    ``upload_concurrency`` in ``uploads`` (objects of ``object_bytes``; a new step each, all
    but the last deleted after it is timed), then ``repeats`` restores of the last per
    ``read_concurrency`` in ``reads``, in rotating order; each with a fresh manager without
    RAM tier, each restore checked bit for bit. The store's thread pool
    (``GcsOptions.max_workers``) is at least the concurrency asked for. Returns the seconds
    of every run per setting (a save: ``save()`` until committed)."""
    from fastckpt import CheckpointManager

    out: dict[str, Any] = {}
    for label, endpoint in endpoints.items():
        prefix = f"remote-{member}-{label}"
        saves: dict[str, list[dict[str, Any]]] = {str(u): [] for u in uploads}
        restores: dict[str, list[dict[str, Any]]] = {str(r): [] for r in reads}
        order = _rotations(uploads, repeats)
        for i, u in enumerate(order):
            step = 10 * (i + 1)
            opts = _options(None, save={"upload_concurrency": u, "object_bytes": object_bytes})
            with CheckpointManager(_store(endpoint, prefix, max(16, u)), options=opts) as mgr:
                state = _make_state(total_bytes, step)
                t0 = time.perf_counter()
                mgr.save(step, state, force=True)
                mgr.wait()
                seconds = time.perf_counter() - t0
                stats = mgr.last_save_stats
                assert stats is not None
                saves[str(u)].append(
                    {
                        "seconds": seconds,
                        "upload_s": stats.upload_s,
                        "commit_s": stats.commit_s,
                        "objects": stats.objects,
                    }
                )
                del state
                if i + 1 < len(order):
                    mgr.delete_step(step)
        for r in _rotations(reads, repeats):
            opts = _options(None, restore={"read_concurrency": r})
            with CheckpointManager(_store(endpoint, prefix, max(16, r)), options=opts) as mgr:
                restores[str(r)].append(_restore_once(mgr, total_bytes))
        out[label] = {"save": saves, "restore": restores}
    return out
