"""What runs inside the simulated hosts for :mod:`benchmarks.ram_redundancy`: one JAX process
per host (``fastckpt_examples.cluster.multiprocess``, after ``jax.distributed.initialize``).

* :func:`train`: one redundancy mode (``ram``: the ``RamOptions`` fields that choose it). A
  training loop whose step leaves the host idle (it sleeps ``step_s``, as a host does while
  its accelerator computes; at every ``interval``-th step a jitted elementwise update then
  makes a new state, so each checkpoint copies fresh arrays while the CPU devices, which
  stand in for the accelerator here, are otherwise idle too), run without and with a RAM
  checkpoint every ``interval`` steps (``mgr.save`` called every step, as a training loop
  does), alternately, ``repeats`` times each, after an untimed loop with
  checkpoints (compiles the update, warms the save path): the wall time of each loop.
  Then ``ckpts`` timed RAM checkpoints, each between two barriers: the bytes this host sent
  and received on its link (``eth0`` of its network namespace, ``/proc/net/dev``). Last, the
  state of step ``final`` (``benchmarks._hosts_job``'s generator) is saved and pushed, and
  the RAM this host holds for that step is measured from its tier: the bytes of the data
  files in ``<tier>/step-<final>``, beside its own share (the bytes it staged).
* :func:`restore`: after a host was lost and replaced, ``repeats`` restores of the newest
  step per mode (a fresh manager each, modes in rotating order), every shard checked bit for
  bit; the stats of each, and the bytes this host's link received during it.

The peer secret comes from the launcher (``FASTCKPT_PEER_SECRET``). Storage is a
:class:`~fastckpt.storage.LocalStore` on the disk the hosts share (RAM steps never reach it).
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

from benchmarks._hosts_job import _barrier, _check, _make_state, arrays

TIER_ROOT = "/dev/shm/fastckpt-bench/redundancy"


def tier_dir(mode: str, member: str) -> str:
    """The RAM tier of ``member`` (its host's own tmpfs) for ``mode``."""
    return f"{TIER_ROOT}/{mode}/{member}"


def _manager(storage: str, mode: str, member: str, ram: dict[str, Any], interval: int) -> Any:
    import fastckpt
    from fastckpt import CheckpointManager
    from fastckpt.options import ManagerOptions, RamOptions, RetentionOptions
    from fastckpt.storage import LocalStore

    options = ManagerOptions(
        save_interval_steps=1_000_000,  # RAM steps only
        retention=RetentionOptions(keep_last=None),
        ram=RamOptions(
            root=tier_dir(mode, member),
            member_id=member,
            interval_steps=interval,
            secret=fastckpt.peer_secret_from_env(),
            **ram,
        ),
    )
    return CheckpointManager(LocalStore(f"{storage}/{mode}"), options=options)


def _link_bytes() -> tuple[int, int]:
    """Bytes this host's ``eth0`` sent and received so far (its network namespace's)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "eth0":
            fields = counters.split()
            return int(fields[8]), int(fields[0])
    raise RuntimeError("no eth0 in /proc/net/dev")


def _pushed(mgr: Any, step: int) -> None:
    """Wait until this host's pushes of ``step`` finished, and every host's (a barrier)."""
    reports = mgr.wait_replication(300)
    if not reports or not all(r.ok for r in reports):
        raise RuntimeError(f"the push of step {step} failed: {reports}")
    _barrier(f"bench-pushed-{step}")


def _held(mgr: Any, mode: str, member: str, step: int) -> dict[str, Any]:
    """RAM this host holds for ``step``: its tier's data files of that step, and its own
    share (the bytes it staged)."""
    stats = mgr.last_save_stats
    files = sorted(Path(tier_dir(mode, member), f"step-{step}").glob("*.data"))
    whole = Path(tier_dir(mode, member))
    return {
        "own_bytes": stats.staged_bytes,
        "held_bytes": sum(p.stat().st_size for p in files),
        "files": [p.stat().st_size for p in files],
        "tier_bytes": sum(p.stat().st_size for p in whole.rglob("*") if p.is_file()),
    }


def _pair(r: int) -> tuple[str, str]:
    """Repeat ``r``'s two loops, the order alternating (drift spreads evenly)."""
    return ("base", "ckpt") if r % 2 == 0 else ("ckpt", "base")


def train(
    *,
    storage: str,
    mode: str,
    ram: dict[str, Any],
    member: str,
    total_bytes: int,
    steps: int,
    step_s: float,
    interval: int,
    repeats: int,
    ckpts: int,
    final: int,
) -> dict[str, Any]:
    """See the module docstring; ``final`` must be past the loops' steps."""
    import jax

    out: dict[str, Any] = {"member": member, "hostname": socket.gethostname(), "loops": []}
    update = jax.jit(
        lambda tree: jax.tree.map(lambda x: x + x.dtype.type(1), tree), donate_argnums=0
    )
    with _manager(storage, mode, member, ram, interval) as mgr:
        state = _make_state(total_bytes, 1)
        step = 0
        # a first, untimed loop with checkpoints: compiles the update, warms the save path
        arms = ["warm-up"] + [a for r in range(repeats) for a in _pair(r)]
        for arm in arms:
            step += interval - step % interval  # each loop starts at a checkpoint step
            _barrier(f"bench-loop-{step}")
            saves = []
            t0 = time.perf_counter()
            for _ in range(steps if arm != "warm-up" else interval):
                time.sleep(step_s)
                if step % interval == 0:  # in both arms: fresh arrays for each checkpoint
                    state = jax.block_until_ready(update(state))
                if arm != "base":
                    s0 = time.perf_counter()
                    if mgr.save(step, state):
                        saves.append(time.perf_counter() - s0)
                step += 1
            seconds = time.perf_counter() - t0
            if arm != "base":
                mgr.wait()
                _pushed(mgr, step)
            if arm != "warm-up":
                out["loops"].append({"arm": arm, "seconds": seconds, "save_blocked_s": saves})
        del state
        out["ckpts"] = []
        for _ in range(ckpts):
            step += interval - step % interval
            state = _make_state(total_bytes, step)
            _barrier(f"bench-ckpt-{step}")
            sent0, recv0 = _link_bytes()
            t0 = time.perf_counter()
            mgr.save(step, state)
            mgr.wait()
            _pushed(mgr, step)
            seconds = time.perf_counter() - t0
            sent1, recv1 = _link_bytes()
            out["ckpts"].append(
                {"sent": sent1 - sent0, "received": recv1 - recv0, "seconds": seconds}
            )
            del state
        if final <= step:
            raise ValueError(f"final step {final} must be past {step}")
        mgr.save(final, _make_state(total_bytes, final))
        mgr.wait()
        _pushed(mgr, final)
        out["held"] = _held(mgr, mode, member, final)
        out["steps_by_tier"] = {str(s): sorted(t) for s, t in mgr.steps_by_tier().items()}
    return out


def restore(
    *,
    storage: str,
    modes: dict[str, dict[str, Any]],
    member: str,
    total_bytes: int,
    interval: int,
    repeats: int,
) -> dict[str, Any]:
    """See the module docstring: per mode, the stats of each restore."""
    import jax

    from benchmarks._hosts_job import _shardings

    out: dict[str, Any] = {"member": member, "runs": {m: [] for m in modes}}
    names = list(modes)
    shardings = _shardings(total_bytes)
    target = {
        n: jax.ShapeDtypeStruct(shape, dtype, sharding=shardings[n])
        for n, (shape, dtype, _) in arrays(total_bytes).items()
    }
    for r in range(repeats):
        for mode in names[r % len(names) :] + names[: r % len(names)]:
            with _manager(storage, mode, member, modes[mode], interval) as mgr:
                _barrier(f"bench-restore-{mode}-{r}")
                recv0 = _link_bytes()[1]
                got = mgr.restore(target=target)
                jax.block_until_ready(got)
                received = _link_bytes()[1] - recv0
                stats = mgr.last_restore_stats
                checked = _check(got, total_bytes, int(stats.step))
                del got
                out["runs"][mode].append(
                    {
                        "step": stats.step,
                        "seconds": stats.seconds,
                        "fetch_s": stats.fetch_s,
                        "select_s": stats.select_s,
                        "bytes_by_tier": dict(stats.bytes_by_tier),
                        "bytes_read_storage": stats.bytes_read_storage,
                        "restored_bytes": stats.restored_bytes,
                        "fallbacks": dict(stats.fallbacks),
                        "checked_shards": checked,
                        "link_received": received,
                    }
                )
                _barrier(f"bench-restored-{mode}-{r}")
    return out
