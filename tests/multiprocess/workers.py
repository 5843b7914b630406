"""Functions run inside each process of a multi-process job (see
fastckpt_examples.cluster.multiprocess).

Loaded by file path in fresh child processes; everything here runs after
``jax.distributed.initialize``. Array values are a deterministic function of the global
index, so every process can check the shards it holds without talking to the others.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fastckpt import (
    CheckpointManager,
    DistributedOptions,
    ManagerOptions,
    RetentionOptions,
    SaveOptions,
)
from fastckpt.storage import LocalStore
from fastckpt.storage._protocol import Payload, PutMode
from tests.support.wrapping import ForwardingStore


def _in_child() -> None:
    """Per-job setup; only ever called inside launched children (the parent imports this
    module for :func:`expected` and must not have its jax config changed)."""
    jax.config.update("jax_enable_x64", True)  # 64-bit dtypes are part of what is checked


ARRAYS: dict[str, tuple[tuple[int, ...], Any]] = {
    "w": ((64, 48), np.float32),
    "e": ((48,), ml_dtypes.bfloat16),
    "k": ((24, 8, 4), np.int8),
    "u": ((24, 16), np.uint64),
}


def expected(name: str, seed: int) -> np.ndarray:
    """The global value of array ``name``: a hash of the flat global index (all bit patterns)."""
    shape, dtype = ARRAYS[name]
    dt = np.dtype(dtype)
    idx = np.arange(math.prod(shape) * dt.itemsize, dtype=np.uint64)
    h = (idx + np.uint64(seed * 7919 + len(name))) * np.uint64(0x9E3779B97F4A7C15)
    return ((h >> np.uint64(29)) & np.uint64(0xFF)).astype(np.uint8).view(dt).reshape(shape)


def global_mesh(shape: tuple[int, ...]) -> Mesh:
    devices = np.asarray(jax.devices())
    assert devices.size == math.prod(shape), (devices.size, shape)
    return Mesh(devices.reshape(shape), ("a", "b")[: len(shape)] if len(shape) > 1 else ("a",))


def _specs(layout: str) -> dict[str, P]:
    """Partition specs per array for a named layout (mesh axes 'a' (across processes) and 'b')."""
    return {
        "rows": {"w": P("a", "b"), "e": P("a"), "k": P(None, "b"), "u": P()},
        "cols": {"w": P("b", "a"), "e": P(), "k": P("a", None, None), "u": P(None, ("a", "b"))},
        "flat": {"w": P(None, "a"), "e": P("a"), "k": P("a"), "u": P("a")},
    }[layout]


def _state(mesh: Mesh, layout: str, seed: int) -> dict[str, Any]:
    specs = _specs(layout)
    state: dict[str, Any] = {}
    for name, spec in specs.items():
        host = expected(name, seed)
        state[name] = jax.make_array_from_callback(
            host.shape, NamedSharding(mesh, spec), lambda i, h=host: h[i]
        )
    state["host"] = np.arange(10) * (seed + 1)
    state["seed"] = seed
    return state


def _options(barrier_timeout_s: float = 30.0, **save: Any) -> ManagerOptions:
    return ManagerOptions(
        save=SaveOptions(max_chunk_bytes=512, object_bytes=4096, **save),
        retention=RetentionOptions(keep_last=None),
        distributed=DistributedOptions(barrier_timeout_s=barrier_timeout_s),
    )


def save(
    root: str, steps: list[int], mesh_shape: list[int], layout: str, device_copy: str = "auto"
) -> dict[str, Any]:
    """Save ``steps`` (seed = step) from this job's topology."""
    _in_child()
    mesh = global_mesh(tuple(mesh_shape))
    with CheckpointManager(root, options=_options(device_copy=device_copy)) as mgr:
        for step in steps:
            assert mgr.save(step, _state(mesh, layout, seed=step))
        mgr.wait()
        stats = mgr.last_save_stats
        return {
            "steps": mgr.all_steps(),
            "process": jax.process_index(),
            "stats": stats.staged_bytes,
            "deferred_copy_s": stats.deferred_copy_s,
        }


def check_restore(
    root: str, steps: list[int], mesh_shape: list[int], layout: str
) -> dict[str, Any]:
    """Restore each of ``steps`` onto this job's topology; check every local shard bit for bit."""
    _in_child()
    mesh = global_mesh(tuple(mesh_shape))
    specs = _specs(layout)
    target: dict[str, Any] = {
        name: jax.ShapeDtypeStruct(
            ARRAYS[name][0], ARRAYS[name][1], sharding=NamedSharding(mesh, spec)
        )
        for name, spec in specs.items()
    }
    target["host"] = np.zeros(10, int)
    target["seed"] = 0
    checked = read = 0
    with CheckpointManager(root, options=_options()) as mgr:
        for step in steps:
            got = mgr.restore(step, target=target)
            stats = mgr.last_restore_stats
            read += stats.bytes_read_storage
            for name in specs:
                arr = got[name]
                assert arr.sharding == target[name].sharding
                full = expected(name, step)
                for shard in arr.addressable_shards:
                    data = np.asarray(shard.data)
                    want = full[shard.index]
                    assert data.dtype == want.dtype and data.shape == want.shape
                    assert data.tobytes() == want.tobytes(), (
                        f"step {step}: {name} shard {shard.index} differs"
                    )
                    checked += 1
            np.testing.assert_array_equal(got["host"], np.arange(10) * (step + 1))
            assert got["seed"] == step
        # The latest step: process 0 lists storage, the others follow it (no listing of theirs).
        listings: list[str] = []
        store_list = mgr.store.list

        async def counting_list(prefix: str = "") -> list[str]:
            listings.append(prefix)
            return await store_list(prefix)

        mgr.store.list = counting_list  # type: ignore[method-assign]
        got = mgr.restore(target=target)
        stats = mgr.last_restore_stats
        mgr.store.list = store_list  # type: ignore[method-assign]
        assert got["seed"] == stats.step == max(steps)
        total = sum(expected(n, s).nbytes for n in specs for s in steps)
        return {
            "checked_shards": checked,
            "bytes_read_storage": read,
            "total_bytes": total,
            "steps": mgr.all_steps(),
            "local_devices": jax.local_device_count(),
            "latest_listings": len(listings),
        }


# ------------------------------------------------------------------ fault injection


class FaultyStore(ForwardingStore):
    """A LocalStore that, in chosen processes, fails or kills this process on a data put."""

    def __init__(self, root: str, *, fail_steps: dict[int, str]) -> None:
        super().__init__(LocalStore(root, durable=False))
        self.fail_steps = fail_steps
        """step -> "raise" | "kill" for this process."""

    async def put(self, key: str, data: Payload, *, mode: PutMode = "overwrite") -> None:
        if key.startswith("steps/") and not key.endswith(".fragment"):
            action = self.fail_steps.get(int(key.split("/")[1]))
            if action == "raise":
                raise OSError(f"injected upload failure in process {jax.process_index()}")
            if action == "kill":
                await self.inner.put(key, data, mode=mode)  # one object lands, then we die
                os.kill(os.getpid(), signal.SIGKILL)
        await self.inner.put(key, data, mode=mode)

    async def close(self) -> None:
        await self.inner.close()


def faulty_saves(
    root: str, plan: dict[str, dict[str, str]], steps: list[int], barrier_timeout_s: float
) -> dict[str, Any]:
    """Save ``steps`` in order; ``plan[str(process)][str(step)]`` injects a fault. Report, per
    step, what ``save``+``wait`` raised here and how long it took."""
    _in_child()
    mine = {int(s): a for s, a in plan.get(str(jax.process_index()), {}).items()}
    store = FaultyStore(root, fail_steps=mine)
    mesh = global_mesh((jax.device_count(),))
    report: dict[str, Any] = {}
    with CheckpointManager(store, options=_options(barrier_timeout_s)) as mgr:
        for step in steps:
            t0 = time.monotonic()
            try:
                mgr.save(step, _state(mesh, "flat", seed=step))
                mgr.wait()
                report[str(step)] = {"ok": True}
            except Exception as e:
                chain, c = [], e
                while c is not None:
                    chain.append(f"{type(c).__name__}: {c}")
                    c = c.__cause__
                report[str(step)] = {"ok": False, "type": type(e).__name__, "chain": chain}
            report[str(step)]["seconds"] = time.monotonic() - t0
        report["steps"] = mgr.all_steps()
    return report


def two_one_shot_saves(root: str) -> dict[str, Any]:
    """``fastckpt.save`` twice in one job (a new manager each time)."""
    _in_child()
    import fastckpt

    mesh = global_mesh((jax.device_count(),))
    opts = _options(barrier_timeout_s=10)
    fastckpt.save(root, 1, _state(mesh, "flat", seed=1), options=opts)
    fastckpt.save(root, 2, _state(mesh, "flat", seed=2), options=opts)
    with CheckpointManager(root) as mgr:
        return {"steps": mgr.all_steps()}


class _SlowListStore(ForwardingStore):
    """LocalStore whose ``list`` is slow in process 0 (retention keeps its save busy)."""

    def __init__(self, root: str) -> None:
        super().__init__(LocalStore(root, durable=False))

    async def list(self, prefix: str = "") -> list[str]:
        if jax.process_index() == 0 and prefix == "manifests/":
            await asyncio.sleep(2.0)
        return await self.inner.list(prefix)


def skip_when_busy(root: str) -> dict[str, Any]:
    """``if_busy="skip"`` where process 0's save is still busy (retention) but process 1's is
    done."""
    _in_child()
    mesh = global_mesh((jax.device_count(),))
    opts = ManagerOptions(
        save=SaveOptions(if_busy="skip"), distributed=DistributedOptions(barrier_timeout_s=10)
    )
    saved = []
    with CheckpointManager(_SlowListStore(root), options=opts) as mgr:
        saved.append(mgr.save(1, _state(mesh, "flat", seed=1)))
        # Process 1: its part is done once the commit verdict is in. Process 0: the step is
        # committed, and its save is still busy applying retention (the slow list).
        deadline = time.monotonic() + 20
        if jax.process_index() == 0:
            while not os.path.exists(os.path.join(root, "manifests", "000000000001.json")):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert mgr._saver.pending is not None and not mgr._saver.pending.done()
        else:
            while not (mgr._saver.pending is None or mgr._saver.pending.done()):
                assert time.monotonic() < deadline
                time.sleep(0.01)
        saved.append(mgr.save(2, _state(mesh, "flat", seed=2)))
        mgr.wait()
        saved.append(mgr.save(3, _state(mesh, "flat", seed=3)))
        mgr.wait()
        return {"saved": saved, "steps": mgr.all_steps()}


def fail_in_process(which: int) -> int:
    """Raise in process ``which``; the others hang (launcher self-test)."""
    _in_child()
    if jax.process_index() == which:
        return 1 // 0
    time.sleep(600)
    return jax.process_index()


def coordinator_values() -> dict[str, Any]:
    """The key-value calls fastckpt adds to jax's: a directory read of every process's key
    (nested and sibling keys left out) and binary values (any bytes, not text)."""
    from fastckpt.coordination.distributed import default_coordinator

    coord = default_coordinator()
    i, n = coord.process_index, coord.process_count
    coord.set(f"t/dir/{i}", f"value {i}")
    coord.set(f"t/dir/{i}/nested", "not a process's value")
    coord.set(f"t/dirx/{i}", "a sibling directory")
    coord.set_bytes(f"t/bin/{i}", bytes([i, 0, 255, 128]) * 1000)
    coord.barrier("t/all-set", timeout_s=30)
    return {
        "dir": coord.try_get_all("t/dir", n + 1),
        "missing": coord.try_get_all("t/none", n),
        "bin": [list(coord.get_bytes(f"t/bin/{j}", timeout_s=30)[:4]) for j in range(n)],
        "bin_len": [len(coord.get_bytes(f"t/bin/{j}", timeout_s=30)) for j in range(n)],
    }


class _FirstDeleteFails(ForwardingStore):
    """A LocalStore whose first delete fails on process 0 (a retention hiccup after a commit)."""

    def __init__(self, root: str) -> None:
        super().__init__(LocalStore(root, durable=False))
        self.failed = False

    async def delete(self, key: str) -> None:
        if not self.failed and jax.process_index() == 0:
            self.failed = True
            raise OSError("injected delete failure")
        await self.inner.delete(key)

    async def close(self) -> None:
        await self.inner.close()


def saves_past_a_retention_failure(root: str, steps: list[int]) -> dict[str, Any]:
    """Saves with retention (keep 2) whose first delete fails on process 0 only: every save
    must still commit, each with its own step's shards from every process."""
    _in_child()
    mesh = global_mesh((jax.device_count(),))
    opts = ManagerOptions(
        save=SaveOptions(max_chunk_bytes=512, object_bytes=4096),
        retention=RetentionOptions(keep_last=2),
        distributed=DistributedOptions(barrier_timeout_s=20),
    )
    with CheckpointManager(_FirstDeleteFails(root), options=opts) as mgr:
        for step in steps:
            mgr.save(step, _state(mesh, "flat", seed=step))
        mgr.wait()
        return {"steps": mgr.persistent_steps()}
