"""CheckpointManager behaviour: typed errors, commit rules, async save errors, retention,
if_busy, save interval, compression and corruption detection."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fastckpt
from fastckpt import CheckpointManager, ManagerOptions, RetentionOptions, SaveOptions
from fastckpt.errors import (
    CheckpointNotFoundError,
    ChecksumMismatchError,
    ConfigError,
    DtypeMismatchError,
    ManifestError,
    NoCheckpointError,
    SaveError,
    ShapeMismatchError,
    StepAlreadyCommittedError,
    StorageError,
    TreeStructureError,
    UnsupportedFormatVersionError,
)
from fastckpt.format.codec import seal_document
from fastckpt.format.layout import manifest_key, step_data_prefix
from fastckpt.storage import LocalStore, MemoryStore, Store
from fastckpt.storage._protocol import Payload, PutMode
from tests.support.arrays import P, assert_bit_exact, assert_sharded_like, device_data, named, sds
from tests.support.wrapping import ForwardingStore


def small_state(seed: int = 0) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    s = named((2, 4), ("a", "b"), P("a", "b"))
    w, wh = device_data((16, 8), np.float32, s, seed=seed)
    v, vh = device_data((8,), np.int32, named((8,), ("x",), P("x")), seed=seed + 100)
    return {"w": w, "v": v, "step": seed}, {"w": wh, "v": vh}


def store_of(root: Any, tmp_path: Path) -> Store:
    return root if isinstance(root, Store) else LocalStore(root)


# ------------------------------------------------------------------ typed restore errors


def test_target_mismatch_errors(root: Any) -> None:
    state, hosts = small_state()
    fastckpt.save(root, 1, state)
    with CheckpointManager(root) as mgr:
        ok = {
            "w": sds(hosts["w"], state["w"].sharding),
            "v": sds(hosts["v"], state["v"].sharding),
            "step": 0,
        }
        mgr.restore(1, target=ok)
        with pytest.raises(TreeStructureError, match="not in checkpoint"):
            mgr.restore(1, target={**ok, "extra": jnp.zeros(2)})
        with pytest.raises(TreeStructureError, match="lacks"):
            mgr.restore(1, target={"w": ok["w"]})
        with pytest.raises(TreeStructureError):
            mgr.restore(1, target={**ok, "step": jnp.zeros(())})  # value leaf vs array target
        with pytest.raises(TreeStructureError):
            mgr.restore(1, target={**ok, "w": 3})  # array leaf vs scalar target
        with pytest.raises(ShapeMismatchError, match=r"\['w'\]"):
            mgr.restore(1, target={**ok, "w": jax.ShapeDtypeStruct((16, 4), jnp.float32)})
        with pytest.raises(DtypeMismatchError, match=r"\['v'\]"):
            mgr.restore(1, target={**ok, "v": jax.ShapeDtypeStruct((8,), jnp.float32)})
        with pytest.raises(DtypeMismatchError):
            mgr.restore(1, target={**ok, "v": jax.random.split(jax.random.key(0), 8)})
        with pytest.raises(CheckpointNotFoundError, match="step 2"):
            mgr.restore(2, target=ok)
        # Errors are also their builtin counterparts.
        with pytest.raises(LookupError):
            mgr.restore(2)
        with pytest.raises(ValueError):
            mgr.restore(1, target={"w": ok["w"]})


def test_restore_argument_order_and_stats() -> None:
    """``restore(step=None, *, target=None)`` on the manager and after the root in the one-shot
    function (the order of ``save``); figures only through ``last_save_stats`` /
    ``last_restore_stats``."""
    store = MemoryStore()
    x = jnp.arange(8, dtype=np.float32)
    with CheckpointManager(store) as mgr:
        assert mgr.last_save_stats is None and mgr.last_restore_stats is None
        mgr.save(1, {"x": x})
        mgr.save(2, {"x": x + 1})  # joins save 1
        assert mgr.last_save_stats is not None and mgr.last_save_stats.step == 1
        mgr.wait()
        assert mgr.last_save_stats.step == 2
        with pytest.raises(TypeError):
            mgr.restore(1, {"x": x})  # type: ignore[misc]
        assert_bit_exact(mgr.restore(1, target={"x": x})["x"], np.arange(8, dtype=np.float32))
        assert mgr.last_restore_stats is not None and mgr.last_restore_stats.step == 1
        assert_bit_exact(mgr.restore()["x"], np.arange(8, dtype=np.float32) + 1)
        assert mgr.last_restore_stats.step == 2
        assert not hasattr(mgr, "restore_with_stats")
    assert_bit_exact(fastckpt.restore(store, 1)["x"], np.arange(8, dtype=np.float32))
    assert_bit_exact(
        fastckpt.restore(store, target={"x": x})["x"], np.arange(8, dtype=np.float32) + 1
    )
    with pytest.raises(TypeError):
        fastckpt.restore(store, 1, {"x": x})  # type: ignore[misc]
    with pytest.raises(TypeError):
        CheckpointManager(store, on_stats=print)  # type: ignore[call-arg]


def test_empty_root(root: Any) -> None:
    with CheckpointManager(root) as mgr:
        assert mgr.all_steps() == [] and mgr.latest_step() is None
        with pytest.raises(NoCheckpointError):  # nothing at all: a job may initialise instead
            mgr.restore()
        with pytest.raises(NoCheckpointError):
            mgr.manifest()
        with pytest.raises(CheckpointNotFoundError) as info:  # a step that is not there
            mgr.manifest(0)
        assert not isinstance(info.value, NoCheckpointError)


def test_unknown_format_version_and_malformed_manifest(root: Any, tmp_path: Path) -> None:
    state, _ = small_state()
    fastckpt.save(root, 1, state)
    fastckpt.save(root, 2, state)
    store = store_of(root, tmp_path)
    doc = json.loads(bytes(asyncio.run(store.get(manifest_key(1)))))
    doc["format_version"] = 4
    asyncio.run(store.put(manifest_key(1), json.dumps(doc).encode()))
    asyncio.run(
        store.put(manifest_key(2), b'{"format_version": 3, "step": 2, "leaves": [{"path": 3}]}')
    )
    with CheckpointManager(root) as mgr:
        assert mgr.all_steps() == [1, 2]
        with pytest.raises(UnsupportedFormatVersionError, match="format_version 4"):
            mgr.restore(1)
        with pytest.raises(ManifestError):
            mgr.restore(2)
        with pytest.raises(ManifestError):
            mgr.metadata(2)


def test_save_argument_errors(root: Any) -> None:
    state, _ = small_state()
    with CheckpointManager(root) as mgr:
        for bad in (-1, 1.0, True, "3"):
            with pytest.raises(ConfigError):
                mgr.save(bad, state)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=r"\['x'\]"):
            mgr.save(1, {"x": object()})
        with pytest.raises(ConfigError, match=r"\['x'\]"):
            mgr.save(1, {"x": np.array(["a", "b"])})
        donated = jax.device_put(jnp.ones(4))
        donated.delete()
        with pytest.raises(ConfigError, match="deleted"):
            mgr.save(1, {"x": donated})
        assert mgr.all_steps() == []
    with pytest.raises(ConfigError):
        mgr.save(1, state)  # closed


# ------------------------------------------------------------------ commit rules


def test_resaving_a_committed_step_is_refused(root: Any) -> None:
    state, hosts = small_state(seed=1)
    other, _ = small_state(seed=2)
    with CheckpointManager(root) as mgr:
        mgr.save(1, state, metadata={"v": 1})
        mgr.wait()
        with pytest.raises(StepAlreadyCommittedError, match="step 1"):
            mgr.save(1, other, metadata={"v": 2})
            mgr.wait()
        # The manager keeps working and the committed step is untouched.
        mgr.save(2, other)
        mgr.wait()
        assert mgr.all_steps() == [1, 2]
        assert mgr.metadata(1) == {"v": 1}
        assert_bit_exact(mgr.restore(1)["w"], hosts["w"])
    with pytest.raises(StepAlreadyCommittedError):
        fastckpt.save(root, 2, state)


def test_metadata_and_manifest(root: Any) -> None:
    state, _ = small_state()
    meta = {"loader": {"epoch": 3, "files": ["a", "b"]}, "lr": 0.5}
    fastckpt.save(root, 10, state, metadata=meta)
    with CheckpointManager(root) as mgr:
        assert mgr.metadata() == meta
        m = mgr.manifest()
        assert m.step == 10 and m.num_processes == 1
        assert {leaf.path for leaf in m.leaves} == {(("d", "w"),), (("d", "v"),), (("d", "step"),)}
        w = next(a for a in m.arrays() if a.path == (("d", "w"),))
        assert w.sharding is not None and w.sharding.mesh_shape == (2, 4)
        assert w.sharding.partition_spec == ("a", "b")


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_compression(root: Any, compression: str) -> None:
    s = named((8,), ("x",), P("x"))
    smooth = jax.device_put(jnp.zeros((64, 256), jnp.float32).at[:, ::7].set(1.0), s)
    noise, noise_h = device_data((64, 256), np.uint8, s, seed=5)
    opts = ManagerOptions(save=SaveOptions(compression=compression))  # type: ignore[arg-type]
    with CheckpointManager(root, options=opts) as mgr:
        mgr.save(1, {"smooth": smooth, "noise": noise})
        mgr.wait()
        stats = mgr.last_save_stats
        assert stats is not None and stats.raw_bytes == smooth.nbytes + noise.nbytes
        codecs = {a.path[0][1]: {c.codec for c in a.chunks} for a in mgr.manifest(1).arrays()}
        if compression == "none":
            assert codecs == {"smooth": {"raw"}, "noise": {"raw"}}
            assert stats.stored_bytes == stats.raw_bytes
        else:
            assert codecs == {"smooth": {"zstd"}, "noise": {"raw"}}  # incompressible stays raw
            assert stats.stored_bytes < stats.raw_bytes * 0.6
        got = mgr.restore(1)
    assert_bit_exact(got["smooth"], np.asarray(smooth))
    assert_bit_exact(got["noise"], noise_h)


# ------------------------------------------------------------------ retention and interval


def test_retention_keep_last_and_keep_every(root: Any, tmp_path: Path) -> None:
    state, _ = small_state()
    opts = ManagerOptions(retention=RetentionOptions(keep_last=2, keep_every=3))
    with CheckpointManager(root, options=opts) as mgr:
        for step in range(1, 8):
            mgr.save(step, state)
        mgr.wait()
        assert mgr.all_steps() == [3, 6, 7]
        for gone in (1, 2, 4, 5):
            assert asyncio.run(mgr.store.list(step_data_prefix(gone))) == []
        for kept in (3, 6, 7):
            assert asyncio.run(mgr.store.list(step_data_prefix(kept)))
            mgr.restore(kept)
    opts = ManagerOptions(retention=RetentionOptions(keep_last=None))
    with CheckpointManager(root, options=opts) as mgr:
        mgr.save(8, state)
        mgr.save(9, state)
        mgr.wait()
        assert mgr.all_steps() == [3, 6, 7, 8, 9]


def test_save_interval(root: Any) -> None:
    state, _ = small_state()
    opts = ManagerOptions(save_interval_steps=3, retention=RetentionOptions(keep_last=None))
    with CheckpointManager(root, options=opts) as mgr:
        results = {step: mgr.save(step, state) for step in range(0, 8)}
        assert mgr.save(8, state, force=True)
        mgr.wait()
        assert [s for s, r in results.items() if r] == [0, 3, 6]
        assert mgr.all_steps() == [0, 3, 6, 8]


# ------------------------------------------------------------------ failures in the background


class FlakyStore(ForwardingStore):
    """Delegates to a MemoryStore; ``put`` of data objects fails while ``fail`` is set and
    sleeps ``delay_s`` first (to keep a save in flight)."""

    def __init__(self) -> None:
        super().__init__(MemoryStore())
        self.url = "flaky://" + self.inner.url
        self.fail = False
        self.fail_nth: int | None = None
        """Fail only the n-th data put (0-based), once."""
        self.data_puts = 0
        self.delay_s = 0.0
        self.gate = threading.Event()
        self.gate.set()

    async def put(self, key: str, data: Payload, *, mode: PutMode = "overwrite") -> None:
        if key.startswith("steps/"):
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            while not self.gate.is_set():
                await asyncio.sleep(0.01)
            n, self.data_puts = self.data_puts, self.data_puts + 1
            if self.fail or n == self.fail_nth:
                raise StorageError(f"injected failure writing {key}")
        await self.inner.put(key, data, mode=mode)


def _causes(e: BaseException | None) -> list[BaseException]:
    out = []
    while e is not None:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def test_save_error_surfaces_on_wait() -> None:
    store = FlakyStore()
    state, hosts = small_state()
    with CheckpointManager(store) as mgr:
        mgr.save(1, state)
        mgr.wait()
        store.fail = True
        assert mgr.save(2, state) is True  # staging succeeds; the upload fails later
        with pytest.raises(SaveError) as info:
            mgr.wait()
        # The cause is the store's error, not a symptom further down the protocol.
        assert any(
            isinstance(c, StorageError) and "injected" in str(c) for c in _causes(info.value)
        ), [repr(c) for c in _causes(info.value)]
        assert mgr.all_steps() == [1]
        store.fail = False
        mgr.save(3, state)
        mgr.wait()
        assert mgr.all_steps() == [1, 3]
        assert_bit_exact(mgr.restore(3)["w"], hosts["w"])


def test_early_upload_failure_among_many_objects_is_reported() -> None:
    """A save of many objects whose first upload fails reports that failure (not a missing
    chunk noticed later), and commits nothing."""
    store = FlakyStore()
    store.fail_nth = 0
    s = named((8,), ("x",), P("x"))
    x, xh = device_data((256, 256), np.float32, s)
    opts = ManagerOptions(
        save=SaveOptions(
            compression="none", max_chunk_bytes=4096, object_bytes=8192, upload_concurrency=1
        )
    )
    with CheckpointManager(store, options=opts) as mgr:
        mgr.save(1, {"x": x})
        with pytest.raises(SaveError) as info:
            mgr.wait()
        causes = _causes(info.value)
        assert any(isinstance(c, StorageError) and "injected" in str(c) for c in causes), [
            repr(c) for c in causes
        ]
        assert not any(isinstance(c, ManifestError) for c in causes), [repr(c) for c in causes]
        assert mgr.all_steps() == []
        mgr.save(2, {"x": x})
        mgr.wait()
        assert_bit_exact(mgr.restore(2)["x"], xh)


def test_save_error_surfaces_on_next_save() -> None:
    store = FlakyStore()
    state, _ = small_state()
    with CheckpointManager(store) as mgr:
        store.fail = True
        mgr.save(1, state)
        with pytest.raises(SaveError):
            mgr.save(2, state)  # reports step 1's failure; step 2 is not started
        store.fail = False
        assert mgr.all_steps() == []
        mgr.wait()  # nothing pending: the error was reported once
        mgr.save(2, state)
        mgr.wait()
        assert mgr.all_steps() == [2]


def test_save_error_surfaces_on_close() -> None:
    store = FlakyStore()
    state, _ = small_state()
    mgr = CheckpointManager(store)
    store.fail = True
    mgr.save(1, state)
    with pytest.raises(SaveError):
        mgr.close()
    mgr.close()  # idempotent
    assert asyncio.run(store.list("manifests/")) == []


def test_if_busy_skip() -> None:
    store = FlakyStore()
    store.gate.clear()  # hold the first save in its upload
    state, _ = small_state()
    opts = ManagerOptions(save=SaveOptions(if_busy="skip"))
    with CheckpointManager(store, options=opts) as mgr:
        assert mgr.save(1, state) is True
        t0 = time.perf_counter()
        assert mgr.save(2, state) is False  # busy: skipped without blocking
        assert time.perf_counter() - t0 < 1.0
        store.gate.set()
        mgr.wait()
        assert mgr.save(3, state) is True
        mgr.wait()
        assert mgr.all_steps() == [1, 3]


def test_if_busy_wait_blocks_until_previous_commits() -> None:
    store = FlakyStore()
    store.delay_s = 0.3
    state, _ = small_state()
    with CheckpointManager(store) as mgr:
        assert mgr.save(1, state) is True
        assert mgr.save(2, state) is True  # waits for step 1 first
        assert mgr.all_steps() == [1]
        mgr.wait()
        assert mgr.all_steps() == [1, 2]


def test_save_is_async() -> None:
    store = FlakyStore()
    store.gate.clear()
    state, _ = small_state()
    with CheckpointManager(store) as mgr:
        t0 = time.perf_counter()
        mgr.save(1, state)
        assert time.perf_counter() - t0 < 5
        assert mgr.all_steps() == []  # not committed while the upload is held
        store.gate.set()
        mgr.wait()
        assert mgr.all_steps() == [1]
        assert mgr.last_save_stats is not None and mgr.last_save_stats.step == 1


# ------------------------------------------------------------------ corruption


def _flip_byte(root: Any, key: str, offset: int) -> None:
    if isinstance(root, MemoryStore):
        blob = bytearray(asyncio.run(root.get(key)))
        blob[offset] ^= 0x40
        asyncio.run(root.put(key, blob))
    else:
        path = Path(root) / key
        blob = bytearray(path.read_bytes())
        blob[offset] ^= 0x40
        path.write_bytes(bytes(blob))


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_corrupted_byte_raises_checksum_mismatch_naming_the_array(
    root: Any, compression: str
) -> None:
    s = named((8,), ("x",), P("x"))
    state = {
        "good": jax.device_put(jnp.arange(1024.0), s),
        "params": {"bad": jax.device_put(jnp.arange(4096, dtype=jnp.int32) % 13, s)},
    }
    opts = ManagerOptions(save=SaveOptions(compression=compression))  # type: ignore[arg-type]
    fastckpt.save(root, 1, state, options=opts)
    with CheckpointManager(root) as mgr:
        leaf = next(a for a in mgr.manifest(1).arrays() if a.path[-1] == ("d", "bad"))
        chunk = leaf.chunks[3]
        _flip_byte(root, chunk.key, chunk.offset + chunk.length // 2)
        with pytest.raises(ChecksumMismatchError, match=r"\['params'\]\['bad'\]") as info:
            mgr.restore(1)
        assert chunk.key in str(info.value)
        # A subtree that does not touch the corrupted chunk restores fine.
        got = mgr.restore(1, target={"good": None}, partial=True)
        assert_bit_exact(got["good"], np.arange(1024.0, dtype=np.float32))


def test_same_mesh_restore_after_many_saves_is_exact(root: Any) -> None:
    """Staging buffers are reused between saves: every step keeps its own values."""
    s = named((4, 2), ("a", "b"), P("a", "b"))
    hosts = {}
    opts = ManagerOptions(retention=RetentionOptions(keep_last=None))
    with CheckpointManager(root, options=opts) as mgr:
        for step in range(4):
            x, hosts[step] = device_data((32, 32), np.float32, s, seed=step)
            mgr.save(step, {"x": x})
        mgr.wait()
        for step in range(4):
            assert_sharded_like(
                mgr.restore(step, target={"x": sds(hosts[step], s)})["x"], s, hosts[step]
            )


def test_one_manifest_format_and_nothing_else_is_restored(root: Any, tmp_path: Path) -> None:
    """Every step's manifest is format 3 (a grid table per leaf, binary columns, the checksum
    first); a step whose manifest claims another format, or has no checksum, is listed but
    refused with a typed error, and the other steps restore."""
    state, hosts = small_state()
    for step in (1, 2, 3):
        fastckpt.save(root, step, state)
    store = store_of(root, tmp_path)
    data = bytes(asyncio.run(store.get(manifest_key(1))))
    doc = json.loads(data)
    assert data.startswith(b'{"manifest_crc32c":') and doc["format_version"] == 3
    tables = [leaf["chunks"] for leaf in doc["leaves"] if leaf["type"] == "array"]
    assert all("grid" in t and t["crc32c"][:3] in ("u1:", "u2:", "u4:") for t in tables)
    asyncio.run(store.put(manifest_key(1), seal_document({**doc, "format_version": 2})))
    asyncio.run(
        store.put(
            manifest_key(2),
            json.dumps({k: v for k, v in doc.items() if k != "manifest_crc32c"}).encode(),
        )
    )
    with CheckpointManager(root) as mgr:
        assert mgr.all_steps() == [1, 2, 3]
        with pytest.raises(
            UnsupportedFormatVersionError, match="format_version 2 is not supported"
        ):
            mgr.restore(1)
        with pytest.raises(ManifestError, match="no manifest_crc32c") as info:
            mgr.restore(2)
        assert not isinstance(info.value, UnsupportedFormatVersionError)
        out = mgr.restore(
            3,
            target={
                "w": sds(hosts["w"], state["w"].sharding),
                "v": sds(hosts["v"], state["v"].sharding),
                "step": 0,
            },
        )
        assert_bit_exact(out["w"], hosts["w"])
    with pytest.raises(TypeError, match="manifest_format"):
        SaveOptions(manifest_format=3)  # type: ignore[call-arg]
