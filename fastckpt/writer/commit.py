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

One path for every tier: :meth:`CommitRound.commit` runs the protocol; the tier supplies
where the fragments go (a :class:`FragmentRoute`) and the create-only ``publish`` of the
manifest. Storage commits through :func:`publish_and_commit` (it is no ``writer.tier.Tier``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol

from fastckpt._pygc import paused_gc
from fastckpt.coordination.distributed import Coordinator, time_left
from fastckpt.errors import (
    AlreadyExistsError,
    BarrierTimeoutError,
    DistributedError,
    StepAlreadyCommittedError,
)
from fastckpt.format.codec import decode_manifest, encode_manifest
from fastckpt.format.layout import fragment_key, manifest_key, step_from_data_key
from fastckpt.format.manifest import ArrayLeaf, KeyPath, Leaf, Manifest
from fastckpt.storage import Buffer, Store
from fastckpt.writer.fragment import ProcessChunks, decode_fragments, encode_fragment
from fastckpt.writer.merge import merge_chunks
from fastckpt.writer.stage import StagedSave

__all__ = [
    "CommitRound",
    "CoordinatorFragments",
    "FragmentRoute",
    "StoreFragments",
    "build_manifest",
    "publish_and_commit",
]

_POLL_S = 0.05
_FRAGMENT_READS = 32


@paused_gc()
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
    also decodes the encoding (a fast tier's manifests skip it: a bad one is refused at
    restore and an older step used). Runs with the cyclic garbage collector paused
    (``fastckpt._pygc.paused_gc``). Raises ``ManifestError``."""
    tables = merge_chunks(parts, staged)
    by_path: dict[KeyPath, Leaf] = {v.path: v for v in staged.values}
    for arr in staged.arrays:
        by_path[arr.path] = ArrayLeaf(
            path=arr.path,
            shape=arr.shape,
            dtype=arr.dtype,
            chunks=tables[arr.path],
            kind=arr.kind,
            sharding=arr.sharding,
            key_impl=arr.key_impl,
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
        polled = coord.try_get_all(f"{ns}/done", n, timeout_s=time_left(deadline))  # one request
        for i, value in enumerate(polled):
            if values[i] is None and value is not None:
                values[i] = value
                if value.startswith("err"):
                    raise DistributedError(f"process {i} failed its part of the save: {value[4:]}")
        if all(v is not None for v in values):
            keys = [v[3:] for v in values]  # type: ignore[index]
            wrong = [(i, k) for i, k in enumerate(keys) if step_from_data_key(k) != step]
            if wrong:
                raise DistributedError(
                    f"process {wrong[0][0]} published {wrong[0][1]!r} for the commit of step "
                    f"{step}: the processes' saves are out of step"
                )
            return keys
        if time.monotonic() > deadline:
            missing = [i for i, v in enumerate(values) if v is None]
            raise BarrierTimeoutError(
                f"processes {missing} did not finish their part of the save in time"
            )
        time.sleep(_POLL_S)


async def _read_all(store: Store, keys: Sequence[str]) -> list[Buffer]:
    """Every fragment, ``_FRAGMENT_READS`` at a time. The first failure cancels the rest and
    is raised as itself (not as an exception group)."""
    limit = asyncio.Semaphore(_FRAGMENT_READS)

    async def one(key: str) -> Buffer:
        async with limit:
            return await store.get(key)

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(k)) for k in keys]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [t.result() for t in tasks]


class FragmentRoute(Protocol):
    """How the processes' fragments (chunk lists) of one commit round reach process 0."""

    def put(self, idx: int, fragment: bytes, deadline: float) -> None:
        """Send process ``idx``'s fragment, and tell process 0 it is there."""

    def fail(self, idx: int, message: str, deadline: float) -> None:
        """Tell process 0 that process ``idx`` failed its part of the save."""

    def gather(self, deadline: float) -> Sequence[bytes | memoryview]:
        """Process 0: every process's fragment; ``DistributedError`` naming one that failed,
        ``BarrierTimeoutError`` past ``deadline``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoreFragments:
    """Fragments as storage objects (a persistent step), announced under ``<ns>/done/<i>``."""

    round: CommitRound
    store: Store
    store_run: Callable[[Coroutine[Any, Any, Any]], Any]
    save_id: str

    def put(self, idx: int, fragment: bytes, deadline: float) -> None:
        key = fragment_key(self.round.step, self.save_id, idx)
        self.store_run(self.store.put(key, fragment, mode="overwrite"))
        self.round.coord.set(
            f"{self.round.ns}/done/{idx}", f"ok {key}", timeout_s=time_left(deadline)
        )

    def fail(self, idx: int, message: str, deadline: float) -> None:
        self.round.coord.set(
            f"{self.round.ns}/done/{idx}", f"err {message}", timeout_s=time_left(deadline)
        )

    def gather(self, deadline: float) -> Sequence[bytes | memoryview]:
        keys = _wait_all_done(self.round.coord, self.round.ns, deadline, self.round.step)
        return self.store_run(_read_all(self.store, keys))  # type: ignore[no-any-return]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CoordinatorFragments:
    """Fragments through the coordinator's key-value store under ``<ns>/frag/<i>`` (a step
    of a fast tier: no storage round trip), each prefixed ``ok `` or ``err ``."""

    round: CommitRound

    def put(self, idx: int, fragment: bytes, deadline: float) -> None:
        self.round.coord.set_bytes(
            f"{self.round.ns}/frag/{idx}", b"ok " + fragment, timeout_s=time_left(deadline)
        )

    def fail(self, idx: int, message: str, deadline: float) -> None:
        self.round.coord.set_bytes(
            f"{self.round.ns}/frag/{idx}", b"err " + message.encode(), timeout_s=time_left(deadline)
        )

    def gather(self, deadline: float) -> Sequence[bytes | memoryview]:
        out: list[bytes | memoryview] = []
        for i in range(self.round.coord.process_count):
            data = self.round.coord.get_bytes(
                f"{self.round.ns}/frag/{i}", timeout_s=time_left(deadline)
            )
            if not data.startswith(b"ok "):
                raise DistributedError(
                    f"process {i} failed its part of the save: {data[4:].decode(errors='replace')}"
                )
            out.append(memoryview(data)[3:])
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommitRound:
    """One commit of ``step`` among the job's processes, meeting under ``ns``: the one commit
    path of storage and of every fast tier (``writer.tier``)."""

    coord: Coordinator
    ns: str
    step: int
    staged: StagedSave
    timeout_s: float
    writer_version: str

    def commit(
        self,
        chunks: ProcessChunks | None,
        *,
        route: FragmentRoute,
        publish: Callable[[bytes], None],
        metadata: dict[str, object],
        error: BaseException | None = None,
        validate: bool = True,
        share: bool = False,
    ) -> bytes | None:
        """Run steps 1-3 of the protocol for this process (blocking; call off the train thread):
        fragments through ``route``, the manifest built on process 0 (``build_manifest``)
        and committed by ``publish(manifest)`` (create-only) before any other process learns
        the outcome. Returns the manifest on process 0, and with ``share`` on every process
        (it goes through the coordinator), else None; raises ``error`` or any failure."""
        coord, step = self.coord, self.step
        deadline = time.monotonic() + self.timeout_s
        idx, n = coord.process_index, coord.process_count
        if n > 1:
            if error is None:
                try:
                    assert chunks is not None
                    route.put(idx, encode_fragment(chunks, self.staged, idx), deadline)
                except BarrierTimeoutError:
                    raise  # no answer from the coordination service: no report would get through
                except BaseException as e:
                    route.fail(idx, f"{type(e).__name__}: {e}", deadline)
                    raise
            else:
                route.fail(idx, f"{type(error).__name__}: {error}", deadline)
        if error is not None and idx != 0:
            raise error
        if idx != 0:
            verdict = coord.get(f"{self.ns}/commit", timeout_s=time_left(deadline))
            if not verdict.startswith("ok"):
                raise DistributedError(f"step {step} was not committed: {verdict[4:]}")
            return verdict[3:].encode() if share else None
        try:
            if error is not None:
                raise error
            assert chunks is not None
            parts = decode_fragments(route.gather(deadline), self.staged) if n > 1 else [chunks]
            manifest = build_manifest(
                step=step,
                staged=self.staged,
                parts=parts,
                num_processes=n,
                metadata=metadata,
                writer_version=self.writer_version,
                validate=validate,
            )
            publish(manifest)
        except BaseException as e:
            if n > 1 and not isinstance(e, BarrierTimeoutError):
                coord.set(
                    f"{self.ns}/commit",
                    f"err {type(e).__name__}: {e}",
                    timeout_s=time_left(deadline),
                )
            raise
        if n > 1:  # the step is committed: the others must learn it, however late
            coord.set(f"{self.ns}/commit", "ok " + manifest.decode() if share else "ok")
        return manifest


def publish_and_commit(
    commit_round: CommitRound,
    *,
    store_run: Callable[[Coroutine[Any, Any, Any]], Any],
    store: Store,
    save_id: str,
    chunks: ProcessChunks | None,
    error: BaseException | None,
    metadata: dict[str, object],
) -> bytes | None:
    """The commit of a persistent step: fragments as storage objects, the manifest put
    create-only (``StepAlreadyCommittedError`` if it exists). ``store_run(coro)`` runs a
    storage coroutine to completion (the manager's loop). See :meth:`CommitRound.commit`."""

    def put_manifest(data: bytes) -> None:
        try:
            store_run(store.put(manifest_key(commit_round.step), data, mode="create"))
        except AlreadyExistsError as e:
            raise StepAlreadyCommittedError(
                f"step {commit_round.step} is already committed in {store.url}"
            ) from e

    route = StoreFragments(round=commit_round, store=store, store_run=store_run, save_id=save_id)
    return commit_round.commit(
        chunks, route=route, publish=put_manifest, metadata=metadata, error=error
    )
