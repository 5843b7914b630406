"""Create-only puts on GCS are refused server-side, proven against the real emulator.

fake-gcs-server enforces ``ifGenerationMatch`` only on multipart and resumable uploads.
These tests fail if GcsStore's create-only put ever moves to a path the emulator (and so
this suite) would not check.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from urllib.parse import quote

import pytest

from fastckpt._checksum import crc32c
from fastckpt.errors import AlreadyExistsError, TransientStorageError
from fastckpt.storage import (
    GcsOptions,
    GcsStore,
    ObjectMeta,
    Payload,
    PutMode,
    RetryingStore,
    RetryPolicy,
    Store,
)
from fastckpt.testing.gcs_emulator import GcsEmulator
from fastckpt.testing.store_tests import run
from tests.support.wrapping import ForwardingStore


def _metadata(emulator: GcsEmulator, store: GcsStore, key: str) -> dict[str, str]:
    name = quote(f"{store.prefix}/{key}", safe="")
    with urllib.request.urlopen(
        f"{emulator.endpoint}/storage/v1/b/{store.bucket}/o/{name}"
    ) as resp:
        return dict(json.load(resp))


def test_second_create_is_refused_and_first_is_intact(
    gcs_emulator: GcsEmulator, gcs_store: GcsStore
) -> None:
    first = b"manifest of step 100" * 1000
    run(gcs_store.put("step-100/MANIFEST", first, mode="create"))
    before = _metadata(gcs_emulator, gcs_store, "step-100/MANIFEST")

    with pytest.raises(AlreadyExistsError):
        run(gcs_store.put("step-100/MANIFEST", b"a different manifest", mode="create"))

    assert bytes(run(gcs_store.get("step-100/MANIFEST"))) == first
    after = _metadata(gcs_emulator, gcs_store, "step-100/MANIFEST")
    assert after["generation"] == before["generation"]
    assert run(gcs_store.head("step-100/MANIFEST")).crc32c == crc32c(first)


def test_create_race_between_two_clients(gcs_emulator: GcsEmulator, gcs_store: GcsStore) -> None:
    """Two independent stores (two "hosts") race to commit one key: exactly one wins."""
    other = GcsStore(
        gcs_store.bucket, gcs_store.prefix, options=GcsOptions(endpoint=gcs_emulator.endpoint)
    )
    payloads = [bytes([i]) * (100_000 + i) for i in range(6)]

    async def race() -> list[BaseException | None]:
        stores = [gcs_store, other] * 3
        return list(
            await asyncio.gather(
                *(s.put("commit", p, mode="create") for s, p in zip(stores, payloads)),
                return_exceptions=True,
            )
        )

    try:
        results = run(race())
    finally:
        run(other.close())
    winners = [i for i, r in enumerate(results) if r is None]
    assert len(winners) == 1, results
    assert all(isinstance(r, AlreadyExistsError) for r in results if r is not None)
    assert bytes(run(gcs_store.get("commit"))) == payloads[winners[0]]


def test_overwrite_replaces_and_create_still_refused(gcs_store: GcsStore) -> None:
    run(gcs_store.put("k", b"one", mode="create"))
    run(gcs_store.put("k", b"two"))
    with pytest.raises(AlreadyExistsError):
        run(gcs_store.put("k", b"three", mode="create"))
    assert bytes(run(gcs_store.get("k"))) == b"two"


def test_emulator_ignores_preconditions_on_simple_uploads(
    gcs_emulator: GcsEmulator, gcs_store: GcsStore
) -> None:
    """The fidelity gap that makes the upload path matter (see docs/storage.md)."""
    run(gcs_store.put("gap", b"committed", mode="create"))
    name = quote(f"{gcs_store.prefix}/gap", safe="")
    req = urllib.request.Request(
        f"{gcs_emulator.endpoint}/upload/storage/v1/b/{gcs_store.bucket}/o?uploadType=media&name={name}&ifGenerationMatch=0",
        data=b"overwritten by a simple upload",
        method="POST",
        headers={"Content-Type": "application/octet-stream"},
    )
    with urllib.request.urlopen(req) as resp:
        assert resp.status == 200  # real GCS would answer 412 here
    assert bytes(run(gcs_store.get("gap"))) == b"overwritten by a simple upload"


class _Faulty(ForwardingStore):
    """Wraps a store; the first put fails transiently, after (``lands``) or before writing."""

    def __init__(self, inner: Store, *, lands: bool) -> None:
        super().__init__(inner)
        self.lands = lands
        self.pending_failures = 1

    async def put(self, key: str, data: Payload, *, mode: PutMode = "overwrite") -> None:
        if self.pending_failures and not self.lands:
            self.pending_failures -= 1
            raise TransientStorageError("connection reset before the request was sent")
        await self.inner.put(key, data, mode=mode)
        if self.pending_failures:
            self.pending_failures -= 1
            raise TransientStorageError("response lost after the object was written")

    async def head(self, key: str) -> ObjectMeta:
        return await self.inner.head(key)


def test_retried_create_after_lost_response_succeeds(gcs_store: GcsStore) -> None:
    store = RetryingStore(
        _Faulty(gcs_store, lands=True), policy=RetryPolicy(initial_backoff_s=0.001)
    )
    run(store.put("manifest", [b"part one|", b"part two"], mode="create"))
    assert bytes(run(gcs_store.get("manifest"))) == b"part one|part two"


def test_retried_create_after_lost_response_detects_other_writer(gcs_store: GcsStore) -> None:
    run(gcs_store.put("manifest", b"someone else's", mode="create"))
    store = RetryingStore(
        _Faulty(gcs_store, lands=False), policy=RetryPolicy(initial_backoff_s=0.001)
    )
    with pytest.raises(AlreadyExistsError):
        run(store.put("manifest", b"ours!!!!!!!!!!", mode="create"))
    assert bytes(run(gcs_store.get("manifest"))) == b"someone else's"
