"""The start-up check that every host reaches the peers it pushes RAM steps to (internal)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from fastckpt.coordination.distributed import Coordinator, time_left
from fastckpt.errors import PeerError, PeersUnreachableError
from fastckpt.replicas.client import PeerClient

__all__ = ["check_push_targets"]

_MAX_PROBES = 32
_SHOWN = 8


def check_push_targets(coord: Coordinator, *, key: str, me: str, clients: Mapping[str, PeerClient],
                       targets: Sequence[str], timeout_s: float) -> None:
    """Fail the job's start on every process, loudly, when any host cannot reach (or
    authenticate to) a peer it pushes to: otherwise its RAM steps would silently lack their
    replicas, and a lost host would be restored from storage, an older step.

    Every process (SPMD; ``key`` the same on all) connects to its ``targets`` (a handshake
    and one request each, all at once, bounded by the peer timeouts) and reports to process
    0, which publishes the job's verdict: O(processes) key-value operations in all.

    Raises:
        PeersUnreachableError: some host could not reach a peer; every process raises it,
            naming the members and addresses (``me`` describes this host).
        BarrierTimeoutError: a process did not report within ``timeout_s``.
    """

    def probe(member: str) -> str | None:
        client = clients[member]
        try:
            client.step_lists()
        except PeerError as e:
            return f"{me} cannot reach {member} at {client.address[0]}:{client.address[1]}: {e}"
        return None

    known = [t for t in targets if t in clients]
    with ThreadPoolExecutor(max(1, min(_MAX_PROBES, len(known))), thread_name_prefix="fastckpt-probe") as pool:
        problems = [p for p in pool.map(probe, known) if p is not None]
    problems += [f"{me} found no published address of its peer {t}" for t in targets if t not in clients]
    coord.set(f"{key}/{coord.process_index}", json.dumps(problems))
    if coord.process_index == 0:
        deadline = time.monotonic() + timeout_s
        found = [p for i in range(coord.process_count)
                 for p in json.loads(coord.get(f"{key}/{i}", timeout_s=time_left(deadline)))]
        coord.set(f"{key}/verdict", json.dumps(found))
    found = json.loads(coord.get(f"{key}/verdict", timeout_s=timeout_s))
    if found:
        more = f" (and {len(found) - _SHOWN} more)" if len(found) > _SHOWN else ""
        raise PeersUnreachableError(
            "RAM replicas cannot work: hosts cannot reach the peers they replicate to: "
            + "; ".join(found[:_SHOWN]) + more + ". Check RamOptions.host (default: this host's address on the "
            "route to the jax.distributed coordinator), firewalls between the hosts, and that every process "
            "has the same secret")
