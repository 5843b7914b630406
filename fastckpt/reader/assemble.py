"""Match a restore target against a manifest, plan units, and build the final arrays.

Call order (the manager drives it): :func:`resolve_target` (pure checks, typed errors) ->
``fill_units`` (I/O) -> :func:`build_leaves` (device placement) -> ``tree_unflatten``.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import numpy as np

from fastckpt._tree import flatten, is_prng_key
from fastckpt.errors import (
    ConfigError,
    DtypeMismatchError,
    ShapeMismatchError,
    TargetMismatchError,
    TreeStructureError,
)
from fastckpt.format.dtypes import dtype_from_name
from fastckpt.format.manifest import ArrayLeaf, Box, KeyPath, Manifest, ShardingSpec, ValueLeaf, keypath_str
from fastckpt.planning import box_from_index, full_box
from fastckpt.reader.fetch import RestoreStats, Unit

__all__ = ["LeafPlan", "RestorePlan", "build_leaves", "resolve_target"]


@dataclasses.dataclass
class LeafPlan:
    """How one target leaf is produced."""

    path: KeyPath
    stored: ArrayLeaf | ValueLeaf
    as_numpy: bool = False
    scalar: bool = False
    """Return a numpy scalar (the target leaf was one)."""
    sharding: jax.sharding.Sharding | None = None
    """Sharding of the (key-data) array to build; None for numpy/value leaves."""
    device_boxes: list[tuple[jax.Device, Box]] = dataclasses.field(default_factory=list)
    units: dict[Box, Unit] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class RestorePlan:
    """All leaves of a restore, in target flatten order, plus the target treedef."""

    leaves: list[LeafPlan]
    treedef: Any

    def units(self) -> list[Unit]:
        return [u for lp in self.leaves for u in lp.units.values()]


def _value(leaf: ValueLeaf) -> Any:
    if leaf.vtype == "complex":
        re, im = leaf.value  # type: ignore[misc]
        return complex(re, im)
    return leaf.value


def _saved_sharding(spec: ShardingSpec | None) -> jax.sharding.Sharding | None:
    """Rebuild the saved NamedSharding on this job's devices, if the device count matches."""
    if spec is None:
        return None
    n = int(np.prod(spec.mesh_shape))
    devices = jax.devices()
    if len(devices) != n:
        return None
    mesh = jax.sharding.Mesh(np.asarray(devices).reshape(spec.mesh_shape), spec.mesh_axis_names)
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec.partition_spec))


def _key_data_sharding(sharding: jax.sharding.Sharding, extra_dims: int) -> jax.sharding.Sharding:
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec) + (None,) * extra_dims
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    raise ConfigError(f"PRNG key targets need a NamedSharding or SingleDeviceSharding, got {type(sharding).__name__}")


_DeviceBoxes = list[tuple[Any, Box]]


def _device_boxes(sharding: Any, shape: tuple[int, ...], cache: dict[Any, _DeviceBoxes]) -> _DeviceBoxes:
    """``(device, box)`` of every addressable shard of ``shape`` under ``sharding``, computed
    once per distinct (sharding, shape) of a restore (a model's leaves share a few)."""
    key: Any = (sharding, shape)
    try:
        hit = cache.get(key)
    except TypeError:  # an unhashable sharding: no caching
        hit = key = None
    if hit is None:
        hit = [(d, box_from_index(idx, shape)) for d, idx in sharding.addressable_devices_indices_map(shape).items()]
        if key is not None:
            cache[key] = hit
    return hit


@functools.lru_cache(maxsize=16)
def _key_info_of(impl: str) -> tuple[Any, tuple[int, ...]]:
    key = jax.eval_shape(lambda: jax.random.key(0, impl=impl))
    data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl)))
    return key.dtype, tuple(data.shape)


def prng_key_info(impl: str | None, where: str) -> tuple[Any, tuple[int, ...]]:
    """``(key dtype, key data shape of one key)`` of a stored PRNG implementation (e.g.
    ``key<fry>`` and ``(2,)`` for threefry); shared by fastckpt's and the Orbax reader.

    Raises:
        DtypeMismatchError: the implementation is unknown to this JAX.
    """
    try:
        return _key_info_of(str(impl))
    except (ValueError, TypeError, KeyError) as e:
        raise DtypeMismatchError(f"{where}: the checkpoint's PRNG implementation {impl!r} is unknown here: {e}") from e


def _plan_array(path: KeyPath, stored: ArrayLeaf, tgt: Any, boxes_cache: dict[Any, _DeviceBoxes]) -> LeafPlan:
    where = keypath_str(path)
    shape = tuple(stored.shape)
    key_extra = 0
    if stored.kind == "prng_key":
        if tgt is not None and not is_prng_key(tgt):
            raise DtypeMismatchError(f"{where}: checkpoint holds a PRNG key array, target is {getattr(tgt, 'dtype', type(tgt))}")
        key_dtype, data_shape = prng_key_info(stored.key_impl, where)
        if tgt is not None and tgt.dtype != key_dtype:
            raise DtypeMismatchError(f"{where}: target keys are {tgt.dtype}, the checkpoint's {key_dtype}")
        if tgt is not None:  # the stored key data: the key array's shape, then the implementation's
            key_extra = len(data_shape)
            if tuple(tgt.shape) != shape[: len(shape) - key_extra]:
                raise ShapeMismatchError(f"{where}: target key array shape {tuple(tgt.shape)} != stored "
                                         f"{shape[: len(shape) - key_extra]}")
    elif tgt is not None:
        if tuple(tgt.shape) != shape:
            raise ShapeMismatchError(f"{where}: target shape {tuple(tgt.shape)} != stored shape {shape}")
        if is_prng_key(tgt) or np.dtype(tgt.dtype) != dtype_from_name(stored.dtype):
            raise DtypeMismatchError(f"{where}: target dtype {tgt.dtype} != stored dtype {stored.dtype}")
    as_numpy = isinstance(tgt, (np.ndarray, np.generic)) or (tgt is None and stored.kind == "numpy")
    if as_numpy:
        box = full_box(shape)
        return LeafPlan(path, stored, as_numpy=True, scalar=isinstance(tgt, np.generic) or (tgt is None and not shape),
                        units={box: Unit(stored, box, lendable=False)})
    sharding = getattr(tgt, "sharding", None) if tgt is not None else None
    if sharding is None:
        sharding = _saved_sharding(stored.sharding)
    if sharding is None:
        if jax.process_count() > 1:
            raise TargetMismatchError(f"{where}: cannot rebuild the saved sharding here; pass a target with .sharding")
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    if isinstance(getattr(sharding, "mesh", None), getattr(jax.sharding, "AbstractMesh", ())):
        raise ConfigError(f"{where}: the target's sharding is over an AbstractMesh (jax.eval_shape under "
                          "jax.set_mesh?); pass concrete shardings, e.g. "
                          "fastckpt.integrations.pytree.abstract_state(target, mesh=mesh)")
    if stored.kind == "prng_key":
        idx_shape = shape[: len(shape) - key_extra] if tgt is not None else shape[:-1]
        key_extra = len(shape) - len(idx_shape)
        index_map = sharding.addressable_devices_indices_map(idx_shape)
        data_sharding = _key_data_sharding(sharding, key_extra)
        device_boxes = [(d, box_from_index(tuple(idx) + (slice(None),) * key_extra, shape))
                        for d, idx in index_map.items()]
    else:
        device_boxes = _device_boxes(sharding, shape, boxes_cache)
        data_sharding = sharding
    plan = LeafPlan(path, stored, sharding=data_sharding, device_boxes=list(device_boxes))
    for _, box in device_boxes:
        if box not in plan.units:
            plan.units[box] = Unit(stored, box)
    return plan


@dataclasses.dataclass(frozen=True, slots=True)
class _StoredPath:
    """A skeleton leaf (not a pytree node) naming the manifest leaf it stands for."""

    path: KeyPath


def resolve_target(manifest: Manifest, target: Any, *, partial: bool) -> RestorePlan:
    """Check ``target`` against ``manifest`` and plan every leaf.

    ``target=None`` restores everything with the saved shardings (when this job's device
    count matches the saved mesh; otherwise a single device), rebuilding nested
    dicts/lists from the key paths. Raises TreeStructureError, ShapeMismatchError or
    DtypeMismatchError with the offending path.
    """
    stored = manifest.by_path()
    if target is None:
        from fastckpt._tree import unflatten_from_paths

        # The skeleton's own paths differ from the stored ones where attributes or
        # flattened indices became dict keys and list positions: carry the stored path.
        skeleton = unflatten_from_paths({leaf.path: _StoredPath(leaf.path) for leaf in manifest.leaves})
        leaves_t, treedef = flatten(skeleton)
        targets: list[tuple[KeyPath, Any]] = [(lf.value.path, None) for lf in leaves_t]
    else:
        leaves_t, treedef = flatten(target)
        targets = [(lf.path, lf.value) for lf in leaves_t]
        paths = {p for p, _ in targets}
        missing = [keypath_str(p) for p in paths if p not in stored]
        if missing:
            raise TreeStructureError(f"target leaves not in checkpoint step {manifest.step}: {sorted(missing)[:10]}")
        extra = [keypath_str(p) for p in stored if p not in paths]
        if extra and not partial:
            raise TreeStructureError(
                f"checkpoint step {manifest.step} has leaves the target lacks: {sorted(extra)[:10]} "
                "(pass partial=True to restore a subtree)"
            )
    plans = []
    boxes_cache: dict[Any, _DeviceBoxes] = {}
    for path, tgt in targets:
        s = stored[path]
        if isinstance(s, ValueLeaf):
            # A 0-d ShapeDtypeStruct is what jax.eval_shape makes of a Python scalar (e.g.
            # TrainState.step): restore the stored value, as saved.
            abstract_scalar = isinstance(tgt, jax.ShapeDtypeStruct) and tgt.shape == () and s.vtype in (
                "bool", "int", "float", "complex")
            if tgt is not None and not abstract_scalar and isinstance(tgt, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
                raise TreeStructureError(f"{keypath_str(path)}: checkpoint holds a {s.vtype} value, target an array")
            plans.append(LeafPlan(path, s))
        else:
            if tgt is not None and not hasattr(tgt, "shape"):
                raise TreeStructureError(f"{keypath_str(path)}: checkpoint holds an array, target is {type(tgt).__name__}")
            plans.append(_plan_array(path, s, tgt, boxes_cache))
    return RestorePlan(plans, treedef)


def build_leaves(plan: RestorePlan, stats: RestoreStats) -> list[Any]:
    """Turn filled units into leaves (device placement happens here), in target order."""
    t0 = time.perf_counter()
    out: list[Any] = []
    for lp in plan.leaves:
        s = lp.stored
        if isinstance(s, ValueLeaf):
            out.append(_value(s))
            continue
        if lp.as_numpy:
            (unit,) = lp.units.values()
            arr = np.asarray(unit.buffer)
            out.append(arr[()] if lp.scalar else arr)
            continue
        assert lp.sharding is not None
        # One batched placement per leaf (a device_put per shard costs ~0.5 ms of dispatch).
        units, shape = lp.units, tuple(s.shape)
        arr = jax.make_array_from_callback(shape, lp.sharding, lambda idx: units[box_from_index(idx, shape)].buffer)
        if s.kind == "prng_key":
            arr = jax.random.wrap_key_data(arr, impl=s.key_impl)
        out.append(arr)
    stats.device_put_s += time.perf_counter() - t0
    return out
