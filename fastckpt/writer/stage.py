"""Stage a pytree for saving: classify leaves and copy this process's shards to host.

This is the only part of a save that blocks the training step. Call order inside
:func:`stage_state`: (1) classify leaves and plan chunks (pure, in ``_stage_plans``), (2)
start every device-to-host copy before waiting on any — into ``pinned_host`` memory where
the devices have it (an accelerator's DMA engines at full speed; ``SaveOptions.device_copy``),
else ``copy_to_host_async``; none for shards already in host memory — (3) copy every shard
into one staging buffer (parallel). After it returns, the caller may mutate or donate the device
arrays: the staged copy is independent of them. With ``defer_host_copies``, step (3) skips the
shards it can copy later and :meth:`StagedSave.finish_copies` (the background part of the save,
first) copies them: those in pinned host memory (private copies: the step waits for the DMA
alone) and those on host-platform (CPU) devices (the step waits for no copy): their numpy views,
taken before returning, keep the buffers alive through a ``delete()`` and make jax decline to
donate them (a donating step allocates new outputs instead) until copied. numpy leaves are
always copied before returning (their owner may write to them).
Checksums are not computed here: the background part of the save computes them from the
staged copy (:func:`staged_crc32c`, or while encoding), so the step waits for the copy alone;
a deferred copy can checksum each chunk as it copies it (``finish_copies(checksum=True)``:
one pass over memory), and :func:`staged_crc32c` then reuses those.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from typing import Any

import jax
import numpy as np

from fastckpt._hostmem import (
    aligned_offsets,
    as_bytes,
    parallel_copy,
    parallel_copy_crc32c,
    parallel_crc32c,
)
from fastckpt._tree import FlatLeaf
from fastckpt.format.manifest import ArrayKind, KeyPath, ShardingSpec, ValueLeaf
from fastckpt.planning import WriteItem
from fastckpt.writer._stage_plans import (
    PendingLeaf,
    StagePlans,
    plan_array,
    sharding_spec_of,
    staging_nbytes,
    value_leaf_of,
)

__all__ = [
    "DeferredCopies",
    "StagePlans",
    "StagedArray",
    "StagedSave",
    "sharding_spec_of",
    "stage_state",
    "staged_crc32c",
    "staging_nbytes",
    "value_leaf_of",
    "warm_plans",
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
    a view of a private ``pinned_host`` copy of a shard or of a host-platform shard's own
    buffer (held here until copied), so nothing the caller does to its arrays can change them
    (see the module docstring). :meth:`run` is idempotent.

    Each pair is one staged chunk, ``ids[k]`` = (array index, item index) of pair ``k``."""

    def __init__(
        self,
        pairs: list[tuple[np.ndarray, np.ndarray]],
        keep: list[Any],
        before: Callable[[], None] | None = None,
        ids: list[tuple[int, int]] | None = None,
    ) -> None:
        self._pairs: list[tuple[np.ndarray, np.ndarray]] | None = pairs
        self._keep: list[Any] | None = keep
        self._before = before
        self._ids = ids or []
        self._failed: BaseException | None = None
        self.nbytes = sum(d.nbytes for d, _ in pairs)
        self.seconds = 0.0
        self.crcs: dict[tuple[int, int], int] = {}
        """crc32c of each copied chunk by (array index, item index), after
        ``run(checksum=True)``."""

    def run(self, executor: Executor | None, *, jobs: int, checksum: bool = False) -> None:
        """Prepare the buffer (``before``: reserving its pages), copy (first call only) and
        release the pinned host copies; with ``checksum``, each chunk's crc32c is taken
        block by block as it is copied (:attr:`crcs`). A failure releases them too, and every
        later call raises it again (the buffer never holds the chunks)."""
        if self._failed is not None:
            raise self._failed
        if self._pairs is None:
            return
        t0 = time.perf_counter()
        try:
            if self._before is not None:
                self._before()
            if checksum and len(self._ids) == len(self._pairs):
                crcs = parallel_copy_crc32c(self._pairs, executor, jobs=jobs)
                self.crcs = dict(zip(self._ids, crcs))
            else:
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

    def finish_copies(
        self, executor: Executor | None, *, jobs: int, checksum: bool = False
    ) -> float:
        """Make the deferred copies (if any, once; ``checksum``: see :meth:`DeferredCopies.run`);
        returns the seconds they took."""
        if self.deferred is None:
            return 0.0
        self.deferred.run(executor, jobs=jobs, checksum=checksum)
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


def _start_transfers(pending: list[PendingLeaf]) -> list[Any]:
    """Start every leaf's device-to-host copies before waiting on any (``device_put`` is
    asynchronous); returns the pinned host copies made, to hold until they are copied."""
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
    return keep


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
        defer_host_copies: leave the copies out of pinned host memory and of host-platform
            shards to :meth:`StagedSave.finish_copies` (the caller must call it before reading
            the buffer); otherwise every copy is made before returning.
        allocate_unreserved: used instead of ``allocate`` when every copy is deferred:
            returns a buffer whose memory is prepared later (a RAM-tier segment whose pages
            are not reserved yet) and the function that prepares it, which
            :meth:`StagedSave.finish_copies` calls before copying.
    """
    pending: list[PendingLeaf] = []
    values: list[ValueLeaf] = []
    for leaf in leaves:
        v = value_leaf_of(leaf.path, leaf.value)
        if v is not None:
            values.append(v)
        else:
            pending.append(
                plan_array(
                    leaf,
                    process_index=process_index,
                    max_chunk_bytes=max_chunk_bytes,
                    plans=plans,
                    device_copy=device_copy,
                )
            )
    keep = _start_transfers(pending)
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
        defer_host_copies and p.transfer in ("pinned_all", "pinned_shards", "host") for p in pending
    ]
    prepare = None
    if allocate_unreserved is not None and pending and all(deferrable):
        buffer, prepare = allocate_unreserved(total)
    else:
        buffer = allocate(total)
    copies: list[tuple[np.ndarray, np.ndarray]] = []
    later: list[tuple[np.ndarray, np.ndarray]] = []
    later_ids: list[tuple[int, int]] = []
    arrays = []
    for ai, (p, hosts, offs, defer) in enumerate(
        zip(pending, leaf_hosts, shard_offsets, deferrable)
    ):
        to = later if defer else copies
        for ii, it in enumerate(p.items):  # items tile their shards: copying them copies all
            dst = offs[it.shard_index] + it.byte_offset
            to.append(
                (
                    buffer[dst : dst + it.nbytes],
                    hosts[it.shard_index][it.byte_offset : it.byte_offset + it.nbytes],
                )
            )
            if defer:
                later_ids.append((ai, ii))
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
    deferred = (
        DeferredCopies(later, keep, prepare, later_ids) if later or prepare is not None else None
    )
    return StagedSave(
        tuple(arrays),
        tuple(values),
        buffer,
        staged_bytes,
        tuple(leaf.path for leaf in leaves),
        deferred,
    )


def warm_plans(
    leaves: list[FlatLeaf],
    *,
    process_index: int,
    max_chunk_bytes: int,
    plans: StagePlans,
    device_copy: str = "auto",
) -> int:
    """Plan every concrete jax array leaf into ``plans`` as :func:`stage_state` would (pure: no
    copy starts; abstract leaves and other leaves are skipped), so that the first save of
    such a state finds its plans cached. On the saving thread (``StagePlans`` is not
    thread-safe). Returns the leaves planned."""
    n = 0
    for leaf in leaves:
        if isinstance(leaf.value, jax.Array) and not leaf.value.is_deleted():
            plan_array(
                leaf,
                process_index=process_index,
                max_chunk_bytes=max_chunk_bytes,
                plans=plans,
                device_copy=device_copy,
            )
            n += 1
    return n


def staged_crc32c(
    staged: StagedSave, executor: Executor | None, *, jobs: int = 2
) -> dict[int, list[int]]:
    """crc32c of every staged chunk's raw bytes: array index -> one per item, in order.

    A pass over the staging buffer in ``jobs`` parallel tasks; run it off the training
    thread (the background part of a save), after :func:`stage_state` returned and
    :meth:`StagedSave.finish_copies`. Chunks whose deferred copy checksummed them
    (``checksum=True``) are not read again.
    """
    known = staged.deferred.crcs if staged.deferred is not None else {}
    todo = [(ai, ii, view) for ai, ii, view in staged.chunk_views() if (ai, ii) not in known]
    computed = parallel_crc32c([view for _, _, view in todo], executor, jobs=jobs)
    crcs = {**known, **{(ai, ii): crc for (ai, ii, _), crc in zip(todo, computed)}}
    return {
        ai: [crcs[(ai, ii)] for ii in range(len(arr.items))] for ai, arr in enumerate(staged.arrays)
    }
