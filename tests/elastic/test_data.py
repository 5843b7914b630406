"""The synthetic pipeline: each step's global batch is a pure function of (seed, step),
identical whatever the mesh, and each process generates only its own rows."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fastckpt.errors import ConfigError
from fastckpt_examples.data import DataConfig, SyntheticData
from fastckpt_examples.trainer import make_mesh

pytestmark = pytest.mark.usefixtures("eight_devices")


def _data(seed: int = 0, global_batch: int = 24) -> SyntheticData:
    return SyntheticData(
        DataConfig(seed=seed, global_batch=global_batch), vocab_size=64, seq_len=16
    )


@pytest.mark.parametrize(
    ("n_devices", "model_axis"), [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (6, 2), (8, 1), (8, 2)]
)
def test_global_batch_identical_on_every_mesh(n_devices: int, model_axis: int) -> None:
    data = _data()
    mesh = make_mesh(jax.devices()[:n_devices], model_axis=model_axis)
    sharding = NamedSharding(mesh, P("data", None))
    for step in (0, 1, 7):
        pos = step * data.cfg.global_batch
        arr = data.device_batch(pos, sharding)
        assert arr.sharding == sharding
        np.testing.assert_array_equal(np.asarray(arr), _data().host_batch(pos))


def test_batches_are_pure_functions_of_seed_and_position() -> None:
    a, b = _data(seed=3), _data(seed=3)
    np.testing.assert_array_equal(a.host_batch(240), b.host_batch(240))
    # a sample does not depend on the range it is generated in
    np.testing.assert_array_equal(a.samples(245, 250), a.host_batch(240)[5:10])
    assert not np.array_equal(a.host_batch(0), a.host_batch(24))
    assert not np.array_equal(a.host_batch(0), _data(seed=4).host_batch(0))
    batch = a.host_batch(0)
    assert batch.dtype == np.int32
    assert batch.shape == (24, 17)
    assert batch.min() >= 0
    assert batch.max() < 64


def test_tokens_follow_the_markov_chain() -> None:
    data = _data()
    batch = data.host_batch(0)
    succ = data._successors
    for row in batch:
        for t in range(len(row) - 1):
            assert row[t + 1] in succ[row[t]]


def test_each_row_range_is_generated_once(monkeypatch: pytest.MonkeyPatch) -> None:
    data = _data()
    calls: list[tuple[int, int]] = []
    real = data.samples
    monkeypatch.setattr(data, "samples", lambda lo, hi: calls.append((lo, hi)) or real(lo, hi))
    mesh = make_mesh(jax.devices()[:8], model_axis=2)
    data.device_batch(48, NamedSharding(mesh, P("data", None)))
    assert sorted(calls) == [
        (48, 54),
        (54, 60),
        (60, 66),
        (66, 72),
    ]  # 4 data shards, 2 replicas each


def test_global_batch_must_divide_over_data_axis() -> None:
    from fastckpt_examples.model import PRESETS
    from fastckpt_examples.trainer import TrainConfig, TrainProgram

    cfg = TrainConfig(model=PRESETS["tiny"], data=DataConfig(global_batch=10))
    with pytest.raises(ConfigError, match="does not divide"):
        TrainProgram(cfg, make_mesh(jax.devices()[:8], model_axis=2))
    with pytest.raises(ConfigError):
        DataConfig(global_batch=0)
