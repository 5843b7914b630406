"""A conformance suite every :class:`~fastckpt.storage.Store` backend must pass.

Usage (in a test module)::

    import pytest
    from fastckpt.storage import MemoryStore
    from fastckpt.testing.store_tests import StoreTests

    class TestMemoryStore(StoreTests):
        @pytest.fixture
        def store(self):
            return MemoryStore()

The ``store`` fixture must return a fresh, empty store (or one whose keys are isolated
under a fresh prefix). The suite closes it after each test. Tests are plain synchronous
pytest tests that drive the async API with :func:`run` (no pytest-asyncio needed).
Backends that write temporary objects next to the final ones override
:meth:`StoreTests.write_stray_temp` so the suite can check that ``list`` hides them and
``sweep`` removes them. A backend that lists in pages should be given a small page size so
that :attr:`StoreTests.list_page_objects` objects span several pages.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import pytest

from fastckpt.errors import AlreadyExistsError, ConfigError, CorruptionError, NotFoundError
from fastckpt.storage import ByteRange, ObjectInfo, Store

__all__ = ["UNSAFE_KEYS", "StoreTests", "run"]

T = TypeVar("T")

#: Keys every backend must reject with ``ConfigError``.
UNSAFE_KEYS: tuple[str, ...] = (
    "",
    "/abs",
    "a//b",
    "a/",
    "a/../b",
    "..",
    ".",
    "./a",
    "a\x00b",
    "a\\b",
)


def run(awaitable: Awaitable[T]) -> T:
    """Run ``awaitable`` to completion on a fresh event loop and return its result."""

    async def _wrap() -> T:
        return await awaitable

    return asyncio.run(_wrap())


def _blob(n: int, seed: int = 0) -> bytes:
    """Deterministic non-repeating-ish bytes (cheap for large ``n``)."""
    block = bytes((i * 131 + seed * 17 + (i >> 8)) & 0xFF for i in range(4096))
    reps, rest = divmod(n, len(block))
    return block * reps + block[:rest]


async def _get(store: Store, key: str, byte_range: ByteRange | None = None) -> bytes:
    return bytes(await store.get(key, byte_range=byte_range))


class StoreTests:
    """Conformance tests for the :class:`~fastckpt.storage.Store` contract.

    Subclasses provide a ``store`` fixture; they may override :meth:`write_stray_temp`.
    """

    #: Size of the object used by :meth:`test_large_object`.
    large_size: int = 20 * 1024 * 1024
    #: How many concurrent ``put(mode="create")`` calls race for one key.
    create_racers: int = 8
    #: Objects :meth:`test_listing_spans_pages` writes (more than one page of the backend's).
    list_page_objects: int = 12
    #: How far a listed ``mtime`` may lie outside the interval of the put, in seconds
    #: (file-system timestamp granularity, a remote server's clock).
    clock_slack_s: float = 2.0

    @pytest.fixture(autouse=True)
    def _close_store(self, store: Store) -> Iterator[None]:
        yield
        run(store.close())

    def write_stray_temp(self, store: Store, key: str) -> bool:
        """Leave behind what an interrupted ``put(key)`` would leave; return False if N/A."""
        del store, key
        return False

    # -- round trips -------------------------------------------------------------------

    @pytest.mark.parametrize("kind", [bytes, bytearray, memoryview], ids=lambda k: k.__name__)
    def test_put_get_round_trip(self, store: Store, kind: Callable[[bytes], Any]) -> None:
        run(store.put("a/b/obj", kind(b"hello, fastckpt")))
        assert run(_get(store, "a/b/obj")) == b"hello, fastckpt"

    def test_get_returns_buffer(self, store: Store) -> None:
        run(store.put("k", b"xyz"))
        got = run(store.get("k"))
        assert isinstance(got, (bytes, bytearray, memoryview))
        assert memoryview(got).nbytes == 3

    def test_empty_object(self, store: Store) -> None:
        run(store.put("empty", b""))
        assert run(_get(store, "empty")) == b""
        assert run(_get(store, "empty", ByteRange(0, 0))) == b""
        assert run(_get(store, "empty", ByteRange(0, 10))) == b""
        assert run(store.exists("empty"))
        with pytest.raises(NotFoundError):
            run(store.get("empty", byte_range=ByteRange(1, 1)))

    def test_get_missing(self, store: Store) -> None:
        with pytest.raises(NotFoundError):
            run(store.get("missing"))
        with pytest.raises(NotFoundError):
            run(store.get("missing", byte_range=ByteRange(0, 4)))
        with pytest.raises(FileNotFoundError):  # the builtin still catches it
            run(store.get("missing/deeper"))

    def test_put_copies_caller_buffer(self, store: Store) -> None:
        buf = bytearray(b"original")
        run(store.put("k", buf))
        buf[:] = b"mutated!"
        assert run(_get(store, "k")) == b"original"

    def test_multi_part_payload(self, store: Store) -> None:
        parts: list[Any] = [b"ab", bytearray(b""), memoryview(b"cdef"), bytearray(b"g"), b""]
        run(store.put("parts", parts))
        assert run(_get(store, "parts")) == b"abcdefg"
        run(store.put("parts-create", [b"x", b"yz"], mode="create"))
        assert run(_get(store, "parts-create")) == b"xyz"

    def test_multi_part_numpy_payload(self, store: Store) -> None:
        np = pytest.importorskip("numpy")
        a = np.arange(1000, dtype=np.float32)
        b = np.arange(7, dtype=np.int64).reshape(7, 1)
        run(store.put("np", [a, memoryview(b)]))
        assert run(_get(store, "np")) == a.tobytes() + b.tobytes()

    def test_single_numpy_array_payload(self, store: Store) -> None:
        np = pytest.importorskip("numpy")
        a = np.arange(50_000, dtype=np.float32).reshape(100, 500)
        run(store.put("np1", a))
        assert run(_get(store, "np1")) == a.tobytes()
        with pytest.raises(ConfigError):
            run(store.put("np2", a[:, ::2]))  # not contiguous

    def test_empty_parts_list(self, store: Store) -> None:
        run(store.put("none", []))
        assert run(_get(store, "none")) == b""

    # -- ranges ------------------------------------------------------------------------

    def test_range_middle(self, store: Store) -> None:
        data = _blob(10_000)
        run(store.put("r", data))
        assert run(_get(store, "r", ByteRange(1234, 5000))) == data[1234:6234]
        assert run(_get(store, "r", ByteRange(0, 1))) == data[:1]
        assert run(_get(store, "r", ByteRange(9_999, 1))) == data[-1:]

    def test_range_clipped_at_end(self, store: Store) -> None:
        data = _blob(1000)
        run(store.put("r", data))
        assert run(_get(store, "r", ByteRange(900, 500))) == data[900:]
        assert run(_get(store, "r", ByteRange(0, 10**9))) == data

    def test_range_start_past_end(self, store: Store) -> None:
        run(store.put("r", b"0123456789"))
        with pytest.raises(NotFoundError):
            run(store.get("r", byte_range=ByteRange(11, 1)))
        with pytest.raises(NotFoundError):
            run(store.get("r", byte_range=ByteRange(1000, 0)))

    def test_range_zero_length(self, store: Store) -> None:
        run(store.put("r", b"0123456789"))
        assert run(_get(store, "r", ByteRange(3, 0))) == b""
        assert run(_get(store, "r", ByteRange(0, 0))) == b""
        assert run(_get(store, "r", ByteRange(10, 0))) == b""
        assert run(_get(store, "r", ByteRange(10, 5))) == b""

    # -- scatter reads (get_into) ----------------------------------------------------------

    def test_get_into_scatter(self, store: Store) -> None:
        data = _blob(10_000)
        run(store.put("s", data))
        a, b, c = bytearray(100), np.zeros(1000, np.uint8), bytearray(3)
        run(store.get_into("s", 1234, [memoryview(a), b.data, memoryview(c)]))
        assert bytes(a) + b.tobytes() + bytes(c) == data[1234:2337]
        whole = np.empty(10_000, np.uint8)
        run(store.get_into("s", 0, [whole.data]))
        assert whole.tobytes() == data

    def test_get_into_many_parts(self, store: Store) -> None:
        data = _blob(3000)
        run(store.put("s", data))
        parts = [bytearray(1 + i % 3) for i in range(1200)]  # more buffers than one readv takes
        run(store.get_into("s", 5, [memoryview(p) for p in parts]))
        assert b"".join(parts) == data[5 : 5 + sum(len(p) for p in parts)]

    def test_get_into_large_unaligned(self, store: Store) -> None:
        data = os.urandom(self.large_size)
        run(store.put("big", data))
        n = self.large_size // 2 + 17
        out = np.empty(n + 8, np.uint8)
        run(store.get_into("big", 11, [out.data[3 : 3 + n // 3], out.data[3 + n // 3 : 3 + n]]))
        assert out[3 : 3 + n].tobytes() == data[11 : 11 + n]

    def test_get_into_short_object_is_corruption(self, store: Store) -> None:
        run(store.put("s", b"0123456789"))
        with pytest.raises(CorruptionError):
            run(store.get_into("s", 8, [memoryview(bytearray(5))]))
        with pytest.raises(CorruptionError):
            run(store.get_into("s", 10, [memoryview(bytearray(1))]))

    def test_get_into_past_end_or_missing(self, store: Store) -> None:
        run(store.put("s", b"0123456789"))
        with pytest.raises(NotFoundError):
            run(store.get_into("s", 11, [memoryview(bytearray(1))]))
        with pytest.raises(NotFoundError):
            run(store.get_into("missing", 0, [memoryview(bytearray(1))]))
        run(store.get_into("s", 10, []))  # empty read at the end is fine

    def test_negative_range_rejected(self) -> None:
        with pytest.raises(ConfigError):
            ByteRange(-1, 2)
        with pytest.raises(ConfigError):
            ByteRange(0, -2)

    # -- create-only and overwrite -----------------------------------------------------

    def test_create_only(self, store: Store) -> None:
        run(store.put("c", b"first", mode="create"))
        with pytest.raises(AlreadyExistsError):
            run(store.put("c", b"second", mode="create"))
        with pytest.raises(FileExistsError):
            run(store.put("c", b"third", mode="create"))
        assert run(_get(store, "c")) == b"first"

    def test_create_after_overwrite_put(self, store: Store) -> None:
        run(store.put("c", b"first"))
        with pytest.raises(AlreadyExistsError):
            run(store.put("c", b"second", mode="create"))
        assert run(_get(store, "c")) == b"first"

    def test_create_after_delete(self, store: Store) -> None:
        run(store.put("c", b"first", mode="create"))
        run(store.delete("c"))
        run(store.put("c", b"again", mode="create"))
        assert run(_get(store, "c")) == b"again"

    def test_concurrent_creates_exactly_one_wins(self, store: Store) -> None:
        payloads = [_blob(3000 + i, seed=i) for i in range(self.create_racers)]

        async def race() -> list[BaseException | None]:
            puts = (store.put("race", p, mode="create") for p in payloads)
            return list(await asyncio.gather(*puts, return_exceptions=True))

        results = run(race())
        winners = [i for i, r in enumerate(results) if r is None]
        assert len(winners) == 1, results
        losers = [r for r in results if r is not None]
        assert all(isinstance(r, AlreadyExistsError) for r in losers), losers
        assert run(_get(store, "race")) == payloads[winners[0]]

    def test_overwrite(self, store: Store) -> None:
        run(store.put("o", b"one"))
        run(store.put("o", b"two, longer"))
        assert run(_get(store, "o")) == b"two, longer"
        run(store.put("o", b"3", mode="overwrite"))
        assert run(_get(store, "o")) == b"3"

    def test_unknown_mode_rejected(self, store: Store) -> None:
        with pytest.raises(ConfigError):
            run(store.put("m", b"x", mode="append"))  # type: ignore[arg-type]

    # -- list / delete / exists --------------------------------------------------------

    def test_list(self, store: Store) -> None:
        keys = ["b/2", "a/1", "a/sub/deep/3", "ab", "a/0", "c"]
        for k in keys:
            run(store.put(k, k.encode()))
        assert run(store.list()) == sorted(keys)
        assert run(store.list("a/")) == ["a/0", "a/1", "a/sub/deep/3"]
        assert run(store.list("a")) == ["a/0", "a/1", "a/sub/deep/3", "ab"]
        assert run(store.list("a/sub")) == ["a/sub/deep/3"]
        assert run(store.list("zzz")) == []
        assert run(store.list("a/1")) == ["a/1"]

    def test_list_empty_store(self, store: Store) -> None:
        assert run(store.list()) == []
        assert run(store.list("x/")) == []

    def test_list_hides_temp_files(self, store: Store) -> None:
        run(store.put("t/done", b"ok"))
        if not self.write_stray_temp(store, "t/crashed"):
            return
        assert run(store.list()) == ["t/done"]
        assert run(store.list("t/")) == ["t/done"]
        with pytest.raises(NotFoundError):
            run(store.get("t/crashed"))
        run(store.put("t/crashed", b"now", mode="create"))
        assert run(store.list("t/")) == ["t/crashed", "t/done"]

    # -- listing with metadata (list_info) and sweep -----------------------------------

    def test_list_info(self, store: Store) -> None:
        objects = {
            "b/2": b"22",
            "a/1": b"1",
            "a/sub/deep/3": _blob(3000),
            "ab": b"",
            "c": _blob(70_000),
        }
        t0 = time.time()
        for k, v in objects.items():
            run(store.put(k, v))
        t1 = time.time()
        infos = run(store.list_info())
        assert [i.key for i in infos] == sorted(objects) == run(store.list())
        for i in infos:
            assert isinstance(i, ObjectInfo) and i.size == len(objects[i.key]), i
            assert t0 - self.clock_slack_s <= i.mtime <= t1 + self.clock_slack_s, (i, t0, t1)
        assert [i.key for i in run(store.list_info("a/"))] == ["a/1", "a/sub/deep/3"]
        assert [i.key for i in run(store.list_info("a"))] == ["a/1", "a/sub/deep/3", "ab"]
        assert [i.key for i in run(store.list_info("a/sub"))] == ["a/sub/deep/3"]
        assert run(store.list_info("zzz")) == []

    def test_list_info_follows_writes(self, store: Store) -> None:
        run(store.put("m/first", b"1"))
        run(store.put("m/second", b"22"))
        first, second = run(store.list_info("m/"))
        assert first.mtime <= second.mtime
        run(store.put("m/first", b"rewritten"))
        again = {i.key: i for i in run(store.list_info("m/"))}
        assert again["m/first"].size == 9 and again["m/first"].mtime >= second.mtime
        run(store.delete("m/second"))
        assert [i.key for i in run(store.list_info("m/"))] == ["m/first"]

    def test_listing_spans_pages(self, store: Store) -> None:
        keys = [f"p/{i:04d}" for i in range(self.list_page_objects)]

        async def put_all() -> None:
            await asyncio.gather(*(store.put(k, k.encode()) for k in keys))

        run(put_all())
        run(store.put("q", b"outside the prefix"))
        assert run(store.list("p/")) == keys
        assert [(i.key, i.size) for i in run(store.list_info("p/"))] == [(k, 6) for k in keys]

    def test_sweep(self, store: Store) -> None:
        run(store.put("t/done", b"ok"))
        stray = self.write_stray_temp(store, "t/crashed")
        assert run(store.sweep(older_than=time.time() - 3600)) == []  # the stray is younger
        later = time.time() + 3600
        found = run(store.sweep(older_than=later, dry_run=True))
        assert len(found) == int(stray), found
        assert run(store.sweep(older_than=later)) == found
        assert run(store.sweep(older_than=later)) == []
        assert run(store.list()) == ["t/done"] and run(_get(store, "t/done")) == b"ok"
        run(store.put("t/crashed", b"now", mode="create"))
        assert run(store.list("t/")) == ["t/crashed", "t/done"]
        for bad in (float("nan"), float("inf")):
            with pytest.raises(ConfigError):
                run(store.sweep(older_than=bad))

    def test_delete(self, store: Store) -> None:
        run(store.put("d/x", b"1"))
        run(store.put("d/y", b"2"))
        run(store.delete("d/x"))
        with pytest.raises(NotFoundError):
            run(store.get("d/x"))
        assert run(store.list()) == ["d/y"]
        run(store.delete("d/x"))  # missing is fine
        run(store.delete("never/existed"))

    def test_exists(self, store: Store) -> None:
        assert not run(store.exists("e"))
        run(store.put("e", b"1"))
        assert run(store.exists("e"))
        assert not run(store.exists("e/child"))
        run(store.delete("e"))
        assert not run(store.exists("e"))

    @pytest.mark.parametrize("key", UNSAFE_KEYS)
    def test_unsafe_keys_rejected(self, store: Store, key: str) -> None:
        calls: list[Callable[[], Awaitable[object]]] = [
            lambda: store.put(key, b"x"),
            lambda: store.put(key, b"x", mode="create"),
            lambda: store.get(key),
            lambda: store.delete(key),
            lambda: store.exists(key),
        ]
        for call in calls:
            with pytest.raises(ConfigError):
                run(call())

    # -- scale -------------------------------------------------------------------------

    def test_large_object(self, store: Store) -> None:
        data = os.urandom(self.large_size)
        third = self.large_size // 3
        run(store.put("big/obj", [memoryview(data)[:third], memoryview(data)[third:]]))
        assert run(_get(store, "big/obj")) == data
        mid = ByteRange(self.large_size // 2 - 12345, 3 * 1024 * 1024 + 7)
        assert run(_get(store, "big/obj", mid)) == data[mid.start : mid.stop]

    def test_many_concurrent_puts_and_gets(self, store: Store) -> None:
        blobs = {f"many/{i:03d}": _blob(1000 + i, seed=i) for i in range(32)}

        async def go() -> list[bytes]:
            await asyncio.gather(*(store.put(k, v) for k, v in blobs.items()))
            return list(await asyncio.gather(*(_get(store, k) for k in blobs)))

        assert run(go()) == list(blobs.values())
        assert run(store.list("many/")) == sorted(blobs)

    def test_close_is_idempotent(self, store: Store) -> None:
        run(store.put("k", b"v"))
        run(store.close())
        run(store.close())
