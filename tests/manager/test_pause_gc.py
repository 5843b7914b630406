"""ManagerOptions.pause_gc: the cyclic collector is off during save()'s blocking part and
during a restore, and back on afterwards (only if it was on)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any, ClassVar

import jax
import numpy as np
import pytest

import fastckpt
from fastckpt._pygc import paused_gc


@pytest.fixture(autouse=True)
def gc_enabled() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


class Probe:
    """A pytree node whose flattening records whether the collector was enabled: save()
    and restore() flatten the state / target in the part the option covers."""

    seen: ClassVar[list[bool]] = []

    def __init__(self, x: Any) -> None:
        self.x = x


jax.tree_util.register_pytree_node(
    Probe,
    lambda p: Probe.seen.append(gc.isenabled()) or ((p.x,), None),  # type: ignore[func-returns-value]
    lambda _, children: Probe(children[0]),
)


def test_paused_gc_restores_the_switch() -> None:
    with paused_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
    with paused_gc(False):
        assert gc.isenabled()
    with pytest.raises(RuntimeError), paused_gc():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_paused_gc_leaves_a_disabled_collector_alone() -> None:
    gc.disable()
    with paused_gc():
        assert not gc.isenabled()
    assert not gc.isenabled()  # not switched on by the block


@pytest.mark.parametrize("pause", [True, False])
def test_manager_pauses_gc_while_saving_and_restoring(pause: bool) -> None:
    x = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8))
    options = fastckpt.ManagerOptions(pause_gc=pause)
    with fastckpt.CheckpointManager(f"mem://pause-gc-{pause}", options=options) as mgr:
        Probe.seen.clear()
        assert mgr.save(0, {"p": Probe(x)})
        assert Probe.seen and all(seen is not pause for seen in Probe.seen)
        assert gc.isenabled()
        mgr.wait()
        Probe.seen.clear()
        restored = mgr.restore(0, target={"p": Probe(jax.ShapeDtypeStruct(x.shape, x.dtype))})
        assert Probe.seen and all(seen is not pause for seen in Probe.seen)
        assert gc.isenabled()
    np.testing.assert_array_equal(np.asarray(restored["p"].x), np.asarray(x))


def test_manager_keeps_a_disabled_collector_disabled() -> None:
    gc.disable()
    x = jax.device_put(np.ones((4, 4), np.float32))
    with fastckpt.CheckpointManager("mem://pause-gc-off") as mgr:
        mgr.save(0, {"x": x})
        mgr.wait()
        mgr.restore(0, target={"x": jax.ShapeDtypeStruct(x.shape, x.dtype)})
    assert not gc.isenabled()
