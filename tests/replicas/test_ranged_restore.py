"""A resharding restore asks peers only for the bytes of each chunk it uses (GET_RANGES),
each range still checked against the whole chunk's crc32c."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import numpy as np
import pytest

from fastckpt import CheckpointManager, ManagerOptions, SaveOptions
from fastckpt.errors import ConfigError
from fastckpt.format.manifest import ArrayLeaf
from fastckpt.options import RamOptions, RestoreOptions
from fastckpt.reader.fetch import RestoreStats, Unit, fill_units
from fastckpt.replicas._client import PeerClient
from fastckpt.replicas._ram import RamTier
from fastckpt.replicas._server import PeerServer
from fastckpt.replicas._sources import TieredChunkSource
from fastckpt.storage import open_store

from .conftest import SECRET, sent_bytes

SHAPE = (8, 256, 128)  # float32: 8 layers of 256 rows x 128 columns (128 KiB each)


def _save(root: str, ram_root: Path, *, layers_per_chunk: int = 1) -> tuple[np.ndarray, ArrayLeaf]:
    w_host = np.random.default_rng(5).standard_normal(SHAPE, dtype=np.float32)
    options = ManagerOptions(
        save=SaveOptions(max_chunk_bytes=layers_per_chunk * (128 << 10)),
        ram=RamOptions(root=str(ram_root), interval_steps=1, replicas=0),
    )
    with CheckpointManager(root, options=options) as mgr:
        mgr.save(1, {"w": jax.numpy.asarray(w_host)})
        mgr.wait()
        (leaf,) = mgr.manifest(1).arrays()
    assert len(leaf.chunks) == 8 // layers_per_chunk
    assert {c.box[0][1] - c.box[0][0] for c in leaf.chunks} == {layers_per_chunk}
    return w_host, leaf


def _fill(
    root: str,
    leaf: ArrayLeaf,
    box: tuple[tuple[int, int], ...],
    source: TieredChunkSource,
    options: RestoreOptions | None = None,
) -> tuple[Unit, RestoreStats]:
    unit, stats = Unit(leaf, box), RestoreStats()

    async def run() -> None:
        store = open_store(root)
        try:
            with ThreadPoolExecutor(2) as ex:
                await fill_units(
                    store,
                    1,
                    [unit],
                    options=options or RestoreOptions(),
                    executor=ex,
                    stats=stats,
                    source=source,
                )
        finally:
            await store.close()

    asyncio.run(run())
    return unit, stats


@pytest.fixture
def saved(
    tmp_path: Path,
    shm_dir: Path,
    make_tier: Callable[..., RamTier],
    make_server: Callable[..., PeerServer],
) -> tuple[str, np.ndarray, ArrayLeaf, Path, PeerServer]:
    root = str(tmp_path / "ckpt")
    w_host, leaf = _save(root, shm_dir / "writer")
    server = make_server(make_tier("writer"))  # the writer's tier, reopened and served
    return root, w_host, leaf, shm_dir / "writer", server


def test_rows_of_column_chunks_cross_the_wire_as_ranges(saved) -> None:  # type: ignore[no-untyped-def]
    root, w_host, leaf, _, server = saved
    with PeerClient(server.address, secret=SECRET, name="writer") as client:
        unit, stats = _fill(
            root, leaf, ((0, 8), (64, 128), (0, 128)), TieredChunkSource(None, [client])
        )
    np.testing.assert_array_equal(unit.buffer, w_host[:, 64:128])
    used = 8 * 64 * 128 * 4  # rows 64..128 of each chunk: one contiguous quarter of it
    assert stats.bytes_by_tier == {"peer:writer": used} and stats.chunks_by_tier == {
        "peer:writer": 8
    }
    assert stats.bytes_read_storage == 0
    assert sent_bytes(server, used) == used  # a quarter of the 1 MiB the chunks hold


def test_a_strided_overlap_crosses_as_one_range_per_layer(
    tmp_path: Path,
    shm_dir: Path,
    make_tier: Callable[..., RamTier],
    make_server: Callable[..., PeerServer],
) -> None:
    """Chunks of 4 stacked layers; rows 64..128 of every layer are 4 separate runs of each
    chunk (a resized FSDP layout of stacked-layer parameters): only they cross the wire."""
    root = str(tmp_path / "ckpt")
    w_host, leaf = _save(root, shm_dir / "writer", layers_per_chunk=4)
    server = make_server(make_tier("writer"))
    with PeerClient(server.address, secret=SECRET, name="writer") as client:
        unit, stats = _fill(
            root, leaf, ((0, 8), (64, 128), (0, 128)), TieredChunkSource(None, [client])
        )
    np.testing.assert_array_equal(unit.buffer, w_host[:, 64:128])
    used = 2 * 4 * (64 * 128 * 4)  # 2 chunks x 4 layers x 64 rows
    assert stats.bytes_by_tier == {"peer:writer": used} and sent_bytes(server, used) == used


def test_own_ram_copies_only_the_ranges(
    tmp_path: Path, shm_dir: Path, make_tier: Callable[..., RamTier]
) -> None:
    root = str(tmp_path / "ckpt")
    w_host, leaf = _save(root, shm_dir / "writer")
    unit, stats = _fill(
        root, leaf, ((0, 8), (64, 128), (0, 128)), TieredChunkSource(make_tier("writer"), [])
    )
    np.testing.assert_array_equal(unit.buffer, w_host[:, 64:128])
    assert stats.bytes_by_tier == {"ram": 8 * 64 * 128 * 4}


def test_a_range_that_spares_little_is_read_whole(saved) -> None:  # type: ignore[no-untyped-def]
    root, w_host, leaf, _, server = saved
    with PeerClient(server.address, secret=SECRET, name="writer") as client:
        # columns 0..64 of every row of chunk 0: the run holding them is nearly all of it
        unit, stats = _fill(
            root, leaf, ((0, 1), (0, 256), (0, 64)), TieredChunkSource(None, [client])
        )
    np.testing.assert_array_equal(unit.buffer, w_host[:1, :, :64])
    assert (
        stats.bytes_by_tier == {"peer:writer": 128 << 10}
        and sent_bytes(server, 128 << 10) == 128 << 10
    )


def test_a_corrupt_byte_outside_the_range_still_fails_the_chunk(saved) -> None:  # type: ignore[no-untyped-def]
    """The range is checked against the whole chunk's checksum: a peer copy corrupt anywhere
    is not used (here storage supplies that chunk), never silently half-trusted."""
    root, w_host, leaf, ram_root, server = saved
    (index,) = (ram_root / "step-1").glob("*.index.json")
    doc = json.loads(index.read_text())
    _, off, _, _ = doc["chunks"][0]
    with (index.parent / doc["data"]).open(
        "r+b"
    ) as f:  # row 0 of the first chunk: outside rows 64..128
        f.seek(off + 8)
        byte = f.read(1)
        f.seek(off + 8)
        f.write(bytes([byte[0] ^ 0x01]))
    with PeerClient(server.address, secret=SECRET, name="writer") as client:
        source = TieredChunkSource(None, [client])
        unit, stats = _fill(root, leaf, ((0, 8), (64, 128), (0, 128)), source)
    np.testing.assert_array_equal(unit.buffer, w_host[:, 64:128])
    assert stats.chunks_by_tier == {"peer:writer": 7, "storage": 1}
    assert source.stats().fallbacks == {"corrupt": 1}


def test_the_saving_threshold_is_an_option(saved) -> None:  # type: ignore[no-untyped-def]
    root, w_host, leaf, _, server = saved
    never = RestoreOptions(min_range_saving_bytes=1 << 40)
    with PeerClient(server.address, secret=SECRET, name="writer") as client:
        unit, stats = _fill(
            root, leaf, ((0, 8), (64, 128), (0, 128)), TieredChunkSource(None, [client]), never
        )
    np.testing.assert_array_equal(unit.buffer, w_host[:, 64:128])
    assert stats.bytes_by_tier == {"peer:writer": 8 * (128 << 10)}  # whole chunks
    with pytest.raises(ConfigError):
        RestoreOptions(min_range_saving_bytes=-1)
