"""Corruption: random bytes flipped at rest (local files, GCS emulator objects, RAM-tier
segment files) and in transit (GCS responses, the peer wire through a man-in-the-middle).

The rule every trial checks: a restore returns bit-exact data or raises a typed fastckpt
error, never wrong data. Where another tier holds the chunk, the restore falls back to it and
succeeds (RAM corrupt -> storage; peer corrupt -> storage; a GCS response corrupted on the
wire -> one re-read). Where none does, the error names the array and the chunk.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import random
import shutil
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fastckpt import (
    CheckpointManager,
    ManagerOptions,
    RestoreOptions,
    RetentionOptions,
    SaveOptions,
)
from fastckpt._checksum import crc32c
from fastckpt.errors import (
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptionError,
    FastckptError,
    FrameAuthenticationError,
    ManifestError,
    NoCheckpointError,
    PeerUnavailableError,
)
from fastckpt.options import RamOptions
from fastckpt.replicas._client import PeerClient
from fastckpt.replicas._connection import PeerOptions
from fastckpt.replicas._ram import RamTier
from fastckpt.replicas._server import PeerServer
from fastckpt.replicas._sources import TieredChunkSource
from fastckpt.replicas._wire import MsgType
from fastckpt.storage import (
    GcsOptions,
    GcsStore,
    LocalStore,
    MemoryStore,
    RetryingStore,
    RetryPolicy,
    Store,
)
from fastckpt.testing.gcs_emulator import GcsEmulator
from tests.support.fault_proxy import FaultProxy
from tests.support.peer_read import get_one
from tests.support.peer_relay import PeerRelay, RelayedFrame, forge_crc32c

from ._util import BUCKET, Recorder, trial_count

SECRET = b"reliability-secret-0123456789"
FAST = PeerOptions(connect_timeout_s=2, handshake_timeout_s=2, io_timeout_s=2)
_names = itertools.count()
OPTIONS = ManagerOptions(
    save=SaveOptions(max_chunk_bytes=32 << 10, object_bytes=96 << 10),
    restore=RestoreOptions(max_gap_bytes=0, max_request_bytes=64 << 10),
    retention=RetentionOptions(keep_last=None),
)


def make_state(step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(state to save, expected host values): random float32 (stored raw: incompressible),
    a compressible int32 array (stored zstd), a bool array and a python value."""
    import jax

    rng = np.random.default_rng(step)
    w = rng.standard_normal((256, 256), dtype=np.float32)
    z = (np.arange(96 << 10, dtype=np.int32) * (step + 3)) % 11
    m = rng.random(5000) < 0.5
    host = {"params": {"w": w, "z": z}, "mask": m, "step": step}
    return {
        "params": {"w": jax.device_put(w), "z": z},
        "mask": jax.device_put(m),
        "step": step,
    }, host


def wrong_leaves(got: Any, host: dict[str, Any]) -> list[str]:
    bad = []
    for name, want in (
        ("w", host["params"]["w"]),
        ("z", host["params"]["z"]),
        ("mask", host["mask"]),
    ):
        g = np.asarray(got["params"][name] if name != "mask" else got["mask"])
        if g.dtype != want.dtype or g.shape != want.shape or g.tobytes() != want.tobytes():
            bad.append(name)
    if got["step"] != host["step"]:
        bad.append("step")
    return bad


def restore_outcome(
    mgr: CheckpointManager, step: int, host: dict[str, Any]
) -> tuple[str, BaseException | None]:
    """``"exact"``, ``"wrong"`` (must never happen) or the fastckpt error class name."""
    try:
        got = mgr.restore(step)
    except FastckptError as e:
        return type(e).__name__, e
    return ("wrong" if wrong_leaves(got, host) else "exact"), None


# ----------------------------------------------------------------------------- at rest


class _Objects:
    """Raw read/write of stored objects, bypassing the manager (local files or the emulator)."""

    def __init__(self, store: Store, raw: GcsStore | None, root: Path | None) -> None:
        self.store, self.raw, self.root = store, raw, root

    def keys(self) -> list[str]:
        return (
            asyncio.run(self.store.list("")) if self.raw is None else self._gcs(self.raw.list(""))
        )

    def read(self, key: str) -> bytes:
        if self.root is not None:
            return (self.root / key).read_bytes()
        assert self.raw is not None
        return bytes(self._gcs(self.raw.get(key)))

    def write(self, key: str, data: bytes) -> None:
        if self.root is not None:
            (self.root / key).write_bytes(data)
        else:
            assert self.raw is not None
            self._gcs(self.raw.put(key, data))

    def _gcs(self, coro: Any) -> Any:
        return asyncio.run(coro)


@pytest.fixture(params=["local", "gcs"])
def objects(
    request: pytest.FixtureRequest, tmp_path: Path, gcs_emulator: GcsEmulator
) -> Iterator[_Objects]:
    if request.param == "local":
        root = tmp_path / "ckpt"
        yield _Objects(LocalStore(root), None, root)
    else:
        prefix = f"corrupt{next(_names):04d}"
        opts = GcsOptions(endpoint=gcs_emulator.endpoint, max_workers=4)
        yield _Objects(
            GcsStore(BUCKET, prefix, options=opts), GcsStore(BUCKET, prefix, options=opts), None
        )


def test_random_byte_flips_at_rest_are_always_detected(
    objects: _Objects, recorder: Recorder
) -> None:
    kind = "local" if objects.root is not None else "gcs"
    state, host = make_state(1)
    with CheckpointManager(objects.store, options=OPTIONS) as mgr:
        mgr.save(1, state)
        mgr.wait()
        keys = [k for k in objects.keys() if k.startswith(("steps/", "manifests/"))]
        rng = random.Random(7 if kind == "local" else 8)
        outcomes: dict[str, int] = {}
        for _ in range(
            trial_count(20 if kind == "local" else 8, scale=0.6 if kind == "local" else 0.2)
        ):
            key = rng.choice(keys)
            orig = objects.read(key)
            pos = rng.randrange(len(orig))
            flipped = bytearray(orig)
            flipped[pos] ^= rng.randrange(1, 256)
            objects.write(key, bytes(flipped))
            try:
                outcome, err = restore_outcome(mgr, 1, host)
            finally:
                objects.write(key, orig)
            where = "manifest" if key.startswith("manifests/") else "data"
            outcomes[f"{where}:{outcome}"] = outcomes.get(f"{where}:{outcome}", 0) + 1
            assert outcome != "wrong", (key, pos)
            if where == "data":
                # Every byte of a data object belongs to a chunk: always caught, and named.
                assert isinstance(err, ChecksumMismatchError), (key, pos, outcome, err)
                assert key in str(err) and "array ['" in str(err) and "chunk [" in str(err), err
            else:
                assert outcome == "exact" or isinstance(err, ManifestError), (
                    key,
                    pos,
                    outcome,
                    err,
                )
        assert restore_outcome(mgr, 1, host)[0] == "exact"  # every flip was undone
    recorder.add(
        f"corruption_at_rest_{kind}",
        trials=sum(outcomes.values()),
        outcomes=outcomes,
        wrong_data=outcomes.get("data:wrong", 0) + outcomes.get("manifest:wrong", 0),
    )


def test_manifest_checksum_catches_what_chunk_checksums_cannot(recorder: Recorder) -> None:
    """Random single-byte changes to a manifest: chunk checksums cannot see a renamed leaf or
    a changed kind, dtype or value; ``manifest_crc32c`` refuses them, so none restores wrong
    state. The same manifest without its checksum is refused whether changed or not: no
    manifest is taken on trust (a checksum-less one restored wrong state silently before the
    field became mandatory)."""
    from ._util import expected, state_mismatches

    store = MemoryStore()
    with CheckpointManager(store, options=OPTIONS) as mgr:
        mgr.save(5, expected(5))
        mgr.wait()
    key = "manifests/000000000005.json"
    with_crc = bytes(asyncio.run(store.get(key)))
    doc = json.loads(with_crc)
    del doc["manifest_crc32c"]
    without = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    figures: dict[str, dict[str, int]] = {}
    n = trial_count(150, scale=8)
    for name, original in (("with_manifest_crc32c", with_crc), ("without_it", without)):
        rng = random.Random(21)
        counts: dict[str, int] = {}
        for trial in range(n + 1):
            data = bytearray(original)
            if trial:  # trial 0: the manifest as it is
                pos = rng.randrange(len(data))
                data[pos] ^= rng.randrange(1, 256)
            asyncio.run(store.put(key, bytes(data)))
            try:
                with CheckpointManager(store, options=OPTIONS) as mgr:
                    outcome = "wrong" if state_mismatches(mgr.restore(5), 5) else "exact"
            except FastckptError as e:
                outcome = type(e).__name__
            if trial == 0:
                assert outcome == ("exact" if original is with_crc else "ManifestError"), (
                    name,
                    outcome,
                )
                continue
            counts[outcome] = counts.get(outcome, 0) + 1
        figures[name] = counts
    assert figures["with_manifest_crc32c"].get("wrong", 0) == 0, figures
    assert set(figures["without_it"]) <= {"ManifestError", "UnsupportedFormatVersionError"}, figures
    recorder.add(
        "corruption_manifest_bytes",
        trials_each=n,
        outcomes=figures,
        wrong_data=sum(c.get("wrong", 0) for c in figures.values()),
    )


def test_gcs_responses_corrupted_in_transit_are_reread(
    gcs_emulator: GcsEmulator, recorder: Recorder
) -> None:
    """The proxy flips a bit in 15% of object downloads. A corrupted chunk read fails its
    crc32c and is re-read once; a corrupted manifest download fails the object's crc32c
    (``x-goog-hash``) in GcsStore and is retried. Only two corrupted reads of the same chunk
    in a row fail the restore (ChecksumMismatchError)."""
    prefix = f"transit{next(_names):04d}"
    state, host = make_state(2)
    outcomes: dict[str, int] = {}
    policy = RetryPolicy(max_attempts=5, initial_backoff_s=0.01, deadline_s=10)
    with FaultProxy(
        gcs_emulator.endpoint,
        seed=3,
        kinds=("corrupt",),
        eligible=lambda method, path, body: method == "GET" and "alt=media" in path,
    ) as proxy:
        store = RetryingStore(
            GcsStore(BUCKET, prefix, options=GcsOptions(endpoint=proxy.endpoint)), policy=policy
        )
        with CheckpointManager(store, options=OPTIONS) as mgr:
            mgr.save(2, state)
            mgr.wait()
            proxy.configure(rate=0.15)
            retries = 0
            for _ in range(trial_count(8, scale=0.2)):
                outcome, err = restore_outcome(mgr, 2, host)
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
                assert outcome in ("exact", "ChecksumMismatchError"), (outcome, err)
                retries += mgr.last_restore_stats.retries if outcome == "exact" else 0  # type: ignore[union-attr]
        corrupted = proxy.faults().get("corrupt", 0)
    assert corrupted > 0 and outcomes.get("exact", 0) > 0
    recorder.add(
        "corruption_gcs_in_transit",
        trials=sum(outcomes.values()),
        responses_corrupted=corrupted,
        outcomes=outcomes,
        chunk_rereads=retries,
        wrong_data=outcomes.get("wrong", 0),
    )


# ----------------------------------------------------------------------------- RAM tier


@pytest.fixture
def shm() -> Iterator[Path]:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    d = base / f"fastckpt-rel-{uuid.uuid4().hex[:10]}"
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _chunk_ranges(tier_root: Path, step: int) -> list[tuple[Path, str, int, int]]:
    """``(data file, chunk id, offset, length)`` of every sealed chunk of ``step``."""
    out = []
    for index in (tier_root / f"step-{step}").glob("*.index.json"):
        doc = json.loads(index.read_text())
        for cid, off, length, _ in doc["chunks"]:
            if length:
                out.append((index.parent / doc["data"], cid, off, length))
    return out


def _flip_file(path: Path, pos: int, rng: random.Random) -> None:
    with path.open("r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ rng.randrange(1, 256)]))


def test_corrupt_ram_tier_falls_back_to_storage(
    tmp_path: Path, shm: Path, recorder: Recorder
) -> None:
    ram_opts = dataclasses.replace(
        OPTIONS, ram=RamOptions(root=str(shm / "host0"), interval_steps=1)
    )
    rng = random.Random(11)
    outcomes: dict[str, int] = {}
    for t in range(trial_count(4, scale=0.4)):
        root = tmp_path / f"ckpt{t}"
        state, host = make_state(t + 1)
        with CheckpointManager(str(root), options=ram_opts) as mgr:
            mgr.save(t + 1, state)  # RAM and storage
            mgr.wait()
        chunks = _chunk_ranges(shm / "host0", t + 1)
        hit = rng.sample(chunks, k=rng.randint(1, 3))
        for data, _, off, length in hit:
            _flip_file(data, off + rng.randrange(length), rng)
        with CheckpointManager(str(root), options=ram_opts) as mgr:
            got = mgr.restore()
            stats = mgr.last_restore_stats
        assert wrong_leaves(got, host) == []
        assert stats.chunks_by_tier.get("storage", 0) >= len({cid for _, cid, _, _ in hit}), (
            stats.chunks_by_tier
        )
        assert (
            stats.chunks_by_tier.get("ram", 0) == len(chunks) - stats.chunks_by_tier["storage"]
        ), stats
        outcomes["exact"] = outcomes.get("exact", 0) + 1
    recorder.add(
        "corruption_ram_tier_with_storage_copy",
        trials=sum(outcomes.values()),
        outcomes=outcomes,
        fallback="storage",
        wrong_data=0,
    )


def _save_then_flip_a_ram_chunk(
    root: str, opts: ManagerOptions, tier: Path, *, flip_step: int, rng: random.Random
) -> tuple[dict[int, set[str]], str]:
    """Save steps 2 and 3, then flip a byte of a random RAM chunk of ``flip_step``; returns
    ``steps_by_tier()`` before the flip and the chunk id."""
    with CheckpointManager(root, options=opts) as mgr:
        for step in (2, 3):
            mgr.save(step, make_state(step)[0])
            mgr.wait()
        tiers = mgr.steps_by_tier()
    data, cid, off, length = rng.choice(_chunk_ranges(tier, flip_step))
    _flip_file(data, off + rng.randrange(length), rng)
    return tiers, cid


def test_corrupt_ram_only_step_fails_naming_the_chunk(
    tmp_path: Path, shm: Path, recorder: Recorder
) -> None:
    """No other tier holds a RAM-only step's chunks: restoring that step fails, typed, naming
    the array and the chunk (never wrong data); ``restore()`` of the latest falls back to the
    older persistent step."""
    opts = dataclasses.replace(
        OPTIONS, ram=RamOptions(root=str(shm / "host0"), interval_steps=1), save_interval_steps=2
    )
    root = str(tmp_path / "ckpt")
    tiers, cid = _save_then_flip_a_ram_chunk(
        root, opts, shm / "host0", flip_step=3, rng=random.Random(12)
    )
    assert tiers == {2: {"storage"}, 3: {"ram"}}
    with CheckpointManager(root, options=opts) as mgr:
        with pytest.raises((CheckpointNotFoundError, CorruptionError)) as info:
            mgr.restore(3)
        leaf = cid.split("@")[0]
        assert (
            "array " in str(info.value) and leaf in str(info.value) and "chunk [" in str(info.value)
        ), info.value
        restored = mgr.restore()  # the latest: step 3 is incomplete, step 2 is used
        stats = mgr.last_restore_stats
        assert stats.step == 2 and wrong_leaves(restored, make_state(2)[1]) == []
        assert wrong_leaves(mgr.restore(2), make_state(2)[1]) == []
    recorder.add(
        "corruption_ram_only_step", trials=1, outcomes={type(info.value).__name__: 1}, wrong_data=0
    )


def test_latest_ram_step_corrupt_falls_back_to_the_previous_ram_step(
    tmp_path: Path, shm: Path
) -> None:
    """RAM-only steps 2 and 3 (no storage step): a corrupt chunk of step 3 makes ``restore()``
    use step 2, exact; with step 2 corrupt too there is nothing left, and the error names the
    chunk. An explicit step never falls back."""
    opts = dataclasses.replace(
        OPTIONS,
        ram=RamOptions(root=str(shm / "host0"), interval_steps=1, keep_steps=2),
        save_interval_steps=1000,
    )
    root = str(tmp_path / "ckpt")
    rng = random.Random(5)
    tiers, _ = _save_then_flip_a_ram_chunk(root, opts, shm / "host0", flip_step=3, rng=rng)
    assert tiers == {2: {"ram"}, 3: {"ram"}}
    with CheckpointManager(root, options=opts) as mgr:
        restored = mgr.restore()
        stats = mgr.last_restore_stats
        assert stats.step == 2 and wrong_leaves(restored, make_state(2)[1]) == []
        with pytest.raises(CheckpointNotFoundError, match="RAM-only step 3"):
            mgr.restore(3)
    data, cid2, off, length = rng.choice(_chunk_ranges(shm / "host0", 2))
    _flip_file(data, off + rng.randrange(length), rng)
    with CheckpointManager(root, options=opts) as mgr:
        with pytest.raises(CheckpointNotFoundError, match="RAM-only step 2") as info:
            mgr.restore()
        assert cid2.split("@")[0] in str(info.value), info.value
        assert not isinstance(
            info.value, NoCheckpointError
        )  # a checkpoint exists: never "start afresh"


# ----------------------------------------------------------------------------- peer wire


class FlippingRelay(PeerRelay):
    """A man-in-the-middle between a PeerClient and a PeerServer (no secret: it cannot tag).

    A frame of a type in ``types`` (in the chosen direction) gets one byte XOR-ed with
    ``probability``, at a random position of the payload (``where="payload"``) or of the whole
    frame (``where="anywhere"``: prefix, JSON header, tags or payload). With ``forge``, a
    payload flip inside a chunk of a CHUNKS reply also patches 4 bytes of that chunk so
    its crc32c still matches the header's (only the frame's MAC can tell).
    """

    def __init__(
        self,
        upstream: tuple[str, int],
        *,
        seed: int,
        direction: str = "down",
        types: frozenset[MsgType] = frozenset({MsgType.CHUNKS}),
        probability: float = 1.0,
        where: str = "payload",
        forge: bool = False,
    ) -> None:
        self.rng = random.Random(seed)
        self.direction, self.types, self.probability, self.where, self.forge = (
            direction,
            types,
            probability,
            where,
            forge,
        )
        self.flips: dict[str, int] = {"prefix": 0, "header": 0, "tag": 0, "payload": 0, "forged": 0}
        self._flip_lock = threading.Lock()
        super().__init__(upstream, tamper=self._flip)

    def _flip(self, f: RelayedFrame) -> list[bytes]:
        if f.direction != self.direction or f.type not in self.types:
            return [f.raw]
        with self._flip_lock:
            if self.rng.random() >= self.probability:
                return [f.raw]
            frame = bytearray(f.raw)
            lo = len(f.prefix) + len(f.header) + len(f.header_tag)
            if self.where == "payload" and f.payload:
                pos = self.rng.randrange(lo, lo + len(f.payload))
            else:
                pos = self.rng.randrange(0, len(frame))
            frame[pos] ^= self.rng.randrange(1, 256)
            part = (
                "prefix"
                if pos < len(f.prefix)
                else "header"
                if pos < len(f.prefix) + len(f.header)
                else "payload"
                if lo <= pos < lo + len(f.payload)
                else "tag"
            )
            self.flips[part] += 1
            if part == "payload" and self.forge:
                self._forge(f, frame, lo, pos - lo)
        return [bytes(frame)]

    def _forge(self, f: RelayedFrame, frame: bytearray, lo: int, at: int) -> None:
        """Restore the crc32c of the chunk holding payload byte ``at`` (4 other bytes of it)."""
        lengths = f.json()["lengths"]
        start = 0
        for n in lengths:
            if start <= at < start + n and n >= 8:
                fix = start if at >= start + 4 else start + n - 4
                chunk = bytearray(frame[lo + start : lo + start + n])
                forge_crc32c(chunk, fix - start, crc32c(f.payload[start : start + n]))
                frame[lo + start : lo + start + n] = chunk
                self.flips["forged"] += 1
                return
            start += n


@pytest.fixture
def served_step(
    tmp_path: Path, shm: Path
) -> Iterator[tuple[str, dict[str, Any], PeerServer, RamTier]]:
    """Step 1 saved to local storage and to a RAM tier that a PeerServer serves."""
    root = str(tmp_path / "ckpt")
    tier_root = shm / "peer"
    state, host = make_state(1)
    with CheckpointManager(
        root, options=dataclasses.replace(OPTIONS, ram=RamOptions(root=str(tier_root)))
    ) as mgr:
        mgr.save(1, state)
        mgr.wait()
    tier = RamTier(tier_root, budget_bytes=64 << 20)
    server = PeerServer(tier, secret=SECRET, options=FAST).start()
    yield root, host, server, tier
    server.close()
    tier.close()


def test_peer_wire_corruption_falls_back_to_storage(served_step: Any, recorder: Recorder) -> None:
    root, host, server, _ = served_step
    outcomes: dict[str, int] = {}
    flips = {"prefix": 0, "header": 0, "tag": 0, "payload": 0, "forged": 0}
    fallbacks: dict[str, int] = {}
    for t in range(trial_count(12, scale=0.5)):
        where = "payload" if t % 3 else "anywhere"
        relay = FlippingRelay(
            server.address, seed=t, probability=0.3, where=where, forge=t % 2 == 1
        )
        try:
            source = TieredChunkSource(
                None, [PeerClient(relay.address, secret=SECRET, options=FAST, name="mitm")]
            )
            with CheckpointManager(root, options=OPTIONS, chunk_source=source) as mgr:
                got = mgr.restore(1)
                stats = mgr.last_restore_stats
        finally:
            relay.close()
        assert wrong_leaves(got, host) == [], (t, relay.flips)
        outcomes["exact"] = outcomes.get("exact", 0) + 1
        for k, v in relay.flips.items():
            flips[k] += v
        for reason, n in source.stats().fallbacks.items():
            fallbacks[reason] = fallbacks.get(reason, 0) + n
        if relay.flips[
            "payload"
        ]:  # the frame's MAC refuses it (crc32c may have been forged to match)
            assert (
                source.stats().fallbacks.get("protocol", 0) >= 1
                and stats.chunks_by_tier.get("storage", 0) >= 1
            )
    assert flips["payload"] > 0 and flips["forged"] > 0 and fallbacks.get("protocol", 0) > 0
    recorder.add(
        "corruption_peer_wire",
        trials=sum(outcomes.values()),
        bytes_flipped_by_part=flips,
        source_fallbacks=fallbacks,
        outcomes=outcomes,
        wrong_data=0,
    )


def test_peer_wire_corruption_without_fallback_is_a_typed_error(served_step: Any) -> None:
    _, _, server, tier = served_step
    hits = {c: tier.read_chunk(1, c) for c in tier.chunk_ids(1)}
    cid, loc = next((c, h[1]) for c, h in hits.items() if h is not None and h[1].length)
    relay = FlippingRelay(server.address, seed=5, probability=1.0)
    try:
        with PeerClient(relay.address, secret=SECRET, options=FAST) as client:
            with pytest.raises(FrameAuthenticationError, match="CHUNKS frame 0 payload"):
                get_one(client, 1, cid, loc.length, loc.raw_crc32c)
    finally:
        relay.close()
    # Without frame MACs (a benchmark setting) the crc32c still catches a random flip...
    plain = dataclasses.replace(FAST, frame_mac=False)
    with PeerServer(tier, secret=SECRET, options=plain).start() as unmac:
        relay = FlippingRelay(unmac.address, seed=5, probability=1.0)
        try:
            with PeerClient(relay.address, secret=SECRET, options=plain) as client:
                assert get_one(client, 1, cid, loc.length, loc.raw_crc32c) == "corrupt"
        finally:
            relay.close()
        # ...but not a forger, who keeps it matching: that is what the MACs are for.
        relay = FlippingRelay(unmac.address, seed=5, probability=1.0, forge=True)
        try:
            with PeerClient(relay.address, secret=SECRET, options=plain) as client:
                got = get_one(client, 1, cid, loc.length, loc.raw_crc32c)
                assert isinstance(got, bytes) and got != bytes(tier.get_chunk(1, cid))  # type: ignore[arg-type]
        finally:
            relay.close()


def test_pushed_chunk_corrupted_on_the_wire_is_refused(served_step: Any) -> None:
    _, _, server, tier = served_step
    relay = FlippingRelay(
        server.address, seed=6, direction="up", types=frozenset({MsgType.PUT_CHUNKS})
    )
    data = np.random.default_rng(0).bytes(50_000)
    try:
        with PeerClient(relay.address, secret=SECRET, options=FAST) as client:
            with pytest.raises(PeerUnavailableError):  # the server drops it unanswered
                client.push_chunks(1, [("pushed@0:1", data, crc32c(data))])
    finally:
        relay.close()
    assert tier.read_chunk(1, "pushed@0:1") is None
    assert relay.flips["payload"] == 1 and server.stats["frame_auth_failures"] == 1
    with PeerClient(server.address, secret=SECRET, options=FAST) as client:  # the direct path works
        client.push_chunks(1, [("pushed@0:1", data, crc32c(data))])
        assert get_one(client, 1, "pushed@0:1", len(data)) == data
