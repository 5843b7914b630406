"""A deterministic synthetic token stream, indexed by sample and independent of host count.

Contract:

* Sample ``i`` of stream ``seed`` is a pure function of ``(seed, i)``: a walk of
  ``seq_len + 1`` tokens through a fixed sparse Markov chain (each token has ``branching``
  possible successors, drawn once from ``seed``). A model can learn it: the loss falls from
  ``log(vocab_size)`` towards ``log(branching)``.
* The global batch at data position ``pos`` is samples ``[pos, pos + global_batch)``.
  Training consumes ``global_batch`` samples per step (``pos = step * global_batch``), so
  the batch of a step is a pure function of ``(seed, step)`` whatever the mesh.
* :meth:`SyntheticData.device_batch` builds the sharded global batch with
  ``jax.make_array_from_callback``: each process generates only the rows its addressable
  devices hold, so no host ever materialises the whole batch.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Sharding

from fastckpt.errors import ConfigError

__all__ = ["DataConfig", "SyntheticData"]

_TABLE_STREAM = 0x7AB1E
_SAMPLE_STREAM = 0x5A3B1E


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """The synthetic stream and how much of it one step consumes."""

    seed: int = 0
    """Stream identity; two streams with different seeds share nothing."""
    global_batch: int = 24
    """Sequences per step, fixed whatever the mesh; must divide by every data-axis size used
    (24 covers 1, 2, 3, 4, 6, 8 and 12)."""
    branching: int = 4
    """Successors per token in the Markov chain (the entropy floor is ``log(branching)``)."""

    def __post_init__(self) -> None:
        if self.global_batch <= 0:
            raise ConfigError(f"global_batch must be > 0, got {self.global_batch}")
        if self.branching <= 0:
            raise ConfigError(f"branching must be > 0, got {self.branching}")


class SyntheticData:
    """The token stream for one ``(DataConfig, vocab_size, seq_len)``; cheap to build."""

    def __init__(self, cfg: DataConfig, *, vocab_size: int, seq_len: int) -> None:
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        table_rng = np.random.default_rng([cfg.seed, _TABLE_STREAM])
        self._successors = table_rng.integers(
            0, vocab_size, size=(vocab_size, cfg.branching), dtype=np.int32
        )

    @property
    def shape(self) -> tuple[int, int]:
        """Global batch shape ``(global_batch, seq_len + 1)``."""
        return (self.cfg.global_batch, self.seq_len + 1)

    def samples(self, start: int, stop: int) -> np.ndarray:
        """Samples ``[start, stop)`` as an int32 array ``[stop - start, seq_len + 1]``."""
        n = stop - start
        if start < 0 or n < 0:
            raise ValueError(f"bad sample range [{start}, {stop})")
        first = np.empty(n, np.int32)
        choices = np.empty((n, self.seq_len), np.int32)
        for row, index in enumerate(range(start, stop)):
            rng = np.random.default_rng([self.cfg.seed, _SAMPLE_STREAM, index])
            first[row] = rng.integers(0, self.vocab_size)
            choices[row] = rng.integers(0, self.cfg.branching, size=self.seq_len)
        out = np.empty((n, self.seq_len + 1), np.int32)
        out[:, 0] = first
        for t in range(self.seq_len):
            out[:, t + 1] = self._successors[out[:, t], choices[:, t]]
        return out

    def host_batch(self, pos: int) -> np.ndarray:
        """The whole global batch at data position ``pos`` on the host (tests, references)."""
        return self.samples(pos, pos + self.cfg.global_batch)

    def device_batch(self, pos: int, sharding: Sharding) -> jax.Array:
        """The global batch at data position ``pos`` as a ``jax.Array`` laid out by ``sharding``.

        Every process calls this with the same arguments; each generates only the rows of its
        addressable shards (once per distinct row range, however many devices hold it).
        """
        cache: dict[tuple[int, int], np.ndarray] = {}

        def rows(index: tuple[slice, ...] | None) -> np.ndarray:
            row_slice, col_slice = (tuple(index or ()) + (slice(None),) * 2)[:2]
            lo, hi, _ = row_slice.indices(self.cfg.global_batch)
            if (lo, hi) not in cache:
                cache[(lo, hi)] = self.samples(pos + lo, pos + hi)
            return cache[(lo, hi)][:, col_slice]

        return jax.make_array_from_callback(self.shape, sharding, rows)
