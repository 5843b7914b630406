"""Saves and restores through GcsStore behind a fault-injecting proxy (fake-gcs-server).

* At a 10% fault rate (every kind in ``DEFAULT_KINDS``), and at a higher rate of each kind
  alone, saves commit and restores are bit-exact: retries hide every fault.
* At a 100% fault rate a save fails with ``SaveError`` (from ``RetriesExhaustedError``) and a
  restore with ``RetriesExhaustedError``, within an asserted wall-time bound; nothing of the
  failed step is committed, and the same manager works again once the outage ends.
* A lost response to the manifest's create-only upload (the write landed) is recognised as
  our own write: the step commits once.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest

from fastckpt import (
    CheckpointManager,
    ManagerOptions,
    RestoreOptions,
    RetentionOptions,
    SaveOptions,
)
from fastckpt.errors import RetriesExhaustedError, SaveError
from fastckpt.format.layout import MANIFEST_PREFIX
from fastckpt.storage import GcsOptions, GcsStore, RetryingStore, RetryPolicy
from fastckpt.testing.gcs_emulator import GcsEmulator
from tests.support.fault_proxy import DEFAULT_KINDS, FaultProxy

from ._util import BUCKET, Recorder, device_state, state_mismatches, trial_count

_prefixes = itertools.count()
#: Kinds that make a request fail (``slow`` completes).
FAILING_KINDS = tuple(k for k in DEFAULT_KINDS if k != "slow")
READ_TIMEOUT_S = 0.4
PATIENT = RetryPolicy(max_attempts=12, initial_backoff_s=0.005, max_backoff_s=0.05, deadline_s=30.0)
IMPATIENT = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.05, deadline_s=2.0)
OPTIONS = ManagerOptions(
    save=SaveOptions(max_chunk_bytes=32 << 10, object_bytes=96 << 10, upload_concurrency=4),
    restore=RestoreOptions(max_request_bytes=64 << 10, max_gap_bytes=0, read_concurrency=4),
    retention=RetentionOptions(keep_last=None),
)


def _store(endpoint: str, prefix: str, policy: RetryPolicy | None) -> Any:
    gcs = GcsStore(
        BUCKET,
        prefix,
        options=GcsOptions(
            endpoint=endpoint, max_workers=8, connect_timeout_s=1.0, read_timeout_s=READ_TIMEOUT_S
        ),
    )
    return gcs if policy is None else RetryingStore(gcs, policy=policy)


def _committed(emulator: GcsEmulator, prefix: str) -> list[str]:
    """Manifest keys under ``prefix``, listed straight from the emulator (no proxy)."""
    store = _store(emulator.endpoint, prefix, None)

    async def go() -> list[str]:
        try:
            return await store.list(MANIFEST_PREFIX)
        finally:
            await store.close()

    return asyncio.run(go())


@pytest.fixture
def proxy(gcs_emulator: GcsEmulator) -> Iterator[FaultProxy]:
    with FaultProxy(gcs_emulator.endpoint, seed=0, stall_s=2.5 * READ_TIMEOUT_S) as p:
        yield p


def fault_trial(
    emulator: GcsEmulator, *, rate: float, kinds: Any, seed: int, steps: tuple[int, ...] = (1, 2)
) -> dict[str, Any]:
    """Save ``steps`` and restore each through a proxy at ``rate``; returns the figures."""
    prefix = f"faults{next(_prefixes):04d}"
    t0 = time.monotonic()
    outcome, mismatched = "ok", []
    with FaultProxy(
        emulator.endpoint, rate=rate, kinds=kinds, seed=seed, stall_s=2.5 * READ_TIMEOUT_S
    ) as proxy:
        try:
            with CheckpointManager(_store(proxy.endpoint, prefix, PATIENT), options=OPTIONS) as mgr:
                for step in steps:
                    mgr.save(step, device_state(step))
                    mgr.wait()
                listed = mgr.persistent_steps()
                for step in steps:
                    mismatched += [f"{step}:{k}" for k in state_mismatches(mgr.restore(step), step)]
            if listed != list(steps):
                outcome = f"listed {listed}"
        except Exception as e:  # recorded, then asserted by the caller
            outcome = f"{type(e).__name__}: {e}"
        counts = proxy.counts()
    manifests = _committed(emulator, prefix)
    return {
        "outcome": outcome,
        "mismatched": mismatched,
        "manifests": len(manifests),
        "requests": counts.get("requests", 0),
        "faults": {k[6:]: v for k, v in counts.items() if k.startswith("fault:")},
        "seconds": time.monotonic() - t0,
    }


def _record(recorder: Recorder, scenario: str, results: list[dict[str, Any]], **extra: Any) -> None:
    recorder.add(
        scenario,
        trials=len(results),
        requests=sum(r["requests"] for r in results),
        faults_injected={
            k: sum(r["faults"].get(k, 0) for r in results)
            for k in {k for r in results for k in r["faults"]}
        },
        outcomes={
            "ok": sum(r["outcome"] == "ok" for r in results),
            "failed": sum(r["outcome"] != "ok" for r in results),
        },
        wrong_data=sum(len(r["mismatched"]) for r in results),
        seconds=round(sum(r["seconds"] for r in results), 2),
        **extra,
    )


def test_mixed_faults_at_10_percent_lose_nothing(
    gcs_emulator: GcsEmulator, recorder: Recorder
) -> None:
    results = [
        fault_trial(gcs_emulator, rate=0.10, kinds=DEFAULT_KINDS, seed=1000 + t)
        for t in range(trial_count(3))
    ]
    _record(recorder, "gcs_faults_10pct_mixed", results, rate=0.10, kinds=list(DEFAULT_KINDS))
    for r in results:
        assert r["outcome"] == "ok", r
        assert r["mismatched"] == [] and r["manifests"] == 2, r
    assert sum(sum(r["faults"].values()) for r in results) > 0


@pytest.mark.parametrize("kind", DEFAULT_KINDS)
def test_each_fault_kind_alone_is_survived(
    gcs_emulator: GcsEmulator, recorder: Recorder, kind: str
) -> None:
    results = [
        fault_trial(gcs_emulator, rate=0.25, kinds=(kind,), seed=2000 + t, steps=(1,))
        for t in range(trial_count(1, scale=0.2))
    ]
    _record(recorder, f"gcs_faults_25pct_{kind}", results, rate=0.25, kinds=[kind])
    for r in results:
        assert r["outcome"] == "ok" and r["mismatched"] == [] and r["manifests"] == 1, r
    assert sum(r["faults"].get(kind, 0) for r in results) > 0, "the proxy injected nothing"


def _causes(e: BaseException | None) -> list[type[BaseException]]:
    out = []
    while e is not None:
        out.append(type(e))
        e = e.__cause__ or e.__context__
    return out


#: Upper bound of a failed save/restore at 100% faults: IMPATIENT gives up after 3 attempts
#: or 2 s per request, each attempt ends within the 0.4 s read timeout; the save has ~8 objects
#: in flight 4 at a time. Generous for a loaded 2-core machine.
FAIL_BOUND_S = 20.0


def test_total_outage_fails_save_fast_and_commits_nothing(
    gcs_emulator: GcsEmulator, proxy: FaultProxy, recorder: Recorder
) -> None:
    prefix = f"outage{next(_prefixes):04d}"
    proxy.configure(rate=1.0, kinds=FAILING_KINDS)
    with CheckpointManager(_store(proxy.endpoint, prefix, IMPATIENT), options=OPTIONS) as mgr:
        t0 = time.monotonic()
        mgr.save(1, device_state(1))
        with pytest.raises(SaveError) as info:
            mgr.wait()
        elapsed = time.monotonic() - t0
        assert elapsed < FAIL_BOUND_S
        assert RetriesExhaustedError in _causes(info.value), _causes(info.value)
        faults = proxy.faults()
        assert _committed(gcs_emulator, prefix) == []  # no partial commit
        # The outage ends: the same manager saves the same step, and it restores bit-exact.
        proxy.configure(rate=0.0)
        mgr.save(1, device_state(1))
        mgr.wait()
        assert mgr.persistent_steps() == [1]
        assert state_mismatches(mgr.restore(1), 1) == []
    recorder.add(
        "gcs_outage_100pct_save",
        trials=1,
        faults_injected=faults,
        outcome="SaveError(RetriesExhaustedError)",
        max_seconds_to_error=round(elapsed, 2),
        bound_s=FAIL_BOUND_S,
        partial_commits=0,
    )


def test_total_outage_fails_restore_and_listing_fast(
    gcs_emulator: GcsEmulator, proxy: FaultProxy, recorder: Recorder
) -> None:
    prefix = f"outage{next(_prefixes):04d}"
    with CheckpointManager(_store(proxy.endpoint, prefix, IMPATIENT), options=OPTIONS) as mgr:
        mgr.save(1, device_state(1))
        mgr.wait()
        proxy.configure(rate=1.0, kinds=FAILING_KINDS)
        worst = 0.0
        for call in (
            lambda: mgr.restore(1),
            mgr.persistent_steps,
            mgr.latest_step,
            lambda: mgr.restore(),
        ):
            t0 = time.monotonic()
            with pytest.raises(RetriesExhaustedError):
                call()
            worst = max(worst, time.monotonic() - t0)
        assert worst < FAIL_BOUND_S
        faults = proxy.faults()
        proxy.configure(rate=0.0)
        assert state_mismatches(mgr.restore(), 1) == []
    recorder.add(
        "gcs_outage_100pct_restore",
        trials=1,
        faults_injected=faults,
        outcome="RetriesExhaustedError",
        max_seconds_to_error=round(worst, 2),
        bound_s=FAIL_BOUND_S,
    )


def test_lost_response_to_the_manifest_upload_commits_once(
    gcs_emulator: GcsEmulator, proxy: FaultProxy
) -> None:
    """The manifest's create-only upload lands but its response is lost; the retry gets a
    412, sees identical bytes under the key, and reports success."""
    hit = []

    def first_manifest_upload(method: str, path: str, body: bytes) -> bool:
        if (
            method == "POST"
            and b'"name": "' in body[:400]
            and b"/manifests/" in body[:400]
            and not hit
        ):
            hit.append(path)
            return True
        return False

    prefix = f"lost{next(_prefixes):04d}"
    proxy.configure(rate=1.0, kinds=("lost_response",), eligible=first_manifest_upload)
    with CheckpointManager(_store(proxy.endpoint, prefix, PATIENT), options=OPTIONS) as mgr:
        mgr.save(3, device_state(3))
        mgr.wait()
        assert hit and proxy.faults() == {"lost_response": 1}
        assert mgr.persistent_steps() == [3]
        assert state_mismatches(mgr.restore(3), 3) == []
    assert _committed(gcs_emulator, prefix) == ["manifests/000000000003.json"]


def _http(
    endpoint: str, method: str, path: str, body: bytes | None = None, timeout: float = 1.0
) -> tuple[int, bytes]:
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(endpoint)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request(
            method,
            path,
            body=body,
            headers={"Content-Type": "application/octet-stream"} if body else {},
        )
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_the_proxy_injects_what_it_says(gcs_emulator: GcsEmulator, proxy: FaultProxy) -> None:
    """Each kind, seen from a plain HTTP client (the proxy is a test instrument: check it)."""
    import http.client

    prefix = f"proxy{next(_prefixes):04d}"
    upload = f"/upload/storage/v1/b/{BUCKET}/o?uploadType=media&name={prefix}%2Fk"
    listing = f"/storage/v1/b/{BUCKET}/o?prefix={prefix}%2F"
    assert _http(proxy.endpoint, "GET", listing)[0] == 200  # rate 0: faithful
    for status in ("429", "500", "503"):
        proxy.configure(rate=1.0, kinds=(status,))
        assert _http(proxy.endpoint, "GET", listing)[0] == int(status)
    proxy.configure(rate=1.0, kinds=("lost_response",))  # executed upstream, answer lost
    with pytest.raises((ConnectionError, http.client.HTTPException)):
        _http(proxy.endpoint, "POST", upload, b"payload")
    proxy.configure(rate=0.0)
    assert b'"name": "' + prefix.encode() + b'/k"' in _http(proxy.endpoint, "GET", listing)[
        1
    ].replace(b'":"', b'": "')
    proxy.configure(rate=1.0, kinds=("reset",))
    with pytest.raises((ConnectionError, http.client.HTTPException)):
        _http(proxy.endpoint, "GET", listing)
    proxy.configure(rate=1.0, kinds=("truncate",))
    with pytest.raises(http.client.IncompleteRead):
        _http(proxy.endpoint, "GET", listing)
    proxy.configure(rate=1.0, kinds=("stall",))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        _http(proxy.endpoint, "GET", listing, timeout=0.3)
    assert time.monotonic() - t0 < 1.0
    proxy.configure(rate=1.0, kinds=("slow",))
    assert _http(proxy.endpoint, "GET", listing)[0] == 200
    assert proxy.faults() == {
        "429": 1,
        "500": 1,
        "503": 1,
        "lost_response": 1,
        "reset": 1,
        "truncate": 1,
        "stall": 1,
        "slow": 1,
    }
