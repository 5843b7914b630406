"""Shared assertions for the integration tests."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from fastckpt._tree import is_prng_key


def raw(x: Any) -> Any:
    """Bytes-comparable view of a leaf (key data for typed PRNG keys)."""
    if is_prng_key(x):
        return ("key", str(jax.random.key_impl(x)), np.asarray(jax.random.key_data(x)))
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return np.asarray(x)
    return x


def assert_bit_exact(expected: Any, actual: Any) -> None:
    """Same structure, same leaf types, bit-identical arrays (dtype, shape, bytes)."""
    e_leaves, e_def = jax.tree_util.tree_flatten_with_path(expected)
    a_leaves, a_def = jax.tree_util.tree_flatten_with_path(actual)
    assert e_def == a_def, f"tree structure differs:\n{e_def}\n{a_def}"
    for (path, e), (_, a) in zip(e_leaves, a_leaves):
        where = jax.tree_util.keystr(path)
        re, ra = raw(e), raw(a)
        if isinstance(re, tuple):
            assert isinstance(ra, tuple) and re[:2] == ra[:2], where
            re, ra = re[2], ra[2]
        if isinstance(re, np.ndarray):
            assert isinstance(ra, np.ndarray), f"{where}: {type(a).__name__}"
            assert re.dtype == ra.dtype and re.shape == ra.shape, (
                f"{where}: {re.dtype}{re.shape} vs {ra.dtype}{ra.shape}"
            )
            assert re.tobytes() == ra.tobytes(), f"{where}: bytes differ"
        else:
            assert type(re) is type(ra) and (re == ra or (re != re and ra != ra)), (
                f"{where}: {re!r} vs {ra!r}"
            )


def assert_shardings(target: Any, actual: Any) -> None:
    """Every array leaf of ``actual`` has the sharding its ``target`` leaf asked for."""
    for (path, t), a in zip(
        jax.tree_util.tree_flatten_with_path(target)[0], jax.tree_util.tree_leaves(actual)
    ):
        s = getattr(t, "sharding", None)
        if s is not None and isinstance(a, jax.Array):
            assert a.sharding.is_equivalent_to(s, a.ndim), (
                f"{jax.tree_util.keystr(path)}: {a.sharding} != {s}"
            )
