"""``fastckpt verify``: re-read every chunk of a step, check crc32c and decode.

Per chunk: the stored bytes must be complete, match the manifest's crc32c, decode (zstd) to
exactly ``raw_length`` bytes, and those must match ``raw_crc32c``. Reads are coalesced per
object (bounded concurrency); checks run on a thread pool (crc32c and zstd release the GIL).
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from concurrent.futures import ThreadPoolExecutor

import zstandard

from fastckpt._checksum import crc32c
from fastckpt.cli._commands import load_manifest
from fastckpt.cli._util import Progress, dump_json, fmt_bytes, fmt_rate
from fastckpt.errors import FastckptError, NotFoundError
from fastckpt.format.manifest import ChunkEntry, Manifest, keypath_str
from fastckpt.maintenance import read_manifests
from fastckpt.planning import coalesce_fetches
from fastckpt.storage import ByteRange, Store

__all__ = ["Damage", "cmd_verify", "verify_manifest"]

_MAX_REQUEST = 64 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class Damage:
    """One chunk that failed verification."""

    step: int
    array: str
    box: list[list[int]]
    key: str
    offset: int
    problem: str

    def __str__(self) -> str:
        where = f"array {self.array} chunk {self.box} (object {self.key} @ {self.offset})"
        return f"step {self.step}: {where}: {self.problem}"


def _check(chunk: ChunkEntry, stored: memoryview) -> str | None:
    """The problem with one chunk's stored bytes, or None if it is good."""
    if stored.nbytes != chunk.length:
        return f"truncated: {stored.nbytes} of {chunk.length} bytes"
    got = crc32c(stored)
    if got != chunk.crc32c:
        return f"crc32c mismatch (stored bytes {got:#010x}, manifest {chunk.crc32c:#010x})"
    raw_crc = got
    if chunk.codec == "zstd":
        try:
            raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=chunk.raw_length)
        except zstandard.ZstdError as e:
            return f"zstd decode failed: {e}"
        if len(raw) != chunk.raw_length:
            return f"decoded {len(raw)} bytes, expected {chunk.raw_length}"
        if chunk.raw_crc32c == 0:
            return None  # a manifest without raw checksums: nothing more to compare
        raw_crc = crc32c(raw)
    if raw_crc != chunk.raw_crc32c:
        return (
            f"raw crc32c mismatch after decode ({raw_crc:#010x}, manifest {chunk.raw_crc32c:#010x})"
        )
    return None


async def verify_manifest(
    store: Store,
    m: Manifest,
    *,
    executor: ThreadPoolExecutor,
    progress: Progress,
    concurrency: int = 8,
) -> tuple[list[Damage], int]:
    """Verify every chunk of ``m``; returns ``(damages, chunks checked)``."""
    owner = {(c.key, c.offset): (leaf, c) for leaf in m.arrays() for c in leaf.chunks}
    ranges = coalesce_fetches((c for _, c in owner.values()), max_gap=0, max_bytes=_MAX_REQUEST)
    damages: list[Damage] = []
    sem = asyncio.Semaphore(concurrency)
    loop = asyncio.get_running_loop()

    def damage(c: ChunkEntry, problem: str) -> None:
        array = keypath_str(owner[(c.key, c.offset)][0].path)
        damages.append(Damage(m.step, array, [list(iv) for iv in c.box], c.key, c.offset, problem))

    async def one(key: str, start: int, length: int, chunks: tuple[ChunkEntry, ...]) -> None:
        async with sem:
            try:
                got = await store.get(key, byte_range=ByteRange(start, length))
                data = memoryview(got).cast("B")
            except NotFoundError:
                data = None
            except FastckptError as e:
                for c in chunks:
                    damage(c, f"read failed: {e}")
                return
        if data is None:
            for c in chunks:
                damage(c, "object missing")
            progress.add(length)
            return
        for c in chunks:
            piece = data[c.offset - start : c.offset - start + c.length]
            problem = await loop.run_in_executor(executor, _check, c, piece)
            if problem is not None:
                damage(c, problem)
            progress.add(c.length)

    await asyncio.gather(*(one(r.key, r.start, r.length, r.chunks) for r in ranges))
    damages.sort(key=lambda d: (d.array, d.box))
    return damages, len(owner)


async def cmd_verify(
    store: Store,
    step: int | None,
    *,
    all_steps: bool,
    as_json: bool,
    progress: bool,
    threads: int = 4,
) -> int:
    """Verify one step (default: latest) or every committed step; 1 if anything is damaged."""
    if all_steps:
        manifests, bad_manifests = await read_manifests(store)
        targets = [m for _, m in sorted(manifests.items()) if m is not None]
    else:
        targets, bad_manifests = [await load_manifest(store, step)], []
    results = []
    with ThreadPoolExecutor(threads, thread_name_prefix="fastckpt-verify") as executor:
        for m in targets:
            p = Progress(f"verify step {m.step}", m.stored_bytes, enabled=progress)
            damages, nchunks = await verify_manifest(store, m, executor=executor, progress=p)
            p.close()
            results.append(
                {
                    "step": m.step,
                    "ok": not damages,
                    "chunks": nchunks,
                    "stored_bytes": m.stored_bytes,
                    "logical_bytes": m.nbytes,
                    "seconds": round(p.elapsed, 3),
                    "damaged": [dataclasses.asdict(d) for d in damages],
                }
            )
            if not as_json:
                verdict = "OK" if not damages else f"DAMAGED ({len(damages)} of {nchunks} chunks)"
                sys.stdout.write(
                    f"step {m.step}: {nchunks} chunks, {fmt_bytes(m.stored_bytes)} stored "
                    f"({fmt_bytes(m.nbytes)} logical) in {p.elapsed:.2f}s "
                    f"({fmt_rate(m.stored_bytes, p.elapsed)}): {verdict}\n"
                )
                for d in damages:
                    sys.stdout.write(f"  {d}\n")
    ok = all(r["ok"] for r in results) and not bad_manifests
    if as_json:
        dump_json({"root": store.url, "ok": ok, "steps": results, "manifest_errors": bad_manifests})
    else:
        for e in bad_manifests:
            sys.stdout.write(f"  {e}\n")
        if not results and not bad_manifests:
            sys.stdout.write(f"{store.url}: no committed checkpoints\n")
    return 0 if ok else 1
