"""Orbax interop against checkpoints written by the real orbax-checkpoint package."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import fastckpt
from fastckpt.errors import (
    CheckpointNotFoundError,
    DtypeMismatchError,
    ShapeMismatchError,
    TreeStructureError,
)
from fastckpt.integrations.orbax import (
    convert_fastckpt_to_orbax,
    convert_orbax_to_fastckpt,
    restore_orbax,
)
from fastckpt.integrations.pytree import abstract_state

from ._helpers import assert_bit_exact, assert_shardings

ocp = pytest.importorskip("orbax.checkpoint")


def _mesh(devices: list[jax.Device], shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    return Mesh(np.asarray(devices[: int(np.prod(shape))]).reshape(shape), names)


def _state(devices: list[jax.Device], seed: int) -> dict[str, Any]:
    mesh = _mesh(devices, (2, 4), ("data", "model"))
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((48, 32), dtype=np.float32)
    return {
        "params": {
            "w": jax.device_put(w, NamedSharding(mesh, P("data", "model"))),
            "b": jax.device_put(
                jnp.asarray(rng.standard_normal(24), jnp.bfloat16), NamedSharding(mesh, P("model"))
            ),
            "layers": [jnp.full((4, 4), seed, jnp.int32), jnp.arange(6, dtype=jnp.float16)],
        },
        "key": jax.random.key(seed),
        "keys": jax.device_put(
            jax.random.split(jax.random.key(seed + 1), 8), NamedSharding(mesh, P(("data", "model")))
        ),
        "count": np.arange(5, dtype=np.int64) + seed,
        "step": 100 * seed,
        "lr": 0.5 * seed,
    }


@pytest.fixture(scope="module")
def orbax_root(
    tmp_path_factory: pytest.TempPathFactory, devices8: list[jax.Device]
) -> tuple[Path, dict[int, Any]]:
    """An Orbax CheckpointManager root (its default format) with steps 1 and 2."""
    root = tmp_path_factory.mktemp("orbax") / "run"
    states = {1: _state(devices8, 1), 2: _state(devices8, 2)}
    with ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(max_to_keep=5)) as mngr:
        for step, st in states.items():
            mngr.save(step, args=ocp.args.StandardSave(st))
        mngr.wait_until_finished()
    return root, states


def _target(state: dict[str, Any], mesh: Mesh | None, spec: P) -> Any:
    """Abstract target: every array leaf laid out on ``mesh`` (None: one device) with ``spec``."""

    def sharding(x: Any) -> jax.sharding.Sharding:
        if mesh is None:
            return jax.sharding.SingleDeviceSharding(jax.devices()[-1])
        dims = tuple(spec)[: x.ndim]
        ok = all(d is None or x.shape[i] % mesh.shape[d] == 0 for i, d in enumerate(dims))
        return NamedSharding(mesh, P(*dims) if ok else P())

    return abstract_state(state, sharding)


@pytest.mark.parametrize(
    "mesh_shape, names, spec",
    [
        ((8,), ("x",), P("x")),
        ((4, 2), ("a", "b"), P("b", "a")),
        ((2,), ("x",), P(None, "x")),
        ((3,), ("x",), P("x")),
        (None, (), P()),
    ],
    ids=["8dev-rows", "4x2-transposed", "2dev-cols", "3dev-uneven-count", "single-device"],
)
def test_restore_onto_other_shardings(
    orbax_root: Any, devices8: list[jax.Device], mesh_shape: Any, names: Any, spec: P
) -> None:
    root, states = orbax_root
    mesh = _mesh(devices8, mesh_shape, names) if mesh_shape else None
    target = _target(states[2], mesh, spec)
    restored = restore_orbax(root, target)
    assert_bit_exact(states[2], restored)
    assert_shardings(target, restored)


def test_path_forms_and_steps(orbax_root: Any) -> None:
    root, states = orbax_root
    target = _target(states[1], None, P())
    assert_bit_exact(states[1], restore_orbax(root, target, step=1))
    assert_bit_exact(states[1], restore_orbax(root / "1", target))
    assert_bit_exact(states[1], restore_orbax(str(root / "1" / "default"), target, item=None))
    assert_bit_exact(
        states[2], restore_orbax(f"file://{root}", _target(states[2], None, P()))
    )  # latest
    with pytest.raises(CheckpointNotFoundError):
        restore_orbax(root, target, step=7)
    with pytest.raises(CheckpointNotFoundError):
        restore_orbax(root / "1", target, item="nope")
    with pytest.raises(CheckpointNotFoundError):
        restore_orbax(root.parent / "missing", target)


def test_no_target_uses_saved_shardings(orbax_root: Any) -> None:
    root, states = orbax_root
    restored = restore_orbax(root)
    expected = dict(states[2])
    expected["params"] = dict(expected["params"], layers=list(expected["params"]["layers"]))
    assert_bit_exact(expected, restored)
    assert restored["params"]["w"].sharding.spec == P("data", "model")
    assert restored["params"]["w"].sharding.mesh.axis_names == ("data", "model")
    assert isinstance(restored["count"], np.ndarray) and isinstance(restored["step"], int)


def test_target_mismatches_are_typed(orbax_root: Any) -> None:
    root, states = orbax_root
    target = _target(states[2], None, P())
    missing = dict(target, extra=jax.ShapeDtypeStruct((2,), jnp.float32))
    with pytest.raises(TreeStructureError, match="extra"):
        restore_orbax(root, missing)
    with pytest.raises(TreeStructureError, match="partial=True"):
        restore_orbax(root, {"params": target["params"]})
    sub = restore_orbax(root, {"params": {"w": target["params"]["w"]}}, partial=True)
    assert (
        np.asarray(sub["params"]["w"]).tobytes() == np.asarray(states[2]["params"]["w"]).tobytes()
    )
    bad_shape = dict(target, count=np.zeros(6, np.int64))
    with pytest.raises(ShapeMismatchError, match="count"):
        restore_orbax(root, bad_shape)
    w32 = {"params": {"w": jax.ShapeDtypeStruct((48, 32), jnp.bfloat16)}}
    with pytest.raises(DtypeMismatchError, match="allow_dtype_cast"):
        restore_orbax(root, w32, partial=True)
    cast = restore_orbax(root, w32, partial=True, allow_dtype_cast=True)
    assert cast["params"]["w"].dtype == jnp.bfloat16


def test_zarr3_strings_and_trainstate_names(tmp_path: Path, devices8: list[jax.Device]) -> None:
    """zarr3 arrays (Orbax v1's default), str leaves, and attribute-named trees
    (TrainState-like)."""
    import optax
    from flax.training import train_state

    mesh = _mesh(devices8, (8,), ("x",))
    params = {
        "dense": {
            "kernel": jax.device_put(jnp.arange(64.0).reshape(16, 4), NamedSharding(mesh, P("x")))
        }
    }
    ts = train_state.TrainState.create(apply_fn=lambda *a: None, params=params, tx=optax.adam(1e-3))
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=True)) as ckptr:
        ckptr.save(tmp_path / "z3", args=ocp.args.PyTreeSave({"state": ts, "name": "run-7"}))
    assert (tmp_path / "z3" / "_strings.json").exists()
    target = {
        "state": abstract_state(ts, NamedSharding(_mesh(devices8, (2,), ("y",)), P())),
        "name": "",
    }
    restored = restore_orbax(tmp_path / "z3", target)
    assert restored["name"] == "run-7"
    assert isinstance(restored["state"], train_state.TrainState)
    assert_bit_exact({"state": ts, "name": "run-7"}, restored)


def test_restore_needs_no_orbax(orbax_root: Any) -> None:
    """Reading goes through tensorstore alone: orbax is unimportable in the child process."""
    root, states = orbax_root
    w_hex = np.asarray(states[2]["params"]["w"]).tobytes().hex()
    code = textwrap.dedent(f"""
        import sys
        sys.modules["orbax"] = None  # any 'import orbax...' now fails
        import numpy as np
        import fastckpt, fastckpt.cli
        from fastckpt.integrations.orbax import restore_orbax, OrbaxStyleCheckpointManager
        out = restore_orbax({str(root)!r}, step=2)
        assert np.asarray(out["params"]["w"]).tobytes() == bytes.fromhex({w_hex!r})
        assert out["step"] == 200
        with OrbaxStyleCheckpointManager("mem://no-orbax") as m:
            m.save(0, {{"x": np.ones(3)}})
            assert m.restore(0)["x"].sum() == 3
        assert not any(k.startswith("orbax") and sys.modules[k] is not None for k in sys.modules)
        print("ok")
    """)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("ok")


def test_convert_orbax_to_fastckpt(
    orbax_root: Any, tmp_path: Path, devices8: list[jax.Device]
) -> None:
    root, states = orbax_root
    dst = tmp_path / "fck"
    assert convert_orbax_to_fastckpt(root, str(dst), orbax_step=1) == 1
    assert convert_orbax_to_fastckpt(root / "2", str(dst), 20) == 20
    with fastckpt.CheckpointManager(str(dst)) as mgr:
        assert mgr.all_steps() == [1, 20]
        assert mgr.metadata(20)["converted_from"]["format"] == "orbax"
        target = _target(states[2], _mesh(devices8, (4,), ("x",)), P("x"))
        restored = mgr.restore(20, target=target)
    assert_bit_exact(states[2], restored)
    assert_shardings(target, restored)


def test_convert_fastckpt_to_orbax_and_back(tmp_path: Path, devices8: list[jax.Device]) -> None:
    state = _state(devices8, 3)
    state["name"] = "tagged"  # str leaves need Orbax's PyTreeSave
    fastckpt.save(str(tmp_path / "fck"), 5, state)
    assert convert_fastckpt_to_orbax(str(tmp_path / "fck"), None, tmp_path / "orbax") == 5
    convert_fastckpt_to_orbax(str(tmp_path / "fck"), 5, tmp_path / "item", layout="item")
    target = _target(state, _mesh(devices8, (2, 2), ("a", "b")), P("a", "b"))
    with ocp.CheckpointManager(tmp_path / "orbax") as mngr:  # Orbax itself reads what we wrote
        assert mngr.all_steps() == [5]
        by_orbax = mngr.restore(
            5,
            args=ocp.args.PyTreeRestore(
                item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)
            ),
        )
    assert_bit_exact(state, by_orbax)
    assert_bit_exact(state, restore_orbax(tmp_path / "item", target))
    # and back again: orbax -> fastckpt, with the real target's key paths
    convert_orbax_to_fastckpt(tmp_path / "orbax", str(tmp_path / "fck2"), target=target)
    assert_bit_exact(state, fastckpt.restore(str(tmp_path / "fck2"), target=target))


# ---------------------------------------------------------------- Orbax-style manager


def _bump(state: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: x + 1 if isinstance(x, jax.Array) else x, state)


def _trainer(
    make_manager: Any, directory: Path, state0: Any, abstract: Any, until: int
) -> tuple[Any, list[int]]:
    """A trainer written against Orbax's CheckpointManager API; resumes from the latest step."""
    mngr = make_manager(directory)
    start = mngr.latest_step()
    state = (
        state0 if start is None else mngr.restore(start, args=ocp.args.StandardRestore(abstract))
    )
    for step in range(0 if start is None else start + 1, until):
        state = _bump(state)
        mngr.save(step, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()
    steps = list(mngr.all_steps())
    mngr.close()
    return state, steps


def test_trainer_migrates_by_swapping_the_manager(
    tmp_path: Path, devices8: list[jax.Device]
) -> None:
    from fastckpt.integrations.orbax import OrbaxStyleCheckpointManager

    mesh = _mesh(devices8, (4, 2), ("d", "m"))
    state0 = {"w": jax.device_put(jnp.zeros((8, 4)), NamedSharding(mesh, P("d", "m"))), "step": 0}
    abstract = abstract_state(state0)
    options = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=2)
    makers = {
        "orbax": lambda d: ocp.CheckpointManager(d, options=options),
        "fastckpt": lambda d: OrbaxStyleCheckpointManager(
            d, options=options
        ),  # the only changed line
    }
    results = {}
    for name, make in makers.items():
        _trainer(make, tmp_path / name, state0, abstract, until=5)  # first run: saves 0, 2, 4
        results[name] = _trainer(make, tmp_path / name, state0, abstract, until=9)  # resumes from 4
    (s_orbax, steps_orbax), (s_fast, steps_fast) = results["orbax"], results["fastckpt"]
    assert steps_fast == steps_orbax == [6, 8]
    assert_bit_exact(s_orbax, s_fast)
    assert float(s_fast["w"][0, 0]) == 9.0


def test_manager_composite_json_metrics(tmp_path: Path) -> None:
    from fastckpt.integrations.orbax import OrbaxStyleCheckpointManager, OrbaxStyleOptions

    state = {"w": jnp.arange(6.0), "b": np.ones(2, np.float32)}
    with OrbaxStyleCheckpointManager(
        tmp_path / "c", options=OrbaxStyleOptions(enable_async_checkpointing=False)
    ) as m:
        m.save(
            3,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), extra=ocp.args.JsonSave({"epoch": 2})
            ),
            metrics={"loss": 0.25},
            custom_metadata={"run": "a"},
        )
        assert m.fastckpt_manager.all_steps() == [3]  # synchronous: committed on return
        out = m.restore(
            3,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state(state)), extra=ocp.args.JsonRestore()
            ),
        )
        assert_bit_exact(state, out.state)
        assert out["extra"] == {"epoch": 2}
        meta = m.metadata(3)
        assert meta.metrics == {"loss": 0.25} and meta.custom_metadata == {"run": "a"}
        assert meta.item_names == ("state",)
        assert m.item_metadata(3)["state"]["w"] == jax.ShapeDtypeStruct((6,), jnp.float32)
        with pytest.raises(TreeStructureError):
            m.restore(3, args=ocp.args.StandardRestore(abstract_state(state)))
        m.save(4, args=ocp.args.StandardSave(state))
        composite = m.restore(
            4, args=ocp.args.Composite(default=ocp.args.StandardRestore(abstract_state(state)))
        )
        assert_bit_exact(state, composite.default)


def test_manager_decisions_and_retention(tmp_path: Path) -> None:
    from fastckpt.errors import ConfigError, StepAlreadyCommittedError
    from fastckpt.integrations.orbax import OrbaxStyleCheckpointManager, OrbaxStyleOptions

    opts = OrbaxStyleOptions(max_to_keep=2, keep_period=4, save_interval_steps=3, save_on_steps=[5])
    state = {"x": jnp.ones(3)}
    with OrbaxStyleCheckpointManager(str(tmp_path / "r"), options=opts) as m:
        assert m.latest_step() is None and m.should_save(1)  # first save always
        saved = [s for s in range(13) if m.save(s, state)]  # plain pytrees work too
        assert saved == [0, 3, 5, 6, 9, 12]
        assert m.latest_step() == 12 and 12 in m.all_steps()  # listed while in flight
        m.wait_until_finished()
        assert m.all_steps() == [0, 9, 12]  # newest 2 + keep_period 4 (0; 4 and 8 never saved)
        with pytest.raises(StepAlreadyCommittedError):
            m.save(12, state, force=True)
        assert not m.save(10, state)  # older than the latest
        m.delete(12)
        assert m.latest_step() == 9
        assert_bit_exact(state, m.restore(None, abstract_state(state)))
    with OrbaxStyleCheckpointManager(
        str(tmp_path / "r"), options=OrbaxStyleOptions(read_only=True)
    ) as ro:
        assert not ro.save(100, state) and ro.all_steps() == [0, 9]
    with pytest.raises(ConfigError, match="best_fn"):
        OrbaxStyleCheckpointManager(
            tmp_path / "x", options=ocp.CheckpointManagerOptions(best_fn=lambda m: m["l"])
        )
    with pytest.raises(ConfigError):
        OrbaxStyleOptions(max_to_keep=0)
