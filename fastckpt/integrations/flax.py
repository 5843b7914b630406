"""Flax helpers: NNX graph states and linen ``TrainState`` s as fastckpt save/restore targets.

fastckpt saves Flax states as they are: an NNX ``State`` (from ``nnx.state`` / ``nnx.split``)
and a linen ``TrainState`` are pytrees whose leaves are arrays, typed PRNG keys and simple
values. These helpers only build the abstract restore targets (with shardings) and wrap
the ``nnx.merge`` step. ``flax`` is imported lazily, inside each function.

NNX example::

    graphdef, abstract = nnx_abstract_state(lambda: Model(rngs=nnx.Rngs(0)), mesh=mesh)
    mgr.save(step, nnx.state(model))
    model = restore_nnx(mgr, graphdef, abstract)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from fastckpt.integrations.pytree import abstract_state

__all__ = ["abstract_train_state", "nnx_abstract_state", "restore_nnx", "save_nnx"]


def nnx_abstract_state(
    factory: Callable[[], Any], *, mesh: jax.sharding.Mesh | None = None
) -> tuple[Any, Any]:
    """``(graphdef, abstract_state)`` of the NNX module ``factory()`` builds, without allocating it.

    Args:
        factory: Builds the module (e.g. ``lambda: Model(rngs=nnx.Rngs(0))``); run under
            ``nnx.eval_shape``.
        mesh: If given, the module is traced under ``jax.set_mesh(mesh)`` (so sharding
            annotations resolve) and every leaf gets the ``NamedSharding`` its
            partitioning metadata names (replicated when it has none). Without a mesh the
            leaves carry no sharding and fastckpt restores with the saved sharding (same
            device count) or onto one device.
    """
    from flax import nnx

    if mesh is None:
        return nnx.split(nnx.eval_shape(factory))
    with jax.set_mesh(mesh):
        graphdef, state = nnx.split(nnx.eval_shape(factory))
    shardings = nnx.get_named_sharding(state, mesh)
    state = jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
    )
    return graphdef, state


def save_nnx(manager: Any, step: int, model: Any, **kwargs: Any) -> bool:
    """``manager.save(step, nnx.state(model), **kwargs)`` (a fastckpt or Orbax-style manager)."""
    from flax import nnx

    return bool(manager.save(step, nnx.state(model), **kwargs))


def restore_nnx(manager: Any, graphdef: Any, abstract: Any, *, step: int | None = None) -> Any:
    """Restore ``step`` (default: latest) into ``abstract`` and ``nnx.merge`` it with
    ``graphdef``."""
    from flax import nnx

    return nnx.merge(graphdef, manager.restore(step, target=abstract))


def abstract_train_state(create: Callable[[], Any], sharding: Any = None) -> Any:
    """Abstract linen ``TrainState`` (or any state) from its constructor, via ``jax.eval_shape``.

    ``apply_fn`` and ``tx`` stay as static fields, so the result is a valid restore target.
    ``sharding``: a ``Sharding`` for every array leaf, or a callable leaf -> sharding.
    """
    return abstract_state(jax.eval_shape(create), sharding)
