"""FSDP layout of the example model: which parameter dimensions go over ``"data"``."""

from __future__ import annotations

import math

import jax
import pytest
from jax.sharding import PartitionSpec as P

from fastckpt_examples.data import DataConfig
from fastckpt_examples.model import PRESETS, param_shapes, param_specs
from fastckpt_examples.trainer import TrainConfig, TrainProgram, make_mesh


def _pairs(preset: str, data_axis: int) -> list[tuple[P, tuple[int, ...]]]:
    return [(spec, shape) for spec, shape, _ in _triples(preset, data_axis)]


def _triples(preset: str, data_axis: int) -> list[tuple[P, tuple[int, ...], bool]]:
    """``(spec, shape, stacked)`` per parameter; ``stacked``: under ``"layers"`` (dim 0 = layer)."""
    cfg = PRESETS[preset]
    specs, shapes = param_specs(cfg, data_axis=data_axis), param_shapes(cfg)
    out = []
    for name in specs:
        leaves = jax.tree.leaves(specs[name], is_leaf=lambda x: isinstance(x, P))
        out += [
            (spec, s.shape, name == "layers")
            for spec, s in zip(leaves, jax.tree.leaves(shapes[name]), strict=True)
        ]
    return out


@pytest.mark.parametrize("data_axis", [2, 3, 4, 6])
def test_bench_preset_is_sharded_over_every_data_axis_size(data_axis: int) -> None:
    """Each host of a 2..6-host job holds only its share of every parameter (so restores
    and checkpoints per host shrink with the host count); the Megatron split is kept."""
    for (spec, shape), (base, _) in zip(
        _pairs("bench", data_axis), _pairs("bench", 1), strict=True
    ):
        assert spec.count("data") == 1, (spec, shape)
        assert shape[spec.index("data")] % data_axis == 0
        assert all(a == b or (b is None and a == "data") for a, b in zip(spec, base, strict=True))


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("data_axis", [2, 3, 4, 5, 8])
def test_data_goes_on_the_largest_dividing_dimension_or_nowhere(
    preset: str, data_axis: int
) -> None:
    for (spec, shape, stacked), (base, _) in zip(
        _triples(preset, data_axis), _pairs(preset, 1), strict=True
    ):
        free = [
            i
            for i in range(int(stacked), len(shape))
            if base[i] is None and shape[i] % data_axis == 0
        ]
        if not free:
            assert spec == base
        else:
            assert spec.count("data") == 1 and shape[spec.index("data")] == max(
                shape[i] for i in free
            )


def test_dimensions_that_do_not_divide_stay_replicated() -> None:
    # tiny: d_model 64, vocab 256, d_ff 256: none divides by 3 (only wqkv's q/k/v axis does).
    assert [shape for spec, shape in _pairs("tiny", 3) if "data" in spec] == [(2, 64, 3, 4, 16)]
    sharded = [shape for spec, shape in _pairs("tiny", 4) if "data" in spec]
    assert len(sharded) == len(_pairs("tiny", 4)) and all(math.prod(s) % 4 == 0 for s in sharded)


@pytest.mark.usefixtures("eight_devices")
def test_fsdp_state_is_split_across_data_shards() -> None:
    cfg = TrainConfig(model=PRESETS["tiny"], data=DataConfig(global_batch=24), model_axis=2)
    prog = TrainProgram(cfg, make_mesh(jax.devices()[:8], model_axis=2))
    mu = prog.abstract_state["opt_state"][1][0].mu["layers"]["w1"]
    shard = mu.sharding.shard_shape(mu.shape)
    assert math.prod(shard) * 8 == math.prod(mu.shape)  # 4 data x 2 model shards, no replica
    off = TrainProgram(
        TrainConfig(
            model=PRESETS["tiny"], data=DataConfig(global_batch=24), model_axis=2, fsdp=False
        ),
        make_mesh(jax.devices()[:8], model_axis=2),
    )
    mu = off.abstract_state["opt_state"][1][0].mu["layers"]["w1"]
    assert math.prod(mu.sharding.shard_shape(mu.shape)) * 2 == math.prod(mu.shape)
