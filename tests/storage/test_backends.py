"""Backend-specific behaviour beyond the conformance suite."""

from __future__ import annotations

import errno
import gc
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from fastckpt._checksum import crc32c
from fastckpt.errors import (
    AlreadyExistsError,
    ConfigError,
    NotFoundError,
    PermissionDeniedError,
    RetriesExhaustedError,
    StorageError,
    TransientStorageError,
)
from fastckpt.storage import (
    ByteRange,
    GcsOptions,
    GcsStore,
    LocalStore,
    MemoryStore,
    RetryingStore,
    RetryPolicy,
    open_store,
)
from fastckpt.storage._local import TEMP_SUFFIX, _translate
from fastckpt.testing.gcs_emulator import EmulatorError, GcsEmulator
from fastckpt.testing.store_tests import run

# -- MemoryStore ----------------------------------------------------------------------


def test_memory_named_stores_share_while_alive() -> None:
    a = MemoryStore("shared-test")
    b = MemoryStore("shared-test")
    run(a.put("k", b"v"))
    assert bytes(run(b.get("k"))) == b"v"
    assert run(MemoryStore().list()) == []  # anonymous stores are private
    del a, b
    gc.collect()
    assert run(MemoryStore("shared-test").list()) == []  # released with its last user


def test_memory_get_is_zero_copy_and_read_only() -> None:
    store = MemoryStore()
    run(store.put("k", bytearray(b"0123456789")))
    view = run(store.get("k", byte_range=ByteRange(2, 3)))
    assert isinstance(view, memoryview) and view.readonly
    assert bytes(view) == b"234"
    assert view.obj is memoryview(run(store.get("k"))).obj


def test_memory_rejects_bad_names() -> None:
    with pytest.raises(ConfigError):
        MemoryStore("a/b")
    with pytest.raises(ConfigError):
        MemoryStore("")


# -- LocalStore -----------------------------------------------------------------------


def test_local_layout_and_no_leftovers(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    run(store.put("a/b/c", [b"x", b"y"], mode="create"))
    run(store.put("a/b/c", b"z"))
    assert (tmp_path / "a" / "b" / "c").read_bytes() == b"z"
    assert sorted(p.name for p in (tmp_path / "a" / "b").iterdir()) == ["c"]
    assert store.url == tmp_path.as_uri()
    run(store.close())


def test_local_rejects_reserved_suffix(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    with pytest.raises(ConfigError):
        run(store.put("x" + TEMP_SUFFIX, b"1"))


def test_local_key_and_prefix_conflict(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, durable=False)
    run(store.put("a/b", b"1"))
    with pytest.raises(StorageError):
        run(store.put("a", b"2"))
    with pytest.raises(StorageError):
        run(store.put("a/b/c", b"3"))
    with pytest.raises(NotFoundError):
        run(store.get("a"))
    assert run(store.list()) == ["a/b"]


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (FileNotFoundError(errno.ENOENT, "x"), NotFoundError),
        (IsADirectoryError(errno.EISDIR, "x"), NotFoundError),
        (FileExistsError(errno.EEXIST, "x"), AlreadyExistsError),
        (PermissionError(errno.EACCES, "x"), PermissionDeniedError),
        (OSError(errno.ESTALE, "x"), TransientStorageError),
        (OSError(errno.ENOSPC, "x"), StorageError),
    ],
)
def test_local_os_error_translation(error: OSError, expected: type[Exception]) -> None:
    with pytest.raises(expected) as info:
        _translate(error, "op")
    assert info.value.__cause__ is error


def test_local_large_ranged_read_is_exact(tmp_path: Path) -> None:
    data = os.urandom(3 * 1024 * 1024 + 5)
    store = LocalStore(tmp_path, durable=False)
    run(store.put("big", data))
    got = run(store.get("big", byte_range=ByteRange(1, len(data))))
    assert memoryview(got).nbytes == len(data) - 1 and bytes(got) == data[1:]


# -- GcsStore -------------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_gcs_connection_refused_is_transient() -> None:
    opts = GcsOptions(endpoint=f"http://127.0.0.1:{_closed_port()}", connect_timeout_s=1.0)
    store = GcsStore("bkt", "p", options=opts)
    with pytest.raises(TransientStorageError):
        run(store.put("k", b"1"))
    with pytest.raises(TransientStorageError):
        run(store.get("k"))
    with pytest.raises(TransientStorageError):
        run(store.list())
    retrying = RetryingStore(store, policy=RetryPolicy(max_attempts=2, initial_backoff_s=0.001))
    with pytest.raises(RetriesExhaustedError) as info:
        run(retrying.get("k"))
    assert isinstance(info.value.__cause__, TransientStorageError)
    run(retrying.close())


def test_gcs_missing_bucket_is_not_found(gcs_emulator: GcsEmulator) -> None:
    store = GcsStore("no-such-bucket-xyz", options=GcsOptions(endpoint=gcs_emulator.endpoint))
    with pytest.raises(NotFoundError):
        run(store.get("k"))
    run(store.close())


def test_gcs_head_reports_server_crc(gcs_store: GcsStore) -> None:
    parts = [b"abc", bytearray(b"def"), memoryview(b"ghi")]
    run(gcs_store.put("k", parts))
    meta = run(gcs_store.head("k"))
    assert meta.size == 9 and meta.crc32c == crc32c(b"abcdefghi")
    with pytest.raises(NotFoundError):
        run(gcs_store.head("missing"))


def test_gcs_keys_with_odd_characters(gcs_store: GcsStore) -> None:
    keys = ["sp ace/x", "q?u#e%ry", "uni/ñ€", "plus+and&"]
    for k in keys:
        run(gcs_store.put(k, k.encode()))
    for k in keys:
        assert bytes(run(gcs_store.get(k))) == k.encode()
    assert run(gcs_store.list()) == sorted(keys)


def test_gcs_options_validation() -> None:
    with pytest.raises(ConfigError):
        GcsOptions(max_workers=0)
    with pytest.raises(ConfigError):
        GcsOptions(endpoint="127.0.0.1:1")
    with pytest.raises(ConfigError):
        GcsStore("a/b")
    with pytest.raises(ConfigError):
        GcsStore("bkt", "a/../b")


# -- open_store -----------------------------------------------------------------------


def test_open_store_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    s = open_store("gs://bkt/some/prefix/", gcs_endpoint="http://127.0.0.1:1")
    assert isinstance(s, RetryingStore) and isinstance(s.inner, GcsStore)
    assert (s.inner.bucket, s.inner.prefix, s.inner.options.endpoint) == (
        "bkt",
        "some/prefix",
        "http://127.0.0.1:1",
    )
    assert s.url == "gs://bkt/some/prefix"

    bare = open_store("gs://bkt", retry=None)
    assert isinstance(bare, GcsStore) and bare.prefix == "" and bare.options.endpoint is None

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:2")
    env = open_store("gs://bkt", retry=None)
    assert isinstance(env, GcsStore) and env.options.endpoint == "http://127.0.0.1:2"
    # An explicit endpoint wins over the variable, whichever way it is given.
    assert (
        open_store("gs://bkt", retry=None, gcs_endpoint="http://x").options.endpoint == "http://x"
    )  # type: ignore[attr-defined]
    explicit = GcsStore("bkt", options=GcsOptions(endpoint="http://127.0.0.1:3"))
    assert explicit.options.endpoint == "http://127.0.0.1:3"
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:4")  # a bare host:port, as gcsfs accepts
    assert GcsStore("bkt").options.endpoint == "http://127.0.0.1:4"
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "")
    assert GcsStore("bkt").options.endpoint is None
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")

    f = open_store(tmp_path.as_uri() + "/ck%20pt", retry=None)
    assert isinstance(f, LocalStore) and f.root == tmp_path / "ck pt"
    assert isinstance(open_store(str(tmp_path), retry=None), LocalStore)
    monkeypatch.chdir(tmp_path)
    rel = open_store("rel/dir", retry=None)
    assert isinstance(rel, LocalStore) and rel.root == tmp_path / "rel" / "dir"
    assert isinstance(open_store("rel/dir"), RetryingStore)

    m1, m2 = open_store("mem://open-test"), open_store("mem://open-test")
    assert isinstance(m1, MemoryStore) and isinstance(m2, MemoryStore)
    run(m1.put("k", b"v"))
    assert run(m2.exists("k"))


@pytest.mark.parametrize(
    "url",
    [
        "s3://bucket/x",
        "http://host/x",
        "gs://",
        "gs:///path",
        "file://otherhost/x",
        "file://rel",
        "mem://a/b",
        "",
    ],
)
def test_open_store_rejects(url: str) -> None:
    with pytest.raises(ConfigError):
        open_store(url)


# -- GcsEmulator ----------------------------------------------------------------------


def test_emulator_raises_when_binary_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    import fastckpt.testing.gcs_emulator as mod

    def missing() -> Path:
        raise EmulatorError("no binary")

    monkeypatch.setattr(mod, "find_emulator_binary", missing)
    with pytest.raises(EmulatorError):
        with GcsEmulator():
            pass


def test_emulator_filesystem_backend_round_trip(tmp_path: Path) -> None:
    with GcsEmulator(backend="filesystem", root=tmp_path / "gcs") as emu:
        emu.create_bucket("fs-bucket")
        store = GcsStore("fs-bucket", options=GcsOptions(endpoint=emu.endpoint))
        run(store.put("a/b", b"on disk", mode="create"))
        assert bytes(run(store.get("a/b"))) == b"on disk"
        run(store.close())
    with pytest.raises(EmulatorError):
        _ = emu.endpoint  # stopped


def test_gcs_reuses_connections(gcs_store: GcsStore, caplog: pytest.LogCaptureFixture) -> None:
    """Gets read the whole body and hand the connection back (no reconnect per request)."""
    data = os.urandom(300_000)
    run(gcs_store.put("k", data))

    async def sequential() -> None:
        for i in range(6):
            assert (
                bytes(await gcs_store.get("k", byte_range=ByteRange(i, 1000))) == data[i : i + 1000]
            )
            assert bytes(await gcs_store.get("k")) == data
            await gcs_store.put(f"k{i}", data)

    run(gcs_store.get("k"))  # warm one connection
    with caplog.at_level("DEBUG", logger="urllib3.connectionpool"):
        run(sequential())
    new = [r for r in caplog.records if "Starting new" in r.getMessage()]
    assert len(new) <= 1, [r.getMessage() for r in new]


def test_gcs_list_leaves_out_folder_placeholders(gcs_store: Any, gcs_emulator: Any) -> None:
    """An object named like a folder ("dir/", made by the Cloud Console or gcsfuse) is not a
    key this store can address: ``list`` and ``list_info`` leave it out, and gc works past it."""
    import urllib.request

    from fastckpt.maintenance import collect_garbage_async

    run(gcs_store.put("steps/000000000001/abc/p00000-00000.fck", b"x"))
    name = f"{gcs_store.prefix}/steps/000000000001/"
    req = urllib.request.Request(
        f"{gcs_emulator.endpoint}/upload/storage/v1/b/{gcs_store.bucket}/o?uploadType=media"
        f"&name={name}",
        data=b"",
        method="POST",
        headers={"Content-Type": "application/octet-stream"},
    )
    urllib.request.urlopen(req).read()
    assert run(gcs_store.list("steps/")) == ["steps/000000000001/abc/p00000-00000.fck"]
    assert [i.key for i in run(gcs_store.list_info("steps/"))] == [
        "steps/000000000001/abc/p00000-00000.fck"
    ]
    report = run(collect_garbage_async(gcs_store, grace_s=3600))
    assert [lo.key for lo in report.kept] == ["steps/000000000001/abc/p00000-00000.fck"]


def test_local_put_survives_gc_pruning_its_new_directory(tmp_path: Path) -> None:
    """gc (safe while saves run) sweeps empty directories away: a put that created its
    directory and had not yet created its file in it makes it again."""
    store = LocalStore(tmp_path)
    real, calls = store._makedirs, []

    def makedirs_then_gc(d: Path) -> None:
        real(d)
        calls.append(d)
        if len(calls) == 1:
            run(store.sweep(older_than=0.0))  # what a collection ends with, at the worst moment

    store._makedirs = makedirs_then_gc  # type: ignore[method-assign]
    run(store.put("steps/000000000005/save/p00000-00000.fck", b"data"))
    assert len(calls) == 2
    assert bytes(run(store.get("steps/000000000005/save/p00000-00000.fck"))) == b"data"


def test_retry_backoff_of_a_long_series_does_not_overflow() -> None:
    policy = RetryPolicy(
        max_attempts=5000, initial_backoff_s=0.01, max_backoff_s=1.0, deadline_s=None
    )
    assert policy.backoff_ceiling(2000) == 1.0
