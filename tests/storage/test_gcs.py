"""The core over GCS (fake-gcs-server emulator): a smaller set of the in-process tests."""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fastckpt
from fastckpt import CheckpointManager, ManagerOptions, RetentionOptions, SaveOptions
from fastckpt.errors import ChecksumMismatchError, StepAlreadyCommittedError
from fastckpt.storage import GcsStore
from tests.support.arrays import P, assert_bit_exact, assert_sharded_like, device_data, named, sds


def test_gcs_reshard_round_trip_and_commit_rules(gcs_store: GcsStore) -> None:
    src = named((2, 4), ("a", "b"), P("a", "b"))
    w, wh = device_data((48, 24), np.float32, src, seed=1)
    b, bh = device_data((48,), ml_dtypes.bfloat16, named((8,), ("x",), P("x")), seed=2)
    key = jax.random.key(5)
    opts = ManagerOptions(
        save=SaveOptions(max_chunk_bytes=1024, object_bytes=4096),
        retention=RetentionOptions(keep_last=2),
    )
    with CheckpointManager(gcs_store, options=opts) as mgr:
        for step in (1, 2, 3):
            mgr.save(
                step,
                {"w": w, "b": b, "key": key, "n": np.arange(5), "s": "x"},
                metadata={"step": step},
            )
        mgr.wait()
        assert mgr.all_steps() == [2, 3]
        assert asyncio_list(mgr, "steps/000000000001/") == []
        with pytest.raises(StepAlreadyCommittedError):
            mgr.save(3, {"w": w})
            mgr.wait()
        assert mgr.metadata(3) == {"step": 3}
        for rshape, rnames, rspec in [
            ((6,), ("x",), P("x", None)),
            ((1,), ("x",), P()),
            ((4, 2), ("a", "b"), P("b", "a")),
        ]:
            dst = named(rshape, rnames, rspec)
            got = mgr.restore(
                3,
                target={
                    "w": sds(wh, dst),
                    "b": sds(bh, named(rshape, rnames, P(rspec[0] if rspec else None))),
                    "key": key,
                    "n": np.zeros(5, int),
                    "s": "",
                },
            )
            assert_sharded_like(got["w"], dst, wh)
            assert_bit_exact(got["b"], bh)
            assert_bit_exact(jax.random.key_data(got["key"]), np.asarray(jax.random.key_data(key)))
            np.testing.assert_array_equal(got["n"], np.arange(5))
            assert got["s"] == "x"
        got = mgr.restore()
        assert_sharded_like(got["w"], src, wh)


def asyncio_list(mgr: CheckpointManager, prefix: str) -> list[str]:
    return mgr._io.run(mgr.store.list(prefix))


def test_gcs_corruption_detected(gcs_store: GcsStore) -> None:
    x = jax.device_put(jnp.arange(2048, dtype=jnp.int32), named((8,), ("x",), P("x")))
    with CheckpointManager(
        gcs_store, options=ManagerOptions(save=SaveOptions(compression="none"))
    ) as mgr:
        mgr.save(1, {"x": x})
        mgr.wait()
        chunk = mgr.manifest(1).arrays()[0].chunks[2]
        blob = bytearray(mgr._io.run(mgr.store.get(chunk.key)))
        blob[chunk.offset + 5] ^= 1
        mgr._io.run(mgr.store.put(chunk.key, bytes(blob)))
        with pytest.raises(ChecksumMismatchError, match=r"\['x'\]"):
            mgr.restore(1)


def test_gs_root_honours_storage_emulator_host(
    gcs_emulator: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain ``gs://`` root, with ``STORAGE_EMULATOR_HOST`` set as for google-cloud-storage
    and no credentials anywhere, saves to and restores from the emulator bit-exact."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.endpoint)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", "/nonexistent/credentials.json")
    w, wh = device_data((32, 8), np.float32, named((2, 4), ("a", "b"), P("a", "b")), seed=3)
    url = f"gs://fastckpt-test/env-{os.getpid()}-{time.monotonic_ns()}"
    with CheckpointManager(url) as mgr:
        assert mgr.store.inner.options.endpoint == gcs_emulator.endpoint  # type: ignore[attr-defined]
        mgr.save(1, {"w": w, "n": np.arange(3)})
        mgr.wait()
    got = fastckpt.restore(url, target={"w": sds(wh, w.sharding), "n": np.zeros(3, int)})
    assert_sharded_like(got["w"], w.sharding, wh)
    np.testing.assert_array_equal(got["n"], np.arange(3))


def test_the_client_modules_are_imported_by_the_constructor_not_the_warm_up_thread() -> None:
    """An import holds the GIL for its whole length: made on the warm-up thread, it slowed a
    save made right after the store was constructed. The constructor imports them (a fresh
    interpreter: nothing imported them before); the client itself is still made in the
    background."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from fastckpt.storage import GcsStore\n"
        "from fastckpt.storage._gcs import GcsOptions\n"
        "assert 'google.cloud.storage' not in sys.modules\n"
        "s = GcsStore('bucket', options=GcsOptions(endpoint='http://127.0.0.1:9'))\n"
        "print('google.cloud.storage' in sys.modules, s._client is None)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "STORAGE_EMULATOR_HOST"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "True"
