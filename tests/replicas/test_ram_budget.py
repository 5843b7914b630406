"""The RAM tier's eviction policy (``_shm.room_to_free``) as pure arithmetic: what it frees
to fit a new allocation, property-tested."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fastckpt.errors import RamBudgetError
from fastckpt.replicas._ram import room_to_free

_sizes = st.integers(0, 1000)


@given(
    spare_sizes=st.lists(_sizes, max_size=5),
    step_sizes=st.dictionaries(st.integers(0, 20), _sizes, max_size=6),
    reserved=_sizes,
    extra=st.integers(0, 3000),
    budget=st.integers(0, 6000),
    for_step=st.one_of(st.none(), st.integers(0, 21)),
    keep=st.one_of(st.none(), st.integers(0, 4)),
)
def test_frees_spares_then_the_oldest_older_steps_and_no_more_than_needed(
    spare_sizes: list[int],
    step_sizes: dict[int, int],
    reserved: int,
    extra: int,
    budget: int,
    for_step: int | None,
    keep: int | None,
) -> None:
    spares = {Path(f"spare-{i}"): n for i, n in enumerate(spare_sizes)}
    keep_spare = Path(f"spare-{keep}") if keep is not None else None
    used = reserved + sum(spare_sizes) + sum(step_sizes.values())
    # the order things may go in: spares (not the kept one), then steps older than for_step, oldest
    # first
    order: list[tuple[str, object, int]] = [
        ("spare", p, n) for p, n in spares.items() if p != keep_spare
    ]
    order += [
        ("step", s, step_sizes[s]) for s in sorted(step_sizes) if for_step is None or s < for_step
    ]
    if used + extra - sum(n for *_, n in order) > budget:
        with pytest.raises(RamBudgetError, match="do not fit the RAM tier budget"):
            room_to_free(
                used=used,
                extra=extra,
                budget=budget,
                spares=spares,
                steps=step_sizes,
                for_step=for_step,
                keep_spare=keep_spare,
            )
        return
    free_spares, free_steps = room_to_free(
        used=used,
        extra=extra,
        budget=budget,
        spares=spares,
        steps=step_sizes,
        for_step=for_step,
        keep_spare=keep_spare,
    )
    freed = [("spare", p, spares[p]) for p in free_spares] + [
        ("step", s, step_sizes[s]) for s in free_steps
    ]
    assert (
        freed == order[: len(freed)]
    )  # a prefix of that order: never the kept spare, never a newer step
    assert used - sum(n for *_, n in freed) + extra <= budget  # it fits afterwards
    if freed:  # and the shortest such prefix: without its last item it would not
        assert used - sum(n for *_, n in freed[:-1]) + extra > budget


def test_nothing_is_freed_when_the_allocation_fits() -> None:
    assert room_to_free(
        used=10, extra=5, budget=15, spares={Path("a"): 10}, steps={1: 10}, for_step=None
    ) == ([], [])
    assert room_to_free(
        used=10, extra=6, budget=15, spares={Path("a"): 10}, steps={1: 10}, for_step=None
    ) == ([Path("a")], [])
    assert room_to_free(
        used=20, extra=6, budget=15, spares={}, steps={1: 10, 0: 10}, for_step=2
    ) == ([], [0, 1])
    with pytest.raises(RamBudgetError):  # step 2 is not older than the step being allocated
        room_to_free(used=20, extra=6, budget=15, spares={}, steps={2: 10, 0: 10}, for_step=2)
