"""Restore's persistent-storage reads: scatter reads straight into destination buffers,
reads coalesced across leaves, and re-reads of chunks corrupted on the wire."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fastckpt import CheckpointManager, ManagerOptions, RestoreOptions, SaveOptions
from fastckpt.errors import ConfigError
from fastckpt.storage import GcsStore, LocalStore, MemoryStore, Store
from tests.support.arrays import P, assert_bit_exact, assert_sharded_like, device_data, named, sds
from tests.support.wrapping import ForwardingStore

OPTS = ManagerOptions(save=SaveOptions(max_chunk_bytes=16 << 10, object_bytes=1 << 20))
N_SMALL = 24


def mixed_state() -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, jax.sharding.Sharding]]:
    """Many small leaves (packed next to each other), a big incompressible leaf (stored raw),
    a compressible one (stored zstd) and a bf16 one."""
    grid = named((2, 4), ("a", "b"), P("a", "b"))
    repl = named((8,), ("x",), P())
    state: dict[str, Any] = {}
    hosts: dict[str, np.ndarray] = {}
    shardings: dict[str, jax.sharding.Sharding] = {}
    for i in range(N_SMALL):
        state[f"s{i:02d}"], hosts[f"s{i:02d}"] = device_data((16,), np.float32, repl, seed=i)
        shardings[f"s{i:02d}"] = repl
    state["big"], hosts["big"] = device_data((256, 128), np.float32, grid, seed=100)
    zeros = np.zeros((256, 64), np.float32)
    zeros[::7, ::3] = 1.5
    state["zeros"], hosts["zeros"] = jax.device_put(zeros, grid), zeros
    state["half"], hosts["half"] = device_data((64, 96), ml_dtypes.bfloat16, grid, seed=7)
    for k in ("big", "zeros", "half"):
        shardings[k] = grid
    return state, hosts, shardings


def check(
    got: dict[str, Any], hosts: dict[str, np.ndarray], shardings: dict[str, jax.sharding.Sharding]
) -> None:
    for k, h in hosts.items():
        assert_sharded_like(got[k], shardings[k], h)


@pytest.fixture(params=["memory", "local"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    return (
        MemoryStore() if request.param == "memory" else LocalStore(tmp_path / "ckpt", durable=False)
    )


def test_same_mesh_restore_reads_in_place_and_coalesced(store: Store) -> None:
    state, hosts, shardings = mixed_state()
    with CheckpointManager(store, options=OPTS) as mgr:
        mgr.save(1, state)
        mgr.wait()
        target = {k: sds(h, shardings[k]) for k, h in hosts.items()}
        got = mgr.restore(1, target=target)
        stats = mgr.last_restore_stats
        check(got, hosts, shardings)
        # Every raw chunk maps onto one contiguous destination span: received in place.
        assert stats.bytes_in_place >= hosts["big"].nbytes + sum(
            hosts[f"s{i:02d}"].nbytes for i in range(N_SMALL)
        )
        assert stats.bytes_in_place < stats.bytes_read_storage  # the zstd leaf went via scratch
        n_objects = len({c.key for a in mgr.manifest(1).arrays() for c in a.chunks})
        assert stats.reads_storage <= n_objects + 2 < len(hosts)  # not one read per leaf


@pytest.mark.parametrize(
    ("shape", "names", "spec"),
    [((4, 2), ("a", "b"), P("b", "a")), ((8,), ("x",), P(None, "x")), ((1,), ("x",), P())],
)
def test_resharded_restore_is_bit_exact(
    store: Store, shape: tuple[int, ...], names: tuple[str, ...], spec: Any
) -> None:
    state, hosts, _ = mixed_state()
    with CheckpointManager(store, options=OPTS) as mgr:
        mgr.save(1, state)
        mgr.wait()
        dst = named(shape, names, spec)
        small = named(shape, names, P())
        shardings = {k: (small if k.startswith("s") else dst) for k in hosts}
        got = mgr.restore(1, target={k: sds(h, shardings[k]) for k, h in hosts.items()})
        check(got, hosts, shardings)


class _FlipOnce(ForwardingStore):
    """Delegates to ``inner``; flips one byte in the largest buffer of the first scatter
    read (a chunk received in place, for the big raw leaf), as a wire fault would."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.flipped = 0

    async def get_into(self, key: str, start: int, into: Sequence[memoryview]) -> None:
        await self.inner.get_into(key, start, into)
        if not self.flipped and into:
            part = max(into, key=lambda b: b.nbytes)
            part[part.nbytes // 2] ^= 0x10
            self.flipped += 1


def test_chunk_corrupted_on_the_wire_is_reread() -> None:
    state, hosts, shardings = mixed_state()
    store = MemoryStore()
    with CheckpointManager(store, options=OPTS) as mgr:
        mgr.save(1, state)
        mgr.wait()
    flaky = _FlipOnce(store)
    with CheckpointManager(flaky, options=OPTS) as mgr:
        got = mgr.restore(1, target={k: sds(h, shardings[k]) for k, h in hosts.items()})
        stats = mgr.last_restore_stats
    assert flaky.flipped == 1
    assert stats.retries == 1
    check(got, hosts, shardings)


def test_zero_size_leaves_next_to_data(store: Store) -> None:
    """Empty arrays may share a stored offset with the next chunk: each is still filled."""
    grid = named((2, 4), ("a", "b"), P("a", "b"))
    x, xh = device_data((64, 32), np.float32, grid, seed=3)
    e = jax.device_put(jnp.zeros((0, 4), jnp.float32), named((8,), ("x",), P()))
    with CheckpointManager(store, options=OPTS) as mgr:
        mgr.save(1, {"a": e, "b": x, "c": e})
        mgr.wait()
        got = mgr.restore(1)
    assert_bit_exact(got["b"], xh)
    assert got["a"].shape == (0, 4) and got["c"].shape == (0, 4)


def test_tiny_scratch_budget_still_restores(store: Store) -> None:
    """Reads needing more scratch than the budget run one at a time, and still complete."""
    state, hosts, _ = mixed_state()
    opts = ManagerOptions(
        save=OPTS.save, restore=RestoreOptions(max_scratch_bytes=1, read_concurrency=3)
    )
    with CheckpointManager(store, options=opts) as mgr:
        mgr.save(1, state)
        mgr.wait()
        dst = named((4, 2), ("a", "b"), P("b", "a"))
        shardings = {
            k: (named((4, 2), ("a", "b"), P()) if k.startswith("s") else dst) for k in hosts
        }
        got = mgr.restore(1, target={k: sds(h, shardings[k]) for k, h in hosts.items()})
        check(got, hosts, shardings)
    with pytest.raises(ConfigError):
        RestoreOptions(max_scratch_bytes=0)


def test_gcs_restore_scatter_reads_are_bit_exact(gcs_store: GcsStore) -> None:
    """Ranged GETs received straight into destination buffers (and scratch for zstd chunks),
    coalesced across leaves, on the same mesh and resharded."""
    state, hosts, shardings = mixed_state()
    with CheckpointManager(gcs_store, options=OPTS) as mgr:
        mgr.save(1, state)
        mgr.wait()
        got = mgr.restore(1, target={k: sds(h, shardings[k]) for k, h in hosts.items()})
        stats = mgr.last_restore_stats
        check(got, hosts, shardings)
        assert stats.bytes_in_place >= hosts["big"].nbytes + sum(
            hosts[f"s{i:02d}"].nbytes for i in range(N_SMALL)
        )
        assert stats.reads_storage < len(hosts)
        dst = named((4, 2), ("a", "b"), P("b", "a"))
        small = named((4, 2), ("a", "b"), P())
        shardings = {k: (small if k.startswith("s") else dst) for k in hosts}
        check(
            mgr.restore(1, target={k: sds(h, shardings[k]) for k, h in hosts.items()}),
            hosts,
            shardings,
        )
