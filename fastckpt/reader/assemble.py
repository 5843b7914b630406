"""Match a restore target against a manifest, plan units, and build the final arrays.

Call order (the manager drives it): :func:`resolve_target` (pure checks, typed errors) ->
``fill_units`` (I/O) -> :func:`build_leaves` (device placement) -> ``tree_unflatten``.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping
from typing import Any, cast

import jax
import numpy as np

from fastckpt._tree import flatten, is_prng_key, unflatten_from_paths
from fastckpt.errors import (
    ConfigError,
    CorruptionError,
    DtypeMismatchError,
    ShapeMismatchError,
    TargetMismatchError,
    TreeStructureError,
)
from fastckpt.format.dtypes import dtype_from_name
from fastckpt.format.manifest import (
    ArrayLeaf,
    Box,
    KeyPath,
    Manifest,
    ShardingSpec,
    ValueLeaf,
    keypath_str,
)
from fastckpt.planning import box_from_index, full_box
from fastckpt.reader.fetch import RestoreStats, Unit

__all__ = [
    "LeafPlan",
    "RestorePlan",
    "build_leaves",
    "key_array_shape",
    "place",
    "resolve_sharding",
    "resolve_target",
    "shard_boxes",
]


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
        re, im = cast(tuple[float, float], leaf.value)
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
    raise ConfigError(
        "PRNG key targets need a NamedSharding or SingleDeviceSharding, got "
        f"{type(sharding).__name__}"
    )


def resolve_sharding(sharding: jax.sharding.Sharding | None, where: str) -> jax.sharding.Sharding:
    """The sharding a leaf restores to: ``sharding`` (the target's, else the checkpoint's
    rebuilt on this job's devices), or one local device when there is none
    (``TargetMismatchError`` in a multi-process job). ``ConfigError`` if ``sharding`` is over
    an AbstractMesh (it names no devices)."""
    if sharding is None:
        if jax.process_count() > 1:
            raise TargetMismatchError(
                f"{where}: cannot rebuild the saved sharding here; pass a target with .sharding"
            )
        return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    if isinstance(getattr(sharding, "mesh", None), getattr(jax.sharding, "AbstractMesh", ())):
        raise ConfigError(
            f"{where}: the target's sharding is over an AbstractMesh (jax.eval_shape under "
            "jax.set_mesh?); pass concrete shardings, e.g. "
            "fastckpt.integrations.pytree.abstract_state(target, mesh=mesh)"
        )
    return sharding


_DeviceBoxes = list[tuple[Any, Box]]


def shard_boxes(
    sharding: jax.sharding.Sharding,
    shape: tuple[int, ...],
    key_extra: int = 0,
    cache: dict[Any, _DeviceBoxes] | None = None,
) -> tuple[jax.sharding.Sharding, _DeviceBoxes]:
    """The sharding of the array to build and ``(device, box)`` of each of its addressable
    shards. With ``key_extra`` > 0, ``shape`` is PRNG key data: ``sharding`` (the key array's)
    splits its leading dimensions and every box spans the trailing ``key_extra`` whole.
    ``cache`` (one per restore) shares the boxes of leaves with the same sharding and shape."""
    if key_extra:
        index_map = sharding.addressable_devices_indices_map(shape[: len(shape) - key_extra])
        return _key_data_sharding(sharding, key_extra), [
            (d, box_from_index(None if idx is None else (*idx, *(slice(None),) * key_extra), shape))
            for d, idx in index_map.items()
        ]
    key: Any = (sharding, shape)
    try:
        hit = None if cache is None else cache.get(key)
    except TypeError:  # an unhashable sharding: no caching
        hit = cache = None
    if hit is None:
        hit = [
            (d, box_from_index(idx, shape))
            for d, idx in sharding.addressable_devices_indices_map(shape).items()
        ]
        if cache is not None:
            cache[key] = hit
    return sharding, hit


def _buffers_of(units: Mapping[Box, Unit]) -> Callable[[Box], Any]:
    """``box -> host buffer`` of one leaf's units (bound now, not to a loop variable)."""
    return lambda box: units[box].buffer


def place(
    shape: tuple[int, ...],
    sharding: jax.sharding.Sharding,
    buffer_of: Callable[[Box], Any],
    key_impl: str | None = None,
) -> jax.Array:
    """The array of ``shape`` under ``sharding``, each addressable shard from the host buffer
    ``buffer_of(box)`` (one batched placement); with ``key_impl``, the array is key data and
    comes back as PRNG keys of that implementation."""
    arr = jax.make_array_from_callback(
        shape, sharding, lambda idx: buffer_of(box_from_index(idx, shape))
    )
    return arr if key_impl is None else jax.random.wrap_key_data(arr, impl=key_impl)


@functools.lru_cache(maxsize=16)
def _key_info_of(impl: str) -> tuple[Any, tuple[int, ...]]:
    key = jax.eval_shape(lambda: jax.random.key(0, impl=impl))
    data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl)))
    return key.dtype, tuple(data.shape)


def key_array_shape(
    impl: str | None, stored_shape: tuple[int, ...], tgt: Any, where: str
) -> tuple[int, ...]:
    """The shape of the PRNG key array whose key data of ``stored_shape`` is stored, checked
    against the target leaf ``tgt`` (None: no target).

    Raises:
        DtypeMismatchError: the implementation is unknown here, or the target's keys are of another.
        ShapeMismatchError: the target's key array has another shape.
        CorruptionError: ``stored_shape`` does not end in the implementation's key data shape.
    """
    try:  # (key dtype, key data shape of one key), e.g. key<fry> and (2,) for threefry
        key_dtype, data_shape = _key_info_of(str(impl))
    except (ValueError, TypeError, KeyError) as e:
        raise DtypeMismatchError(
            f"{where}: the checkpoint's PRNG implementation {impl!r} is unknown here: {e}"
        ) from e
    split = len(stored_shape) - len(data_shape)
    if split < 0 or stored_shape[split:] != data_shape:
        raise CorruptionError(
            f"{where}: stored key data of shape {stored_shape} does not end in {impl}'s "
            f"key data shape {data_shape}"
        )
    if tgt is not None and tgt.dtype != key_dtype:
        raise DtypeMismatchError(
            f"{where}: target keys are {tgt.dtype}, the checkpoint's {key_dtype}"
        )
    if tgt is not None and tuple(tgt.shape) != stored_shape[:split]:
        raise ShapeMismatchError(
            f"{where}: target key array shape {tuple(tgt.shape)} != stored {stored_shape[:split]}"
        )
    return stored_shape[:split]


def _plan_array(
    path: KeyPath, stored: ArrayLeaf, tgt: Any, boxes_cache: dict[Any, _DeviceBoxes]
) -> LeafPlan:
    where = keypath_str(path)
    shape = tuple(stored.shape)
    key_extra = 0
    if stored.kind == "prng_key":
        if tgt is not None and not is_prng_key(tgt):
            raise DtypeMismatchError(
                f"{where}: checkpoint holds a PRNG key array, target is "
                f"{getattr(tgt, 'dtype', type(tgt))}"
            )
        key_extra = len(shape) - len(key_array_shape(stored.key_impl, shape, tgt, where))
    elif tgt is not None:
        if tuple(tgt.shape) != shape:
            raise ShapeMismatchError(
                f"{where}: target shape {tuple(tgt.shape)} != stored shape {shape}"
            )
        if is_prng_key(tgt) or np.dtype(tgt.dtype) != dtype_from_name(stored.dtype):
            raise DtypeMismatchError(
                f"{where}: target dtype {tgt.dtype} != stored dtype {stored.dtype}"
            )
    as_numpy = isinstance(tgt, (np.ndarray, np.generic)) or (tgt is None and stored.kind == "numpy")
    if as_numpy:
        box = full_box(shape)
        return LeafPlan(
            path,
            stored,
            as_numpy=True,
            scalar=isinstance(tgt, np.generic) or (tgt is None and not shape),
            units={box: Unit(stored, box, lendable=False)},
        )
    sharding = getattr(tgt, "sharding", None)
    sharding = resolve_sharding(
        _saved_sharding(stored.sharding) if sharding is None else sharding, where
    )
    data_sharding, device_boxes = shard_boxes(sharding, shape, key_extra, boxes_cache)
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
        # The skeleton's own paths differ from the stored ones where attributes or
        # flattened indices became dict keys and list positions: carry the stored path.
        skeleton = unflatten_from_paths(
            {leaf.path: _StoredPath(leaf.path) for leaf in manifest.leaves}
        )
        leaves_t, treedef = flatten(skeleton)
        targets: list[tuple[KeyPath, Any]] = [(lf.value.path, None) for lf in leaves_t]
    else:
        leaves_t, treedef = flatten(target)
        targets = [(lf.path, lf.value) for lf in leaves_t]
        paths = {p for p, _ in targets}
        missing = [keypath_str(p) for p in paths if p not in stored]
        if missing:
            raise TreeStructureError(
                f"target leaves not in checkpoint step {manifest.step}: {sorted(missing)[:10]}"
            )
        extra = [keypath_str(p) for p in stored if p not in paths]
        if extra and not partial:
            raise TreeStructureError(
                f"checkpoint step {manifest.step} has leaves the target lacks: "
                f"{sorted(extra)[:10]} "
                "(pass partial=True to restore a subtree)"
            )
    plans = []
    boxes_cache: dict[Any, _DeviceBoxes] = {}
    for path, tgt in targets:
        s = stored[path]
        if isinstance(s, ValueLeaf):
            # A 0-d ShapeDtypeStruct is what jax.eval_shape makes of a Python scalar (e.g.
            # TrainState.step): restore the stored value, as saved.
            abstract_scalar = (
                isinstance(tgt, jax.ShapeDtypeStruct)
                and tgt.shape == ()
                and s.vtype in ("bool", "int", "float", "complex")
            )
            if (
                tgt is not None
                and not abstract_scalar
                and isinstance(tgt, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))
            ):
                raise TreeStructureError(
                    f"{keypath_str(path)}: checkpoint holds a {s.vtype} value, target an array"
                )
            plans.append(LeafPlan(path, s))
        else:
            if tgt is not None and not hasattr(tgt, "shape"):
                raise TreeStructureError(
                    f"{keypath_str(path)}: checkpoint holds an array, target is "
                    f"{type(tgt).__name__}"
                )
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
        out.append(
            place(
                tuple(s.shape),
                lp.sharding,
                _buffers_of(lp.units),
                s.key_impl if s.kind == "prng_key" else None,
            )
        )
    stats.device_put_s += time.perf_counter() - t0
    return out
