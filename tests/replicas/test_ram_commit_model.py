"""A RAM tier's steps, commits (manifests and commit records) and retention against a model,
through random sequences of seals, commits, drops and reopens (hypothesis state machine)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from fastckpt.errors import StaleStepError
from fastckpt.replicas._ram import RamTier

from .conftest import fill, seal_chunks, verified_chunk

STEPS = st.integers(1, 8)


class TierModel(RuleBasedStateMachine):
    """The model: which steps the tier holds, which are committed, which hold a manifest.
    Retention after each commit (and at reopen): steps older than the ``held``-th newest
    committed one are dropped; data for a step older than that floor is refused."""

    def __init__(self) -> None:
        super().__init__()
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        self.dir = Path(tempfile.mkdtemp(prefix="fastckpt-model-", dir=base))
        self.kw: dict[str, object] = {}
        self.tier: RamTier | None = None
        self.steps: set[int] = set()
        self.committed: set[int] = set()
        self.manifests: dict[int, bytes] = {}
        self.held = 0

    @precondition(lambda self: self.tier is None)
    @rule(keep=st.integers(1, 2), replicated=st.booleans())
    def open(self, keep: int, replicated: bool) -> None:
        self.kw = {"keep_steps": keep, "replicated": replicated}
        self.held = keep + replicated
        self.tier = RamTier(self.dir / "t", budget_bytes=64 << 20, **self.kw)  # type: ignore[arg-type]

    def _floor(self) -> int | None:
        c = sorted(self.committed)
        return c[-self.held] if len(c) >= self.held else None

    def _retain(self) -> None:
        floor = self._floor()
        if floor is not None:
            for s in [s for s in self.steps if s < floor]:
                self.steps.discard(s)
                self.committed.discard(s)
                self.manifests.pop(s, None)

    def _stale(self, step: int) -> bool:
        floor = self._floor()
        return floor is not None and step < floor

    @precondition(lambda self: self.tier is not None)
    @rule(step=STEPS)
    def seal(self, step: int) -> None:
        assert self.tier is not None
        if self._stale(step):
            with pytest.raises(StaleStepError):
                seal_chunks(self.tier, step, fill(step, {f"c{step}": 64}))
            return
        if step in self.steps and f"c{step}" in self.tier.chunk_ids(step):
            return  # one chunk per step in this model
        seal_chunks(self.tier, step, fill(step, {f"c{step}": 64}))
        self.steps.add(step)

    @precondition(lambda self: self.tier is not None)
    @rule(step=STEPS, manifest=st.booleans())
    def commit(self, step: int, manifest: bool) -> None:
        assert self.tier is not None
        if self._stale(step):
            with pytest.raises(StaleStepError):
                self.tier.put_manifest(step, b"m") if manifest else self.tier.mark_committed(step)
            return
        if manifest:
            data = b'{"step": %d}' % step
            self.tier.put_manifest(step, data)
            self.manifests[step] = data
        else:
            self.tier.mark_committed(step)
        self.steps.add(step)
        self.committed.add(step)
        self._retain()

    @precondition(lambda self: self.tier is not None)
    @rule(step=STEPS)
    def drop(self, step: int) -> None:
        assert self.tier is not None
        self.tier.drop_step(step)
        self.steps.discard(step)
        self.committed.discard(step)
        self.manifests.pop(step, None)

    @precondition(lambda self: self.tier is not None)
    @rule()
    def reopen(self) -> None:
        assert self.tier is not None
        self.tier.close()
        self.tier = RamTier(self.dir / "t", budget_bytes=64 << 20, **self.kw)  # type: ignore[arg-type]
        self._retain()

    @invariant()
    def matches(self) -> None:
        if self.tier is None:
            return
        assert self.tier.steps() == sorted(self.steps)
        assert self.tier.committed_steps() == sorted(self.committed)
        assert self.tier.manifest_steps() == sorted(self.manifests)
        for s in self.steps:
            assert self.tier.get_manifest(s) == self.manifests.get(s)
            if f"c{s}" in self.tier.chunk_ids(s):
                got = verified_chunk(self.tier, s, f"c{s}")
                assert got is not None and bytes(got) == fill(s, {f"c{s}": 64})[f"c{s}"].tobytes()

    def teardown(self) -> None:
        if self.tier is not None:
            self.tier.close()
        shutil.rmtree(self.dir, ignore_errors=True)


TestTierModel = TierModel.TestCase
TestTierModel.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
