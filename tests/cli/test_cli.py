"""The ``fastckpt`` CLI on real files: via ``main(argv)`` and as a subprocess."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fastckpt
from fastckpt.cli import main
from fastckpt.format.codec import decode_manifest
from fastckpt.format.manifest import ArrayLeaf

_STEPS_DIR = "steps"


def _state(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "params": {
            "w": jnp.asarray(rng.standard_normal((256, 64), dtype=np.float32)),
            "b": jnp.zeros((64,), jnp.bfloat16),
        },
        "key": jax.random.key(seed),
        "count": np.arange(10, dtype=np.int32),
        "step": seed,
        "name": "run",
    }


def _leftover(root: Path, step: int, name: str, size: int = 100) -> Path:
    p = root / _STEPS_DIR / f"{step:012d}" / "deadbeef0000" / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"x" * size)
    return p


@pytest.fixture(scope="module")
def saved_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli") / "root"
    for step in (1, 2, 3):
        fastckpt.save(str(root), step, _state(step), metadata={"loader": step * 10})
    return root


@pytest.fixture
def root(saved_root: Path, tmp_path: Path) -> Path:
    """A private copy with an uncommitted step (4) and an unreferenced object under step 1."""
    dst = tmp_path / "root"
    shutil.copytree(saved_root, dst)
    _leftover(dst, 4, "p00000-00000.fck", 300)
    _leftover(dst, 1, "p00000.fragment", 50)
    return dst


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> Any:
    rc, out, err = _run([*argv, "--json"], capsys)
    assert rc == 0, err
    return json.loads(out)


def _first_chunk(root: Path, step: int) -> tuple[ArrayLeaf, Any]:
    m = decode_manifest((root / "manifests" / f"{step:012d}.json").read_bytes())
    leaf = next(a for a in m.arrays() if a.path == (("d", "params"), ("d", "w")))
    return leaf, leaf.chunks[0]


def test_ls(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(["ls", str(root)], capsys)
    assert rc == 0
    lines = out.splitlines()
    assert any(line.split()[:2] == ["3", "committed"] for line in lines)
    assert any(line.split()[:2] == ["4", "uncommitted"] for line in lines)
    assert "+1 unreferenced object" in out and "KiB" in out
    doc = _json(["ls", str(root)], capsys)
    by_step = {(r["step"], r["state"]): r for r in doc["steps"]}
    assert set(by_step) == {
        (1, "committed"),
        (2, "committed"),
        (3, "committed"),
        (4, "uncommitted"),
    }
    assert (
        by_step[(4, "uncommitted")]["objects"] == 1
        and by_step[(4, "uncommitted")]["stored_bytes"] == 300
    )
    c3 = by_step[(3, "committed")]
    assert c3["logical_bytes"] == 256 * 64 * 4 + 64 * 2 + 8 + 40 and 0 < c3["stored_bytes"]
    assert by_step[(1, "committed")]["leftover_objects"] == 1


def test_inspect(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(["inspect", str(root)], capsys)
    assert rc == 0
    assert (
        "step 3" in out
        and "['params']['w']" in out
        and "(256, 64)" in out
        and "key<threefry2x32>" in out
    )
    assert "bfloat16" in out and "ratio" in out and '"loader": 30' in out
    doc = _json(["inspect", str(root), "2"], capsys)
    assert doc["step"] == 2 and doc["metadata"] == {"loader": 20}
    leaves = {leaf["path"]: leaf for leaf in doc["leaves"]}
    w = leaves["['params']['w']"]
    assert (
        w["shape"] == [256, 64] and w["dtype"] == "float32" and w["logical_bytes"] == 256 * 64 * 4
    )
    assert 0 < w["ratio"] <= 1.0 and w["chunks"] >= 1
    assert leaves["['key']"]["kind"] == "prng_key" and leaves["['step']"]["value"] == 2
    rc, _, err = _run(["inspect", str(root), "9"], capsys)
    assert rc == 1 and "step 9 is not committed" in err


def test_verify_ok(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(["verify", str(root), "--no-progress"], capsys)
    assert rc == 0 and out.startswith("step 3:") and out.rstrip().endswith("OK")
    doc = _json(["verify", str(root), "--all"], capsys)
    assert doc["ok"] and [s["step"] for s in doc["steps"]] == [1, 2, 3]


def test_verify_names_the_damaged_chunk(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _leaf, chunk = _first_chunk(root, 2)
    obj = root / chunk.key
    data = bytearray(obj.read_bytes())
    data[chunk.offset + chunk.length // 2] ^= 0x40  # one flipped bit
    obj.write_bytes(bytes(data))
    rc, out, _ = _run(["verify", str(root), "2"], capsys)
    assert rc == 1
    assert (
        "DAMAGED" in out
        and "['params']['w']" in out
        and chunk.key in out
        and "crc32c mismatch" in out
    )
    rc, out, _ = _run(["verify", str(root), "3"], capsys)
    assert rc == 0  # other steps are intact
    doc = json.loads(_run(["verify", str(root), "--all", "--json"], capsys)[1])
    assert not doc["ok"] and [s["ok"] for s in doc["steps"]] == [True, False, True]
    (damaged,) = [d for s in doc["steps"] for d in s["damaged"]]
    assert damaged["array"] == "['params']['w']" and damaged["key"] == chunk.key
    os.remove(root / _first_chunk(root, 1)[1].key)
    rc, out, _ = _run(["verify", str(root), "1"], capsys)
    assert rc == 1 and "object missing" in out


def test_gc(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fresh = root / _STEPS_DIR / f"{4:012d}" / "deadbeef0000" / "p00000-00000.fck"
    unref = root / _STEPS_DIR / f"{1:012d}" / "deadbeef0000" / "p00000.fragment"
    doc = _json(["gc", str(root), "--dry-run"], capsys)
    assert [lo["key"] for lo in doc["removed"]] == [str(unref.relative_to(root))]
    assert [lo["key"] for lo in doc["kept"]] == [
        str(fresh.relative_to(root))
    ]  # young: may be in flight
    assert unref.exists() and fresh.exists()
    rc, out, _ = _run(["gc", str(root)], capsys)
    assert rc == 0 and "removed" in out and not unref.exists() and fresh.exists()
    old = time.time() - 7200
    os.utime(fresh, (old, old))
    rc, out, _ = _run(["gc", str(root), "--grace", "1h"], capsys)
    assert rc == 0 and not fresh.exists() and not fresh.parent.exists()
    doc = _json(["gc", str(root), "--keep-last", "1", "--dry-run"], capsys)
    assert doc["retention_steps"] == [1, 2] and (root / "manifests" / f"{1:012d}.json").exists()
    rc, _, _ = _run(["gc", str(root), "--keep-last", "1"], capsys)
    assert rc == 0
    assert [r["step"] for r in _json(["ls", str(root)], capsys)["steps"]] == [3]
    rc, out, _ = _run(["verify", str(root)], capsys)
    assert rc == 0


@pytest.mark.parametrize(
    "argv, code",
    [
        ([], 2),
        (["frobnicate"], 2),
        (["inspect", "/tmp", "notastep"], 2),
        (["ls", "/tmp", "--bogus"], 2),
        (["ls", "s3://bucket/x"], 2),
        (["gc", "/tmp", "--grace", "soon"], 2),
        (["gc", "/tmp", "--keep-every", "10"], 2),
        (["ls", "/definitely/not/here"], 1),
        (["--help"], 0),
    ],
)
def test_exit_codes(argv: list[str], code: int, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == code


def test_subprocess_entry_points(root: Path) -> None:
    """``python -m fastckpt`` and the ``fastckpt`` console script, with real exit codes."""
    r = subprocess.run(
        [sys.executable, "-m", "fastckpt", "ls", str(root), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert {s["step"] for s in json.loads(r.stdout)["steps"]} == {1, 2, 3, 4}
    _, chunk = _first_chunk(root, 3)
    with open(root / chunk.key, "r+b") as f:
        f.seek(chunk.offset)
        f.write(b"\0\0\0\0")
    script = shutil.which("fastckpt", path=os.path.dirname(sys.executable)) or shutil.which(
        "fastckpt"
    )
    assert script, "the fastckpt console script is not installed"
    r = subprocess.run([script, "verify", str(root)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "DAMAGED" in r.stdout, r.stdout + r.stderr


def test_gcs_root_from_env_and_flag(
    gcs_emulator: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from fastckpt.storage import open_store

    url = f"gs://fastckpt-test/cli-{os.getpid()}-{time.monotonic_ns()}"
    fastckpt.save(open_store(url, gcs_endpoint=gcs_emulator.endpoint), 7, _state(7))
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.endpoint)
    assert [s["step"] for s in _json(["ls", url], capsys)["steps"]] == [7]
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")
    rc, out, err = _run(["verify", url, "--gcs-endpoint", gcs_emulator.endpoint], capsys)
    assert rc == 0 and "OK" in out, err


def test_convert_both_ways(
    saved_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ocp = pytest.importorskip("orbax.checkpoint")
    from fastckpt.integrations.orbax import restore_orbax

    rc, out, err = _run(
        ["convert", str(saved_root), str(tmp_path / "orbax"), "--step", "2"], capsys
    )
    assert rc == 0, err
    back = restore_orbax(tmp_path / "orbax")
    assert (
        np.asarray(back["params"]["w"]).tobytes() == np.asarray(_state(2)["params"]["w"]).tobytes()
    )
    state = {"w": jnp.arange(12.0).reshape(3, 4), "n": 5}
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "std" / "40", state)
    rc, out, err = _run(["convert", str(tmp_path / "std" / "40"), str(tmp_path / "fck")], capsys)
    assert rc == 0, err
    assert "fastckpt step 40" in out
    assert fastckpt.restore(str(tmp_path / "fck"))["n"] == 5
    rc, _, err = _run(["convert", str(tmp_path / "empty"), str(tmp_path / "x")], capsys)
    assert rc == 1 and "neither" in err


def test_no_bench_verb_and_demo(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench"]) == 2  # gone: it only worked from a source checkout
    assert "invalid choice: 'bench'" in capsys.readouterr().err
    calls: list[list[str]] = []
    fake = types.ModuleType("fastckpt_examples.demo")
    fake.main = lambda argv: calls.append(argv) or 4  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fastckpt_examples.demo", fake)
    assert main(["demo", "--hosts", "2", "-h"]) == 4
    assert calls == [["--hosts", "2", "-h"]]


def test_convert_orbax_checkpoint_on_gcs(
    gcs_emulator: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An Orbax checkpoint in a bucket (read by tensorstore's gcs driver) -> fastckpt, via the
    CLI."""
    import asyncio

    ocp = pytest.importorskip("orbax.checkpoint")
    from fastckpt.storage import GcsOptions, GcsStore

    state = {"w": jnp.arange(24.0).reshape(4, 6), "n": 9}
    with ocp.CheckpointManager(tmp_path / "orbax") as mngr:
        mngr.save(12, args=ocp.args.StandardSave(state))
        mngr.wait_until_finished()
    prefix = f"cli-orbax-{os.getpid()}-{time.monotonic_ns()}"
    store = GcsStore("fastckpt-test", prefix, options=GcsOptions(endpoint=gcs_emulator.endpoint))

    async def upload() -> None:
        for p in (tmp_path / "orbax").rglob("*"):
            if p.is_file():
                await store.put(str(p.relative_to(tmp_path / "orbax")), p.read_bytes())
        await store.close()

    asyncio.run(upload())
    env = dict(os.environ, STORAGE_EMULATOR_HOST=gcs_emulator.endpoint)
    env.pop("TENSORSTORE_GCS_HTTP_URL", None)  # the CLI derives it from the emulator host
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "fastckpt",
            "convert",
            f"gs://fastckpt-test/{prefix}",
            f"gs://fastckpt-test/{prefix}-fck",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "fastckpt step 12" in r.stdout
    doc = _json(
        ["inspect", f"gs://fastckpt-test/{prefix}-fck", "--gcs-endpoint", gcs_emulator.endpoint],
        capsys,
    )
    assert doc["step"] == 12 and {leaf["path"] for leaf in doc["leaves"]} == {"['w']", "['n']"}


def test_convert_failures_are_one_line_errors(
    saved_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Orbax/OS failures of ``convert`` exit 1 with one typed line, never a traceback."""
    ocp = pytest.importorskip("orbax.checkpoint")
    src = str(saved_root)
    assert _run(["convert", src, str(tmp_path / "mgr"), "--step", "1"], capsys)[0] == 0
    assert (
        _run(["convert", src, str(tmp_path / "item"), "--step", "1", "--layout", "item"], capsys)[0]
        == 0
    )
    (tmp_path / "afile").write_text("x")
    with ocp.CheckpointManager(tmp_path / "orbax") as mngr:
        mngr.save(5, args=ocp.args.StandardSave({"w": jnp.arange(4.0)}))
        mngr.wait_until_finished()
    (tmp_path / "orbax" / "5" / "default" / "_sharding").write_text("[]")
    cases = [
        (["convert", src, str(tmp_path / "mgr"), "--step", "1"], "StepAlreadyCommittedError"),
        (["convert", src, str(tmp_path / "item"), "--layout", "item"], "AlreadyExistsError"),
        (["convert", src, str(tmp_path / "afile" / "sub")], "StorageError"),
        (["convert", src, str(tmp_path / "afile"), "--layout", "item"], "AlreadyExistsError"),
        (
            ["convert", str(tmp_path / "orbax"), str(tmp_path / "back")],
            "ManifestError: .*_sharding",
        ),
    ]
    for argv, expected in cases:
        rc, _, err = _run(argv, capsys)
        assert rc == 1, (argv, err)
        assert len(err.strip().splitlines()) == 1 and re.match(
            f"fastckpt convert: {expected}", err
        ), (argv, err)


class _ClosedPipe:
    """A stdout whose reader went away."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_broken_pipe_exits_quietly(
    saved_root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    assert main(["inspect", str(saved_root)]) == 141
    assert capsys.readouterr().err == ""


def test_broken_pipe_subprocess(tmp_path: Path) -> None:
    """``fastckpt inspect BIG | head -1``: no traceback, the shell's SIGPIPE status."""
    fastckpt.save(
        str(tmp_path / "big"),
        1,
        {f"leaf{i:05d}": np.full((2,), i, np.float32) for i in range(3000)},
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastckpt", "inspect", str(tmp_path / "big")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline()
    proc.stdout.close()  # like `head -1` exiting
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
