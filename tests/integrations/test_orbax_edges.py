"""Orbax interop edge cases: stored values win over target leaf types, PRNG key targets are
checked, malformed Orbax metadata and failed Orbax writes raise typed errors, and the
Orbax-style manager's step bookkeeping around in-flight and failed saves."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fastckpt
from fastckpt.errors import (
    AlreadyExistsError,
    ConfigError,
    DtypeMismatchError,
    FastckptError,
    ManifestError,
    SaveError,
    ShapeMismatchError,
    StepAlreadyCommittedError,
    StorageError,
)
from fastckpt.integrations.orbax import convert_fastckpt_to_orbax, restore_orbax
from fastckpt.storage import MemoryStore

ocp = pytest.importorskip("orbax.checkpoint")


def _orbax_save(root: Path, state: Any, step: int = 1) -> Path:
    with ocp.CheckpointManager(root, item_handlers=ocp.PyTreeCheckpointHandler()) as mngr:
        mngr.save(step, args=ocp.args.PyTreeSave(state))
        mngr.wait_until_finished()
    return root


def _key_struct(shape: tuple[int, ...], impl: str) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype)


# ---------------------------------------------------------------- restore_orbax


def test_python_scalars_restore_as_stored(tmp_path: Path) -> None:
    """A target scalar of another type does not convert the stored value (as Orbax)."""
    root = _orbax_save(tmp_path / "s", {"f": 2.5, "s": 3, "big": 2**40})
    out = restore_orbax(root, {"f": 0, "s": False, "big": 0})
    assert out == {"f": 2.5, "s": 3, "big": 2**40}
    assert type(out["f"]) is float and type(out["s"]) is int


def test_reading_without_tensorstore_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tensorstore comes with the ``orbax`` extra: without it, reading an Orbax checkpoint is a
    ConfigError that says which extra to install."""
    import sys

    root = _orbax_save(tmp_path / "s", {"w": np.arange(4.0)})
    monkeypatch.setitem(sys.modules, "tensorstore", None)  # `import tensorstore` raises ImportError
    with pytest.raises(ConfigError, match=r"fastckpt\[orbax\]"):
        restore_orbax(root, {"w": jax.ShapeDtypeStruct((4,), jnp.float64)})
    with pytest.raises(ConfigError, match=r"fastckpt\[orbax\]"):
        restore_orbax(
            f"gs://no-bucket/{root.name}"
        )  # a remote directory is listed through tensorstore


def test_key_targets_check_implementation_and_shape(tmp_path: Path) -> None:
    keys = jax.random.split(jax.random.key(1), 8)
    state = {"k": jax.random.key(0), "kr": jax.random.key(0, impl="rbg"), "ks": keys}
    root = _orbax_save(tmp_path / "k", state)
    with pytest.raises(DtypeMismatchError, match="k: target keys are key<rbg>"):
        restore_orbax(root, {"k": _key_struct((), "rbg")}, partial=True)
    with pytest.raises(DtypeMismatchError, match="kr"):
        restore_orbax(root, {"kr": _key_struct((), "threefry2x32")}, partial=True)
    for name, shape, impl in [
        ("k", (2,), "threefry2x32"),
        ("kr", (4,), "rbg"),
        ("ks", (4,), "threefry2x32"),
        ("ks", (8, 2), "threefry2x32"),
    ]:
        with pytest.raises(ShapeMismatchError, match=name):
            restore_orbax(root, {name: _key_struct(shape, impl)}, partial=True)
    ok = restore_orbax(
        root,
        {
            "k": _key_struct((), "threefry2x32"),
            "kr": _key_struct((), "rbg"),
            "ks": _key_struct((8,), "threefry2x32"),
        },
    )
    for name, value in state.items():
        assert ok[name].dtype == value.dtype and ok[name].shape == value.shape
        assert np.array_equal(jax.random.key_data(ok[name]), jax.random.key_data(value))


def test_empty_values_restore_as_saved_not_as_the_target_placeholder(tmp_path: Path) -> None:
    root = _orbax_save(tmp_path / "e", {"x": None, "y": jnp.ones(3), "z": {}})
    target = {
        "x": jax.ShapeDtypeStruct((4,), jnp.float32),
        "y": jax.ShapeDtypeStruct((3,), jnp.float32),
        "z": jax.ShapeDtypeStruct((2,), jnp.float32),
    }
    out = restore_orbax(root, target)
    assert out["x"] is None and out["z"] == {}
    out["z"]["mutated"] = 1  # a restored empty container is not shared with later restores
    assert restore_orbax(root)["z"] == {}


def _write(path: Path, text: str) -> None:
    path.write_text(text)


@pytest.mark.parametrize(
    "name, mutate",
    [
        ("_sharding", lambda d: _write(d / "_sharding", "[1, 2]")),
        ("process_0", lambda d: [_write(p, "[1]") for p in (d / "array_metadatas").iterdir()]),
        (
            "process_0",
            lambda d: [
                _write(p, json.dumps({"array_metadatas": [1]}))
                for p in (d / "array_metadatas").iterdir()
            ],
        ),
        (
            "process_0",
            lambda d: [
                _write(p, json.dumps({"array_metadatas": 5}))
                for p in (d / "array_metadatas").iterdir()
            ],
        ),
        ("_strings.json", lambda d: _write(d / "_strings.json", "[1]")),
    ],
    ids=[
        "sharding-list",
        "array-metadatas-list",
        "array-metadatas-int-entries",
        "array-metadatas-int",
        "strings-list",
    ],
)
def test_malformed_orbax_metadata_is_a_manifest_error(
    tmp_path: Path, name: str, mutate: Callable[[Path], Any]
) -> None:
    root = _orbax_save(
        tmp_path / "m", {"w": jnp.arange(16.0), "k": jax.random.key(0), "name": "abc"}
    )
    mutate(root / "1" / "default")
    with pytest.raises(ManifestError, match=name):
        restore_orbax(root)


# ---------------------------------------------------------------- convert_fastckpt_to_orbax


@pytest.fixture
def fck_root(tmp_path: Path) -> str:
    root = str(tmp_path / "fck")
    fastckpt.save(root, 1, {"w": jnp.arange(8.0), "s": 1})
    return root


def test_convert_to_orbax_destination_errors_are_typed(fck_root: str, tmp_path: Path) -> None:
    convert_fastckpt_to_orbax(fck_root, 1, tmp_path / "mgr")
    with pytest.raises(StepAlreadyCommittedError, match="step 1 already exists"):
        convert_fastckpt_to_orbax(fck_root, 1, tmp_path / "mgr")
    convert_fastckpt_to_orbax(fck_root, 1, tmp_path / "item", layout="item")
    with pytest.raises(AlreadyExistsError, match="already exists"):
        convert_fastckpt_to_orbax(fck_root, 1, tmp_path / "item", layout="item")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(StorageError, match="not a directory"):
        convert_fastckpt_to_orbax(fck_root, 1, tmp_path / "afile" / "sub")
    for layout in ("manager", "item"):
        with pytest.raises(AlreadyExistsError, match="not a directory"):
            convert_fastckpt_to_orbax(fck_root, 1, tmp_path / "afile", layout=layout)  # type: ignore[arg-type]


def test_convert_to_orbax_translates_orbax_exceptions(
    fck_root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the up-front checks cannot see a problem (gs://), Orbax's own exceptions are typed."""
    import fastckpt.integrations.orbax as integ

    monkeypatch.setattr(integ, "_check_orbax_destination", lambda *a: None)
    convert_fastckpt_to_orbax(fck_root, 1, tmp_path / "mgr")
    with pytest.raises(StepAlreadyCommittedError):
        convert_fastckpt_to_orbax(fck_root, 1, tmp_path / "mgr")
    convert_fastckpt_to_orbax(fck_root, 1, tmp_path / "item", layout="item")
    with pytest.raises(AlreadyExistsError):
        convert_fastckpt_to_orbax(fck_root, 1, tmp_path / "item", layout="item")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(StorageError):
        convert_fastckpt_to_orbax(fck_root, 1, tmp_path / "afile" / "sub")

    def fail(*a: Any) -> None:
        raise RuntimeError("orbax exploded")

    monkeypatch.setattr(integ, "_write_orbax", fail)
    with pytest.raises(SaveError, match="RuntimeError: orbax exploded"):
        convert_fastckpt_to_orbax(fck_root, 1, tmp_path / "other")


@pytest.mark.parametrize(
    "value, why", [(1 + 2j, "complex"), (2**70, "int64"), (np.zeros((0, 3)), "zero-size")]
)
def test_convert_to_orbax_refuses_leaves_orbax_cannot_save(
    tmp_path: Path, value: Any, why: str
) -> None:
    fastckpt.save(str(tmp_path / "fck"), 1, {"w": jnp.arange(4.0), "v": value})
    with pytest.raises(ConfigError, match=why):
        convert_fastckpt_to_orbax(str(tmp_path / "fck"), 1, tmp_path / "orbax")
    assert not (tmp_path / "orbax").exists()


# ---------------------------------------------------------------- OrbaxStyleCheckpointManager


@pytest.mark.parametrize("housekeeping", ["delete", "reload"])
def test_manager_delete_and_reload_keep_the_inflight_save(
    tmp_path: Path, housekeeping: str
) -> None:
    from fastckpt.integrations.orbax import OrbaxStyleCheckpointManager

    state = {"w": jnp.ones((256, 1024))}
    with OrbaxStyleCheckpointManager(tmp_path / "r") as m:
        m.save(1, args=ocp.args.StandardSave(state))
        m.wait_until_finished()
        m.save(2, args=ocp.args.StandardSave(state))  # in flight
        m.delete(1) if housekeeping == "delete" else m.reload()
        assert m.latest_step() == 2
        m.wait_until_finished()
        assert m.latest_step() == 2 and not m.should_save(2)
        assert m.all_steps() == ([2] if housekeeping == "delete" else [1, 2])


def test_manager_delete_of_the_inflight_step_deletes_it(tmp_path: Path) -> None:
    from fastckpt.integrations.orbax import OrbaxStyleCheckpointManager

    with OrbaxStyleCheckpointManager(tmp_path / "r") as m:
        m.save(1, {"w": jnp.ones(4)})
        m.wait_until_finished()
        m.save(2, {"w": jnp.ones(4)})
        m.delete(2)
        assert m.all_steps() == [1] and m.latest_step() == 1


class _FailStep2(MemoryStore):
    """A memory store whose writes under step 2 fail."""

    async def put(self, key: str, data: Any, *, mode: str = "overwrite") -> Any:
        if "000000000002" in key:
            raise StorageError(f"simulated outage writing {key}")
        return await super().put(key, data, mode=mode)  # type: ignore[arg-type]


@pytest.mark.parametrize("surfaced_by", ["save", "wait_until_finished"])
def test_manager_never_reports_a_failed_save(surfaced_by: str) -> None:
    from fastckpt.integrations.orbax import OrbaxStyleCheckpointManager

    state = {"w": jnp.ones(4)}
    with OrbaxStyleCheckpointManager(_FailStep2()) as m:
        m.save(1, args=ocp.args.StandardSave(state))
        m.wait_until_finished()
        m.save(2, args=ocp.args.StandardSave(state))  # its background write fails
        with pytest.raises(FastckptError, match="simulated outage"):
            m.save(
                3, args=ocp.args.StandardSave(state)
            ) if surfaced_by == "save" else m.wait_until_finished()
        m.wait_until_finished()
        assert m.fastckpt_manager.all_steps() == [1]
        assert m.latest_step() == 1 and m.all_steps() == [1]
        assert m.should_save(2)
        assert m.restore(m.latest_step())["w"].sum() == 4
