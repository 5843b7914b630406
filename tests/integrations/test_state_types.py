"""Real training-state types saved and restored bit-exact onto other shardings."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import fastckpt
from fastckpt.errors import ConfigError
from fastckpt.integrations.flax import (
    abstract_train_state,
    nnx_abstract_state,
    restore_nnx,
    save_nnx,
)
from fastckpt.integrations.pytree import abstract_state, combine, partition_savable
from fastckpt.storage import MemoryStore

from ._helpers import assert_bit_exact, assert_shardings


def _mesh(devices: list[jax.Device], shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    return Mesh(np.asarray(devices[: int(np.prod(shape))]).reshape(shape), names)


def _roundtrip(state: Any, target: Any) -> Any:
    with fastckpt.CheckpointManager(MemoryStore()) as mgr:
        mgr.save(1, state)
        mgr.wait()
        return mgr.restore(1, target=target)


def _spread(mesh: Mesh, axis: str) -> Any:
    """Sharding callable: dim 0 over ``axis`` when it divides, else replicated."""

    def pick(x: Any) -> NamedSharding:
        if x.ndim and x.shape[0] % mesh.shape[axis] == 0:
            return NamedSharding(mesh, P(axis))
        return NamedSharding(mesh, P())

    return pick


# ---------------------------------------------------------------- Flax NNX


def test_nnx_state_split_merge_onto_other_mesh(devices8: list[jax.Device]) -> None:
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
            self.dense = nnx.Linear(8, 16, kernel_init=init, rngs=rngs)
            self.norm = nnx.BatchNorm(16, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            self.calls = nnx.Variable(jnp.int32(7))

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.drop(self.norm(self.dense(x)))

    def factory() -> Model:
        return Model(nnx.Rngs(params=0, dropout=1))

    save_mesh = _mesh(devices8, (2, 4), ("data", "model"))
    with jax.set_mesh(save_mesh):
        model = nnx.jit(factory)()
        optimizer = nnx.jit(lambda m: nnx.Optimizer(m, optax.adamw(1e-2), wrt=nnx.Param))(model)
        x = jnp.ones((4, 8))

        @nnx.jit
        def train_step(model: Model, optimizer: nnx.Optimizer) -> None:
            optimizer.update(model, nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model))

        train_step(
            model, optimizer
        )  # non-trivial params, Adam moments, BatchNorm stats, RNG counts
    with fastckpt.CheckpointManager(MemoryStore()) as mgr:
        save_nnx(mgr, 1, model)
        mgr.save(2, nnx.state(optimizer))
        mgr.wait()
        # restore onto a different mesh: 'model' is now 2-way instead of 4-way
        new_mesh = _mesh(devices8, (4, 2), ("data", "model"))
        graphdef, abstract = nnx_abstract_state(factory, mesh=new_mesh)
        restored = restore_nnx(mgr, graphdef, abstract, step=1)
        assert_bit_exact(nnx.state(model), nnx.state(restored))
        assert_shardings(abstract, nnx.state(restored))
        assert restored.dense.kernel[...].sharding.spec == P(None, "model")
        assert restored.dense.kernel[...].sharding.mesh.shape["model"] == 2
        assert isinstance(restored.drop.rngs, nnx.Rngs) or restored.drop.rngs is not None
        # nnx.split graph state (no mesh given: the saved sharding is rebuilt)
        graphdef2, state2 = nnx.split(model)
        _, abstract2 = nnx_abstract_state(lambda: nnx.merge(graphdef2, state2))
        merged = nnx.merge(graphdef2, mgr.restore(1, target=abstract2))
        assert_bit_exact(state2, nnx.split(merged)[1])
        # optimizer state (Adam moments are Variables too)
        with jax.set_mesh(save_mesh):
            abstract_opt = nnx.state(
                nnx.eval_shape(lambda: nnx.Optimizer(factory(), optax.adamw(1e-2), wrt=nnx.Param))
            )
        with pytest.raises(ConfigError, match="AbstractMesh"):
            mgr.restore(
                2, target=abstract_opt
            )  # eval_shape under set_mesh: shardings over an AbstractMesh
        abstract_opt = abstract_state(abstract_opt, mesh=save_mesh)
        assert_bit_exact(nnx.state(optimizer), mgr.restore(2, target=abstract_opt))
        assert_shardings(abstract_opt, mgr.restore(2, target=abstract_opt))


# ---------------------------------------------------------------- Flax linen TrainState


def test_linen_train_state(devices8: list[jax.Device]) -> None:
    import flax.linen as nn
    from flax.training import train_state

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return nn.Dense(4)(nn.relu(nn.Dense(16)(x)))

    model = MLP()

    @jax.jit
    def create() -> train_state.TrainState:
        params = model.init(jax.random.key(0), jnp.ones((1, 8)))["params"]
        return train_state.TrainState.create(
            apply_fn=model.apply, params=params, tx=optax.adamw(1e-3)
        )

    mesh = _mesh(devices8, (8,), ("x",))
    pick = _spread(mesh, "x")
    state = jax.tree_util.tree_map(
        lambda x: jax.device_put(x, pick(x)) if isinstance(x, jax.Array) else x, create()
    )
    grads = jax.tree_util.tree_map(jnp.ones_like, state.params)
    state = jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, grads)
    target = abstract_train_state(create, _spread(_mesh(devices8, (2,), ("y",)), "y"))
    restored = _roundtrip(state, target)
    assert isinstance(restored, train_state.TrainState)
    # a Python step (eval_shape turns it into a 0-d ShapeDtypeStruct) restores as saved
    host_step = state.replace(step=3)
    assert _roundtrip(host_step, target).step == 3
    assert restored.apply_fn == model.apply and restored.tx is not None
    assert_bit_exact(state, restored)
    assert_shardings(target, restored)
    out = restored.apply_fn({"params": restored.params}, jnp.ones((2, 8)))
    np.testing.assert_allclose(
        out, state.apply_fn({"params": state.params}, jnp.ones((2, 8))), rtol=1e-5
    )


# ---------------------------------------------------------------- Optax


_PARAMS_LABELS = {"w": "adam", "b": "sgd", "emb": "adam"}


@pytest.mark.parametrize(
    "tx",
    [
        optax.adamw(1e-3),
        optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam(), optax.scale(-1e-3)),
        optax.masked(optax.adam(1e-3), {"w": True, "b": False, "emb": True}),
        optax.multi_transform(
            {"adam": optax.adam(1e-3), "sgd": optax.sgd(1e-2, momentum=0.9)}, _PARAMS_LABELS
        ),
        optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3),
    ],
    ids=["adamw", "chain", "masked", "multi_transform", "inject_hyperparams"],
)
def test_optax_states(tx: optax.GradientTransformation, devices8: list[jax.Device]) -> None:
    mesh = _mesh(devices8, (4, 2), ("a", "b"))
    params = {
        "w": jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("a", "b"))),
        "b": jax.device_put(jnp.ones(8), NamedSharding(mesh, P())),
        "emb": jax.device_put(
            jnp.arange(32, dtype=jnp.bfloat16).reshape(16, 2), NamedSharding(mesh, P("a"))
        ),
    }
    opt_state = jax.jit(tx.init)(params)
    _, opt_state = jax.jit(tx.update)(
        jax.tree_util.tree_map(jnp.ones_like, params), opt_state, params
    )
    target = abstract_state(opt_state, _spread(_mesh(devices8, (8,), ("x",)), "x"))
    restored = _roundtrip(opt_state, target)
    assert_bit_exact(opt_state, restored)  # same NamedTuple/dict/MaskedNode structure, same bytes
    assert_shardings(target, restored)


# ---------------------------------------------------------------- Equinox-style modules


class Linear:
    """An Equinox-style module: every field is a leaf, arrays or not."""

    def __init__(self, weight: Any, bias: Any, activation: Any, name: str, features: int) -> None:
        self.weight, self.bias, self.activation, self.name, self.features = (
            weight,
            bias,
            activation,
            name,
            features,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.activation(x @ self.weight + self.bias)


_FIELDS = ("weight", "bias", "activation", "name", "features")
jax.tree_util.register_pytree_with_keys(
    Linear,
    lambda m: (tuple((jax.tree_util.GetAttrKey(f), getattr(m, f)) for f in _FIELDS), None),
    lambda _, children: Linear(*children),
)


def test_equinox_style_module(devices8: list[jax.Device]) -> None:
    mesh = _mesh(devices8, (2, 4), ("d", "m"))
    rng = np.random.default_rng(0)
    model = [
        Linear(
            jax.device_put(
                rng.standard_normal((8, 16), np.float32), NamedSharding(mesh, P(None, "m"))
            ),
            jnp.zeros(16),
            jax.nn.relu,
            "hidden",
            16,
        ),
        Linear(
            jax.device_put(rng.standard_normal((16, 4), np.float32), NamedSharding(mesh, P("m"))),
            jnp.ones(4),
            jnp.tanh,
            "out",
            4,
        ),
    ]
    with pytest.raises(ConfigError, match=r"\[0\]\.activation"):
        _roundtrip(model, None)  # callables cannot be stored: split them off
    saved, static = partition_savable(model)
    abstract_saved, _ = partition_savable(
        abstract_state(model, NamedSharding(_mesh(devices8, (4,), ("x",)), P()))
    )
    restored = combine(_roundtrip(saved, abstract_saved), static)
    assert (
        restored[0].activation is jax.nn.relu
        and restored[1].name == "out"
        and restored[1].features == 4
    )
    assert_bit_exact(saved, partition_savable(restored)[0])
    x = jnp.ones((2, 8))
    np.testing.assert_allclose(restored[1](restored[0](x)), model[1](model[0](x)), rtol=1e-5)


# ---------------------------------------------------------------- typed PRNG keys


def test_typed_prng_keys(devices8: list[jax.Device]) -> None:
    mesh8 = _mesh(devices8, (8,), ("x",))
    mesh22 = _mesh(devices8, (2, 2), ("a", "b"))
    state = {
        "key": jax.random.key(0),
        "rbg": jax.random.key(1, impl="rbg"),
        "split": jax.device_put(
            jax.random.split(jax.random.key(2), 8), NamedSharding(mesh8, P("x"))
        ),
        "grid": jax.device_put(
            jax.random.split(jax.random.key(3), 8).reshape(4, 2), NamedSharding(mesh22, P("a", "b"))
        ),
        "legacy": jax.random.PRNGKey(4),  # raw uint32 key data
    }
    other = _mesh(devices8, (4,), ("y",))
    target = {
        "key": jax.ShapeDtypeStruct((), state["key"].dtype, sharding=NamedSharding(other, P())),
        "rbg": jax.ShapeDtypeStruct(
            (), state["rbg"].dtype, sharding=jax.sharding.SingleDeviceSharding(devices8[5])
        ),
        "split": jax.ShapeDtypeStruct(
            (8,), state["split"].dtype, sharding=NamedSharding(other, P("y"))
        ),
        "grid": jax.ShapeDtypeStruct(
            (4, 2), state["grid"].dtype, sharding=NamedSharding(other, P(None, None))
        ),
        "legacy": jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=NamedSharding(other, P())),
    }
    restored = _roundtrip(state, target)
    assert_bit_exact(state, restored)
    assert_shardings(target, restored)


# ---------------------------------------------------------------- custom pytree nodes


class Pair:
    """A node registered without keys (jax uses flattened indices)."""

    def __init__(self, left: Any, right: Any) -> None:
        self.left, self.right = left, right


jax.tree_util.register_pytree_node(Pair, lambda p: ((p.left, p.right), None), lambda _, c: Pair(*c))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Block:
    weight: jax.Array
    scale: float
    tag: str = dataclasses.field(metadata={"static": True}, default="blk")


class Stats(NamedTuple):
    count: jax.Array
    mean: jax.Array


def test_custom_pytree_nodes(devices8: list[jax.Device]) -> None:
    mesh = _mesh(devices8, (8,), ("x",))
    state = {
        "pair": Pair(
            jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("x"))), Pair(jnp.int8(3), None)
        ),
        "block": Block(jnp.full((4, 4), 2.0, jnp.float16), 0.5, "b0"),
        "stats": Stats(
            jnp.int64(10) if jax.config.jax_enable_x64 else jnp.int32(10),
            jnp.zeros((3,), jnp.float32),
        ),
        "ints": {7: (np.arange(3, dtype=np.uint16), [1.5, "s", None, 2j]), 3: jnp.zeros((8, 2))},
    }
    target = abstract_state(state, _spread(_mesh(devices8, (2,), ("y",)), "y"))
    restored = _roundtrip(state, target)
    assert isinstance(restored["pair"], Pair) and isinstance(restored["pair"].right, Pair)
    assert isinstance(restored["block"], Block) and restored["block"].tag == "b0"
    assert isinstance(restored["stats"], Stats)
    assert_bit_exact(state, restored)
    assert_shardings(target, restored)
