"""Read checkpoints written by orbax-checkpoint with tensorstore directly (no handler stack).

Orbax is not imported. Sharding resolution, shard boxes, PRNG key checks and placement are
the reader's (:mod:`fastckpt.reader.assemble`). Call order inside :func:`read_item`: match the
target's leaves to ``_METADATA`` entries by Orbax parameter name -> open every array's
tensorstore (concurrently) -> check shapes and dtypes (typed errors) -> per leaf, read only
the boxes this process's devices need -> place them. Host memory held at once is bounded by
``max_inflight_bytes`` (plus one leaf's boxes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from fastckpt._tree import is_prng_key, unflatten_from_paths
from fastckpt.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptionError,
    DtypeMismatchError,
    ManifestError,
    ShapeMismatchError,
    TreeStructureError,
)
from fastckpt.format.manifest import Box, box_volume
from fastckpt.integrations._orbax_layout import (
    EMPTY_TYPES,
    OrbaxEntry,
    OrbaxItem,
    import_tensorstore,
    kv_spec,
    read_json,
)
from fastckpt.planning import box_to_slices, full_box
from fastckpt.reader.assemble import key_array_shape, place, resolve_sharding, shard_boxes

__all__ = ["read_item"]

_ARRAY_TYPES = ("jax.Array", "np.ndarray", "scalar")


# ---------------------------------------------------------------- restore planning


def _names_of(jax_path: tuple[Any, ...]) -> tuple[str, ...]:
    """Orbax's key names of a jax key path (``str`` of the dict key / index / attribute)."""
    out = []
    for k in jax_path:
        if isinstance(k, jax.tree_util.DictKey):
            out.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            out.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            out.append(k.name)
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            out.append(str(k.key))
        else:
            raise ConfigError(f"unsupported pytree key {k!r}")
    return tuple(out)


def _device_ids(node: Any) -> list[Any]:
    if isinstance(node, dict):
        return [node.get("id")]
    if isinstance(node, list):
        return [i for child in node for i in _device_ids(child)]
    return []


def _saved_sharding(desc: Any) -> jax.sharding.Sharding | None:
    """Rebuild a saved NamedSharding on this job's devices if the device count matches;
    None when there is none, or it does not describe one (it is informational only)."""
    if not isinstance(desc, dict) or desc.get("sharding_type") != "NamedSharding":
        return None
    try:
        shape = tuple(int(n) for n in desc.get("shape", ()))
        devices = jax.devices()
        if not shape or int(np.prod(shape)) != len(devices):
            return None
        by_id = {d.id: d for d in devices}
        ids = _device_ids((desc.get("device_mesh") or {}).get("mesh", []))
        if len(ids) == len(devices) and all(i in by_id for i in ids):
            devices = [by_id[i] for i in ids]
        spec = [tuple(p) if isinstance(p, list) else p for p in desc.get("partition_spec", [])]
        mesh_devices = np.asarray(devices, dtype=object).reshape(shape)
        mesh = jax.sharding.Mesh(mesh_devices, tuple(desc.get("axis_names", ())))
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


@dataclasses.dataclass
class _Leaf:
    entry: OrbaxEntry
    target: Any
    mode: str  # "jax" | "key" | "numpy" | "npscalar" | "pyscalar" | "string" | "empty"
    store: Any = None
    shape: tuple[int, ...] = ()
    dtype: np.dtype | None = None
    sharding: jax.sharding.Sharding | None = None
    key_impl: str | None = None
    device_boxes: list[tuple[jax.Device, Box]] = dataclasses.field(default_factory=list)


def _mode_of(entry: OrbaxEntry, tgt: Any, item: OrbaxItem) -> str:
    where = entry.param_name
    if entry.value_type in EMPTY_TYPES:
        return "empty"
    if entry.value_type == "string":
        if tgt is not None and not isinstance(tgt, str):
            raise TreeStructureError(
                f"{where}: checkpoint holds a string, target is {type(tgt).__name__}"
            )
        return "string"
    if entry.value_type not in _ARRAY_TYPES:
        raise ConfigError(f"{where}: unsupported Orbax value type {entry.value_type!r}")
    if tgt is None:
        array = "key" if where in item.key_impls else "jax"
        return {"scalar": "pyscalar", "np.ndarray": "numpy"}.get(entry.value_type, array)
    if is_prng_key(tgt):
        return "key"
    if isinstance(tgt, np.generic):
        return "npscalar"
    if isinstance(tgt, np.ndarray):
        return "numpy"
    if isinstance(tgt, (jax.Array, jax.ShapeDtypeStruct)):
        return "jax"
    if isinstance(tgt, (bool, int, float, complex)):
        return "pyscalar"
    raise ConfigError(f"{where}: unsupported target leaf type {type(tgt).__name__}")


def _spec(item: OrbaxItem, name: str) -> dict[str, Any]:
    base = kv_spec(item.url)
    kv = dict(base, path=base["path"] + name + "/")
    if item.use_ocdbt:
        kv = {"driver": "ocdbt", "base": base, "path": name, "cache_pool": "cache_pool#ocdbt"}
    return {
        "driver": "zarr3" if item.use_zarr3 else "zarr",
        "kvstore": kv,
        "recheck_cached_data": False,
        "recheck_cached_metadata": False,
    }


def _plan(leaf: _Leaf, item: OrbaxItem, *, allow_cast: bool) -> None:
    """Check the opened store against the target and plan per-device boxes (jax/key modes)."""
    where = leaf.entry.param_name
    stored_shape = tuple(int(n) for n in leaf.store.shape)
    stored_dtype = np.dtype(leaf.store.dtype.numpy_dtype)
    tgt = leaf.target
    leaf.shape, leaf.dtype = stored_shape, stored_dtype
    key_extra = 0
    if leaf.mode == "key":
        impl = item.key_impls.get(where)
        if impl is None:
            raise DtypeMismatchError(
                f"{where}: target is a PRNG key array but the checkpoint holds plain {stored_dtype}"
            )
        leaf.key_impl = impl
        key_extra = len(stored_shape) - len(key_array_shape(impl, stored_shape, tgt, where))
    elif tgt is not None and leaf.mode in ("jax", "numpy", "npscalar"):
        if tuple(tgt.shape) != stored_shape:
            raise ShapeMismatchError(
                f"{where}: target shape {tuple(tgt.shape)} != stored shape {stored_shape}"
            )
        if np.dtype(tgt.dtype) != stored_dtype:
            if not allow_cast:
                raise DtypeMismatchError(
                    f"{where}: target dtype {tgt.dtype} != stored dtype {stored_dtype} "
                    "(pass allow_dtype_cast=True to convert)"
                )
            leaf.dtype = np.dtype(tgt.dtype)
    elif leaf.mode == "pyscalar" and stored_shape != ():
        raise ShapeMismatchError(f"{where}: target is a scalar, stored shape is {stored_shape}")
    if leaf.mode not in ("jax", "key"):
        leaf.device_boxes = [(None, full_box(stored_shape))]
        return
    sharding = getattr(tgt, "sharding", None)
    sharding = resolve_sharding(
        _saved_sharding(item.shardings.get(where)) if sharding is None else sharding, where
    )
    leaf.sharding, leaf.device_boxes = shard_boxes(sharding, stored_shape, key_extra)


def _translate(e: Exception, what: str) -> Exception:
    msg = str(e)
    return (CheckpointNotFoundError if "NOT_FOUND" in msg else CorruptionError)(f"{what}: {msg}")


def _finish(leaf: _Leaf, futures: dict[Box, Any], strings: dict[str, Any]) -> Any:
    """The restored value of ``leaf``: as stored (a target leaf gives only shape, dtype and
    sharding; a stored None / empty container or Python scalar is returned as stored)."""
    where = leaf.entry.param_name
    if leaf.mode == "empty":  # None, or a new empty container (never shared)
        value = EMPTY_TYPES[leaf.entry.value_type]
        return type(value)() if isinstance(value, (dict, list)) else value
    if leaf.mode == "string":
        if where not in strings:
            raise CheckpointNotFoundError(f"string leaf {where} is missing from _strings.json")
        return str(strings[where])
    bufs: dict[Box, np.ndarray] = {}
    for box, fut in futures.items():
        try:
            arr = np.asarray(fut.result())
        except Exception as e:  # tensorstore raises ValueError subclasses
            raise _translate(e, f"reading {where}") from e
        assert leaf.dtype is not None
        bufs[box] = arr if arr.dtype == leaf.dtype else arr.astype(leaf.dtype)
    if leaf.mode in ("numpy", "npscalar", "pyscalar"):
        (arr,) = bufs.values()
        if leaf.mode == "numpy":
            return arr
        if leaf.mode == "npscalar":
            return arr[()]
        return arr.item()  # the stored Python scalar, whatever scalar type the target holds
    assert leaf.sharding is not None
    return place(leaf.shape, leaf.sharding, bufs.__getitem__, leaf.key_impl)


def _match(
    item: OrbaxItem, target: Any, *, partial: bool
) -> tuple[list[tuple[OrbaxEntry, Any]], Any]:
    """Pair target leaves with entries; returns ``([(entry, target_leaf)], treedef)``."""
    if target is None:
        return [(e, None) for e in item.entries.values()], None
    pairs, treedef = jax.tree_util.tree_flatten_with_path(target)
    named = [(_names_of(path), leaf) for path, leaf in pairs]
    missing = [".".join(names) for names, _ in named if names not in item.entries]
    if missing:
        raise TreeStructureError(
            f"target leaves not in the Orbax checkpoint {item.url}: {sorted(missing)[:10]}"
        )
    seen = {names for names, _ in named}
    extra = [
        e.param_name
        for n, e in item.entries.items()
        if n not in seen and e.value_type not in EMPTY_TYPES
    ]
    if extra and not partial:
        raise TreeStructureError(
            f"the Orbax checkpoint has leaves the target lacks: {sorted(extra)[:10]} "
            "(pass partial=True to restore a subtree)"
        )
    return [(item.entries[names], leaf) for names, leaf in named], treedef


def read_item(
    item: OrbaxItem,
    target: Any = None,
    *,
    partial: bool = False,
    allow_dtype_cast: bool = False,
    max_inflight_bytes: int = 1 << 30,
) -> Any:
    """Restore an Orbax item laid out as ``target`` (see
    :func:`fastckpt.integrations.orbax.restore_orbax`)."""
    ts = import_tensorstore()

    matched, treedef = _match(item, target, partial=partial)
    leaves = [_Leaf(e, t, _mode_of(e, t, item)) for e, t in matched]
    context = ts.Context({"cache_pool#ocdbt": {"total_bytes_limit": 100_000_000}})
    opens = {
        id(lf): ts.open(_spec(item, lf.entry.param_name), open=True, read=True, context=context)
        for lf in leaves
        if lf.mode not in ("empty", "string")
    }
    for lf in leaves:
        if id(lf) in opens:
            try:
                lf.store = opens[id(lf)].result()
            except Exception as e:
                raise _translate(e, f"opening {lf.entry.param_name} in {item.url}") from e
            _plan(lf, item, allow_cast=allow_dtype_cast)
    strings: dict[str, Any] = {}
    if any(lf.mode == "string" for lf in leaves):
        strings = read_json(item.url, "_strings.json") or {}
        if not isinstance(strings, dict):
            raise ManifestError(
                f"{item.url}/_strings.json: expected a JSON object, got {type(strings).__name__}"
            )
    results: list[Any] = [None] * len(leaves)
    pending: list[tuple[int, dict[Box, Any]]] = []
    inflight = 0

    def drain() -> None:
        nonlocal inflight
        for i, futs in pending:
            results[i] = _finish(leaves[i], futs, strings)
        pending.clear()
        inflight = 0

    for i, lf in enumerate(leaves):
        futs: dict[Box, Any] = {}
        for _, box in lf.device_boxes:
            if box not in futs:
                futs[box] = (lf.store[box_to_slices(box)] if box else lf.store).read()
                inflight += box_volume(box) * lf.store.dtype.numpy_dtype.itemsize
        pending.append((i, futs))
        if inflight >= max_inflight_bytes:
            drain()
    drain()
    if treedef is None:
        return unflatten_from_paths({lf.entry.keypath: r for lf, r in zip(leaves, results)})
    return jax.tree_util.tree_unflatten(treedef, results)
