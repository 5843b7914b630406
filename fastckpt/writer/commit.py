"""The commit protocol: gather every process's chunks and write the manifest, last.

Protocol for save number ``seq`` of a manager (all processes call save in the same order):

1. Every process uploads its objects (``writer.pipeline``). With more than one process it
   then writes its *fragment* (its chunk list as a chunk table: ``writer.fragment``) and
   publishes ``<ns>/<seq>/done/<i> = "ok <fragment key>"``, or ``"err <message>"`` if
   anything failed. A single process writes no fragment: it merges its own chunk list.
2. Process 0 waits for all ``done`` keys (bounded by ``barrier_timeout_s``; it stops early
   at the first ``err``), reads and decodes the fragments, builds the manifest and writes
   it with a create-only put. Only then does the step exist. It publishes
   ``<ns>/<seq>/commit`` as ``"ok"`` or ``"err <message>"``.
3. Every other process waits for ``commit`` (bounded) and raises if it is not ``ok``.

A process that dies makes the others time out with :class:`BarrierTimeoutError`; no commit
happens. A step whose manifest already exists is never overwritten
(:class:`StepAlreadyCommittedError`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from fastckpt.coordination.distributed import Coordinator, time_left
from fastckpt.errors import (
    AlreadyExistsError,
    BarrierTimeoutError,
    DistributedError,
    StepAlreadyCommittedError,
)
from fastckpt._pygc import paused_gc
from fastckpt.format.codec import decode_manifest, encode_manifest
from fastckpt.format.layout import fragment_key, manifest_key, ram_object_key, step_from_data_key
from fastckpt.format.manifest import ArrayLeaf, KeyPath, Leaf, Manifest
from fastckpt.storage._protocol import Buffer, Store
from fastckpt.writer.fragment import ChunkRows, ProcessChunks, decode_fragments, encode_fragment
from fastckpt.writer.merge import merge_chunks
from fastckpt.writer.stage import StagedSave

__all__ = [
    "build_manifest",
    "exchange_ram_manifest",
    "publish_and_commit",
    "ram_chunks",
]

_POLL_S = 0.05
_FRAGMENT_READS = 32


def build_manifest(
    *,
    step: int,
    staged: StagedSave,
    parts: Sequence[ProcessChunks],
    num_processes: int,
    metadata: dict[str, object],
    writer_version: str,
    validate: bool = True,
) -> bytes:
    """Merge the processes' chunks (``writer.merge``) and encode the manifest of a step;
    returns the bytes to store. The merge proves the tiling and the ranges; ``validate``
    also decodes the encoding (a persistent step's manifest, written once and read for
    years, is checked end to end; a RAM step's, built every few steps, is not: a bad one
    would be refused at restore and an older step used).
    Runs with the cyclic garbage collector paused (``fastckpt._pygc.paused_gc``): the merged
    tables are millions of fresh ints, which the collector would otherwise walk while the
    manifest is encoded. Raises ``ManifestError``."""
    with paused_gc():
        return _build(step, staged, parts, num_processes, metadata, writer_version, validate)


def _build(step: int, staged: StagedSave, parts: Sequence[ProcessChunks], num_processes: int,
           metadata: dict[str, object], writer_version: str, validate: bool) -> bytes:
    tables = merge_chunks(parts, staged)
    by_path: dict[KeyPath, Leaf] = {v.path: v for v in staged.values}
    for arr in staged.arrays:
        by_path[arr.path] = ArrayLeaf(
            path=arr.path, shape=arr.shape, dtype=arr.dtype, chunks=tables[arr.path],
            kind=arr.kind, sharding=arr.sharding, key_impl=arr.key_impl,  # type: ignore[arg-type]
        )
    manifest = Manifest(
        step=step,
        leaves=tuple(by_path[p] for p in staged.order),
        num_processes=num_processes,
        created_unix=time.time(),
        writer_version=writer_version,
        metadata=dict(metadata),
    )
    data = encode_manifest(manifest)
    if validate:
        decode_manifest(data)
    return data


def _wait_all_done(coord: Coordinator, ns: str, deadline: float, step: int) -> list[str]:
    """Every process's fragment key, once all are done; each must be a fragment of ``step``
    (a process saving another step would have its shards committed as this one's)."""
    n = coord.process_count
    values: list[str | None] = [None] * n
    while True:
        for i, value in enumerate(coord.try_get_all(f"{ns}/done", n, timeout_s=time_left(deadline))):  # one request per poll
            if values[i] is None and value is not None:
                values[i] = value
                if value.startswith("err"):
                    raise DistributedError(f"process {i} failed its part of the save: {value[4:]}")
        if all(v is not None for v in values):
            keys = [v[3:] for v in values]  # type: ignore[index]
            wrong = [(i, k) for i, k in enumerate(keys) if step_from_data_key(k) != step]
            if wrong:
                raise DistributedError(f"process {wrong[0][0]} published {wrong[0][1]!r} for the commit of step "
                                       f"{step}: the processes' saves are out of step")
            return keys
        if time.monotonic() > deadline:
            missing = [i for i, v in enumerate(values) if v is None]
            raise BarrierTimeoutError(f"processes {missing} did not finish their part of the save in time")
        time.sleep(_POLL_S)


async def _read_all(store: Store, keys: Sequence[str]) -> list[Buffer]:
    """Every fragment, ``_FRAGMENT_READS`` at a time (one read per process: on GCS a pod's
    fragments read one after another would cost hundreds of round trips per commit).
    The first failure cancels the rest and is raised as itself (not as an exception group)."""
    limit = asyncio.Semaphore(_FRAGMENT_READS)

    async def one(key: str) -> bytes:
        async with limit:
            return await store.get(key)

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(k)) for k in keys]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [t.result() for t in tasks]


def publish_and_commit(
    *,
    store_run: Callable[[Coroutine[Any, Any, Any]], Any],
    store: Store,
    coord: Coordinator,
    ns: str,
    step: int,
    save_id: str,
    staged: StagedSave,
    chunks: ProcessChunks | None,
    error: BaseException | None,
    timeout_s: float,
    metadata: dict[str, object],
    writer_version: str,
) -> bytes | None:
    """Run steps 1–3 of the protocol for this process (blocking; call off the train thread).

    ``store_run(coro)`` runs a storage coroutine to completion (the manager's loop).
    Returns the encoded manifest on process 0, None elsewhere; raises on any failure.
    """
    deadline = time.monotonic() + timeout_s
    idx, n = coord.process_index, coord.process_count
    if n > 1:
        if error is None:
            try:
                assert chunks is not None
                fkey = fragment_key(step, save_id, idx)
                store_run(store.put(fkey, encode_fragment(chunks, staged, idx), mode="overwrite"))
                coord.set(f"{ns}/done/{idx}", f"ok {fkey}", timeout_s=time_left(deadline))
            except BarrierTimeoutError:
                raise  # the coordination service did not answer: a report would not get through either
            except BaseException as e:
                coord.set(f"{ns}/done/{idx}", f"err {type(e).__name__}: {e}", timeout_s=time_left(deadline))
                raise
        else:
            coord.set(f"{ns}/done/{idx}", f"err {type(error).__name__}: {error}", timeout_s=time_left(deadline))
    if error is not None and idx != 0:
        raise error
    if idx != 0:
        verdict = coord.get(f"{ns}/commit", timeout_s=time_left(deadline))
        if verdict != "ok":
            raise DistributedError(f"step {step} was not committed: {verdict[4:]}")
        return None
    try:
        if error is not None:
            raise error
        assert chunks is not None
        if n > 1:
            keys = _wait_all_done(coord, ns, deadline, step)
            parts = decode_fragments(store_run(_read_all(store, keys)), staged)
        else:
            parts = [chunks]
        manifest_bytes = build_manifest(step=step, staged=staged, parts=parts, num_processes=n,
                                        metadata=metadata, writer_version=writer_version)
        try:
            store_run(store.put(manifest_key(step), manifest_bytes, mode="create"))
        except AlreadyExistsError as e:
            raise StepAlreadyCommittedError(f"step {step} is already committed in {store.url}") from e
    except BaseException as e:
        if n > 1 and not isinstance(e, BarrierTimeoutError):
            coord.set(f"{ns}/commit", f"err {type(e).__name__}: {e}", timeout_s=time_left(deadline))
        raise
    if n > 1:
        coord.set(f"{ns}/commit", "ok")  # the step is committed: the others must learn it, however late
    return manifest_bytes


def ram_chunks(staged: StagedSave, raw_crcs: dict[int, list[int]], step: int, *,
               writer: str | None = None) -> ProcessChunks:
    """This process's chunks of a RAM-only step: raw codec, located in the staging segment.

    The key (:func:`ram_object_key`) names no persistent object: RAM tiers and peers find
    chunks by ``chunk_id`` and verify against ``raw_crc32c``. It names the ``writer``
    (this process's RAM member id), so that the manifest tells a restoring host which
    member wrote each chunk, and so which peers hold it (the writer and its ring successors).
    """
    key = ram_object_key(step, writer)
    rows = ChunkRows()
    for ai, arr in enumerate(staged.arrays):
        crcs = raw_crcs[ai]
        for ii, it in enumerate(arr.items):
            rows.add(ai, it.box, key, arr.item_offsets[ii], it.nbytes, "raw", crcs[ii], crcs[ii])
    return rows.build()


_HELD = "held by process 0"  # the RAM manifest record when it is not broadcast


def exchange_ram_manifest(
    *,
    coord: Coordinator,
    ns: str,
    step: int,
    staged: StagedSave,
    chunks: ProcessChunks,
    timeout_s: float,
    metadata: dict[str, object],
    writer_version: str,
    hold: Callable[[bytes], None],
    broadcast: bool = True,
) -> bytes | None:
    """Build the manifest of a RAM-only step through the coordinator; returns it (or None).

    Each process publishes its fragment under ``<ns>/ramfrag/<i>`` (a single process merges
    its own chunks, with no fragment); process 0 decodes and merges them,
    calls ``hold(manifest)`` (stores it in its RAM tier) and only then tells the others
    under ``<ns>/rammanifest``, so the manifest exists before any process counts the step
    as committed. With ``broadcast`` the record is the manifest itself and every process
    returns it (each must hold it: there is no peer to fetch it from); without, the record
    is a few bytes, process 0 returns the manifest and the others None: the manifest then
    reaches process 0's ring successors with its push, and a restore fetches it from any
    peer holding it, instead of every RAM checkpoint moving (processes x manifest) bytes
    through the coordinator. Bounded by ``timeout_s`` (``BarrierTimeoutError``).
    """
    idx, n = coord.process_index, coord.process_count
    if n == 1:
        data = build_manifest(step=step, staged=staged, parts=[chunks], num_processes=1,
                              metadata=metadata, writer_version=writer_version, validate=False)
        hold(data)
        return data
    deadline = time.monotonic() + timeout_s
    coord.set_bytes(f"{ns}/ramfrag/{idx}", encode_fragment(chunks, staged, idx), timeout_s=time_left(deadline))
    if idx == 0:
        fragments = [coord.get_bytes(f"{ns}/ramfrag/{i}", timeout_s=time_left(deadline)) for i in range(n)]
        data = build_manifest(step=step, staged=staged, parts=decode_fragments(fragments, staged),
                              num_processes=n, metadata=metadata, writer_version=writer_version,
                              validate=False)
        hold(data)
        coord.set(f"{ns}/rammanifest", data.decode() if broadcast else _HELD, timeout_s=time_left(deadline))
        return data
    record = coord.get(f"{ns}/rammanifest", timeout_s=time_left(deadline))
    if record == _HELD:
        return None
    return record.encode()
