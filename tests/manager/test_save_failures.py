"""The manager around failed or concurrent work: retention and restores, a failed write's
staging buffer, a failed construction, options that cannot work."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from fastckpt import (
    CheckpointManager,
    DistributedOptions,
    ManagerOptions,
    RetentionOptions,
    SaveOptions,
)
from fastckpt._checksum import crc32c
from fastckpt.errors import ConfigError, PeerError, SaveError
from fastckpt.options import RamOptions
from fastckpt.storage import LocalStore
from fastckpt.storage._protocol import Buffer, Payload, PutMode
from tests.support.arrays import P, named
from tests.support.wrapping import ForwardingStore


class _Wrapped(ForwardingStore):
    def __init__(self, root: Path) -> None:
        super().__init__(LocalStore(root, durable=False))

    async def close(self) -> None:
        await self.inner.close()


def _state(seed: int, shape: tuple[int, int] = (256, 1024)) -> tuple[dict[str, Any], np.ndarray]:
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return {"w": jax.device_put(x, named((2, 4), ("a", "b"), P("a", "b"))), "seed": seed}, x


def test_retention_leaves_a_step_that_is_being_restored(tmp_path: Path) -> None:
    """keep_last=1: the background part of save 2 would delete step 1 while ``restore(1)``
    reads it (slow reads); it waits for a later save instead."""

    class SlowReads(_Wrapped):
        async def get(self, key: str, *, byte_range: Any = None) -> Buffer:
            if key.startswith("steps/"):
                await asyncio.sleep(0.5)
            return await super().get(key, byte_range=byte_range)

        async def put(self, key: str, data: Payload, *, mode: PutMode = "overwrite") -> None:
            if key.startswith("manifests/"):  # the commit (and the retention after it) comes later
                await asyncio.sleep(0.2)
            await super().put(key, data, mode=mode)

    opts = ManagerOptions(
        save=SaveOptions(max_chunk_bytes=64 << 10, object_bytes=128 << 10),
        retention=RetentionOptions(keep_last=1),
    )
    with CheckpointManager(SlowReads(tmp_path), options=opts) as mgr:
        s1, h1 = _state(1)
        mgr.save(1, s1)
        mgr.wait()
        s2, _ = _state(2)
        mgr.save(2, s2)  # commits 2, then retention: step 1 goes, unless it is being read
        target = {
            "w": jax.ShapeDtypeStruct(h1.shape, h1.dtype, sharding=s1["w"].sharding),
            "seed": 0,
        }
        got = mgr.restore(1, target=target)
        np.testing.assert_array_equal(np.asarray(got["w"]), h1)
        mgr.wait()
        s3, _ = _state(3)
        mgr.save(3, s3)
        mgr.wait()
        assert mgr.persistent_steps() == [3]  # caught up


def test_a_failed_writes_buffer_is_not_staged_into_while_its_uploads_run(tmp_path: Path) -> None:
    """One object's upload fails while another is still being put from a store thread: the
    next save must not stage into the buffer that thread reads."""
    seen: list[bool] = []

    class FailOneSlowOther(_Wrapped):
        async def put(self, key: str, data: Payload, *, mode: PutMode = "overwrite") -> None:
            if key.startswith("steps/000000000002/") and key.endswith("-00000.fck"):
                await asyncio.sleep(0.3)
                raise OSError("injected upload failure")
            if key.startswith("steps/000000000002/") and key.endswith("-00001.fck"):
                parts = [memoryview(p).cast("B") for p in data]  # type: ignore[union-attr]

                def slow_put() -> None:  # an upload in flight on a store thread
                    before = [crc32c(p) for p in parts]
                    time.sleep(1.5)
                    seen.append(before == [crc32c(p) for p in parts])

                await asyncio.get_running_loop().run_in_executor(None, slow_put)
            await super().put(key, data, mode=mode)

    opts = ManagerOptions(
        save=SaveOptions(compression="none", max_chunk_bytes=256 << 10, object_bytes=512 << 10)
    )
    with CheckpointManager(FailOneSlowOther(tmp_path), options=opts) as mgr:
        mgr.save(1, _state(1, (1024, 1024))[0])
        mgr.wait()
        mgr.save(2, _state(2, (1024, 1024))[0])
        with pytest.raises(SaveError, match="injected"):
            mgr.wait()
        mgr.save(3, _state(3, (1024, 1024))[0])
        mgr.wait()
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.05)
    assert seen == [True]


def test_a_failed_construction_leaves_no_thread_behind(tmp_path: Path, shm_dir: Path) -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    before = {t.ident for t in threading.enumerate()}
    try:
        for i in range(3):
            # the RAM tier's peer server cannot bind its port
            with pytest.raises(PeerError, match="cannot listen"):
                CheckpointManager(
                    str(tmp_path / "ck"),
                    options=ManagerOptions(
                        ram=RamOptions(root=str(shm_dir / f"t{i}"), secret=b"x" * 32, port=port)
                    ),
                )
    finally:
        busy.close()
    leftover = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert not leftover


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 0.0, -1.0])
def test_a_barrier_timeout_must_be_positive_and_finite(value: float) -> None:
    with pytest.raises(ConfigError, match="finite"):
        DistributedOptions(barrier_timeout_s=value)
