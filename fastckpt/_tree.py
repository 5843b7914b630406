"""Pytree <-> key paths, and classification of leaves into what the manifest stores.

Supported leaves: ``jax.Array`` (any sharding, any dtype incl. typed PRNG keys), numpy
arrays and numpy scalars, Python ``None``/``bool``/``int``/``float``/``complex``/``str``.
Anything else is a :class:`~fastckpt.errors.ConfigError` naming the path.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from fastckpt.errors import ConfigError, TreeStructureError
from fastckpt.format.manifest import KeyEntry, KeyPath, keypath_str

__all__ = ["FlatLeaf", "flatten", "is_prng_key", "keypath_of", "unflatten_from_paths"]


@dataclasses.dataclass(frozen=True, slots=True)
class FlatLeaf:
    """One leaf with its manifest key path."""

    path: KeyPath
    value: Any


def keypath_of(jax_path: tuple[Any, ...]) -> KeyPath:
    """Convert a ``jax.tree_util`` key path into a manifest :data:`KeyPath`."""
    out: list[KeyEntry] = []
    for k in jax_path:
        if isinstance(k, jax.tree_util.DictKey):
            key = k.key
            if isinstance(key, (bool, np.integer)):
                key = int(key)
            if not isinstance(key, (str, int)):
                raise ConfigError(f"dict key {key!r} must be str or int to be checkpointed")
            out.append(("d", key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            out.append(("i", int(k.idx)))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            out.append(("a", str(k.name)))
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            out.append(("f", int(k.key)))
        else:
            raise ConfigError(f"unsupported pytree key {k!r}")
    return tuple(out)


def flatten(tree: Any) -> tuple[list[FlatLeaf], Any]:
    """Flatten ``tree`` (``None`` kept as a leaf) into leaves with paths, plus its treedef."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)
    leaves = [FlatLeaf(keypath_of(p), v) for p, v in pairs]
    seen: set[KeyPath] = set()
    for leaf in leaves:
        if leaf.path in seen:
            raise ConfigError(f"two leaves share the path {keypath_str(leaf.path)}")
        seen.add(leaf.path)
    return leaves, treedef


def is_prng_key(x: Any) -> bool:
    """Whether ``x`` is a typed PRNG key array (``jax.random.key``)."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.numpy.issubdtype(dtype, jax.dtypes.prng_key)


def unflatten_from_paths(items: dict[KeyPath, Any]) -> Any:
    """Rebuild nested dicts/lists from key paths (used when restoring without a target).

    Dict keys and attributes become dict keys; sequence and flattened indices become list
    positions. The root of a single empty path is the value itself.
    """
    if () in items:
        if len(items) != 1:
            raise TreeStructureError("a root leaf cannot coexist with other leaves")
        return items[()]
    root: dict[Any, Any] = {}
    for path, value in items.items():
        node = root
        for i, (kind, key) in enumerate(path):
            tag = (kind in ("i", "f"), key)
            if i == len(path) - 1:
                node[tag] = value
            else:
                node = node.setdefault(tag, {})

    def build(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        if node and all(is_index for is_index, _ in node):
            keys = sorted(k for _, k in node)
            return [build(node[(True, k)]) for k in keys]
        return {k: build(v) for (_, k), v in node.items()}

    return build(root)
