"""Stage a pytree for saving: classify leaves and copy this process's shards to host.

This is the only part of a save that blocks the training step. Call order inside
:func:`stage_state`: (1) classify leaves and plan chunks (pure), (2) start every
device-to-host copy before waiting on any — into ``pinned_host`` memory where the devices
have it (an accelerator's DMA engines at full speed; ``SaveOptions.device_copy``), else
``copy_to_host_async``; none for shards already in host memory — (3) copy every shard into
one staging buffer (parallel). After it returns, the caller may mutate or donate the device
arrays: the staged copy is independent of them. Shards copied to pinned host memory are
already private copies, so with ``defer_host_copies`` step (3) skips them and
:meth:`StagedSave.finish_copies` (the background part of the save, first) copies them: the
step then waits for the device-to-host DMA alone.
Checksums are not computed here: the background part of the save computes them from the
staged copy (:func:`staged_crc32c`, or while encoding), so the step waits for the copy alone.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from typing import Any

import jax
import numpy as np

from fastckpt._hostmem import aligned_offsets, as_bytes, parallel_copy, parallel_crc32c
from fastckpt._tree import FlatLeaf, is_prng_key
from fastckpt.errors import ConfigError
from fastckpt.format.dtypes import dtype_name
from fastckpt.format.manifest import ArrayKind, KeyPath, ShardingSpec, ValueLeaf, keypath_str
from fastckpt.planning import ShardInfo, WriteItem, box_from_index, full_box, plan_leaf_writes

log = logging.getLogger("fastckpt")

__all__ = [
    "DeferredCopies",
    "StagePlans",
    "StagedArray",
    "StagedSave",
    "sharding_spec_of",
    "stage_state",
    "staged_crc32c",
    "value_leaf_of",
]


@dataclasses.dataclass(frozen=True, slots=True)
class StagedArray:
    """An array leaf as staged: metadata plus the chunks this process writes."""

    path: KeyPath
    shape: tuple[int, ...]
    dtype: str
    kind: ArrayKind
    sharding: ShardingSpec | None
    key_impl: str | None
    items: tuple[WriteItem, ...]
    item_offsets: tuple[int, ...]
    """Absolute offset of each item's bytes in the staging buffer."""


class DeferredCopies:
    """Copies into the staging buffer left for the background part of a save: each source is
    a view of a private ``pinned_host`` copy of a shard (held here until copied), so nothing
    the caller does to its arrays can change them. :meth:`run` is idempotent."""

    def __init__(
        self,
        pairs: list[tuple[np.ndarray, np.ndarray]],
        keep: list[Any],
        before: Callable[[], None] | None = None,
    ) -> None:
        self._pairs: list[tuple[np.ndarray, np.ndarray]] | None = pairs
        self._keep: list[Any] | None = keep
        self._before = before
        self._failed: BaseException | None = None
        self.nbytes = sum(d.nbytes for d, _ in pairs)
        self.seconds = 0.0

    def run(self, executor: Executor | None, *, jobs: int) -> None:
        """Prepare the buffer (``before``: reserving its pages), copy (first call only) and
        release the pinned host copies. A failure releases them too, and every later call
        raises it again (the buffer never holds the chunks)."""
        if self._failed is not None:
            raise self._failed
        if self._pairs is None:
            return
        t0 = time.perf_counter()
        try:
            if self._before is not None:
                self._before()
            parallel_copy(self._pairs, executor, jobs=jobs)
        except BaseException as e:
            self._failed = e
            raise
        finally:
            self._pairs = self._keep = None
            self.seconds = time.perf_counter() - t0


@dataclasses.dataclass(frozen=True, slots=True)
class StagedSave:
    """Everything the background pipeline needs; independent of device memory.

    If ``deferred`` is set, the buffer holds its chunks only after :meth:`finish_copies`;
    the background part of a save calls it before reading the buffer."""

    arrays: tuple[StagedArray, ...]
    values: tuple[ValueLeaf, ...]
    buffer: np.ndarray
    """The staging buffer (uint8); chunk bytes live at ``item_offsets``."""
    nbytes: int
    """Bytes of shard data staged (excluding alignment padding)."""
    order: tuple[KeyPath, ...]
    """Every leaf path in flatten order (the manifest keeps this order)."""
    deferred: DeferredCopies | None = None
    """Copies from pinned host memory still to make (``stage_state(defer_host_copies=True)``)."""

    def finish_copies(self, executor: Executor | None, *, jobs: int) -> float:
        """Make the deferred copies (if any, once); returns the seconds they took."""
        if self.deferred is None:
            return 0.0
        self.deferred.run(executor, jobs=jobs)
        return self.deferred.seconds

    def chunk_view(self, array: StagedArray, i: int) -> memoryview:
        """Raw bytes of ``array.items[i]`` (a view into the staging buffer)."""
        off = array.item_offsets[i]
        return self.buffer.data[off : off + array.items[i].nbytes]

    def chunk_views(self) -> Iterator[tuple[int, int, memoryview]]:
        """``(array index, item index, raw bytes)`` of every staged chunk, in order (views
        into the staging buffer; slicing one memoryview costs less than slicing numpy arrays)."""
        buf = self.buffer.data
        for ai, arr in enumerate(self.arrays):
            for ii, (off, item) in enumerate(zip(arr.item_offsets, arr.items)):
                yield ai, ii, buf[off : off + item.nbytes]


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
class _Pending:
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
    """``"all"``, ``"shards"``, ``"pinned_all"``, ``"pinned_shards"`` or None: see
    :func:`_transfer_mode`."""


def _transfer_mode(
    *, on_host: bool, local_shards: int, used: Sequence[int], pinned: bool
) -> str | None:
    """How to start a leaf's device-to-host copies (pure).

    With ``pinned`` (the devices have ``pinned_host`` memory and the options allow it):
    ``"pinned_all"`` when every local shard is used (one ``device_put`` of the global array
    into pinned host memory), ``"pinned_shards"`` otherwise (each used shard's own, so
    replicas this process does not write stay on the device). Pinned memory is what an
    accelerator's DMA engines copy into at full speed, many times faster than
    ``jax.device_get`` into pageable memory (``docs/benchmarks.md``, accelerator).
    Without: None for shards on host-platform (CPU) devices: their memory is host memory,
    ``np.asarray`` views it without a copy and an asynchronous "transfer" is pure overhead
    (Python per shard). ``"all"`` when every local shard is used: the global
    array's ``copy_to_host_async`` starts them all in one call (no per-shard Python).
    ``"shards"`` otherwise: each used shard's own call."""
    every = len(used) == local_shards
    if pinned:
        return "pinned_all" if every else "pinned_shards"
    if on_host:
        return None
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


def _plan_array(
    leaf: FlatLeaf,
    *,
    process_index: int,
    max_chunk_bytes: int,
    plans: StagePlans | None = None,
    device_copy: str = "auto",
) -> _Pending:
    x = leaf.value
    where = keypath_str(leaf.path)
    key = None
    if plans is not None and isinstance(x, jax.Array) and not is_prng_key(x):
        key = _plan_key(x, process_index, max_chunk_bytes)
        plan = plans.get(key) if key is not None else None
        if plan is not None:
            _check_live(x, where)
            return _Pending(
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
        try:
            name = dtype_name(arr.dtype)
        except Exception as e:
            raise ConfigError(f"{where}: {e}") from e
        shards = [ShardInfo(full_box(arr.shape), 0 if process_index == 0 else 1, 0)]
        items = plan_leaf_writes(
            shards, itemsize=arr.dtype.itemsize, max_chunk_bytes=max_chunk_bytes
        )
        return _Pending(
            leaf.path, arr.shape, name, "numpy", None, None, items, {0: arr} if items else {}
        )
    if not isinstance(x, jax.Array):
        raise ConfigError(f"{where}: unsupported leaf type {type(x).__name__}")
    kind: ArrayKind = "jax"
    key_impl: str | None = None
    if is_prng_key(x):
        kind, key_impl = "prng_key", str(jax.random.key_impl(x))
        sharding = sharding_spec_of(x.sharding)
        x = jax.random.key_data(x)
    else:
        sharding = sharding_spec_of(x.sharding)
    _check_live(x, where)
    try:
        name = dtype_name(x.dtype)
    except Exception as e:
        raise ConfigError(f"{where}: {e}") from e
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
    )
    if key is not None:
        plans.put(key, _LeafPlan(name, sharding, items, tuple(used), transfer))  # type: ignore[union-attr]
    return _Pending(
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


def stage_state(
    leaves: list[FlatLeaf],
    *,
    process_index: int,
    max_chunk_bytes: int,
    allocate: Callable[[int], np.ndarray],
    executor: Executor | None,
    copy_threads: int = 2,
    plans: StagePlans | None = None,
    device_copy: str = "auto",
    defer_host_copies: bool = False,
    allocate_unreserved: Callable[[int], tuple[np.ndarray, Callable[[], None]]] | None = None,
) -> StagedSave:
    """Classify leaves, start all device-to-host copies, then copy shards into one buffer.

    Args:
        leaves: flattened state (``fastckpt._tree.flatten``).
        process_index: this process; numpy leaves are written by process 0 only.
        max_chunk_bytes: sub-chunk size bound.
        allocate: returns a writable uint8 buffer of at least the given size (a pooled
            staging buffer or a RAM-tier segment).
        executor: threads for the parallel copy (None: copy inline).
        copy_threads: parallel copy tasks on ``executor`` (at most its thread count).
        plans: leaf plans to reuse and extend (None: plan every leaf afresh). Plans record
            the transfer mode: reuse them only with the same ``device_copy`` (a manager's
            options are fixed).
        device_copy: ``SaveOptions.device_copy`` (how accelerator shards reach host memory).
        defer_host_copies: leave the copies out of pinned host memory to
            :meth:`StagedSave.finish_copies` (the caller must call it before reading the
            buffer); otherwise every copy is made before returning.
        allocate_unreserved: used instead of ``allocate`` when every copy is deferred:
            returns a buffer whose memory is prepared later (a RAM-tier segment whose pages
            are not reserved yet) and the function that prepares it, which
            :meth:`StagedSave.finish_copies` calls before copying.
    """
    pending: list[_Pending] = []
    values: list[ValueLeaf] = []
    for leaf in leaves:
        v = value_leaf_of(leaf.path, leaf.value)
        if v is not None:
            values.append(v)
        else:
            pending.append(
                _plan_array(
                    leaf,
                    process_index=process_index,
                    max_chunk_bytes=max_chunk_bytes,
                    plans=plans,
                    device_copy=device_copy,
                )
            )
    # (2) start every transfer before waiting on any (device_put is asynchronous).
    keep: list[Any] = []
    for p in pending:
        if p.transfer == "all":
            p.array.copy_to_host_async()
        elif p.transfer == "shards":
            for src in p.sources.values():
                src.copy_to_host_async()
        elif p.transfer == "pinned_all":
            host = jax.device_put(
                p.array, p.array.sharding.with_memory_kind("pinned_host"), may_alias=False
            )
            keep.append(host)
            p.sources = {i: host.addressable_data(i) for i in p.sources}
        elif p.transfer == "pinned_shards":
            p.sources = {
                i: jax.device_put(
                    src, src.sharding.with_memory_kind("pinned_host"), may_alias=False
                )
                for i, src in p.sources.items()
            }  # (may_alias: a shard already pinned is copied too)
            keep.extend(p.sources.values())
    # (3) host views of the shards (waits for the transfers), laid out in one buffer,
    # 64-byte aligned; then copy.
    leaf_hosts = [
        {idx: as_bytes(np.asarray(src)) for idx, src in p.sources.items()} for p in pending
    ]
    flat = [h.nbytes for hosts in leaf_hosts for h in hosts.values()]
    starts, total = aligned_offsets(flat)
    staged_bytes = sum(flat)
    next_start = iter(starts)
    shard_offsets = [{idx: next(next_start) for idx in hosts} for hosts in leaf_hosts]
    deferrable = [
        defer_host_copies and p.transfer in ("pinned_all", "pinned_shards") for p in pending
    ]
    prepare = None
    if allocate_unreserved is not None and pending and all(deferrable):
        buffer, prepare = allocate_unreserved(total)
    else:
        buffer = allocate(total)
    copies: list[tuple[np.ndarray, np.ndarray]] = []
    later: list[tuple[np.ndarray, np.ndarray]] = []
    arrays = []
    for p, hosts, offs, defer in zip(pending, leaf_hosts, shard_offsets, deferrable):
        to = later if defer else copies
        for it in p.items:  # items tile their shards: copying them copies every shard
            dst = offs[it.shard_index] + it.byte_offset
            to.append(
                (
                    buffer[dst : dst + it.nbytes],
                    hosts[it.shard_index][it.byte_offset : it.byte_offset + it.nbytes],
                )
            )
        arrays.append(
            StagedArray(
                path=p.path,
                shape=p.shape,
                dtype=p.dtype,
                kind=p.kind,
                sharding=p.sharding,
                key_impl=p.key_impl,
                items=p.items,
                item_offsets=tuple(offs[it.shard_index] + it.byte_offset for it in p.items),
            )
        )
    parallel_copy(copies, executor, jobs=copy_threads)
    deferred = DeferredCopies(later, keep, prepare) if later or prepare is not None else None
    return StagedSave(
        tuple(arrays),
        tuple(values),
        buffer,
        staged_bytes,
        tuple(leaf.path for leaf in leaves),
        deferred,
    )


def staged_crc32c(
    staged: StagedSave, executor: Executor | None, *, jobs: int = 2
) -> dict[int, list[int]]:
    """crc32c of every staged chunk's raw bytes: array index -> one per item, in order.

    A pass over the staging buffer in ``jobs`` parallel tasks; run it off the training
    thread (the background part of a save), after :func:`stage_state` returned.
    """
    views = [view for _, _, view in staged.chunk_views()]
    crcs = iter(parallel_crc32c(views, executor, jobs=jobs))
    return {ai: [next(crcs) for _ in arr.items] for ai, arr in enumerate(staged.arrays)}
