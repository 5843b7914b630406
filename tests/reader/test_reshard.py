"""Bit-exact save/restore across meshes, partition specs and device counts (8 -> 1..8)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fastckpt
from fastckpt import CheckpointManager, ManagerOptions, RestoreOptions, SaveOptions
from tests.support.arrays import (
    P,
    assert_bit_exact,
    assert_sharded_like,
    device_data,
    mesh,
    named,
    sds,
)

SHAPE = (48, 24)  # divisible by 1, 2, 3, 4, 6 and 8 in both dimensions

SAVE_LAYOUTS = {
    "8-rows": ((8,), ("x",), P("x", None)),
    "8-cols": ((8,), ("x",), P(None, "x")),
    "8-replicated": ((8,), ("x",), P()),
    "2x4-both": ((2, 4), ("a", "b"), P("a", "b")),
    "2x4-partial-replica": ((2, 4), ("a", "b"), P("b", None)),
    "2x4-two-axes-one-dim": ((2, 4), ("a", "b"), P(("a", "b"), None)),
    "4x2-transposed": ((4, 2), ("a", "b"), P("b", "a")),
    "4x2-cols-partial": ((4, 2), ("a", "b"), P(None, "a")),
}

RESTORE_LAYOUTS = [
    ((1,), ("x",), P()),
    ((1,), ("x",), P("x", None)),
    ((2,), ("x",), P("x", None)),
    ((2,), ("x",), P()),
    ((4,), ("x",), P(None, "x")),
    ((2, 2), ("a", "b"), P("b", "a")),
    ((6,), ("x",), P("x", None)),
    ((2, 3), ("a", "b"), P("a", "b")),
    ((3, 2), ("a", "b"), P(None, ("a", "b"))),
    ((8,), ("x",), P(None, "x")),
    ((2, 4), ("a", "b"), P(("b", "a"), None)),
    ((4, 2), ("a", "b"), P("a", None)),
]


@pytest.mark.parametrize("layout", sorted(SAVE_LAYOUTS))
def test_reshard_round_trip(root: Any, layout: str) -> None:
    mshape, names, spec = SAVE_LAYOUTS[layout]
    src = named(mshape, names, spec)
    w, w_host = device_data(SHAPE, jnp.float32, src, seed=1)
    b, b_host = device_data(SHAPE[:1], jnp.bfloat16, NamedSharding1D(src), seed=2)
    opts = ManagerOptions(save=SaveOptions(max_chunk_bytes=1024))  # several sub-chunks per shard
    with CheckpointManager(root, options=opts) as mgr:
        assert mgr.save(5, {"w": w, "b": b})
        mgr.wait()
        assert mgr.all_steps() == [5]
    with CheckpointManager(root) as mgr:
        for rshape, rnames, rspec in RESTORE_LAYOUTS:
            dst = named(rshape, rnames, rspec)
            dst_b = NamedSharding1D(dst)
            target = {"w": sds(w_host, dst), "b": sds(b_host, dst_b)}
            got = mgr.restore(target=target)
            stats = mgr.last_restore_stats
            assert_sharded_like(got["w"], dst, w_host)
            assert_sharded_like(got["b"], dst_b, b_host)
            assert stats.restored_bytes >= w_host.nbytes + b_host.nbytes
        # target=None: the saved sharding is rebuilt (this job has the saved device count).
        got = mgr.restore()
        assert_sharded_like(got["w"], src, w_host)
        assert got["w"].sharding.spec == src.spec


def NamedSharding1D(s: jax.sharding.NamedSharding) -> jax.sharding.NamedSharding:
    """The same mesh, sharding a 1-d array like the first dimension of ``s``."""
    first = s.spec[0] if len(s.spec) else None
    return jax.sharding.NamedSharding(s.mesh, P(first))


def test_restore_onto_concrete_arrays_and_single_device(root: Any) -> None:
    src = named((2, 4), ("a", "b"), P("a", "b"))
    w, w_host = device_data(SHAPE, jnp.int32, src, seed=3)
    fastckpt.save(root, 1, {"w": w})
    # A concrete array as target: its sharding is used, its values are not.
    dst = named((4,), ("x",), P(None, "x"))
    like = jax.device_put(np.zeros(SHAPE, np.int32), dst)
    got = fastckpt.restore(root, target={"w": like})
    assert_sharded_like(got["w"], dst, w_host)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[5])
    got = fastckpt.restore(root, target={"w": jax.ShapeDtypeStruct(SHAPE, jnp.int32, sharding=one)})
    assert got["w"].devices() == {jax.devices()[5]}
    assert_sharded_like(got["w"], one, w_host)
    # A numpy target restores to host memory.
    got = fastckpt.restore(root, target={"w": np.zeros(SHAPE, np.int32)})
    assert isinstance(got["w"], np.ndarray)
    np.testing.assert_array_equal(got["w"], w_host)


def test_jax_refuses_uneven_named_sharding() -> None:
    """jax requires divisibility for NamedSharding, so uneven layouts cannot reach a save."""
    with pytest.raises(Exception, match=r"divisible|Indivisible|evenly"):
        jax.device_put(np.zeros(10), named((8,), ("x",), P("x")))


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_subchunked_row_restore_reads_only_needed_chunks(root: Any, compression: str) -> None:
    """Shards saved as column blocks, split into 256-byte sub-chunks: a process that needs
    one row block reads only the sub-chunks that overlap it, not whole shards."""
    from fastckpt.reader.fetch import RestoreStats, Unit, fill_units

    src = named((8,), ("x",), P(None, "x"))
    shape = (64, 64)
    w, w_host = device_data(shape, jnp.float32, src, seed=4)
    opts = ManagerOptions(save=SaveOptions(max_chunk_bytes=256, compression=compression))  # type: ignore[arg-type]
    with CheckpointManager(root, options=opts) as mgr:
        mgr.save(1, {"w": w})
        mgr.wait()
        manifest = mgr.manifest(1)
        (leaf,) = manifest.arrays()
        assert len(leaf.chunks) == 64  # 8 shards x 8 sub-chunks of (8 rows x 8 cols)
        assert max(c.raw_length for c in leaf.chunks) <= 256
        # What a process owning rows [8, 16) of a row-sharded target reads:
        stats = RestoreStats()
        unit = Unit(leaf, ((8, 16), (0, 64)))
        ropts = RestoreOptions(max_gap_bytes=0)
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as ex:
            mgr._io.run(fill_units(mgr.store, 1, [unit], options=ropts, executor=ex, stats=stats))
        np.testing.assert_array_equal(unit.buffer, w_host[8:16])
        needed = sum(c.length for c in leaf.chunks if c.box[0] == (8, 16))
        assert stats.bytes_read_storage == needed
        assert stats.bytes_read_storage < leaf.stored_bytes / 4
        # The full resharded restore is exact too.
        dst = named((8,), ("x",), P("x", None))
        got = mgr.restore(1, target={"w": sds(w_host, dst)})
        assert_sharded_like(got["w"], dst, w_host)


def test_save_does_not_alias_caller_arrays(root: Any) -> None:
    """After save() returns the caller may overwrite its buffers; the checkpoint keeps the
    values at save time (staging copies)."""
    host = np.arange(4096, dtype=np.float32)
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"h": host, "d": jax.device_put(host, mesh((8,), ("x",)).devices.flat[0])})
        host[:] = -1
        mgr.wait()
        got = mgr.restore(1)
    np.testing.assert_array_equal(got["h"], np.arange(4096, dtype=np.float32))
    np.testing.assert_array_equal(np.asarray(got["d"]), np.arange(4096, dtype=np.float32))


def test_default_options_large_replicated_array(root: Any) -> None:
    """Default chunking (16 MiB) and packing: a 20 MiB replicated array is written once, in
    two sub-chunks, and restores exactly onto a sharded layout."""
    src = named((2, 4), ("a", "b"), P())
    host = (np.arange(5 << 20, dtype=np.int64) % 1009).astype(np.float32).reshape(1280, 4096)
    x = jax.device_put(host, src)
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"x": x})
        mgr.wait()
        (leaf,) = mgr.manifest(1).arrays()
        assert [c.raw_length for c in leaf.chunks] == [16 << 20, 4 << 20]
        assert {c.codec for c in leaf.chunks} == {"zstd"}
        dst = named((8,), ("x",), P(None, "x"))
        got = mgr.restore(1, target={"x": sds(host, dst)})
        stats = mgr.last_restore_stats
        assert_sharded_like(got["x"], dst, host)
        assert stats.bytes_read_storage == leaf.stored_bytes


@pytest.mark.timeout(120)
def test_tight_memory_budget_and_tiny_reads(root: Any) -> None:
    """A budget smaller than one chunk, tiny objects, one upload and one read at a time,
    tiny ranged reads: no deadlock, exact data."""
    src = named((4, 2), ("a", "b"), P("a", "b"))
    x, xh = device_data((128, 64), np.float32, src, seed=9)
    y = jax.device_put(jnp.arange(128 * 64, dtype=jnp.int32).reshape(128, 64) % 7, src)
    opts = ManagerOptions(
        save=SaveOptions(
            max_chunk_bytes=2048,
            max_inflight_bytes=1024,
            object_bytes=512,
            upload_concurrency=1,
            encode_threads=1,
        ),
        restore=RestoreOptions(
            read_concurrency=1, max_request_bytes=1, max_gap_bytes=0, decode_threads=1
        ),
    )
    with CheckpointManager(root, options=opts) as mgr:
        mgr.save(1, {"x": x, "y": y})
        mgr.wait()
        got = mgr.restore(1, target={"x": sds(xh, named((2,), ("x",), P(None, "x"))), "y": None})
    assert_bit_exact(got["x"], xh)
    assert_bit_exact(got["y"], np.asarray(y))


def test_restore_checks_its_step_and_prng_key_implementations(tmp_path: Any) -> None:
    """restore() refuses steps that are not ints (a str, a float, a bool) with ConfigError, and a
    PRNG key target of another implementation with DtypeMismatchError (it was restored as the
    checkpoint's implementation)."""
    import jax

    from fastckpt import CheckpointManager
    from fastckpt.errors import ConfigError, DtypeMismatchError

    with CheckpointManager(str(tmp_path / "ck")) as mgr:
        mgr.save(1, {"k": jax.random.split(jax.random.key(0), 8)})
        mgr.wait()
        for bad in ("1", 1.0, True, -1):
            with pytest.raises(ConfigError, match="step must be"):
                mgr.restore(bad)  # type: ignore[arg-type]
        for impl in ("rbg", "unsafe_rbg"):
            target = {
                "k": jax.eval_shape(
                    lambda impl=impl: jax.random.split(jax.random.key(0, impl=impl), 8)
                )
            }
            with pytest.raises(DtypeMismatchError, match="target keys are"):
                mgr.restore(1, target=target)
        same = {"k": jax.eval_shape(lambda: jax.random.split(jax.random.key(0), 8))}
        got = mgr.restore(1, target=same)["k"]
        assert got.dtype == same["k"].dtype
        np.testing.assert_array_equal(
            jax.random.key_data(got), jax.random.key_data(jax.random.split(jax.random.key(0), 8))
        )


def test_a_key_target_of_another_key_shape_is_refused(tmp_path: Any) -> None:
    """A scalar key (key data (2,)) restored into a target of 2 keys: ShapeMismatchError (it
    was restored as one key, silently); a batch of keys into a scalar target too."""
    import jax

    from fastckpt import CheckpointManager
    from fastckpt.errors import ShapeMismatchError

    with CheckpointManager(str(tmp_path / "ck")) as mgr:
        mgr.save(1, {"one": jax.random.key(0), "many": jax.random.split(jax.random.key(1), 4)})
        mgr.wait()
        key = jax.eval_shape(lambda: jax.random.key(0))
        two = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), 2))
        with pytest.raises(ShapeMismatchError, match="target key array shape"):
            mgr.restore(
                1,
                target={
                    "one": two,
                    "many": jax.eval_shape(lambda: jax.random.split(jax.random.key(1), 4)),
                },
            )
        with pytest.raises(ShapeMismatchError, match="target key array shape"):
            mgr.restore(1, target={"one": key, "many": key})
        got = mgr.restore(
            1,
            target={
                "one": key,
                "many": jax.eval_shape(lambda: jax.random.split(jax.random.key(1), 4)),
            },
        )
        assert got["one"].shape == () and got["many"].shape == (4,)
        np.testing.assert_array_equal(
            jax.random.key_data(got["many"]),
            jax.random.key_data(jax.random.split(jax.random.key(1), 4)),
        )
