"""The example training program: mesh, shardings, train state, a jitted AdamW step.

The train state is a dict pytree (every leaf a ``jax.Array``, so a restore target is just
:attr:`TrainProgram.abstract_state`):

* ``params``: the model parameters (:mod:`fastckpt_examples.model`),
* ``opt_state``: optax state of ``clip_by_global_norm + adamw``, moments sharded like params,
* ``key``: a typed ``jax.random.key``, split once per step for dropout,
* ``step``: int32 scalar, steps taken,
* ``data_pos``: int32 scalar, samples consumed (``step * global_batch``).

The mesh is ``("data", "model")``: ``model`` has a fixed small size (devices of one host),
``data`` takes whatever devices exist. The global batch never changes, so a resized mesh
trains on exactly the same samples; only the per-device share changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fastckpt.errors import ConfigError
from fastckpt_examples.data import DataConfig, SyntheticData
from fastckpt_examples.model import ModelConfig, init_params, loss_fn, param_shapes, param_specs

__all__ = ["TrainConfig", "TrainProgram", "TrainState", "make_mesh"]

TrainState = dict[str, Any]
"""``{"params", "opt_state", "key", "step", "data_pos"}``; see the module docstring."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that defines a training run (and so must match across restarts)."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """Model shape."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """Synthetic data stream and global batch."""
    learning_rate: float = 3e-3
    """Peak AdamW learning rate."""
    warmup_steps: int = 10
    """Linear warm-up from 0 to ``learning_rate``."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""
    clip_norm: float = 1.0
    """Global gradient-norm clip."""
    init_seed: int = 0
    """Seed of the parameter init and of the dropout key stream."""
    model_axis: int = 2
    """Size of the ``"model"`` mesh axis (use the devices per host)."""
    fsdp: bool = True
    """Also shard parameters and optimizer moments over ``"data"`` where a dimension divides
    (see :func:`~fastckpt_examples.model.param_specs`): each host then stores, updates and
    checkpoints only its share of the state. ``False``: replicated over ``"data"``."""

    def __post_init__(self) -> None:
        if self.model_axis <= 0:
            raise ConfigError(f"model_axis must be > 0, got {self.model_axis}")
        self.model.check_model_axis(self.model_axis)


def make_mesh(devices: Sequence[jax.Device] | None = None, *, model_axis: int) -> Mesh:
    """A ``("data", "model")`` mesh over ``devices`` (default: all global devices).

    Devices are ordered by ``(process_index, id)`` so that, with ``model_axis`` equal to the
    devices per host, each mesh row is one host: model-parallel traffic stays inside a
    host, data-parallel all-reduces cross hosts.
    """
    devs = sorted(
        jax.devices() if devices is None else devices, key=lambda d: (d.process_index, d.id)
    )
    if len(devs) % model_axis:
        raise ConfigError(f"{len(devs)} devices do not divide into a model axis of {model_axis}")
    grid = np.array(devs, dtype=object).reshape(len(devs) // model_axis, model_axis)
    return Mesh(grid, ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))


class TrainProgram:
    """The compiled pieces of one training run on one mesh.

    Build one per mesh (per supervisor generation). ``init_state`` and ``abstract_state``
    give bit-identical layouts, so a fresh state and a restored one feed the same
    compiled step.
    """

    def __init__(self, cfg: TrainConfig, mesh: Mesh) -> None:
        data_size = mesh.shape["data"]
        if cfg.data.global_batch % data_size:
            raise ConfigError(
                f"global_batch={cfg.data.global_batch} does not divide over {data_size} data shards"
            )
        if mesh.shape["model"] != cfg.model_axis:
            raise ConfigError(
                f"mesh model axis {mesh.shape['model']} != TrainConfig.model_axis {cfg.model_axis}"
            )
        self.cfg = cfg
        self.mesh = mesh
        self.data = SyntheticData(
            cfg.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.model.seq_len
        )
        warmup = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
        schedule = optax.join_schedules(
            [warmup, optax.constant_schedule(cfg.learning_rate)], [cfg.warmup_steps]
        )
        self.optimizer = optax.chain(
            optax.clip_by_global_norm(cfg.clip_norm),
            optax.adamw(schedule, weight_decay=cfg.weight_decay),
        )
        self.replicated = NamedSharding(mesh, P())
        self.batch_sharding = NamedSharding(mesh, P("data", None))
        self.state_shardings = self._state_shardings()
        shapes = {
            "params": param_shapes(cfg.model),
            "opt_state": jax.eval_shape(self.optimizer.init, param_shapes(cfg.model)),
            "key": jax.eval_shape(lambda: jax.random.key(0)),
            "step": jax.ShapeDtypeStruct((), jnp.int32),
            "data_pos": jax.ShapeDtypeStruct((), jnp.int32),
        }
        self.abstract_state: TrainState = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            shapes,
            self.state_shardings,
        )
        self._opt_init = jax.jit(
            self.optimizer.init, out_shardings=self.state_shardings["opt_state"]
        )
        self._step_jit = jax.jit(
            self._step,
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, self.replicated),
            donate_argnums=0,
        )

    def _state_shardings(self) -> TrainState:
        params_sh = jax.tree.map(
            lambda spec: NamedSharding(self.mesh, spec),
            param_specs(self.cfg.model, data_axis=self.mesh.shape["data"] if self.cfg.fsdp else 1),
            is_leaf=lambda x: isinstance(x, P),
        )
        opt_sh = optax.tree_map_params(
            self.optimizer,
            lambda _, sharding: sharding,
            jax.eval_shape(self.optimizer.init, param_shapes(self.cfg.model)),
            params_sh,
            transform_non_params=lambda _: self.replicated,
            is_leaf=lambda x: isinstance(x, NamedSharding),
        )
        rep = self.replicated
        return {"params": params_sh, "opt_state": opt_sh, "key": rep, "step": rep, "data_pos": rep}

    def _step(self, state: TrainState, batch: jax.Array) -> tuple[TrainState, jax.Array]:
        key, dropout_key = jax.random.split(state["key"])
        loss, grads = jax.value_and_grad(lambda p: loss_fn(self.cfg.model, p, batch, dropout_key))(
            state["params"]
        )
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
        new_state = {
            "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state,
            "key": key,
            "step": state["step"] + 1,
            "data_pos": state["data_pos"] + self.cfg.data.global_batch,
        }
        return new_state, loss

    def init_state(self) -> TrainState:
        """A fresh state at step 0, laid out by :attr:`state_shardings`. Pure function of
        ``cfg``; every process calls it and materialises only its own shards."""
        host = init_params(self.cfg.model, self.cfg.init_seed)
        params = jax.tree.map(_place, host, self.state_shardings["params"])
        run_key = jax.random.fold_in(jax.random.key(self.cfg.init_seed), 1)
        return {
            "params": params,
            "opt_state": self._opt_init(params),
            "key": jax.random.wrap_key_data(
                _place(np.asarray(jax.random.key_data(run_key)), self.replicated)
            ),
            "step": _place(np.zeros((), np.int32), self.replicated),
            "data_pos": _place(np.zeros((), np.int32), self.replicated),
        }

    def compile_step(self, compiler_options: dict[str, Any] | None = None) -> Any:
        """AOT-compile the train step for this mesh; returns the callable
        ``(state, batch) -> (state, loss)``. The input state is donated.

        ``compiler_options`` go to XLA (e.g. ``{"xla_backend_optimization_level": 0}``
        trades a slower step for less CPU compile time)."""
        batch = jax.ShapeDtypeStruct(self.data.shape, jnp.int32, sharding=self.batch_sharding)
        return self._step_jit.lower(self.abstract_state, batch).compile(compiler_options)

    def batch(self, data_pos: int) -> jax.Array:
        """The global batch at ``data_pos``, each process generating its own rows."""
        return self.data.device_batch(data_pos, self.batch_sharding)

    def state_bytes(self) -> int:
        """Global size of the train state in bytes (keys counted as their raw data)."""
        total = 0
        for leaf in jax.tree.leaves(self.abstract_state):
            if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                total += 8 * int(np.prod(leaf.shape, dtype=np.int64))
            else:
                total += leaf.dtype.itemsize * int(np.prod(leaf.shape, dtype=np.int64))
        return total


def _place(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from a host array every process holds in full (takes local slices)."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
