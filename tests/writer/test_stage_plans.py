"""Leaf plans are reused across saves only when shape, dtype and sharding recur, and a reused
plan stages exactly what a fresh one does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from jax._src.array import ArrayImpl

from fastckpt import CheckpointManager, ManagerOptions, SaveOptions
from fastckpt._checksum import crc32c
from fastckpt._tree import flatten
from fastckpt.errors import ConfigError
from fastckpt.options import RamOptions
from fastckpt.writer import _stage_plans as stage_plans
from fastckpt.writer import stage as stage_module
from fastckpt.writer.stage import StagePlans, stage_state, staged_crc32c, staging_nbytes
from tests.support.arrays import P, assert_bit_exact, assert_sharded_like, device_data, named


def _stage(state: Any, plans: StagePlans | None) -> tuple[list[tuple[Any, ...]], bytes]:
    """What staging decided (per array: path, dtype, sharding, items) and the staged bytes."""
    staged = stage_state(
        flatten(state)[0],
        process_index=0,
        max_chunk_bytes=1 << 10,
        allocate=lambda n: np.zeros(n, np.uint8),
        executor=None,
        plans=plans,
    )
    meta = [(a.path, a.dtype, a.kind, a.sharding, a.items) for a in staged.arrays]
    data = b"".join(
        bytes(staged.chunk_view(a, i)) for a in staged.arrays for i in range(len(a.items))
    )
    return meta, data


def _state(seed: int, spec_b: Any = None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    a, ha = device_data((16, 32), np.float32, named((2, 4), ("x", "y"), P("x", "y")), seed=seed)
    b, hb = device_data(
        (16, 32), np.float32, named((2, 4), ("x", "y"), spec_b or P("y", None)), seed=seed + 1
    )
    r, hr = device_data(
        (8, 8), np.int32, named((8,), ("x",), P()), seed=seed + 2
    )  # replicated: written once
    return {"a": a, "b": b, "r": r, "n": np.arange(6)}, {"a": ha, "b": hb, "r": hr}


def _stage_deferred(state: Any, device_copy: str = "pinned_host", **extra: Any) -> Any:
    """Staged with the copies it can defer left to ``finish_copies`` (by default through
    pinned host memory)."""
    return stage_state(
        flatten(state)[0],
        process_index=0,
        max_chunk_bytes=1 << 10,
        allocate=lambda n: np.zeros(n, np.uint8),
        executor=None,
        device_copy=device_copy,
        defer_host_copies=True,
        **extra,
    )


def test_a_reused_plan_stages_what_a_fresh_plan_does() -> None:
    plans = StagePlans()
    first = _stage(_state(0)[0], plans)
    assert (plans.hits, plans.misses) == (0, 3)  # three jax arrays; numpy leaves are not cached
    for seed in (0, 5):
        state = _state(seed)[0]
        assert _stage(state, plans) == _stage(state, None)
    assert (plans.hits, plans.misses) == (6, 3)
    assert _stage(_state(0)[0], plans) == first


@pytest.mark.parametrize("change", ["sharding", "shape", "dtype"])
def test_a_changed_leaf_is_planned_afresh(change: str) -> None:
    plans = StagePlans()
    _stage(_state(0)[0], plans)
    state = _state(0, spec_b=P(None, "x") if change == "sharding" else None)[0]
    if change == "shape":
        state["b"] = device_data((8, 32), np.float32, named((2, 4), ("x", "y"), P("y", None)))[0]
    elif change == "dtype":
        state["b"] = state["b"].astype(np.float16)
    misses = plans.misses
    assert _stage(state, plans) == _stage(state, None)
    assert plans.misses == misses + 1


def test_a_deleted_array_is_refused_on_a_cached_plan_too() -> None:
    plans = StagePlans()
    state = _state(0)[0]
    _stage(state, plans)
    state = _state(1)[0]
    state["a"].delete()
    with pytest.raises(ConfigError, match="deleted"):
        _stage(state, plans)


def test_manager_saves_reuse_plans_and_restore_bit_exact(root: Any) -> None:
    with CheckpointManager(root) as mgr:
        for step, spec in ((1, None), (2, None), (3, P(None, "x"))):  # step 3 reshards leaf "b"
            state, hosts = _state(step, spec_b=spec)
            mgr.save(step, state)
            mgr.wait()
            got = mgr.restore(step)
            for k, h in hosts.items():
                assert_sharded_like(got[k], state[k].sharding, h)
            assert np.array_equal(got["n"], np.arange(6))
        assert (mgr._saver.plans.hits, mgr._saver.plans.misses) == (5, 4)


def test_transfer_mode_views_host_devices_and_is_one_call_when_every_shard_is_used() -> None:
    assert (
        stage_plans._transfer_mode(on_host=True, local_shards=8, used=range(8), pinned=False)
        == "host"
    )
    assert (
        stage_plans._transfer_mode(
            on_host=True, local_shards=8, used=range(8), pinned=False, view_host=False
        )
        is None
    )
    assert (
        stage_plans._transfer_mode(on_host=False, local_shards=8, used=range(8), pinned=False)
        == "all"
    )
    assert (
        stage_plans._transfer_mode(on_host=False, local_shards=8, used=[0, 4], pinned=False)
        == "shards"
    )
    for on_host in (False, True):
        assert (
            stage_plans._transfer_mode(on_host=on_host, local_shards=8, used=range(8), pinned=True)
            == "pinned_all"
        )
        assert (
            stage_plans._transfer_mode(on_host=on_host, local_shards=8, used=[0, 4], pinned=True)
            == "pinned_shards"
        )


def test_pinned_host_is_automatic_on_accelerators_only_and_refused_where_missing() -> None:
    import jax

    cpu = jax.devices()
    assert (
        stage_plans._pinned_ok(cpu, "auto") is False
    )  # host-platform devices: their memory is host memory
    assert (
        stage_plans._pinned_ok(cpu, "pinned_host") is True
    )  # forced (jax's CPU client has the memory kind)
    assert stage_plans._pinned_ok(cpu, "pageable") is False

    class NoPinned:
        platform = "gpu"

        def addressable_memories(self) -> list[Any]:
            return []

    assert stage_plans._pinned_ok([NoPinned()], "auto") is False
    with pytest.raises(ConfigError, match="pinned_host"):
        stage_plans._pinned_ok([NoPinned()], "pinned_host")
    with pytest.raises(ConfigError, match="device_copy"):
        SaveOptions(device_copy="pinned")  # type: ignore[arg-type]


def test_auto_falls_back_to_pageable_where_a_pinned_round_trip_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A device that lists pinned_host memory but cannot round-trip through it (a backend or
    jax version without the support) gets pageable copies in "auto", probed once per device,
    with a warning; a working device passes the probe."""
    import jax

    assert stage_plans._pinned_round_trip(jax.devices()[0]) is True

    class Memory:
        kind = "pinned_host"

    class Broken:
        platform = "tpu"

        def addressable_memories(self) -> list[Any]:
            return [Memory()]

    broken = Broken()
    probed: dict[Any, bool] = {}
    with caplog.at_level("WARNING", logger="fastckpt"):
        assert stage_plans._pinned_ok([broken], "auto", probed) is False
        assert stage_plans._pinned_ok([broken], "auto", probed) is False
    assert probed == {broken: False}
    assert (
        len([r for r in caplog.records if "pinned host memory do not work" in r.getMessage()]) == 1
    )
    assert (
        stage_plans._pinned_ok([broken], "pinned_host") is True
    )  # forced: no probe, errors surface


def test_deferred_pinned_copies_are_independent_of_the_device_arrays() -> None:
    """Staging through pinned host memory with the copies deferred: the buffer is filled only
    by ``finish_copies``, from private copies — deleting (as donation does) or overwriting
    the device arrays in between changes nothing."""
    state = _state(4)[0]
    expected = _stage(state, None)
    staged = _stage_deferred(state)
    assert staged.deferred is not None and staged.deferred.nbytes == sum(
        it.nbytes for a in staged.arrays if a.kind == "jax" for it in a.items
    )
    for k in ("a", "b", "r"):
        state[k].delete()
    assert staged.finish_copies(None, jobs=2) >= 0.0
    staged.finish_copies(None, jobs=2)  # idempotent
    meta = [(a.path, a.dtype, a.kind, a.sharding, a.items) for a in staged.arrays]
    data = b"".join(
        bytes(staged.chunk_view(a, i)) for a in staged.arrays for i in range(len(a.items))
    )
    assert (meta, data) == expected


@pytest.mark.parametrize("device_copy", ["auto", "pageable"])
def test_host_device_shards_are_copied_later_from_their_own_buffers_unless_pageable(
    device_copy: str,
) -> None:
    """CPU-device shards with ``"auto"``: staging copies none of them (the numpy leaf only);
    ``finish_copies`` copies them later from views of their buffers, and neither ``delete()``
    nor a donating step in between changes what is staged. ``"pageable"``: copied at once."""
    import jax

    state = _state(9)[0]
    expected = _stage(state, None)
    staged = _stage_deferred(state, device_copy)
    jax_bytes = sum(it.nbytes for a in staged.arrays if a.kind == "jax" for it in a.items)
    if device_copy == "pageable":
        assert staged.deferred is None
        return
    assert staged.deferred is not None and staged.deferred.nbytes == jax_bytes
    numpy_leaf = next(a for a in staged.arrays if a.kind == "numpy")
    assert bytes(staged.chunk_view(numpy_leaf, 0)) == np.arange(6).tobytes()  # copied at once
    assert not any(staged.buffer[staged.arrays[0].item_offsets[0] :][:64])  # jax: not yet
    step = jax.jit(lambda t: jax.tree.map(lambda x: x * 3 + 1, t), donate_argnums=0)
    after = step({k: state[k] for k in ("a", "b")})  # donation declined: views hold the buffers
    jax.block_until_ready(after)
    state["r"].delete()
    staged.finish_copies(None, jobs=2, checksum=True)
    data = b"".join(
        bytes(staged.chunk_view(a, i)) for a in staged.arrays for i in range(len(a.items))
    )
    assert data == expected[1]


def test_arrays_already_in_pinned_host_memory_get_a_private_copy_too() -> None:
    """A state kept in pinned host memory (host-offloaded optimizer state): ``device_put`` to
    the same memory kind would hand back the caller's own buffers, which a donating step may
    reuse before the deferred copy reads them. Staging must copy them."""
    import jax

    for spec in (
        P("x", "y"),
        P("y", None),
    ):  # every shard written (one put), some replicated (per shard)
        sharding = named((2, 4), ("x", "y"), spec).with_memory_kind("pinned_host")
        host = np.arange(16 * 32, dtype=np.float32).reshape(16, 32)
        x = jax.device_put(host, sharding)
        staged = stage_state(
            flatten({"x": x})[0],
            process_index=0,
            max_chunk_bytes=1 << 10,
            allocate=lambda n: np.zeros(n, np.uint8),
            executor=None,
            device_copy="pinned_host",
            defer_host_copies=True,
        )
        assert staged.deferred is not None
        src = {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
        kept = {
            a.unsafe_buffer_pointer()
            for k in staged.deferred._keep
            for a in (
                [k]
                if not hasattr(k, "addressable_shards")
                else [s.data for s in k.addressable_shards]
            )
        }
        assert kept and not kept & src  # private copies, not the caller's buffers
        staged.finish_copies(None, jobs=2)
        data = b"".join(
            bytes(staged.chunk_view(a, i)) for a in staged.arrays for i in range(len(a.items))
        )
        assert (
            data
            == _stage({"x": jax.device_put(host, sharding.with_memory_kind("device"))}, None)[1]
        )


def test_a_failed_deferred_copy_releases_the_pinned_copies_and_stays_failed() -> None:
    """The preparation (reserving a RAM segment) fails: the pinned copies are let go at once,
    and asking again raises again instead of reporting a buffer that never got its chunks."""

    class Full(Exception):
        pass

    def unreserved(n: int) -> tuple[np.ndarray, Any]:
        def prepare() -> None:
            raise Full("tmpfs is full")

        return np.zeros(n, np.uint8), prepare

    state = {k: v for k, v in _state(7)[0].items() if k != "n"}
    staged = _stage_deferred(state, allocate_unreserved=unreserved)
    deferred = staged.deferred
    assert deferred is not None and deferred._keep
    for _ in range(2):
        with pytest.raises(Full):
            staged.finish_copies(None, jobs=2)
        assert deferred._keep is None and deferred._pairs is None


def test_an_unreserved_buffer_is_asked_for_only_when_every_copy_is_deferred() -> None:
    """``allocate_unreserved`` serves a save whose copies all run in the background, and its
    preparation runs inside ``finish_copies``, before the copies; a state with a leaf that
    must be copied at once (numpy) gets a ready buffer from ``allocate``."""
    events: list[str] = []

    def unreserved(n: int) -> tuple[np.ndarray, Any]:
        events.append("unreserved")
        return np.zeros(n, np.uint8), lambda: events.append("prepare")

    def ready(n: int) -> np.ndarray:
        events.append("ready")
        return np.zeros(n, np.uint8)

    def run(state: dict[str, Any]) -> Any:
        return stage_state(
            flatten(state)[0],
            process_index=0,
            max_chunk_bytes=1 << 10,
            allocate=ready,
            executor=None,
            device_copy="pinned_host",
            defer_host_copies=True,
            allocate_unreserved=unreserved,
        )

    state = _state(6)[0]
    jax_only = {k: state[k] for k in ("a", "b", "r")}
    expected = _stage(jax_only, None)
    staged = run(jax_only)
    assert events == ["unreserved"]
    staged.finish_copies(None, jobs=2)
    assert events == ["unreserved", "prepare"]
    data = b"".join(
        bytes(staged.chunk_view(a, i)) for a in staged.arrays for i in range(len(a.items))
    )
    assert data == expected[1]
    events.clear()
    run(state)  # "n" is a numpy leaf: copied at once, into a ready buffer
    assert events == ["ready"]


@pytest.mark.parametrize("device_copy", ["pinned_host", "auto"])
def test_manager_saves_with_deferred_copies_and_the_step_may_donate_at_once(
    tmp_path: Path, shm_dir: Path, device_copy: Any
) -> None:
    """RAM and persistent saves whose copies run in the background (through pinned host
    memory, or from the CPU shards' own buffers): a donating step right after ``save()``
    returns does not reach the checkpoint; both tiers restore bit-exact."""
    import jax

    step_fn = jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t), donate_argnums=0)
    options = ManagerOptions(
        save=SaveOptions(device_copy=device_copy),
        save_interval_steps=2,
        ram=RamOptions(
            root=str(shm_dir / "h0"), interval_steps=1, replicas=0, budget_bytes=64 << 20
        ),
    )
    with CheckpointManager(str(tmp_path / "ckpt"), options=options) as mgr:
        for step in (1, 2):  # 1: RAM only; 2: RAM and storage
            state, hosts = _state(step)
            arrays = {k: state[k] for k in hosts}
            mgr.save(step, arrays)
            arrays = step_fn(arrays)  # donates the saved buffers while the background copies run
            mgr.wait()
            stats = mgr.last_save_stats
            assert stats is not None and stats.deferred_copy_s > 0.0
            assert stats.tiers == (("ram",) if step == 1 else ("ram", "storage"))
            for tier_restore in (
                mgr.restore(step),
                mgr.restore(
                    step,
                    target={
                        k: jax.ShapeDtypeStruct(h.shape, h.dtype, sharding=state[k].sharding)
                        for k, h in hosts.items()
                    },
                ),
            ):
                for k, h in hosts.items():
                    assert_sharded_like(tier_restore[k], state[k].sharding, h)
            if device_copy == "pinned_host":  # the step took the saved buffers (CPU views held
                # until copied make jax decline the donation: a race with the copy)
                assert all(state[k].is_deleted() for k in hosts)
    with CheckpointManager(str(tmp_path / "ckpt")) as mgr:  # storage alone (no RAM tier)
        got = mgr.restore(2)
        for k, h in _state(2)[1].items():
            assert_bit_exact(got[k], h)


@pytest.mark.parametrize("mode", [None, "host", "all", "shards", "pinned_all", "pinned_shards"])
@pytest.mark.parametrize("cached", [False, True])
def test_each_transfer_mode_starts_the_copies_it_says_and_stages_the_same_bytes(
    mode: str | None, cached: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _state(3)[0]
    expected = _stage(state, None)  # CPU devices: no asynchronous transfer at all
    calls: list[tuple[int, ...]] = []
    real = ArrayImpl.copy_to_host_async

    def counting(self: Any) -> None:
        calls.append(tuple(self.shape))
        real(self)

    monkeypatch.setattr(ArrayImpl, "copy_to_host_async", counting)
    assert _stage(state, None) == expected and calls == []
    monkeypatch.setattr(stage_plans, "_transfer_mode", lambda **kw: mode)
    plans = StagePlans()
    if cached:
        _stage(state, plans)
        calls.clear()
    assert _stage(state, plans) == expected
    if mode in (None, "host") or mode.startswith("pinned"):  # pinned: device_put instead
        assert calls == []
    elif mode == "all":  # one call per jax leaf, on the global array
        assert sorted(calls) == [(8, 8), (16, 32), (16, 32)]
    else:  # one per used shard: a's 8; b's 4 distinct (not its replicas over "x"); r's 1
        assert sorted(calls) == [(4, 32)] * 4 + [(8, 8)] * 9


def test_a_deferred_copy_checksums_each_chunk_as_it_copies_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``finish_copies(checksum=True)`` (a RAM commit) takes every deferred chunk's crc32c
    during its copy: ``staged_crc32c`` then reads only the chunks copied at once (the numpy
    leaf), and its crcs are those of the staged bytes."""
    state = _state(8)[0]
    staged = _stage_deferred(state)
    staged.finish_copies(None, jobs=2, checksum=True)
    expected = {
        ai: [crc32c(staged.chunk_view(a, i)) for i in range(len(a.items))]
        for ai, a in enumerate(staged.arrays)
    }
    read: list[int] = []
    real = stage_module.parallel_crc32c

    def counting(views: Any, executor: Any, *, jobs: int) -> list[int]:
        read.extend(v.nbytes for v in views)
        return real(views, executor, jobs=jobs)

    monkeypatch.setattr(stage_module, "parallel_crc32c", counting)
    assert staged_crc32c(staged, None, jobs=2) == expected
    numpy_bytes = sum(it.nbytes for a in staged.arrays if a.kind == "numpy" for it in a.items)
    assert 0 < sum(read) == numpy_bytes


@pytest.mark.parametrize("max_chunk_bytes", [1 << 10, 1 << 20])
@pytest.mark.parametrize("process_index", [0, 1])
def test_staging_nbytes_is_the_buffer_stage_state_allocates(
    max_chunk_bytes: int, process_index: int
) -> None:
    """Sized from the concrete state or from its abstract twin (``ShapeDtypeStruct`` with the
    sharding): exactly the staging buffer a save allocates (what ``prepare`` provisions)."""
    import jax

    state: dict[str, Any] = dict(_state(9)[0])
    state["key"] = jax.random.key(3)
    state["rows"] = device_data((8, 6), np.int8, named((2, 4), ("x", "y"), P("y", None)))[0]
    state["value"] = 1.5
    sizes: list[int] = []
    staged = stage_state(
        flatten(state)[0],
        process_index=process_index,
        max_chunk_bytes=max_chunk_bytes,
        allocate=lambda n: sizes.append(n) or np.zeros(n, np.uint8),
        executor=None,
    )
    abstract = jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            if isinstance(x, jax.Array)
            else x
        ),
        state,
    )
    for tree in (state, abstract):
        got = staging_nbytes(
            flatten(tree)[0], process_index=process_index, max_chunk_bytes=max_chunk_bytes
        )
        assert [got] == sizes == [staged.buffer.nbytes]
