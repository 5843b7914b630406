"""Every leaf kind round-trips bit-exact: all jax dtypes, PRNG keys, numpy, Python values,
containers."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fastckpt
from fastckpt import CheckpointManager
from fastckpt.storage import MemoryStore
from tests.support.arrays import (
    P,
    assert_bit_exact,
    assert_sharded_like,
    device_data,
    host_data,
    named,
    sds,
)

JAX_DTYPES = [
    "bool",
    "int2",
    "uint2",
    "int4",
    "uint4",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "float8_e3m4",
    "float8_e4m3",
    "float8_e4m3b11fnuz",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn",
]


def np_dtype(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name, None) or name)


def test_every_jax_dtype_round_trips_bit_exact(root: Any) -> None:
    src = named((2, 4), ("a", "b"), P("a", "b"))
    dst = named((4,), ("x",), P(None, "x"))
    state, hosts = {}, {}
    with jax.enable_x64(True):
        for i, name in enumerate(JAX_DTYPES):
            state[name], hosts[name] = device_data((8, 16), np_dtype(name), src, seed=i)
            assert state[name].dtype == np_dtype(name)
        state["scalar_f64"], hosts["scalar_f64"] = device_data(
            (), np.float64, named((8,), ("x",), P()), seed=99
        )
        state["empty"], hosts["empty"] = device_data((0, 16), np.float32, src)
        with CheckpointManager(root) as mgr:
            mgr.save(3, state)
            mgr.wait()
            stored = {leaf.path[0][1]: leaf.dtype for leaf in mgr.manifest(3).arrays()}
            assert stored == {k: str(np.dtype(v.dtype).name) for k, v in state.items()}
            target = {
                k: sds(h, dst if h.ndim == 2 else named((8,), ("x",), P()))
                for k, h in hosts.items()
            }
            got = mgr.restore(3, target=target)
            for k, h in hosts.items():
                assert_sharded_like(got[k], target[k].sharding, h)
            got = mgr.restore(3)  # target=None: saved shardings
            for k, h in hosts.items():
                assert_sharded_like(got[k], state[k].sharding, h)


@pytest.mark.parametrize(
    ("impl", "where"),
    [
        ("threefry2x32", "memory"),
        ("threefry2x32", "local"),
        ("rbg", "memory"),
        ("unsafe_rbg", "local"),
    ],
)
def test_typed_prng_keys(impl: str, where: str, tmp_path: Path) -> None:
    root: Any = MemoryStore() if where == "memory" else str(tmp_path / "ckpt")
    src = named((8,), ("x",), P("x"))
    keys = jax.device_put(jax.random.split(jax.random.key(7, impl=impl), 16), src)
    scalar = jax.random.key(3, impl=impl)
    grid = jax.device_put(
        jax.random.split(jax.random.key(1, impl=impl), 8).reshape(2, 4),
        named((2, 4), ("a", "b"), P("a", "b")),
    )
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"keys": keys, "scalar": scalar, "grid": grid})
        mgr.wait()
        dst = named((2,), ("x",), P("x"))
        target = {
            "keys": jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=dst),
            "scalar": scalar,
            "grid": jax.ShapeDtypeStruct(
                grid.shape, grid.dtype, sharding=named((4,), ("x",), P(None, "x"))
            ),
        }
        for got in (mgr.restore(1, target=target), mgr.restore(1)):
            for k, orig in (("keys", keys), ("scalar", scalar), ("grid", grid)):
                assert jax.dtypes.issubdtype(got[k].dtype, jax.dtypes.prng_key)
                assert jax.random.key_impl(got[k]) == jax.random.key_impl(orig)
                assert got[k].shape == orig.shape
                assert_bit_exact(jax.random.key_data(got[k]), np.asarray(jax.random.key_data(orig)))
        got = mgr.restore(1, target=target)
        assert got["keys"].sharding == dst
        # The restored keys are usable keys that draw the same numbers.
        np.testing.assert_array_equal(
            jax.random.uniform(got["scalar"], (4,)), jax.random.uniform(scalar, (4,))
        )
        with pytest.raises(fastckpt.errors.DtypeMismatchError):
            mgr.restore(1, target={**target, "keys": jax.ShapeDtypeStruct((16, 2), jnp.uint32)})


NUMPY_DTYPES = JAX_DTYPES + ["float6_e2m3fn", "float6_e3m2fn"]


def test_numpy_arrays_and_scalars(root: Any) -> None:
    arrays = {
        name: host_data((3, 5), np_dtype(name), seed=i) for i, name in enumerate(NUMPY_DTYPES)
    }
    scalars = {
        "f32": np.float32(1.5),
        "f64": np.float64(-0.0),
        "f64nan": np.float64("nan"),
        "i64": np.int64(-(2**62)),
        "u8": np.uint8(255),
        "b": np.bool_(True),
        "c128": np.complex128(1 - 2j),
        "bf16": ml_dtypes.bfloat16(3.0),
        "zero_d": np.array(7, np.int16),
    }
    state = {"arrays": arrays, "scalars": scalars, "empty": np.zeros((2, 0, 3), np.float32)}
    fastckpt.save(root, 2, state)
    for got in (fastckpt.restore(root, target=state), fastckpt.restore(root)):
        for k, a in arrays.items():
            assert isinstance(got["arrays"][k], np.ndarray)
            assert_bit_exact(got["arrays"][k], a)
        for k, s in scalars.items():
            g = got["scalars"][k]
            if k == "zero_d":  # a 0-d array; without a target it comes back as a numpy scalar
                assert np.asarray(g).shape == ()
            else:
                assert type(g) is type(s), (k, type(g), type(s))
            assert_bit_exact(np.asarray(g), np.asarray(s))
        assert got["empty"].shape == (2, 0, 3)
    got = fastckpt.restore(root, target=state)
    assert isinstance(got["scalars"]["zero_d"], np.ndarray)


def test_python_values(root: Any) -> None:
    state = {
        "int": 3,
        "big": 2**100,
        "neg": -(2**70),
        "float": 0.1,
        "nan": math.nan,
        "inf": -math.inf,
        "negzero": -0.0,
        "complex": complex(math.nan, -1.5),
        "str": "héllo \x00 ✓",
        "empty_str": "",
        "none": None,
        "true": True,
        "false": False,
    }
    fastckpt.save(root, 1, state)
    for got in (fastckpt.restore(root), fastckpt.restore(root, target=state)):
        assert set(got) == set(state)
        for k, v in state.items():
            g = got[k]
            assert type(g) is type(v), k
            if isinstance(v, float):
                assert repr(g) == repr(v)  # nan, inf and -0.0 exactly
            elif isinstance(v, complex):
                assert (repr(g.real), repr(g.imag)) == (repr(v.real), repr(v.imag))
            else:
                assert g == v


class Opt(NamedTuple):
    mu: Any
    nu: Any
    count: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
    kernel: Any
    bias: Any


class Pair:
    """A custom pytree node flattened without keys (FlattenedIndexKey paths)."""

    def __init__(self, a: Any, b: Any) -> None:
        self.a, self.b = a, b


jax.tree_util.register_pytree_node(Pair, lambda p: ((p.a, p.b), None), lambda _, c: Pair(*c))


def nested_state() -> tuple[Any, dict[str, np.ndarray]]:
    s = named((8,), ("x",), P("x"))
    w, wh = device_data((16, 4), np.float32, s, seed=1)
    m, mh = device_data((16, 4), np.float32, s, seed=2)
    state = {
        "params": {"layers": [Layer(w, jnp.arange(4.0)), Layer(jnp.ones((2, 2)), None)]},
        "by_int": {0: "zero", 7: jnp.float16(2.5)},
        "opt": Opt(mu=m, nu=(jnp.zeros(3), np.arange(3)), count=7),
        "pair": Pair(jnp.int8(5), [1.5, "x"]),
        "tuple": (None, (), {}),
    }
    return state, {"w": wh, "m": mh}


def test_nested_containers_round_trip_with_target(root: Any) -> None:
    state, hosts = nested_state()
    fastckpt.save(root, 4, state)
    got = fastckpt.restore(root, target=state)
    assert jax.tree_util.tree_structure(
        got, is_leaf=lambda x: x is None
    ) == jax.tree_util.tree_structure(state, is_leaf=lambda x: x is None)
    assert isinstance(got["opt"], Opt) and isinstance(got["pair"], Pair)
    assert isinstance(got["params"]["layers"][0], Layer)
    assert_bit_exact(got["params"]["layers"][0].kernel, hosts["w"])
    assert_bit_exact(got["opt"].mu, hosts["m"])
    assert got["opt"].count == 7 and got["pair"].b == [1.5, "x"] and got["by_int"][0] == "zero"
    assert got["params"]["layers"][1].bias is None
    np.testing.assert_array_equal(got["opt"].nu[1], np.arange(3))


def test_nested_containers_target_none(root: Any) -> None:
    """Without a target, containers come back as nested dicts (keys, attributes) and lists
    (sequence / flattened indices); every leaf is present and exact."""
    state, hosts = nested_state()
    fastckpt.save(root, 4, state)
    got = fastckpt.restore(root)
    assert_bit_exact(got["params"]["layers"][0]["kernel"], hosts["w"])
    np.testing.assert_array_equal(
        np.asarray(got["params"]["layers"][0]["bias"]), np.arange(4.0, dtype=np.float32)
    )
    assert got["params"]["layers"][1]["bias"] is None
    assert got["by_int"][0] == "zero" and float(got["by_int"][7]) == 2.5
    assert_bit_exact(got["opt"]["mu"], hosts["m"])
    assert got["opt"]["count"] == 7
    np.testing.assert_array_equal(got["opt"]["nu"][1], np.arange(3))
    assert int(got["pair"][0]) == 5 and got["pair"][1] == [1.5, "x"]
    assert got["tuple"] == [None]


def test_partial_restore_of_subtrees(root: Any) -> None:
    state, hosts = nested_state()
    fastckpt.save(root, 4, state)
    dst = named((2,), ("x",), P(None, "x"))
    sub = {
        "opt": Opt(
            mu=jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=dst),
            nu=(jnp.zeros(3), np.zeros(3, int)),
            count=0,
        )
    }
    got = fastckpt.restore(root, target=sub, partial=True)
    assert set(got) == {"opt"}
    assert_sharded_like(got["opt"].mu, dst, hosts["m"])
    with pytest.raises(fastckpt.errors.TreeStructureError, match="partial=True"):
        fastckpt.restore(root, target=sub)
    # A single deep leaf.
    got = fastckpt.restore(
        root, target={"params": {"layers": [Layer(kernel=None, bias=None)]}}, partial=True
    )
    # A None target leaf restores the stored array with its saved sharding.
    kernel = got["params"]["layers"][0].kernel
    assert_bit_exact(kernel, hosts["w"])
