"""A small decoder-only transformer language model in plain JAX.

The model exists to give the elastic loop a real training state: embeddings, a stack of
pre-norm attention + MLP blocks (scanned, so compile time does not grow with depth), an
untied unembedding, AdamW moments and a typed PRNG key driving dropout. Parameters are
initialised with numpy (no XLA compile on a fresh start: on a few shared CPU cores, compile
time is most of a restart).

Parameters are laid out for a ``("data", "model")`` mesh, Megatron style: attention heads,
the MLP hidden dimension and the vocabulary are split over ``"model"``; everything is
replicated over ``"data"``. :func:`param_specs` returns the ``PartitionSpec`` of every
parameter; XLA propagates the rest.

Presets (:data:`PRESETS`): ``"tiny"`` for CI (a few hundred KiB of state), ``"small"`` for
the demo, ``"bench"`` for the restore benchmark (~0.5 GiB of params + AdamW moments).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from fastckpt.errors import ConfigError

__all__ = [
    "PRESETS",
    "ModelConfig",
    "Params",
    "forward",
    "init_params",
    "loss_fn",
    "param_count",
    "param_shapes",
    "param_specs",
]

Params = dict[str, Any]
"""A nested dict of parameter arrays (see :func:`param_shapes` for the layout)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of the transformer. All sizes are global (unsharded)."""

    vocab_size: int = 256
    """Number of token ids; must be divisible by the model-axis size."""
    seq_len: int = 32
    """Tokens per training sequence (the model sees ``seq_len`` inputs, predicts the next)."""
    d_model: int = 64
    """Residual stream width."""
    n_layers: int = 2
    """Transformer blocks (stacked and scanned)."""
    n_heads: int = 4
    """Attention heads; must be divisible by the model-axis size."""
    d_ff: int = 256
    """MLP hidden width; must be divisible by the model-axis size."""
    dropout: float = 0.0
    """Residual dropout rate (0 disables it; the PRNG key is still split every step)."""
    dtype: str = "float32"
    """Parameter and activation dtype."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "d_ff"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ConfigError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_heads

    def check_model_axis(self, model_axis: int) -> None:
        """Raise ``ConfigError`` unless every sharded dimension divides by ``model_axis``."""
        for name in ("vocab_size", "n_heads", "d_ff"):
            if getattr(self, name) % model_axis:
                raise ConfigError(
                    f"{name}={getattr(self, name)} is not divisible by the model axis "
                    f"({model_axis})"
                )


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(),
    "small": ModelConfig(vocab_size=512, seq_len=64, d_model=128, n_layers=2, n_heads=4, d_ff=512),
    # ~0.5 GiB of params + AdamW moments (540 MiB), but short sequences (and a small global
    # batch, see PRESET_GLOBAL_BATCH): recovery is about moving state, and a step of long
    # sequences of a model this size is slow on CPUs. Every sharded dimension
    # divides by 12, so the state is also split over a data axis of 2, 3, 4 or 6 (FSDP).
    "bench": ModelConfig(
        vocab_size=12288, seq_len=16, d_model=768, n_layers=4, n_heads=12, d_ff=3072, dropout=0.1
    ),
}
"""Named model sizes: ``tiny`` (CI), ``small`` (demo), ``bench`` (~0.5 GiB train state)."""

PRESET_GLOBAL_BATCH: dict[str, int] = {"bench": 12}
"""Global batch of a preset when none is given (default 24); divisible by 3 and 4 hosts."""


def param_specs(cfg: ModelConfig, *, data_axis: int = 1) -> Params:
    """``PartitionSpec`` of every parameter, same tree as :func:`init_params` returns.

    Megatron style over ``"model"`` (heads, MLP hidden, vocabulary). With ``data_axis > 1``
    parameters are also sharded over ``"data"`` (ZeRO-3 / FSDP style): each parameter's
    largest remaining dimension that ``data_axis`` divides (the stacked-layer dimension
    excepted) is split over ``"data"``; a parameter with no such dimension stays replicated
    over ``"data"``. The optimizer moments follow, so each host holds and updates only its
    share of the train state; XLA gathers parameters and reduce-scatters gradients.
    """
    megatron: Params = {
        "embed": P("model", None),
        "pos": P(None, None),
        "layers": {
            "ln1": P(None, None),
            "wqkv": P(None, None, None, "model", None),
            "wo": P(None, "model", None, None),
            "ln2": P(None, None),
            "w1": P(None, None, "model"),
            "w2": P(None, "model", None),
        },
        "ln_f": P(None),
        "unembed": P(None, "model"),
    }
    if data_axis <= 1:
        return megatron

    def add_data(spec: P, shape: jax.ShapeDtypeStruct, first: int) -> P:
        free = [
            i
            for i in range(first, len(spec))
            if spec[i] is None and shape.shape[i] % data_axis == 0
        ]
        if not free:
            return spec
        best = max(free, key=lambda i: (shape.shape[i], -i))
        return P(*("data" if i == best else a for i, a in enumerate(spec)))

    shapes = param_shapes(cfg)
    return {  # dimension 0 of the stacked "layers" is what the scan walks: never split
        name: jax.tree.map(
            functools.partial(add_data, first=int(name == "layers")),
            spec_tree,
            shapes[name],
            is_leaf=lambda x: isinstance(x, P),
        )
        for name, spec_tree in megatron.items()
    }


def _init_rules(cfg: ModelConfig) -> Params:
    """``(shape, std)`` of every parameter; ``std == 0`` means "ones" (norm scales)."""
    v, t, d, n, h, dh, f = (
        cfg.vocab_size,
        cfg.seq_len,
        cfg.d_model,
        cfg.n_layers,
        cfg.n_heads,
        cfg.head_dim,
        cfg.d_ff,
    )
    out_std = 0.02 / math.sqrt(2 * n)
    return {
        "embed": ((v, d), 0.02),
        "pos": ((t, d), 0.01),
        "layers": {
            "ln1": ((n, d), 0.0),
            "wqkv": ((n, d, 3, h, dh), 1.0 / math.sqrt(d)),
            "wo": ((n, h, dh, d), out_std),
            "ln2": ((n, d), 0.0),
            "w1": ((n, d, f), 1.0 / math.sqrt(d)),
            "w2": ((n, f, d), out_std),
        },
        "ln_f": ((d,), 0.0),
        "unembed": ((d, v), 1.0 / math.sqrt(d)),
    }


def _is_rule(x: object) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple)


def param_shapes(cfg: ModelConfig) -> Params:
    """``jax.ShapeDtypeStruct`` of every parameter (no sharding), same tree as :func:`init_params`.

    Layout: ``embed [V, D]``, ``pos [T, D]``, ``layers/{ln1, ln2} [L, D]``,
    ``layers/wqkv [L, D, 3, H, Dh]``, ``layers/wo [L, H, Dh, D]``, ``layers/w1 [L, D, F]``,
    ``layers/w2 [L, F, D]``, ``ln_f [D]``, ``unembed [D, V]``.
    """
    dt = jnp.dtype(cfg.dtype)
    shapes: Params = jax.tree.map(
        lambda r: jax.ShapeDtypeStruct(r[0], dt), _init_rules(cfg), is_leaf=_is_rule
    )
    return shapes


def init_params(cfg: ModelConfig, seed: int) -> Params:
    """Fresh parameters as host numpy arrays: scaled normal weights, unit norm scales.

    A pure function of ``(cfg, seed)``, computed with numpy so that a fresh start costs no
    XLA compilation; :meth:`~fastckpt_examples.trainer.TrainProgram.init_state` places the
    arrays onto the mesh.
    """
    dt = np.dtype(cfg.dtype)
    rules, treedef = jax.tree.flatten(_init_rules(cfg), is_leaf=_is_rule)
    leaves = []
    for i, (shape, std) in enumerate(rules):
        if std == 0.0:
            leaves.append(np.ones(shape, dt))
        else:
            rng = np.random.default_rng([seed, i])
            leaves.append(
                (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(dt)
            )
    params: Params = jax.tree.unflatten(treedef, leaves)
    return params


def param_count(cfg: ModelConfig) -> int:
    """Number of scalar parameters."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(param_shapes(cfg)))


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    var = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
    return (x * jax.lax.rsqrt(var + 1e-6)).astype(x.dtype) * scale


def _dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def forward(
    cfg: ModelConfig, params: Params, tokens: jax.Array, key: jax.Array | None
) -> jax.Array:
    """Logits ``[B, T, V]`` for int tokens ``[B, T]``. ``key=None`` disables dropout."""
    t = tokens.shape[1]
    x = params["embed"][tokens] + params["pos"][:t]
    causal = jnp.tril(jnp.ones((t, t), bool))
    layer_keys = None if key is None else jax.random.split(key, cfg.n_layers)

    def block(x: jax.Array, layer: tuple[Params, jax.Array | None]) -> tuple[jax.Array, None]:
        p, k = layer
        k_attn, k_mlp = (None, None) if k is None else tuple(jax.random.split(k))
        h = _rms_norm(x, p["ln1"])
        q, kk, v = jnp.einsum("btd,dshk->sbthk", h, p["wqkv"])
        scores = jnp.einsum("bqhk,bthk->bhqt", q, kk) / math.sqrt(cfg.head_dim)
        scores = jnp.where(causal, scores.astype(jnp.float32), -1e30)
        attn = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        o = jnp.einsum("bhqt,bthk->bqhk", attn, v)
        x = x + _dropout(jnp.einsum("bqhk,hkd->bqd", o, p["wo"]), cfg.dropout, k_attn)
        h = _rms_norm(x, p["ln2"])
        m = jnp.einsum("bqf,fd->bqd", jax.nn.gelu(jnp.einsum("bqd,df->bqf", h, p["w1"])), p["w2"])
        return x + _dropout(m, cfg.dropout, k_mlp), None

    x, _ = jax.lax.scan(block, x, (params["layers"], layer_keys))
    return jnp.einsum("btd,dv->btv", _rms_norm(x, params["ln_f"]), params["unembed"])


def loss_fn(cfg: ModelConfig, params: Params, batch: jax.Array, key: jax.Array | None) -> jax.Array:
    """Mean next-token cross entropy of an int batch ``[B, seq_len + 1]`` (float32 scalar)."""
    logits = forward(cfg, params, batch[:, :-1], key).astype(jnp.float32)
    targets = batch[:, 1:]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
