"""The replication window, simulated over real tiers: whichever host dies at whatever point
of a RAM step's pushes, the survivors still hold one complete committed step.

Each of ``n`` hosts has a replicated RamTier (keep_steps=1). Per RAM step every host seals
its own chunk and commits the step (the manifest exchange is collective), then the ring
pushes happen in an arbitrary interleaving (each: the chunk, then the manifest, on the
successor); a push finishes before the next RAM step starts (the condition the retention
rule documents). At an arbitrary point after the first step was replicated (before that,
no step can be complete without the lost host), one host dies. A step is restorable when every
host's chunk of it is held by a survivor, and the survivors must have one.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fastckpt.replicas._ram import RamTier

from .conftest import fill, seal_chunks


def _complete_steps(tiers: dict[int, RamTier], hosts: int) -> list[int]:
    steps = set().union(*(t.committed_steps() for t in tiers.values()))
    need = {f"h{h}" for h in range(hosts)}
    return sorted(s for s in steps if need <= {c for t in tiers.values() for c in t.chunk_ids(s)})


@settings(max_examples=40, deadline=None)
@given(
    hosts=st.integers(2, 5),
    ram_steps=st.integers(1, 4),
    victim=st.integers(0, 4),
    data=st.data(),
)
def test_survivors_hold_a_complete_step_wherever_a_host_dies(
    hosts: int, ram_steps: int, victim: int, data: st.DataObject
) -> None:
    victim %= hosts
    # Events of the whole run; the host dies right before event number `death`. Everything
    # is drawn before any tier exists (a draw may abort the example).
    events: list[tuple[str, int, int]] = []
    for k in range(ram_steps):
        step = 10 * (k + 1)
        events += [("commit", step, h) for h in range(hosts)]
        events += data.draw(
            st.permutations([("push", step, h) for h in range(hosts)]), label=f"pushes of {step}"
        )
    death = data.draw(
        st.integers(2 * hosts, len(events)), label="death"
    )  # once the first step is replicated
    root = Path("/dev/shm") / f"fastckpt-window-{uuid.uuid4().hex[:12]}"
    tiers: dict[int, RamTier] = {}
    try:
        for h in range(hosts):
            tiers[h] = RamTier(root / f"h{h}", budget_bytes=1 << 20, keep_steps=1, replicated=True)
        for kind, step, h in events[:death]:
            if kind == "commit":
                seal_chunks(tiers[h], step, {f"h{h}": fill(step, {"x": 64}, seed=h)["x"]})
                tiers[h].put_manifest(step, b"m")
            else:
                chunk = bytes(tiers[h].get_chunk(step, f"h{h}"))  # type: ignore[arg-type]
                successor = tiers[(h + 1) % hosts]
                seal_chunks(successor, step, {f"h{h}": np.frombuffer(chunk, np.uint8)})
                successor.put_manifest(step, b"m")
        survivors = {h: t for h, t in tiers.items() if h != victim}
        complete = _complete_steps(survivors, hosts)
        assert complete, (death, events[:death], {h: t.steps() for h, t in survivors.items()})
        # Nothing older than the previous RAM step is held: the bound is keep_steps + 1.
        assert all(len(t.committed_steps()) <= 2 for t in tiers.values())
    finally:
        for t in tiers.values():
            t.close()
        shutil.rmtree(root, ignore_errors=True)
