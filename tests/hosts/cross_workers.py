"""A scripted training job for the cross-host tests: each process runs inside its own
simulated host and executes the commands the test writes, one after another.

Loaded by file path in fresh child processes (``fastckpt_examples.cluster.multiprocess``) after
``jax.distributed.initialize``. The state is the deterministic generator of
``tests/replicas/multiprocess/workers.py`` (every array a hash of its global index and the
step), so a restore is checked bit for bit, shard by shard, against numpy.

Control (a directory on the shared disk: hosts have private ``/tmp`` and ``/dev/shm``, and
a partitioned host still reads the disk): the test writes ``cmd-<n>.json``
(``{"op": ...}``); every process runs command ``n`` and writes ``res-<n>-<process>.json``.
Ops: ``save`` (``step``, ``force``): train to ``step``, ``save``, ``wait``; ``replicated``:
wait for this host's pushes; ``sync`` (``wait_s``): a barrier of the coordination service
with a long timeout (after a partition heals, TCP's retransmission backoff can keep a
connection silent for seconds); ``restore``: restore the newest step and check it; ``exit``.
With ``hold_after_fragment``, the process that is told so (``hold_process``) pauses its next
persistent save right after its fragment reached storage, writes
``held-<n>``, and waits for ``go-<n>`` (the test cuts its link in between: a partition in
the middle of the commit round, deterministically).
"""

from __future__ import annotations

import faulthandler
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

_MP_PATH = Path(__file__).resolve().parents[1] / "replicas" / "multiprocess" / "workers.py"


def _mp() -> Any:
    """tests/replicas/multiprocess/workers.py (the state generator and its numpy twin), loaded
    once."""
    name = "_fastckpt_hosts_state"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _MP_PATH)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


SECRET = b"cross-host-secret-0123456789abcdef"
BUCKET = "fastckpt-hosts"


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def _causes(e: BaseException | None) -> list[str]:
    out = []
    while e is not None:
        out.append(type(e).__name__)
        e = e.__cause__ or e.__context__
    return out


def _options(
    ram_root: str,
    member: str,
    barrier_s: float,
    secret: bytes,
    host: str | None,
    port: int,
    replicas: int,
    ram: dict[str, Any],
) -> Any:
    from fastckpt.options import (
        DistributedOptions,
        ManagerOptions,
        RamOptions,
        RestoreOptions,
        RetentionOptions,
        SaveOptions,
    )

    return ManagerOptions(
        save_interval_steps=1_000_000,  # persistent only when forced: RAM steps are RAM-only
        save=SaveOptions(max_chunk_bytes=_mp().MAX_CHUNK_BYTES, object_bytes=512 << 10),
        restore=RestoreOptions(min_range_saving_bytes=1),
        retention=RetentionOptions(keep_last=None),
        distributed=DistributedOptions(barrier_timeout_s=barrier_s),
        ram=RamOptions(
            root=ram_root,
            member_id=member,
            interval_steps=10,
            budget_bytes=64 << 20,
            replicas=replicas,
            secret=secret,
            host=host,
            port=port,
            discovery_timeout_s=30,
            peer_connect_timeout_s=3,
            peer_io_timeout_s=5,
            **ram,
        ),
    )


def _store(endpoint: str, prefix: str, control: Path, hold_process: int | None) -> Any:
    import jax

    from fastckpt.storage import GcsOptions, GcsStore
    from tests.support.wrapping import ForwardingStore

    store = GcsStore(
        BUCKET, prefix, options=GcsOptions(endpoint=endpoint, connect_timeout_s=3, read_timeout_s=5)
    )
    if hold_process != jax.process_index():
        return store

    class Holding(ForwardingStore):
        """Pauses after a fragment reached storage while ``control/hold`` exists."""

        async def put(self, key: str, data: Any, *, mode: Any = "overwrite") -> None:
            await self.inner.put(key, data, mode=mode)
            if key.endswith(".fragment") and (control / "hold").exists():
                _write_json(control / "held", {"t": time.time(), "key": key})
                deadline = time.monotonic() + 60
                while not (control / "go").exists() and time.monotonic() < deadline:
                    time.sleep(0.01)

    return Holding(store)


def scripted(
    *,
    control: str,
    endpoint: str,
    prefix: str,
    ram_root: str,
    member: str,
    barrier_s: float = 30.0,
    secret_hex: str | None = None,
    host: str | None = None,
    port: int = 0,
    replicas: int = 1,
    hold_process: int | None = None,
    advertise_via: str | None = None,
    ram: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the test's commands (see the module docstring) until ``exit``; returns a summary.

    ``ram``: more ``RamOptions`` fields (e.g. the redundancy mode).

    ``advertise_via``: publish this host's peer address as that host instead of its own (the
    man-in-the-middle test routes peers through a proxy listening there on the same port).
    """
    import jax

    from fastckpt import CheckpointManager
    from fastckpt.errors import FastckptError

    me = jax.process_index()
    ctl = Path(control)
    mp = _mp()
    secret = bytes.fromhex(secret_hex) if secret_hex else SECRET
    if advertise_via is not None:
        from fastckpt.replicas import _tiered

        real = _tiered.make_record
        _tiered.make_record = lambda member_id, address: real(
            member_id, (advertise_via, address[1])
        )  # type: ignore[assignment]
    summary: dict[str, Any] = {"process": me, "member": member, "hostname": os.uname().nodename}
    layout = "save4x2" if jax.process_count() == 4 else "resize3x2"
    mesh = mp._mesh((jax.process_count(), jax.local_device_count()))
    make = mp._generator(mp._shardings(mesh, layout))
    store = _store(endpoint, prefix, ctl, hold_process)
    try:
        mgr = CheckpointManager(
            store,
            options=_options(ram_root, member, barrier_s, secret, host, port, replicas, ram or {}),
        )
    except FastckptError as e:
        summary["start_error"] = {"type": type(e).__name__, "message": str(e), "t": time.time()}
        return summary
    with mgr:
        assert mgr._tier is not None
        summary["advertised"] = list(mgr._tier.advertised or ())
        n = 0
        while True:
            cmd_path = ctl / f"cmd-{n}.json"
            while not cmd_path.exists():
                time.sleep(0.01)
            cmd = json.loads(cmd_path.read_text())
            res: dict[str, Any] = {"op": cmd["op"], "t_start": time.time()}
            faulthandler.dump_traceback_later(
                75
            )  # a command stuck this long shows every thread's stack
            try:
                if cmd["op"] == "exit":
                    faulthandler.cancel_dump_traceback_later()
                    _write_json(ctl / f"res-{n}-{me}.json", res)
                    break
                if cmd["op"] == "save":
                    state = {**make(np.uint32(cmd["step"])), "step": cmd["step"]}
                    res["saved"] = mgr.save(cmd["step"], state, force=cmd.get("force", False))
                    res["t_returned"] = time.time()
                    mgr.wait()
                    assert mgr.last_save_stats is not None
                    res["tiers"] = list(mgr.last_save_stats.tiers)
                elif cmd["op"] == "replicated":
                    reports = mgr.wait_replication(30)
                    res["reports"] = [
                        {
                            "step": r.step,
                            "ok": r.ok,
                            "targets": list(r.targets),
                            "errors": {k: str(v)[:300] for k, v in r.errors.items()},
                        }
                        for r in reports
                    ]
                elif (
                    cmd["op"] == "sync"
                ):  # after a partition heals: wait until the coordinator answers again
                    from jax._src import distributed

                    assert distributed.global_state.client is not None
                    distributed.global_state.client.wait_at_barrier(
                        f"test-sync-{n}", int(cmd["wait_s"] * 1000)
                    )
                elif cmd["op"] == "restore":
                    res.update(_restore(mgr, mp))
                else:
                    raise ValueError(f"unknown op {cmd['op']!r}")
                res["ok"] = True
            except Exception as e:  # reported to the test, which judges it
                res.update(
                    ok=False,
                    error=type(e).__name__,
                    causes=_causes(e),
                    message=str(e)[:2000],
                    traceback=traceback.format_exc()[-3000:],
                )
            faulthandler.cancel_dump_traceback_later()
            res["t_end"] = time.time()
            _write_json(ctl / f"res-{n}-{me}.json", res)
            n += 1
        summary["ram_steps"] = mgr._tier.tier.committed_steps()
        summary["persistent_steps"] = mgr.persistent_steps()
    return summary


def _restore(mgr: Any, mp: Any) -> dict[str, Any]:
    """Restore the newest step onto this job's mesh; check every local shard bit for bit."""
    import jax

    mesh = mp._mesh((jax.process_count(), jax.local_device_count()))
    layout = "save4x2" if jax.process_count() == 4 else "resize3x2"
    shardings = mp._shardings(mesh, layout)
    target: dict[str, Any] = {
        name: jax.ShapeDtypeStruct(shape, dtype, sharding=shardings[name])
        for name, (shape, dtype) in mp.ARRAYS.items()
    }
    target["step"] = 0
    t0 = time.perf_counter()
    got = mgr.restore(target=target)
    stats = mgr.last_restore_stats
    seconds = time.perf_counter() - t0
    step = got["step"]
    checked = 0
    for name in mp.ARRAYS:
        full = mp.expected(name, step)
        for shard in got[name].addressable_shards:
            data = np.asarray(shard.data)
            want = full[shard.index]
            assert data.tobytes() == want.tobytes(), (
                f"step {step}: {name} shard {shard.index} differs"
            )
            checked += 1
    return {
        "step": step,
        "checked_shards": checked,
        "bytes_by_tier": dict(stats.bytes_by_tier),
        "bytes_read_storage": stats.bytes_read_storage,
        "restored_bytes": stats.restored_bytes,
        "fallbacks": dict(stats.fallbacks),
        "seconds": seconds,
    }
