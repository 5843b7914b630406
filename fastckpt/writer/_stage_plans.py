"""Plan the staging of a save's leaves: classify each one (inline value, numpy or jax array),
cut it into the chunks this process writes and decide how its shards reach host memory.

Pure, apart from probing once per device whether its ``pinned_host`` memory works. Plans
of jax array leaves are kept in :class:`StagePlans` and reused when a leaf recurs.
:mod:`fastckpt.writer.stage` makes the copies these plans call for.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from fastckpt._hostmem import slab_bytes
from fastckpt._tree import FlatLeaf, is_prng_key
from fastckpt.errors import ConfigError
from fastckpt.format.dtypes import dtype_name
from fastckpt.format.manifest import ArrayKind, KeyPath, ShardingSpec, ValueLeaf, keypath_str
from fastckpt.planning import (
    ShardInfo,
    WriteItem,
    box_from_index,
    box_volume,
    full_box,
    plan_leaf_writes,
)

log = logging.getLogger("fastckpt")

__all__ = [
    "PendingLeaf",
    "StagePlans",
    "plan_array",
    "sharding_spec_of",
    "staging_nbytes",
    "value_leaf_of",
]


def value_leaf_of(path: KeyPath, x: Any) -> ValueLeaf | None:
    """The inline leaf for a Python scalar/str/None, or None if ``x`` is not one.

    numpy scalars are stored as arrays, even those that subclass a Python type
    (``np.float64`` is a ``float``), so they restore with their numpy type; ``np.str_``
    (no array dtype) is stored as a ``str``.
    """
    if isinstance(x, np.generic) and not isinstance(x, np.str_):
        return None
    if x is None:
        return ValueLeaf(path, "none", None)
    if isinstance(x, bool):
        return ValueLeaf(path, "bool", x)
    if isinstance(x, int):
        return ValueLeaf(path, "int", int(x))
    if isinstance(x, float):
        return ValueLeaf(path, "float", float(x))
    if isinstance(x, complex):
        return ValueLeaf(path, "complex", (x.real, x.imag))
    if isinstance(x, str):
        return ValueLeaf(path, "str", str(x))
    return None


def sharding_spec_of(sharding: Any) -> ShardingSpec | None:
    """Describe a ``NamedSharding`` (others are not described: restore needs a target)."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    mesh = sharding.mesh
    spec: list[str | tuple[str, ...] | None] = []
    for p in sharding.spec:
        if p is None or isinstance(p, str):
            spec.append(p)
        else:
            spec.append(tuple(str(a) for a in p))
    return ShardingSpec(
        tuple(str(n) for n in mesh.axis_names), tuple(mesh.devices.shape), tuple(spec)
    )


@dataclasses.dataclass
class PendingLeaf:
    """An array leaf as planned, its copies to host not made yet (:func:`plan_array`)."""

    path: KeyPath
    shape: tuple[int, ...]
    dtype: str
    kind: ArrayKind
    sharding: ShardingSpec | None
    key_impl: str | None
    items: tuple[WriteItem, ...]
    sources: dict[int, Any]  # shard_index -> device array or numpy array
    transfer: str | None = None
    """How this leaf's device-to-host copies start (:func:`_transfer_mode`); None for numpy."""
    array: Any = None
    """The global jax array (what ``transfer="all"`` starts the copies of)."""


@dataclasses.dataclass(frozen=True, slots=True)
class _LeafPlan:
    """What planning decided for a jax array leaf, minus its data (see :class:`StagePlans`)."""

    dtype: str
    sharding: ShardingSpec | None
    items: tuple[WriteItem, ...]
    used: tuple[int, ...]
    """Indexes (into ``addressable_shards``) of the shards the items read."""
    transfer: str | None
    """``"all"``, ``"shards"``, ``"pinned_all"``, ``"pinned_shards"``, ``"host"`` or None: see
    :func:`_transfer_mode`."""


def _transfer_mode(
    *, on_host: bool, local_shards: int, used: Sequence[int], pinned: bool, view_host: bool = True
) -> str | None:
    """How to start a leaf's device-to-host copies (pure).

    With ``pinned`` (the devices have ``pinned_host`` memory and the options allow it):
    ``"pinned_all"`` when every local shard is used (one ``device_put`` of the global array
    into pinned host memory), ``"pinned_shards"`` otherwise (each used shard's own, so
    replicas this process does not write stay on the device). Pinned memory is what an
    accelerator's DMA engines copy into at full speed, many times faster than
    ``jax.device_get`` into pageable memory (``docs/benchmarks.md``, accelerator).
    Without: shards on host-platform (CPU) devices are host memory already, ``np.asarray``
    views them without a copy and an asynchronous "transfer" is pure overhead: ``"host"``
    (``view_host``: the views may be held and copied later, see ``stage_state``), else None
    (copied before staging returns). ``"all"`` when every local shard is used: the global
    array's ``copy_to_host_async`` starts them all in one call (no per-shard Python).
    ``"shards"`` otherwise: each used shard's own call."""
    every = len(used) == local_shards
    if pinned:
        return "pinned_all" if every else "pinned_shards"
    if on_host:
        return "host" if view_host else None
    return "all" if every else "shards"


def _pinned_ok(
    devices: Sequence[Any], device_copy: str, probed: dict[Any, bool] | None = None
) -> bool:
    """Whether to copy shards on ``devices`` (this process's: only addressable devices can be
    asked for their memories) through ``pinned_host`` memory: ``"auto"`` on accelerators
    that have it and pass :func:`_pinned_round_trip` (each device's answer kept in
    ``probed``), ``"pinned_host"`` wherever it exists (else ConfigError), ``"pageable"`` never."""
    if device_copy == "pageable" or (
        device_copy == "auto" and all(d.platform == "cpu" for d in devices)
    ):
        return False
    if device_copy == "pinned_host":
        if not all(_has_pinned(d) for d in devices):
            raise ConfigError(
                "SaveOptions.device_copy='pinned_host' but a device has no pinned_host memory"
            )
        return True
    probed = {} if probed is None else probed
    for d in devices:
        if d not in probed:
            probed[d] = _has_pinned(d) and _pinned_round_trip(d)
    return all(probed[d] for d in devices)


def _has_pinned(device: Any) -> bool:
    return any(m.kind == "pinned_host" for m in device.addressable_memories())


def _pinned_round_trip(device: Any) -> bool:
    """Whether this backend and jax version copy into ``device``'s pinned host memory and read
    it back as numpy (a 4-byte probe): ``"auto"`` falls back to pageable copies, with a
    warning, where they do not, rather than fail every save."""
    try:
        x = jax.device_put(np.full(1, 7, np.int32), device)
        y = jax.device_put(x, jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host"))
        if int(np.asarray(y)[0]) == 7:
            return True
        problem = "read back a wrong value"
    except Exception as e:
        problem = f"{type(e).__name__}: {e}"
    log.warning(
        "fastckpt: copies through pinned host memory do not work on %s (%s): saving through "
        "pageable memory (slower device-to-host copies)",
        device,
        problem,
    )
    return False


class StagePlans:
    """Leaf plans of earlier saves, reused when a leaf's shape, dtype and sharding recur.

    A leaf's plan (its shards' boxes and replica ids, the chunks it is cut into) is a pure
    function of those, and a training loop saves the same structure every time; a hit skips
    jax's per-shard objects and the box arithmetic, which are most of the Python work of the
    blocking part of a save (about half of it for a 768-shard state). Holds no arrays, only
    plans; bounded (cleared when full). One saving thread at a time (a manager's).
    """

    def __init__(self, max_entries: int = 1 << 16) -> None:
        self._plans: dict[Any, _LeafPlan] = {}
        self._max = max_entries
        self.pinned: dict[Any, bool] = {}
        """Per device: whether copies through its pinned host memory work (``_pinned_ok``)."""
        self.hits = 0
        self.misses = 0

    def get(self, key: Any) -> _LeafPlan | None:
        plan = self._plans.get(key)
        if plan is None:
            self.misses += 1
        else:
            self.hits += 1
        return plan

    def put(self, key: Any, plan: _LeafPlan) -> None:
        if len(self._plans) >= self._max:
            self._plans.clear()
        self._plans[key] = plan


def _plan_key(x: jax.Array, process_index: int, max_chunk_bytes: int) -> Any:
    """The cache key of a jax array's plan, or None if its sharding is not hashable."""
    key = (tuple(x.shape), x.dtype, x.sharding, process_index, max_chunk_bytes)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _check_live(x: jax.Array, where: str) -> None:
    if x.is_deleted():
        raise ConfigError(f"{where}: the array was deleted (donated?) before save")


def _dtype_name(dtype: Any, where: str) -> str:
    try:
        return dtype_name(dtype)
    except Exception as e:
        raise ConfigError(f"{where}: {e}") from e


def plan_array(
    leaf: FlatLeaf,
    *,
    process_index: int,
    max_chunk_bytes: int,
    plans: StagePlans | None = None,
    device_copy: str = "auto",
) -> PendingLeaf:
    """Plan an array leaf (numpy or jax; not an inline value): the chunks this process
    writes, the shards they read and how those reach host memory (reusing ``plans``)."""
    x = leaf.value
    where = keypath_str(leaf.path)
    key = None
    if plans is not None and isinstance(x, jax.Array) and not is_prng_key(x):
        key = _plan_key(x, process_index, max_chunk_bytes)
        plan = plans.get(key) if key is not None else None
        if plan is not None:
            _check_live(x, where)
            return PendingLeaf(
                leaf.path,
                tuple(x.shape),
                plan.dtype,
                "jax",
                plan.sharding,
                None,
                plan.items,
                {i: x.addressable_data(i) for i in plan.used},
                plan.transfer,
                x,
            )
    if isinstance(x, (np.ndarray, np.generic)):
        arr = np.asarray(x)
        name = _dtype_name(arr.dtype, where)
        shards = [ShardInfo(full_box(arr.shape), 0 if process_index == 0 else 1, 0)]
        items = plan_leaf_writes(
            shards, itemsize=arr.dtype.itemsize, max_chunk_bytes=max_chunk_bytes
        )
        return PendingLeaf(
            leaf.path, arr.shape, name, "numpy", None, None, items, {0: arr} if items else {}
        )
    if not isinstance(x, jax.Array):
        raise ConfigError(f"{where}: unsupported leaf type {type(x).__name__}")
    kind: ArrayKind = "jax"
    key_impl: str | None = None
    sharding = sharding_spec_of(x.sharding)
    if is_prng_key(x):
        kind, key_impl = "prng_key", str(jax.random.key_impl(x))
        x = jax.random.key_data(x)
    _check_live(x, where)
    name = _dtype_name(x.dtype, where)
    shards, sources, local = [], {}, []
    for i, s in enumerate(x.addressable_shards):
        shards.append(ShardInfo(box_from_index(s.index, x.shape), s.replica_id, i))
        sources[i] = s.data
        local.append(s.device)
    items = plan_leaf_writes(
        shards, itemsize=np.dtype(x.dtype).itemsize, max_chunk_bytes=max_chunk_bytes
    )
    used = sorted({it.shard_index for it in items})
    transfer = _transfer_mode(
        on_host=all(d.platform == "cpu" for d in local),
        local_shards=len(shards),
        used=used,
        pinned=bool(used)
        and _pinned_ok(local, device_copy, plans.pinned if plans is not None else None),
        view_host=device_copy != "pageable",
    )
    if key is not None:
        plans.put(key, _LeafPlan(name, sharding, items, tuple(used), transfer))  # type: ignore[union-attr]
    return PendingLeaf(
        leaf.path,
        tuple(x.shape),
        name,
        kind,
        sharding,
        key_impl,
        items,
        {i: sources[i] for i in used},
        transfer,
        x,
    )


def _leaf_shard_bytes(x: Any, *, process_index: int, max_chunk_bytes: int) -> list[int]:
    """Bytes of each shard this process copies into the staging buffer for array leaf ``x``
    (concrete, or abstract: ``jax.ShapeDtypeStruct``), as :func:`plan_array` plans them:
    replica ids follow jax's rule (the order of ``devices_indices_map``)."""
    if isinstance(x, (np.ndarray, np.generic)):
        arr = np.asarray(x)
        return [arr.nbytes] if process_index == 0 and arr.size else []
    if jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
        shape, dtype = tuple(data.shape), data.dtype
    else:
        shape, dtype = tuple(x.shape), x.dtype
    itemsize = np.dtype(dtype).itemsize
    sharding = getattr(x, "sharding", None)
    if sharding is None:  # placed on the default device: process 0's
        return [box_volume(full_box(shape)) * itemsize] if process_index == 0 else []
    local = set(sharding.addressable_devices)
    replicas: collections.Counter[Any] = collections.Counter()
    shards: list[ShardInfo] = []
    for device, index in sharding.devices_indices_map(shape).items():
        box = box_from_index(index, shape)
        if device in local:
            shards.append(ShardInfo(box, replicas[box], len(shards)))
        replicas[box] += 1
    items = plan_leaf_writes(shards, itemsize=itemsize, max_chunk_bytes=max_chunk_bytes)
    return [box_volume(shards[i].box) * itemsize for i in sorted({it.shard_index for it in items})]


def staging_nbytes(leaves: Sequence[FlatLeaf], *, process_index: int, max_chunk_bytes: int) -> int:
    """The size of the staging buffer ``stage_state`` allocates for a state like ``leaves``
    (the same tree of shapes, dtypes and shardings; arrays concrete or ``ShapeDtypeStruct``,
    whose sharding says where its shards are: None, the default device). Pure; raises on a
    leaf it cannot size (an unsupported type, a sharding without ``devices_indices_map``)."""
    sizes: list[int] = []
    for leaf in leaves:
        if value_leaf_of(leaf.path, leaf.value) is None:
            sizes += _leaf_shard_bytes(
                leaf.value, process_index=process_index, max_chunk_bytes=max_chunk_bytes
            )
    return slab_bytes(sizes)
