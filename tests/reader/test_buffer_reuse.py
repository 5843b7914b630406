"""Restores reuse the host memory of earlier restores' arrays once those are freed."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from fastckpt import CheckpointManager, ManagerOptions, RestoreOptions
from fastckpt._hostmem import BufferCache


def _state() -> dict[str, object]:
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("d", "m"))
    rng = np.random.default_rng(0)
    return {
        "w": jax.device_put(
            rng.standard_normal((256, 1024), dtype=np.float32), NamedSharding(mesh, P("d", "m"))
        ),
        "b": jax.device_put(
            rng.standard_normal((4096,), dtype=np.float32), NamedSharding(mesh, P())
        ),
    }


@contextlib.contextmanager
def _saved(
    root: Path, options: ManagerOptions | None = None
) -> Iterator[tuple[CheckpointManager, dict[str, np.ndarray], Any]]:
    """A manager holding ``_state()`` as step 1, the state's host values and a restore target."""
    import jax

    state = _state()
    expected = {k: np.asarray(v) for k, v in state.items()}
    target = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state
    )
    with CheckpointManager(str(root), options=options) as mgr:
        mgr.save(1, state)
        mgr.wait()
        yield mgr, expected, target


def test_second_restore_reuses_freed_buffers_and_is_exact(tmp_path: Path) -> None:
    with _saved(tmp_path) as (mgr, expected, target):
        first = mgr.restore(1, target=target)
        kept = first["w"]  # still alive: its buffers must not be handed out again
        del first
        gc.collect()
        cache: BufferCache = mgr._restore_buffers
        before = cache.reused
        second = mgr.restore(1, target=target)
        assert cache.reused > before  # "b"'s buffers came back and were reused
        for k in expected:
            np.testing.assert_array_equal(np.asarray(second[k]), expected[k])
        np.testing.assert_array_equal(np.asarray(kept), expected["w"])
        assert not set(s.data.unsafe_buffer_pointer() for s in kept.addressable_shards) & set(
            s.data.unsafe_buffer_pointer() for s in second["w"].addressable_shards
        )
    assert cache.held_bytes() == 0  # close released them


def test_reuse_can_be_turned_off(tmp_path: Path) -> None:
    options = ManagerOptions(restore=RestoreOptions(reuse_host_buffers=False))
    with _saved(tmp_path, options) as (mgr, _, target):
        for _ in range(2):
            del_me = mgr.restore(1, target=target)
            del del_me
            gc.collect()
        assert mgr._restore_buffers.reused == 0 and mgr._restore_buffers.held_bytes() == 0


def test_a_leafs_shards_share_one_mapping_aliased_by_its_array_and_come_back_together(
    tmp_path: Path,
) -> None:
    """A storage restore allocates one mapping per leaf (its 8 boxes 64-byte aligned in it),
    the restored shards alias it (no copy into jax), and it returns to the cache as one."""
    with _saved(tmp_path) as (mgr, expected, target):
        got = mgr.restore(1, target=target)
        ptrs = sorted(s.data.unsafe_buffer_pointer() for s in got["w"].addressable_shards)
        shard_bytes = got["w"].addressable_shards[0].data.nbytes
        assert [p % 64 for p in ptrs] == [0] * 8
        assert (
            ptrs[-1] - ptrs[0] == 7 * shard_bytes
        )  # back to back in one slab (128 KiB each: no padding)
        np.testing.assert_array_equal(np.asarray(got["w"]), expected["w"])
        cache: BufferCache = mgr._restore_buffers
        held, reused = cache.held_bytes(), cache.reused
        del got
        gc.collect()
        # w's one slab, and b's one box (replicated: every device places the same unit)
        assert cache.held_bytes() - held == 8 * shard_bytes + expected["b"].nbytes
        again = mgr.restore(1, target=target)
        assert cache.reused == reused + 2 and cache.held_bytes() == held
        ptrs = sorted(s.data.unsafe_buffer_pointer() for s in again["w"].addressable_shards)
        assert ptrs[-1] - ptrs[0] == 7 * shard_bytes
        for k in expected:
            np.testing.assert_array_equal(np.asarray(again[k]), expected[k])
