"""Per-leaf and per-chunk costs of a restore as a state grows towards pod scale.

Run ``python -m benchmarks.planning_scale [--quick]``. On a pod, a leaf saved by N devices
has N chunks and a state has thousands of leaves; the costs that grow with them, not with
bytes, decide how long a restore takes before any data moves. Eight parts, each reported
side by side in one run:

1. **Read planning** (pure, no devices): planning one host's 8 destination boxes of one
   leaf against N stored chunks, by scanning every chunk per box (``plan_leaf_reads`` of a
   table with listed boxes, without an index), through one
   :class:`~fastckpt.planning.ChunkIndex` per leaf (what the reader does for listed boxes)
   and through a :class:`~fastckpt.planning.GridIndex` of the table's grid (what fastckpt
   writes for every sharding), same mesh and a 4 -> 3 reshard; ms per leaf and the ratios.
2. **Manifest codec**: encode and decode a manifest of L leaves x N chunks (a chunk table
   per leaf, binary columns); microseconds and bytes per chunk.
3. **Commit on process 0**: decoding P processes' fragments of L leaves x N chunks and
   merging them into the manifest (``writer.merge``, column by column), as every
   multi-process persistent and RAM checkpoint does.
4. **A restoring host**: decoding the manifest and planning one host's 8 units of every
   leaf (chunk tables whose entries are built on access, bisected by a
   :class:`~fastckpt.planning.GridIndex`); seconds, microseconds per chunk of the manifest,
   and the decoded manifest's memory.
5. **A RAM manifest through the coordinator**: a real 4-process ``jax.distributed`` job times
   handing the manifest's bytes from process 0 to every process through the key-value store
   (the broadcast every multi-host RAM checkpoint made before process 0 kept the manifest)
   beside the few-byte record announced now.
6. **Choosing the RAM step**: process 0 checking every chunk id against every peer's chunk
   list (until ``a42628d``) beside one host checking its own share (now); CPU seconds.
7. **Own-RAM restore vs leaf count**: RAM-only saves and own-RAM restores of states made of
   many small leaves (128 KiB, 8 shards each) on 8 CPU devices; ms per leaf for the
   blocking part of ``save()`` and for ``restore()``.
8. **A RAM manifest to every restoring host**: every host asking every peer for its steps and
   reading one of the 2 holders (until ``manifest_relay``) beside the relay tree
   (``placement.relay_parent``): requests, copies the busiest host serves, tree depth, and
   process 0's CPU to plan it (pure: the tree over H hosts).

Writes ``benchmarks/results/planning_scale.{json,md,png}``.
"""

from __future__ import annotations

from benchmarks._common import configure_host_devices

configure_host_devices(8)  # before anything imports jax

import argparse  # noqa: E402
import gc  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks._common import (  # noqa: E402
    RESULTS_DIR,
    bar_chart,
    make_mesh,
    markdown_table,
    median,
    publish_docs,
    write_json,
)

MiB = 1 << 20
ROWS, COLS = 8192, 1024


def _cells(grid: tuple[int, int]) -> list[tuple[int, int, tuple[tuple[int, int], ...]]]:
    """``(row, column, box)`` of every cell of ``grid`` over the ROWS x COLS array, row-major."""
    return [
        (
            i,
            j,
            (
                (i * ROWS // grid[0], (i + 1) * ROWS // grid[0]),
                (j * COLS // grid[1], (j + 1) * COLS // grid[1]),
            ),
        )
        for i in range(grid[0])
        for j in range(grid[1])
    ]


def _leaf(k: int, grid: tuple[int, int]) -> Any:
    """Leaf ``k`` saved by ``grid`` devices: device ``(i, j)``'s shard in process ``i``'s
    object (real key layout, offsets growing with ``k``, random checksums); its chunk table
    has a grid."""
    import random

    from fastckpt.format.chunk_table import table_from_entries
    from fastckpt.format.layout import data_key
    from fastckpt.format.manifest import ArrayLeaf, ChunkEntry, box_volume

    rng = random.Random(k)
    chunks = []
    for i, j, box in _cells(grid):
        n = box_volume(box) * 4
        crc = rng.getrandbits(32)
        chunks.append(
            ChunkEntry(
                box=box,
                key=data_key(100, "3f9a1c2e", i, 0),
                offset=n * (j + k * grid[1]),
                length=n,
                raw_length=n,
                codec="raw",
                crc32c=crc,
                raw_crc32c=crc,
            )
        )
    return ArrayLeaf(
        path=(("d", f"layer{k:04d}"), ("d", "w")),
        shape=(ROWS, COLS),
        dtype="float32",
        chunks=table_from_entries(chunks, shape=(ROWS, COLS), itemsize=4),
    )


def _listed(leaf: Any) -> Any:
    """``leaf`` with the same chunks, its table listing their boxes (no grid)."""
    import dataclasses

    from fastckpt.format.manifest import ChunkTable

    c = leaf.chunks.columns()
    table = ChunkTable(
        cuts=None,
        boxes=list(leaf.chunks.boxes()),
        keys=c.keys,
        object_index=c.object_index,
        offsets=c.offsets,
        lengths=c.lengths,
        codec=c.codec,
        crc32c=c.crc32c,
        raw_crc32c=c.raw_crc32c,
        itemsize=4,
    )
    return dataclasses.replace(leaf, chunks=table)


def _grid(n: int) -> tuple[int, int]:
    """FSDP x Megatron-like split of ``n`` chunks (8 along columns once n >= 64)."""
    return (n // 8, 8) if n >= 64 else (n, 1)


def _host_boxes(grid: tuple[int, int]) -> list[tuple[tuple[int, int], ...]]:
    """Host 0's 8 destination boxes under ``grid`` (the first 8 cells in row-major order)."""
    return [box for _, _, box in _cells(grid)[:8]]


def _best(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def run_planning(chunk_counts: list[int], reps: int) -> list[dict[str, Any]]:
    from fastckpt.format.codec import decode_manifest, encode_manifest
    from fastckpt.format.manifest import Manifest
    from fastckpt.planning import ChunkIndex, GridIndex, leaf_index, plan_leaf_reads

    out = []
    for n in chunk_counts:
        grid = _grid(n)
        [table_leaf] = decode_manifest(
            encode_manifest(Manifest(step=1, leaves=(_leaf(0, grid),)))
        ).arrays()
        leaf = _listed(table_leaf)
        assert isinstance(leaf_index(table_leaf), GridIndex) and isinstance(
            leaf_index(leaf), ChunkIndex
        )
        for layout, dst_grid in (
            ("same mesh", grid),
            ("4 -> 3 reshard", (max(1, grid[0] * 3 // 4), grid[1])),
        ):
            boxes = _host_boxes(dst_grid)

            # each timed function binds this iteration's leaf and boxes
            def scan(leaf: Any = leaf, boxes: Any = boxes) -> None:
                for b in boxes:
                    plan_leaf_reads(leaf, b)

            def indexed(leaf: Any = leaf, boxes: Any = boxes) -> None:
                index = ChunkIndex(leaf.chunks)
                for b in boxes:
                    plan_leaf_reads(leaf, b, index=index)

            def gridded(table_leaf: Any = table_leaf, boxes: Any = boxes) -> None:
                index = leaf_index(table_leaf)
                for b in boxes:
                    plan_leaf_reads(table_leaf, b, index=index)

            assert (
                [plan_leaf_reads(leaf, b) for b in boxes]
                == [plan_leaf_reads(leaf, b, index=ChunkIndex(leaf.chunks)) for b in boxes]
                == [plan_leaf_reads(table_leaf, b) for b in boxes]
            )
            s, i, g = _best(scan, reps), _best(indexed, reps), _best(gridded, reps)
            out.append(
                {
                    "chunks": n,
                    "layout": layout,
                    "units": len(boxes),
                    "scan_ms": 1e3 * s,
                    "index_ms": 1e3 * i,
                    "speedup": s / i,
                    "grid_ms": 1e3 * g,
                    "grid_speedup": s / g,
                }
            )
            print(
                f"[planning] {n} chunks, {layout}: scan {1e3 * s:.3f} ms, index {1e3 * i:.3f} ms, "
                f"grid {1e3 * g:.3f} ms per leaf",
                file=sys.stderr,
                flush=True,
            )
    return out


def _codec_case(leaves: int, n: int, reps: int) -> dict[str, Any]:
    from fastckpt.format.codec import decode_manifest, encode_manifest
    from fastckpt.format.manifest import Manifest

    m = Manifest(
        step=1, leaves=tuple(_leaf(k, _grid(n)) for k in range(leaves)), num_processes=_grid(n)[0]
    )
    data = encode_manifest(m)
    m = decode_manifest(data)  # its tables share one object key list, as the commit's do
    gc.collect()
    enc = _best(lambda: encode_manifest(m), reps)
    dec = _best(lambda: decode_manifest(data), reps)
    total = leaves * n
    print(
        f"[codec] {leaves} x {n} chunks: {len(data) / MiB:.1f} MiB, encode {enc:.2f} s, "
        f"decode {dec:.2f} s",
        file=sys.stderr,
        flush=True,
    )
    return {
        "leaves": leaves,
        "chunks_per_leaf": n,
        "chunks": total,
        "bytes": len(data),
        "encode_s": enc,
        "decode_s": dec,
        "encode_us_per_chunk": 1e6 * enc / total,
        "decode_us_per_chunk": 1e6 * dec / total,
        "bytes_per_chunk": len(data) / total,
    }


def run_codec(cases: list[tuple[int, int]], reps: int) -> list[dict[str, Any]]:
    """Encode and decode the manifest of each case."""
    return [_codec_case(leaves, n, reps) for leaves, n in cases]


def _merge_case(leaves: int, n: int, reps: int) -> dict[str, Any]:
    import numpy as np

    from fastckpt.writer.commit import build_manifest
    from fastckpt.writer.fragment import ChunkRows, decode_fragments, encode_fragment
    from fastckpt.writer.stage import StagedArray, StagedSave

    grid = _grid(n)
    stored = [_leaf(k, grid) for k in range(leaves)]
    arrays = tuple(
        StagedArray(
            path=a.path,
            shape=a.shape,
            dtype=a.dtype,
            kind="jax",
            sharding=None,
            key_impl=None,
            items=(),
            item_offsets=(),
        )
        for a in stored
    )
    staged = StagedSave(
        arrays=arrays,
        values=(),
        buffer=np.zeros(0, np.uint8),
        nbytes=0,
        order=tuple(a.path for a in arrays),
    )
    procs, per = grid[0], grid[1]  # process i wrote grid row i of every leaf
    parts = []
    for p in range(procs):
        rows = ChunkRows()
        for i, a in enumerate(stored):
            for c in a.chunks[p * per : (p + 1) * per]:
                rows.add(i, c.box, c.key, c.offset, c.length, c.codec, c.crc32c, c.raw_crc32c)
        parts.append(rows.build())
    frag = _best(lambda: encode_fragment(parts[0], staged, 0), reps)
    fragments = [encode_fragment(part, staged, p) for p, part in enumerate(parts)]
    gc.collect()

    def build(validate: bool) -> None:
        build_manifest(
            step=1,
            staged=staged,
            parts=decode_fragments(fragments, staged),
            num_processes=procs,
            metadata={},
            writer_version="bench",
            validate=validate,
        )

    ram, persist = _best(lambda: build(False), reps), _best(lambda: build(True), reps)
    total = leaves * n
    print(
        f"[commit] {procs} processes, {leaves} x {n} chunks: fragment "
        f"{1e6 * frag / (total / procs):.2f} us/chunk, "
        f"merge + encode {ram:.2f} s, with validation {persist:.2f} s",
        file=sys.stderr,
        flush=True,
    )
    return {
        "processes": procs,
        "leaves": leaves,
        "chunks_per_leaf": n,
        "chunks": total,
        "fragment_bytes_per_chunk": sum(map(len, fragments)) / total,
        "fragment_encode_us_per_chunk": 1e6 * frag / (total / procs),
        "merge_s": ram,
        "merge_validate_s": persist,
        "merge_us_per_chunk": 1e6 * ram / total,
        "merge_validate_us_per_chunk": 1e6 * persist / total,
    }


def _host_case(leaves: int, n: int, reps: int) -> dict[str, Any]:
    import tracemalloc

    from fastckpt.format.codec import decode_manifest, encode_manifest
    from fastckpt.format.manifest import Manifest
    from fastckpt.planning import leaf_index, plan_leaf_reads

    grid = _grid(n)
    data = encode_manifest(
        Manifest(step=1, leaves=tuple(_leaf(k, grid) for k in range(leaves)), num_processes=grid[0])
    )
    boxes = _host_boxes(grid)  # host 0's 8 devices, same mesh, as in part 1
    gc.collect()
    tracemalloc.start()
    m = decode_manifest(data)
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del m
    gc.collect()

    def decode() -> Any:
        return decode_manifest(data)

    def plan(m: Any) -> int:
        items = 0
        for a in m.arrays():  # what each LeafFiller does: one index per leaf, the host's units
            index = leaf_index(a)
            items += sum(len(plan_leaf_reads(a, b, index=index)) for b in boxes)
        return items

    m = decode()
    assert plan(m) == leaves * len(boxes)
    dec, pl = _best(decode, reps), _best(lambda: plan(m), reps)
    total = leaves * n
    print(
        f"[host] {leaves} x {n} chunks: decode {dec:.3f} s, plan {pl:.3f} s, "
        f"held {held / MiB:.0f} MiB",
        file=sys.stderr,
        flush=True,
    )
    return {
        "leaves": leaves,
        "chunks_per_leaf": n,
        "chunks": total,
        "decode_s": dec,
        "plan_s": pl,
        "total_s": dec + pl,
        "us_per_chunk": 1e6 * (dec + pl) / total,
        "held_bytes": held,
        "held_bytes_per_chunk": held / total,
    }


def run_host(cases: list[tuple[int, int]], reps: int) -> list[dict[str, Any]]:
    """A restoring host's work before data moves: decode the manifest, plan its 8 units of
    every leaf (chunk tables + GridIndex)."""
    return [_host_case(leaves, n, reps) for leaves, n in cases]


def _selection_case(leaves: int, n: int, reps: int) -> dict[str, Any]:
    import json

    from fastckpt.format.codec import decode_manifest, encode_manifest
    from fastckpt.format.manifest import Manifest, chunk_ids
    from fastckpt.planning import needed_chunks
    from fastckpt.replicas._wire import decode_json_list

    grid = _grid(n)
    hosts, per = grid
    m = decode_manifest(
        encode_manifest(
            Manifest(
                step=1, leaves=tuple(_leaf(k, grid) for k in range(leaves)), num_processes=hosts
            )
        )
    )
    arrays = m.arrays()
    ids = [chunk_ids(a) for a in arrays]

    def tier(
        h: int,
    ) -> list[str]:  # host h's own row of every leaf + its ring predecessor's (pushed to it)
        prev = (h - 1) % hosts
        return [
            i
            for leaf_ids in ids
            for i in leaf_ids[h * per : (h + 1) * per] + leaf_ids[prev * per : (prev + 1) * per]
        ]

    lists = [
        json.dumps(tier(h)).encode() for h in range(hosts)
    ]  # CHUNK_LIST payloads, as a peer sends them
    counts = [len(tier(h)) for h in range(hosts)]
    own0 = tier(0)
    boxes = _host_boxes(grid)  # host 0's 8 units of every leaf, same mesh

    def old() -> bool:  # process 0 before a42628d: every id of the step vs every peer's whole list
        need: set[str] = set()
        for a in arrays:
            need.update(chunk_ids(a))
        have = set(own0)
        for h in range(1, hosts):
            have.update(decode_json_list(lists[h], count=counts[h]))
        return need <= have

    def new(own: list[str], successor: int | None) -> bool:  # each host now: its own share
        need = set(needed_chunks((a, b) for a in arrays for b in boxes)).difference(own)
        if need and successor is not None:
            need -= set(decode_json_list(lists[successor], count=counts[successor]))
        return not need

    assert old() and new(own0, None) and new([], 1)
    t_old, t_in_place, t_replacement = (
        _best(f, reps) for f in (old, lambda: new(own0, None), lambda: new([], 1))
    )
    total = leaves * n
    print(
        f"[selection] {hosts} hosts, {leaves} x {n} chunks: process 0 checking every chunk "
        f"{t_old:.3f} s "
        f"({sum(map(len, lists[1:])) / MiB:.1f} MiB of lists); each host its share "
        f"{t_in_place:.3f} s in place, "
        f"{t_replacement:.3f} s as a replacement (1 list, {len(lists[1]) / MiB:.2f} MiB)",
        file=sys.stderr,
        flush=True,
    )
    return {
        "hosts": hosts,
        "leaves": leaves,
        "chunks_per_leaf": n,
        "chunks": total,
        "old_s": t_old,
        "old_list_bytes": sum(map(len, lists[1:])),
        "old_lists": hosts - 1,
        "in_place_s": t_in_place,
        "replacement_s": t_replacement,
        "replacement_list_bytes": len(lists[1]),
    }


def run_selection(cases: list[tuple[int, int]], reps: int) -> list[dict[str, Any]]:
    """Choosing the RAM step to restore, CPU on one host: process 0 checking every chunk id
    of the step against every peer's chunk list (until ``a42628d``) beside a host checking the
    chunks of its own restore (now), in place (its tier holds them) and as a replacement
    (its successor's list). Network time not included (the lists' bytes are reported)."""
    return [_selection_case(leaves, n, reps) for leaves, n in cases]


def run_broadcast(cases: list[tuple[int, int]], processes: int, reps: int) -> list[dict[str, Any]]:
    """What a multi-host RAM checkpoint's manifest cost on the ``jax.distributed`` key-value
    store when process 0 broadcast it (until `26ddef6`): a real ``processes``-process job
    times process 0's ``set`` until every process ``get``s the manifest's bytes, beside the
    few-byte record it announces now."""
    from fastckpt.format.codec import encode_manifest
    from fastckpt.format.manifest import Manifest
    from fastckpt.writer.commit import _HELD
    from fastckpt_examples.cluster.multiprocess import run_processes

    sizes = {"record (now)": len(_HELD)}
    for leaves, n in cases:
        grid = _grid(n)
        sizes[f"{leaves} x {n} manifest"] = len(
            encode_manifest(
                Manifest(
                    step=1,
                    leaves=tuple(_leaf(k, grid) for k in range(leaves)),
                    num_processes=grid[0],
                )
            )
        )
    leaves, n = cases[-1]
    sizes[f"{leaves * 10} x {n} manifest (10x leaves, estimated)"] = (
        10 * sizes[f"{leaves} x {n} manifest"]
    )
    outs = run_processes(
        "benchmarks._kv:broadcast_times",
        num_processes=processes,
        devices_per_process=1,
        kwargs={"sizes": sorted(set(sizes.values())), "reps": reps},
        timeout_s=900,
    )
    seconds = outs[0].value["seconds"]
    rows = []
    for what, nbytes in sizes.items():
        t = seconds[str(nbytes)]
        rows.append(
            {
                "what": what,
                "bytes": nbytes,
                "processes": processes,
                "seconds": t,
                "coordinator_bytes": nbytes * (processes - 1),
            }
        )
        print(
            f"[broadcast] {what}: {nbytes / MiB:.2f} MiB to {processes - 1} processes in {t:.3f} s",
            file=sys.stderr,
            flush=True,
        )
    return rows


def run_merge(cases: list[tuple[int, int]], reps: int) -> list[dict[str, Any]]:
    """Process 0's part of a commit: merge every process's fragment into the manifest."""
    return [_merge_case(leaves, n, reps) for leaves, n in cases]


def run_relay(host_counts: list[int], manifest_bytes: int, reps: int) -> list[dict[str, Any]]:
    """The manifest of a RAM step held by process 0 and its ring successor (k = 1), needed by
    every other host: holders only (before) vs the relay tree (now)."""
    from fastckpt.replicas._client import StepLists
    from fastckpt.replicas._manifest_relay import manifest_sources
    from fastckpt.replicas._placement import relay_parent

    out = []
    for hosts in host_counts:
        members = [f"host{i:05d}/0" for i in range(hosts)]
        lists = {m: StepLists([7], [7], [7] if i < 2 else []) for i, m in enumerate(members)}

        src = manifest_sources(lists)[7]
        parents = {m: relay_parent(m, src.holders, src.relays, fanout=4) for m in members}

        # process 0's survey into sources, then one host's own parent
        def one_host(lists: dict[str, StepLists] = lists, members: list[str] = members) -> None:
            sources = manifest_sources(lists)[7]
            relay_parent(members[-1], sources.holders, sources.relays, fanout=4)

        t = _best(one_host, reps)
        served: dict[str, int] = {}
        depth = 0
        for m, parent in parents.items():
            if parent is not None:
                served[parent] = served.get(parent, 0) + 1
            d, node = 0, m
            while parents[node] is not None:
                node, d = parents[node], d + 1  # type: ignore[assignment]
            depth = max(depth, d)
        busiest_before = -(-(hosts - 2) // 2)
        out.append(
            {
                "hosts": hosts,
                "manifest_bytes": manifest_bytes,
                "before_step_requests": (hosts - 2) * (hosts - 1),
                "before_max_copies": busiest_before,
                "before_max_bytes": busiest_before * manifest_bytes,
                "after_step_requests": hosts - 1,
                "after_max_copies": max(served.values()),
                "after_max_bytes": max(served.values()) * manifest_bytes,
                "depth": depth,
                "plan_s": t,
            }
        )
        print(
            f"[relay] {hosts} hosts: busiest host serves {busiest_before} -> "
            f"{max(served.values())} copies, "
            f"depth {depth}, planned in {t:.4f} s",
            file=sys.stderr,
            flush=True,
        )
    return out


def run_leaves(leaf_counts: list[int], reps: int, shm: Path) -> list[dict[str, Any]]:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    import fastckpt
    from fastckpt.options import RamOptions

    mesh = make_mesh((2, 4))
    sharding = NamedSharding(mesh, PartitionSpec("data", "model"))
    out = []
    for count in leaf_counts:
        state = {
            f"l{i:05d}": jax.device_put(np.full((64, 512), i, np.float32), sharding)
            for i in range(count)
        }
        nbytes = sum(x.nbytes for x in state.values())
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
        )
        root = shm / f"planning-scale-{count}"
        shutil.rmtree(root, ignore_errors=True)
        ram = RamOptions(
            root=str(root),
            member_id="host-a",
            interval_steps=10,
            budget_bytes=3 * nbytes + 256 * MiB,
        )
        with fastckpt.CheckpointManager(
            f"mem://planning-scale-{count}",
            options=fastckpt.ManagerOptions(save_interval_steps=1 << 40, ram=ram),
        ) as mgr:
            blocked = []
            for k in range(3):  # the first save builds the leaf plans, later ones reuse them
                t0 = time.perf_counter()
                mgr.save(10 * (k + 1), state)
                blocked.append(time.perf_counter() - t0)
                mgr.wait()
            restores = []
            for i in range(reps + 1):
                gc.collect()
                t0 = time.perf_counter()
                restored = mgr.restore(target=target)
                stats = mgr.last_restore_stats
                jax.block_until_ready(restored)
                restores.append(time.perf_counter() - t0)
                if i == 0:
                    assert all(
                        np.array_equal(np.asarray(restored[k]), np.asarray(state[k])) for k in state
                    )
                    assert set(stats.bytes_by_tier) == {"ram"}, stats.bytes_by_tier
                del restored
        shutil.rmtree(root, ignore_errors=True)
        steady = median(restores[1:])
        out.append(
            {
                "leaves": count,
                "bytes": nbytes,
                "save_blocked_first_s": blocked[0],
                "save_blocked_s": median(blocked[1:]),
                "restore_first_s": restores[0],
                "restore_s": steady,
                "restore_ms_per_leaf": 1e3 * steady / count,
                "save_ms_per_leaf": 1e3 * median(blocked[1:]) / count,
            }
        )
        print(
            f"[leaves] {count} leaves ({nbytes / MiB:.0f} MiB): save blocks "
            f"{median(blocked[1:]):.3f} s, "
            f"restore {steady:.3f} s ({1e3 * steady / count:.3f} ms per leaf)",
            file=sys.stderr,
            flush=True,
        )
        del state
    return out


def _f(x: float | None, fmt: str) -> str:
    return "" if x is None else fmt.format(x)


def render(doc: dict[str, Any]) -> str:
    plan_rows = [
        [
            r["chunks"],
            r["layout"],
            r["units"],
            f"{r['scan_ms']:.3f}",
            f"{r['index_ms']:.3f}",
            f"{r['speedup']:.1f}x",
            _f(r.get("grid_ms"), "{:.3f}"),
            _f(r.get("grid_speedup"), "{:.1f}x"),
        ]
        for r in doc["planning"]
    ]
    host_rows = [
        [
            f"{r['leaves']} x {r['chunks_per_leaf']}",
            r["chunks"],
            f"{r['decode_s']:.3f}",
            f"{r['plan_s']:.3f}",
            f"{r['total_s']:.3f}",
            f"{r['us_per_chunk']:.2f}",
            f"{r['held_bytes'] / MiB:.1f}",
            f"{r['held_bytes_per_chunk']:.0f}",
        ]
        for r in doc.get("host", [])
    ]
    codec_rows = [
        [
            f"{r['leaves']} x {r['chunks_per_leaf']}",
            r["chunks"],
            f"{r['bytes'] / MiB:.1f}",
            f"{r['bytes_per_chunk']:.0f}",
            f"{r['encode_s']:.2f}",
            f"{r['decode_s']:.2f}",
            f"{r['encode_us_per_chunk']:.1f}",
            f"{r['decode_us_per_chunk']:.1f}",
        ]
        for r in doc["codec"]
    ]
    merge_rows = [
        [
            r["processes"],
            f"{r['leaves']} x {r['chunks_per_leaf']}",
            r["chunks"],
            f"{r['fragment_bytes_per_chunk']:.0f}",
            f"{r['fragment_encode_us_per_chunk']:.2f}",
            f"{r['merge_s']:.2f}",
            f"{r['merge_us_per_chunk']:.2f}",
            f"{r['merge_validate_s']:.2f}",
            f"{r['merge_validate_us_per_chunk']:.2f}",
        ]
        for r in doc.get("merge", [])
    ]
    bcast_rows = [
        [
            r["what"],
            f"{r['bytes'] / MiB:.2f}",
            r["processes"],
            f"{r['coordinator_bytes'] / MiB:.1f}",
            f"{r['seconds']:.3f}",
        ]
        for r in doc.get("broadcast", [])
    ]
    sel_rows = [
        [
            r["hosts"],
            f"{r['leaves']} x {r['chunks_per_leaf']}",
            r["chunks"],
            f"{r['old_s']:.3f}",
            f"{r['old_lists']} ({r['old_list_bytes'] / MiB:.1f} MiB)",
            f"{r['in_place_s']:.3f}",
            f"{r['replacement_s']:.3f}",
            f"1 ({r['replacement_list_bytes'] / MiB:.2f} MiB)",
        ]
        for r in doc.get("selection", [])
    ]
    relay_rows = [
        [
            r["hosts"],
            r["before_step_requests"],
            f"{r['before_max_copies']} ({r['before_max_bytes'] / MiB:.0f} MiB)",
            r["after_step_requests"],
            f"{r['after_max_copies']} ({r['after_max_bytes'] / MiB:.0f} MiB)",
            r["depth"],
            f"{r['plan_s'] * 1e3:.1f}",
        ]
        for r in doc.get("relay", [])
    ]
    leaf_rows = [
        [
            r["leaves"],
            f"{r['bytes'] / MiB:.0f}",
            f"{r['save_blocked_s']:.3f}",
            f"{r['save_ms_per_leaf']:.3f}",
            f"{r['restore_s']:.3f}",
            f"{r['restore_first_s']:.3f}",
            f"{r['restore_ms_per_leaf']:.3f}",
        ]
        for r in doc["leaves"]
    ]
    meta = doc["meta"]
    return (
        "\n\n".join(
            [
                "# Planning and per-leaf costs at scale",
                f"`python -m benchmarks.planning_scale{' --quick' if meta['quick'] else ''}`, "
                f"{meta['date']} "
                f"(git {meta['git']}), 2 CPUs. Best of {meta['reps']} for the pure parts.",
                "## Read planning: one host's 8 boxes of one leaf (8192 x 1024 f32) against N "
                "stored chunks",
                markdown_table(
                    [
                        "chunks",
                        "layout",
                        "boxes",
                        "scan (ms/leaf)",
                        "ChunkIndex (ms/leaf)",
                        "speedup",
                        "GridIndex, chunk table (ms/leaf)",
                        "speedup",
                    ],
                    plan_rows,
                ),
                "## Manifest codec (a chunk table per leaf, binary columns): raw chunks, 2-d grid",
                markdown_table(
                    [
                        "leaves x chunks",
                        "chunks",
                        "MiB",
                        "bytes/chunk",
                        "encode s",
                        "decode s",
                        "encode us/chunk",
                        "decode us/chunk",
                    ],
                    codec_rows,
                ),
                "## Commit on process 0: decode and merge P fragments into the manifest (every "
                "multi-process "
                "checkpoint, RAM ones included)",
                markdown_table(
                    [
                        "processes",
                        "leaves x chunks",
                        "chunks",
                        "fragment bytes/chunk",
                        "fragment encode us/chunk",
                        "decode + merge + encode s (RAM step)",
                        "us/chunk",
                        "+ validating decode s (persistent)",
                        "us/chunk",
                    ],
                    merge_rows,
                ),
                "## A restoring host before data moves: decode the manifest, plan its 8 units of "
                "every leaf",
                "The manifest decodes to chunk tables (entries built on access) planned by "
                "bisecting the "
                "grid. `held` is the decoded manifest's memory (tracemalloc).",
                markdown_table(
                    [
                        "leaves x chunks",
                        "chunks",
                        "decode s",
                        "plan s",
                        "total s",
                        "us/chunk",
                        "held MiB",
                        "held bytes/chunk",
                    ],
                    host_rows,
                ),
                "## A RAM checkpoint's manifest through the coordinator (jax.distributed key-value "
                "store)",
                "Until `26ddef6` process 0 broadcast each multi-host RAM step's manifest through "
                "the store; "
                "now, with peers, it announces a few bytes (the manifest goes to its ring "
                "successors "
                "with its push). Measured in a real 4-process job: process 0's `set` until every "
                "process "
                "holds the value; the coordinator carries it once per other process.",
                markdown_table(
                    [
                        "value",
                        "MiB",
                        "processes",
                        "through the coordinator, MiB",
                        "until all hold it, s",
                    ],
                    bcast_rows,
                ),
                "## Choosing the RAM step to restore: CPU on one host",
                "Until `a42628d` process 0 alone checked every chunk id of the step against every "
                "peer's chunk "
                "list; now each host checks the chunks its own restore reads (its 8 units of every "
                "leaf): in "
                "place its own tier holds them, as a replacement its ring successor's list does. "
                "Lists are "
                "decoded as the peer client does; network time is not included.",
                markdown_table(
                    [
                        "hosts",
                        "leaves x chunks",
                        "chunks",
                        "process 0, every chunk s",
                        "lists fetched",
                        "one host, its share, in place s",
                        "as a replacement s",
                        "lists fetched",
                    ],
                    sel_rows,
                ),
                "## Own-RAM save and restore vs leaf count (128 KiB leaves, 8 shards each, 8 CPU "
                "devices)",
                markdown_table(
                    [
                        "leaves",
                        "MiB",
                        "save() blocks s",
                        "ms/leaf",
                        "restore s (median)",
                        "first restore s",
                        "ms/leaf",
                    ],
                    leaf_rows,
                ),
                "## A RAM step's manifest to every restoring host (2 holders: process 0 and its "
                "ring successor)",
                "Before `manifest_relay`: every host without it asked every peer for its step "
                "lists and read one "
                "of the 2 holders. Now process 0 alone asks (one request per peer) and the others "
                "fetch down a "
                "tree of fan-out 4 rooted at the holders. Bytes for the manifest of the largest "
                "codec case "
                "(x10 at 3000 leaves); `plan ms`: the survey's sources (process 0) and one host's "
                "parent (each host computes only its own).",
                markdown_table(
                    [
                        "hosts",
                        "step-list requests, before",
                        "busiest host serves, before",
                        "step-list requests, now",
                        "busiest host serves, now",
                        "tree depth",
                        "plan ms",
                    ],
                    relay_rows,
                ),
            ]
        )
        + "\n"
    )


def plot(doc: dict[str, Any], path: Path) -> None:
    same = [r for r in doc["planning"] if r["layout"] == "same mesh"]
    bar_chart(
        path,
        title="Per-leaf and per-chunk costs at scale",
        ncols=2,
        panels=[
            {
                "title": "read planning, same mesh (ms per leaf)",
                "ylabel": "ms",
                "groups": [str(r["chunks"]) for r in same],
                "series": {
                    "scan": [r["scan_ms"] for r in same],
                    "ChunkIndex": [r["index_ms"] for r in same],
                    "GridIndex": [r.get("grid_ms") or 0.0 for r in same],
                },
            },
            {
                "title": "manifest codec (us per chunk)",
                "ylabel": "us",
                "groups": [str(r["chunks"]) for r in doc["codec"]],
                "series": {
                    what: [r[f"{what}_us_per_chunk"] for r in doc["codec"]]
                    for what in ("encode", "decode")
                },
            },
            {
                "title": "commit merge on process 0 (us per chunk)",
                "ylabel": "us",
                "groups": [str(r["chunks"]) for r in doc.get("merge", [])],
                "series": {
                    "RAM step": [r["merge_us_per_chunk"] for r in doc.get("merge", [])],
                    "persistent (validated)": [
                        r["merge_validate_us_per_chunk"] for r in doc.get("merge", [])
                    ],
                },
            },
            {
                "title": "own-RAM restore (ms per leaf)",
                "ylabel": "ms",
                "groups": [str(r["leaves"]) for r in doc["leaves"]],
                "series": {
                    "save() blocks": [r["save_ms_per_leaf"] for r in doc["leaves"]],
                    "restore": [r["restore_ms_per_leaf"] for r in doc["leaves"]],
                },
            },
        ],
    )


def main(argv: list[str] | None = None) -> int:
    import datetime
    import subprocess

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller cases (about 20 s)")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"))
    p.add_argument(
        "--update-docs",
        action="store_true",
        help="rewrite the docs/benchmarks.md block even for --quick or another --results-dir",
    )
    args = p.parse_args(argv)
    reps = 3 if args.quick else 5
    chunk_counts = [8, 64, 512] if args.quick else [8, 64, 512, 2048]
    codec_cases = [(100, 64), (100, 512)] if args.quick else [(300, 64), (300, 512), (60, 2048)]
    leaf_counts = [200, 1000] if args.quick else [200, 1000, 3000]
    git = (
        subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
            check=False,
        ).stdout.strip()
        or "unknown"
    )
    meta = {
        "quick": args.quick,
        "reps": reps,
        "git": git,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }
    # The restores first: after the codec and merge parts built and freed millions of objects
    # in this process, the same restores measured ~10-20% slower.
    leaves = run_leaves(leaf_counts, reps, args.shm_dir)
    doc = {
        "meta": meta,
        "planning": run_planning(chunk_counts, reps),
        "codec": run_codec(codec_cases, max(2, reps // 2)),
        "merge": run_merge(codec_cases, max(2, reps // 2)),
        "host": run_host(codec_cases, max(2, reps // 2)),
        "broadcast": run_broadcast(codec_cases[1:2], 4, 2 if args.quick else 3),
        "selection": run_selection(codec_cases[1:], max(2, reps // 2)),
        "leaves": leaves,
    }
    manifest_bytes = max((r["bytes"] for r in doc["codec"]), default=0)
    doc["relay"] = run_relay([64, 512] if args.quick else [64, 512, 2048], manifest_bytes, reps)
    name = "planning_scale_quick" if args.quick else "planning_scale"
    write_json(args.results_dir / f"{name}.json", doc)
    (args.results_dir / f"{name}.md").write_text(render(doc))
    plot(doc, args.results_dir / f"{name}.png")
    publish_docs(
        "planning_scale",
        doc,
        render=render,
        results_path=args.results_dir / f"{name}.json",
        quick=args.quick,
        force=args.update_docs,
    )
    print(render(doc))
    print(f"wrote {args.results_dir / name}.{{json,md,png}}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
