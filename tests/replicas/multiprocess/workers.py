"""Functions run inside each process of a real multi-process job
(``fastckpt_examples.cluster.multiprocess``).

Loaded by file path in fresh child processes, after ``jax.distributed.initialize``. Every
array is a deterministic function of its flat global index and the step (:func:`expected`,
a uint32 hash), computed on device by a jitted, purely elementwise "training step" (no
cross-process collectives, so a dead process never hangs the others) and in numpy here
for checking: restores are compared bit for bit, shard by shard.

The parent imports this module only for :func:`expected` and the constants; it must not
change the parent's jax configuration.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

SECRET = b"replicas-mp-secret-0123456789"
WRONG_SECRET = b"not-the-job-secret-0123456789"
PERSIST_STEP = 5
"""Forced persistent save (also a RAM step): storage's latest, older than the RAM step."""
RAM_STEPS = (10, 20)
LAST_RAM_STEP = RAM_STEPS[-1]
MAX_CHUNK_BYTES = 64 << 10

ARRAYS: dict[str, tuple[tuple[int, ...], Any]] = {
    "w": ((768, 512), np.float32),  # 1.5 MiB
    "m": ((768, 512), ml_dtypes.bfloat16),  # 0.75 MiB
    "k": ((96, 12, 256), np.int8),  # 288 KiB
    "u": ((3072,), np.uint32),
    "r": ((48, 64), np.float16),
}

# Partition specs per layout, as tuples (mesh axes "a" (across processes) and "b").
# "save4x2" is how the job saves and how a same-size job restores (each process reads the
# chunks it wrote, plus the replicated ones process 0 wrote); "resize3x2" divides a 3 x 2 mesh.
LAYOUTS: dict[str, dict[str, tuple[Any, ...]]] = {
    "save4x2": {
        "w": ("a", "b"),
        "m": ("b", "a"),
        "k": (None, None, ("a", "b")),
        "u": (("a", "b"),),
        "r": (),
    },
    "resize3x2": {
        "w": ("a", "b"),
        "m": (("a", "b"), None),
        "k": ("b", None, None),
        "u": ("a",),
        "r": ("b",),
    },
}

_M1, _M2, _M3 = 0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35


def _uint(bits: int) -> Any:
    return {8: np.uint8, 16: np.uint16, 32: np.uint32}[bits]


def expected(name: str, step: int) -> np.ndarray:
    """The global value of array ``name`` at ``step`` (numpy twin of the jitted generator)."""
    shape, dtype = ARRAYS[name]
    dt = np.dtype(dtype)
    i = np.arange(math.prod(shape), dtype=np.uint32)
    h = (i + np.uint32((step * _M1) % 2**32)) * np.uint32(_M2)
    h ^= h >> np.uint32(13)
    h *= np.uint32(_M3)
    h ^= h >> np.uint32(16)
    bits = dt.itemsize * 8
    return (h & np.uint32(2**bits - 1)).astype(_uint(bits)).view(dt).reshape(shape)


def _mesh(shape: tuple[int, int]) -> Any:
    import jax
    from jax.sharding import Mesh

    devices = np.asarray(jax.devices())
    assert devices.size == math.prod(shape), (devices.size, shape)
    return Mesh(devices.reshape(shape), ("a", "b"))


def _shardings(mesh: Any, layout: str) -> dict[str, Any]:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return {name: NamedSharding(mesh, P(*spec)) for name, spec in LAYOUTS[layout].items()}


def _generator(shardings: dict[str, Any]) -> Any:
    """A jitted elementwise "training step": the state of ``step`` (see :func:`expected`)."""
    import jax
    import jax.numpy as jnp

    def gen(name: str, step: jax.Array) -> jax.Array:
        shape, dtype = ARRAYS[name]
        dt = np.dtype(dtype)
        i = jax.lax.iota(jnp.uint32, math.prod(shape)).reshape(shape)
        h = (i + step * jnp.uint32(_M1)) * jnp.uint32(_M2)
        h = h ^ (h >> 13)
        h = h * jnp.uint32(_M3)
        h = h ^ (h >> 16)
        bits = dt.itemsize * 8
        u = (h & jnp.uint32(2**bits - 1)).astype(_uint(bits))
        return u if dt == np.dtype(_uint(bits)) else jax.lax.bitcast_convert_type(u, dt)

    return jax.jit(lambda step: {name: gen(name, step) for name in ARRAYS}, out_shardings=shardings)


def _options(ram_root: str, member: str, redundancy: str = "replicas") -> Any:
    from fastckpt.options import (
        DistributedOptions,
        ManagerOptions,
        RamOptions,
        RestoreOptions,
        RetentionOptions,
        SaveOptions,
    )

    # Even-numbered hosts stage through pinned host memory (as on accelerators: deferred copies
    # into unreserved segments), odd ones copy at once (CPU devices): both paths in one job.
    device_copy = "pinned_host" if int(member.removeprefix("host")) % 2 == 0 else "auto"
    return ManagerOptions(
        save_interval_steps=1_000_000,  # persistent only when forced: the RAM steps are RAM-only
        save=SaveOptions(
            max_chunk_bytes=MAX_CHUNK_BYTES, object_bytes=512 << 10, device_copy=device_copy
        ),
        # chunks of <= 64 KiB: a resharding restore asks for the parts it uses however small
        restore=RestoreOptions(min_range_saving_bytes=1),
        retention=RetentionOptions(keep_last=None),
        distributed=DistributedOptions(barrier_timeout_s=30),
        ram=RamOptions(
            root=ram_root,
            member_id=member,
            interval_steps=10,
            budget_bytes=64 << 20,
            replicas=1,
            redundancy=redundancy,  # type: ignore[arg-type]
            group_size=4,
            secret=SECRET,
            discovery_timeout_s=30,
            peer_connect_timeout_s=3,
            peer_io_timeout_s=10,
        ),
    )


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def train(
    ram_root: str, member: str, persist_root: str, signals: str, redundancy: str = "replicas"
) -> dict[str, Any]:
    """See :func:`_train`; a failure also leaves ``<signals>/failed-<process>`` (the parent
    then stops the job at once instead of waiting for markers that never come)."""
    import jax

    try:
        return _train(ram_root, member, persist_root, signals, redundancy)
    except BaseException as e:
        _write_json(Path(signals) / f"failed-{jax.process_index()}", {"error": repr(e)})
        raise


def _train(
    ram_root: str, member: str, persist_root: str, signals: str, redundancy: str
) -> dict[str, Any]:
    """Train on a 4 x 2 mesh, checkpointing: step 5 forced persistent, RAM at steps 10 and 20.

    After step 20 is committed and this process's pushes to its ring successor are done,
    it writes ``<signals>/replicated-<process>.json`` (with its pid) and keeps training
    (steps 21, 22, ..., writing ``progress-<process>`` each step; no RAM step is due before
    30) until ``<signals>/stop`` appears. The parent SIGKILLs one process in that loop.
    """
    import jax

    me = jax.process_index()
    sig = Path(signals)
    mesh = _mesh((jax.process_count(), jax.local_device_count()))
    make = _generator(_shardings(mesh, "save4x2"))
    from fastckpt import CheckpointManager

    report: dict[str, Any] = {"process": me, "member": member}
    with CheckpointManager(persist_root, options=_options(ram_root, member, redundancy)) as mgr:
        assert mgr._tier is not None
        step = 0
        while True:
            step += 1
            state = {**make(np.uint32(step)), "step": step}
            if step == PERSIST_STEP:
                assert mgr.save(step, state, force=True)
            elif step in RAM_STEPS:
                assert mgr.save(step, state)
            else:
                assert not mgr.save(step, state)  # not due: the loop only trains
            if step == LAST_RAM_STEP:
                mgr.wait()
                assert mgr.last_save_stats is not None and mgr.last_save_stats.tiers == ("ram",)
                # An older step's push may have failed as stale (its target already committed
                # step 20) or been superseded; the newest step's push must be complete.
                # With parity: the manifest's push and the parity parts' push.
                reports = mgr.wait_replication(30)
                last = [r for r in reports if r.step == LAST_RAM_STEP]
                assert last and all(r.ok for r in last), reports
                assert redundancy == "parity" or len(last) == len(last[0].targets) == 1, last
                report["pushed_to"] = sorted({t for r in last for t in r.targets})
                report["bytes_pushed"] = sum(r.bytes_pushed for r in last)
                report["tier_bytes"] = mgr._tier.tier.nbytes()
                report["ram_steps"] = mgr._tier.tier.committed_steps()
                _write_json(sig / f"replicated-{me}.json", {"pid": os.getpid(), **report})
            if step > LAST_RAM_STEP:
                _write_json(sig / f"progress-{me}", {"step": step})
                if (sig / "stop").exists():
                    break
                if step >= 29:  # never reach the next RAM step; idle until told to stop
                    while not (sig / "stop").exists():
                        time.sleep(0.02)
                    break
                time.sleep(0.05)
        report["last_step"] = step
    return report


def _impostor(address: tuple[str, int], chunk_id: str) -> dict[str, Any]:
    """Handshake by hand with a proof made from the wrong secret (ignoring the server's
    proof, as an attacker would), then ask for a chunk the server holds anyway."""
    from fastckpt.replicas import _wire as wire
    from fastckpt.replicas import _wire_auth as wire_auth
    from fastckpt.replicas._channel import Channel
    from fastckpt.replicas._wire import MsgType

    with socket.create_connection(address, timeout=5) as s:
        plain = Channel(s, limits=wire.AUTH_LIMITS)
        cn = wire_auth.new_nonce()
        plain.send(MsgType.HELLO, {"nonce": cn.hex(), "frame_mac": True})
        _, h, _ = plain.recv_head()
        sn = bytes.fromhex(h["nonce"])
        keys = wire_auth.session_keys(
            WRONG_SECRET, client_nonce=cn, server_nonce=sn, frame_mac=True
        )
        plain.send(MsgType.AUTH, {"mac": keys.client_proof.hex()})
        reply, h, _ = plain.recv_head()
        chan = Channel(
            s,
            limits=wire.WireLimits(),
            role="client",
            send_key=keys.client_key,
            recv_key=keys.server_key,
        )
        received = 0
        try:
            s.sendall(
                chan.encode(
                    MsgType.GET_CHUNKS,
                    {"step": LAST_RAM_STEP, "count": 1},
                    json.dumps([chunk_id]).encode(),
                )
            )
            while data := s.recv(1 << 16):
                received += len(data)
        except OSError:
            pass  # the server hung up: nothing more to read
    return {"reply": reply.name, "code": h.get("code"), "bytes_after_auth": received}


def _probe_wrong_secret(mgr: Any) -> dict[str, Any]:
    """Against every other live peer server of this job: a ``PeerClient`` with a wrong secret
    is refused at the handshake, and a hand-made wrong proof is refused by the server, which
    then sends nothing (not even for a chunk it holds)."""
    from fastckpt.errors import AuthenticationError
    from fastckpt.replicas._client import PeerClient
    from fastckpt.replicas._connection import PeerOptions

    ram = mgr._tier
    assert ram is not None and ram._directory is not None
    out = {}
    for member, rec in ram._directory.lookup().items():
        if member == ram.member_id:
            continue
        held = ram._peers()[member].list_chunks(LAST_RAM_STEP)  # with the right secret
        assert held
        client = PeerClient(
            rec.address,
            secret=WRONG_SECRET,
            options=PeerOptions(connect_timeout_s=3, io_timeout_s=5),
        )
        calls = []
        for call in (
            client.steps,
            lambda client=client, held=held: client.get_chunks(
                LAST_RAM_STEP, [(held[0], bytearray(1), None)]
            ),
            lambda client=client: client.list_chunks(LAST_RAM_STEP),
        ):
            try:
                calls.append(f"served: {call()!r}")
            except AuthenticationError as e:
                calls.append(f"AuthenticationError: {e}")
        client.close()
        out[member] = {"client": calls, "impostor": _impostor(rec.address, held[0])}
    return out


def restore(
    ram_root: str,
    member: str,
    persist_root: str,
    layout: str,
    probe_wrong_secret: bool = False,
    redundancy: str = "replicas",
) -> dict[str, Any]:
    """Restore the newest step (no step given) onto this job's mesh; check every local shard.

    Returns the restored step, ``RestoreStats.bytes_by_tier``, storage bytes read, the tier
    each chunk came from (``provenance``) and the fallbacks (other than misses) recorded by
    the manager's tiered chunk source; with ``probe_wrong_secret``, the wrong-secret probes.
    """
    import jax

    from fastckpt import CheckpointManager

    mesh = _mesh((jax.process_count(), jax.local_device_count()))
    shardings = _shardings(mesh, layout)
    target: dict[str, Any] = {
        name: jax.ShapeDtypeStruct(ARRAYS[name][0], ARRAYS[name][1], sharding=shardings[name])
        for name in ARRAYS
    }
    target["step"] = 0
    out: dict[str, Any] = {"process": jax.process_index(), "member": member}
    with CheckpointManager(persist_root, options=_options(ram_root, member, redundancy)) as mgr:
        ram = mgr._tier
        assert ram is not None
        out["own_ram_steps_before"] = ram.tier.committed_steps()
        sources: list[Any] = []
        make_source = ram.source

        provenance: dict[str, str | None] = {}
        whole_bytes: dict[str, int] = {}  # per tier: the fetched chunks' whole lengths ...
        ranged_bytes: dict[
            str, int
        ] = {}  # ... and the bytes asked for (ranges of resharded chunks)

        def capture() -> (
            Any
        ):  # keep the restore's TieredChunkSource; record where each chunk came from
            src = make_source()
            fetch_many, lend_many = src.fetch_many, src.lend_many

            def recording_fetch_many(step: int, items: Any, **kw: Any) -> list[str | None]:
                tiers = fetch_many(step, items, **kw)
                provenance.update({item[0]: tier for item, tier in zip(items, tiers)})
                runs = kw.get("runs") or [None] * len(items)
                for item, tier, rs in zip(
                    items, tiers, runs
                ):  # whole chunk bytes vs bytes received
                    if tier is not None:
                        whole_bytes[tier] = whole_bytes.get(tier, 0) + item[1]
                        ranged_bytes[tier] = ranged_bytes.get(tier, 0) + (
                            item[1] if rs is None else sum(n for _, n in rs)
                        )
                return tiers

            def recording_lend_many(step: int, groups: Any, **kw: Any) -> Any:
                views = lend_many(step, groups, **kw)
                for chunks, view in zip(groups, views):
                    if (
                        view is not None
                    ):  # an unverified view found bad is fetched (and recorded) afterwards
                        provenance.update({c[0]: "ram" for c in chunks})
                return views

            src.fetch_many = recording_fetch_many
            src.lend_many = recording_lend_many
            sources.append(src)
            return src

        ram.source = capture  # type: ignore[method-assign]
        if probe_wrong_secret:
            out["wrong_secret"] = _probe_wrong_secret(mgr)
        listings: list[int] = []
        store_list = mgr.store.list

        async def counting_list(prefix: str) -> list[str]:
            listings.append(1)
            return await store_list(prefix)

        mgr.store.list = counting_list  # type: ignore[method-assign]
        got = mgr.restore(target=target)
        stats = mgr.last_restore_stats
        mgr.store.list = store_list  # type: ignore[method-assign]
        out["storage_listings"] = len(listings)  # only process 0 lists storage for a restore
        step = got["step"]
        out["step"] = step
        checked = 0
        for name in ARRAYS:
            arr = got[name]
            assert arr.sharding == shardings[name], (name, arr.sharding)
            full = expected(name, step)
            for shard in arr.addressable_shards:
                data = np.asarray(shard.data)
                want = full[shard.index]
                assert data.dtype == want.dtype and data.shape == want.shape, (name, shard.index)
                assert data.tobytes() == want.tobytes(), (
                    f"step {step}: {name} shard {shard.index} differs"
                )
                checked += 1
        (src,) = sources
        sst = src.stats()
        out.update(
            checked_shards=checked,
            bytes_by_tier=dict(stats.bytes_by_tier),
            chunks_by_tier=dict(stats.chunks_by_tier),
            bytes_read_storage=stats.bytes_read_storage,
            restored_bytes=stats.restored_bytes,
            provenance=provenance,
            fetched_whole_bytes=whole_bytes,
            fetched_ranged_bytes=ranged_bytes,
            fallbacks=[
                [f.tier, f.chunk_id, f.reason] for f in sst.recent_fallbacks if f.reason != "miss"
            ],
            dead_peers=sst.dead_peers,
            listed_peers=sst.listed_peers,
            persistent_steps=mgr.persistent_steps(),
        )
    return out
