"""Pytree helpers for states that are not plain dicts of arrays.

fastckpt stores array leaves (``jax.Array`` incl. typed PRNG keys, numpy) and simple values
(``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``). Equinox-style modules also hold
leaves that cannot be stored (activation functions, other callables, arbitrary objects).
Split those off before saving and put them back after restoring, as ``eqx.partition`` /
``eqx.combine`` do::

    saved, static = partition_savable(model)
    mgr.save(step, saved)
    abstract_saved, _ = partition_savable(abstract_model)
    model = combine(mgr.restore(target=abstract_saved), static)

No dependency beyond jax and numpy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from fastckpt.errors import ConfigError

__all__ = ["abstract_state", "combine", "is_savable_leaf", "partition_savable"]

_VALUE_TYPES = (bool, int, float, complex, str)


def _is_none(x: Any) -> bool:
    return x is None


def is_savable_leaf(x: Any) -> bool:
    """Whether fastckpt can store ``x`` as a leaf (arrays, abstract arrays, simple values)."""
    return x is None or isinstance(
        x, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic, *_VALUE_TYPES)
    )


def partition_savable(
    tree: Any, is_savable: Callable[[Any], bool] = is_savable_leaf
) -> tuple[Any, Any]:
    """Split ``tree`` into ``(savable, static)`` trees of the same structure.

    ``savable`` holds the leaves ``is_savable`` accepts and ``None`` elsewhere; ``static``
    holds the others and ``None`` in the savable positions. Save ``savable``; keep
    ``static`` in memory (or rebuild it from code) and :func:`combine` after restoring.
    """
    savable = jax.tree_util.tree_map(lambda x: x if is_savable(x) else None, tree, is_leaf=_is_none)
    static = jax.tree_util.tree_map(lambda x: None if is_savable(x) else x, tree, is_leaf=_is_none)
    return savable, static


def combine(savable: Any, static: Any) -> Any:
    """Inverse of :func:`partition_savable`: take each leaf from whichever tree has it."""
    return jax.tree_util.tree_map(
        lambda a, b: b if a is None else a, savable, static, is_leaf=_is_none
    )


def abstract_state(
    tree: Any,
    sharding: jax.sharding.Sharding | Callable[[Any], Any] | None = None,
    *,
    mesh: jax.sharding.Mesh | None = None,
) -> Any:
    """A restore target for ``tree``: each ``jax.Array`` becomes a ``jax.ShapeDtypeStruct``.

    Typed PRNG key arrays keep their key dtype. numpy arrays and simple values are kept
    as they are (they restore as themselves).

    Args:
        tree: A concrete state, or one whose array leaves are already ShapeDtypeStructs
            (e.g. from ``jax.eval_shape``).
        sharding: None keeps each array's own sharding; a ``Sharding`` applies to every
            array leaf; a callable maps a leaf to its sharding.
        mesh: Rebind ``NamedSharding`` s over an ``AbstractMesh`` (what ``jax.eval_shape``
            under ``jax.set_mesh`` produces) to this concrete mesh of the same axes.

    Raises:
        ConfigError: ``mesh`` does not match an abstract mesh's axis names and sizes.
    """

    def leaf(x: Any) -> Any:
        if not isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
            return x
        s: Any
        if sharding is None:
            s = getattr(x, "sharding", None)
        elif isinstance(sharding, jax.sharding.Sharding):
            s = sharding
        else:
            s = sharding(x)
        abstract_mesh = getattr(jax.sharding, "AbstractMesh", ())
        if mesh is not None and isinstance(getattr(s, "mesh", None), abstract_mesh):
            abstract = s.mesh
            names, sizes = tuple(abstract.axis_names), tuple(abstract.axis_sizes)
            if (names, sizes) != (tuple(mesh.axis_names), tuple(mesh.axis_sizes)):
                raise ConfigError(
                    f"mesh {dict(mesh.shape)} does not match the abstract mesh "
                    f"{dict(abstract.shape)}"
                )
            s = jax.sharding.NamedSharding(mesh, s.spec)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

    return jax.tree_util.tree_map(leaf, tree)
