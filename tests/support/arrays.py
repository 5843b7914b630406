"""Helpers for in-process jax tests: meshes, deterministic data, bit-exact checks."""

from __future__ import annotations

import math
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

P = PartitionSpec


def mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    """A mesh over the first ``prod(shape)`` devices."""
    n = math.prod(shape)
    return Mesh(np.asarray(jax.devices()[:n]).reshape(shape), names)


def named(shape: tuple[int, ...], names: tuple[str, ...], spec: PartitionSpec) -> NamedSharding:
    return NamedSharding(mesh(shape, names), spec)


_SUB_BYTE = {"int2": (-2, 2), "uint2": (0, 4), "int4": (-8, 8), "uint4": (0, 16)}


def host_data(shape: tuple[int, ...], dtype: Any, seed: int = 0) -> np.ndarray:
    """Deterministic host data of every bit pattern a dtype can hold (nan payloads included)."""
    dt = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    n = math.prod(shape)
    if dt == np.bool_:
        return rng.integers(0, 2, n).astype(bool).reshape(shape)
    if dt.name in _SUB_BYTE:
        lo, hi = _SUB_BYTE[dt.name]
        return rng.integers(lo, hi, n).astype(dt).reshape(shape)
    if dt == np.dtype(ml_dtypes.float4_e2m1fn):
        return rng.integers(0, 16, n).astype(np.uint8).view(dt).reshape(shape)
    return np.frombuffer(rng.bytes(n * dt.itemsize), dt).reshape(shape).copy()


def device_data(
    shape: tuple[int, ...], dtype: Any, sharding: jax.sharding.Sharding, seed: int = 0
) -> tuple[jax.Array, np.ndarray]:
    host = host_data(shape, dtype, seed)
    return jax.make_array_from_callback(shape, sharding, lambda idx: host[idx]), host


def bits(x: Any) -> np.ndarray:
    """The raw bytes of an array (to compare floats bit for bit, nan payloads and -0.0 included)."""
    a = np.ascontiguousarray(np.asarray(x))
    return a.reshape(-1).view(np.uint8) if a.size else np.zeros(0, np.uint8)


def assert_bit_exact(got: Any, expected: np.ndarray) -> None:
    a = np.asarray(got)
    assert a.dtype == expected.dtype, (a.dtype, expected.dtype)
    assert a.shape == expected.shape, (a.shape, expected.shape)
    np.testing.assert_array_equal(bits(a), bits(expected))


def assert_sharded_like(
    got: jax.Array, sharding: jax.sharding.Sharding, expected: np.ndarray
) -> None:
    """Bit-exact, on exactly the requested devices, every shard holding its own box."""
    assert isinstance(got, jax.Array)
    assert got.sharding.is_equivalent_to(sharding, expected.ndim), (got.sharding, sharding)
    assert_bit_exact(got, expected)
    index_map = sharding.devices_indices_map(expected.shape)
    for shard in got.addressable_shards:
        assert shard.index == index_map[shard.device]
        assert_bit_exact(shard.data, expected[shard.index])


def sds(x: np.ndarray, sharding: jax.sharding.Sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
