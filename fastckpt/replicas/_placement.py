"""Where RAM replicas go (``docs/replicas.md``, "Placement"): pure functions over member ids,
which are content-stable strings (e.g. ``"<host>/<slot>"``), never process indices, each
optionally in a *failure domain* (its host, ``domain_of``). No I/O, no state.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable

from fastckpt.errors import ConfigError

__all__ = ["host_domain", "relay_parent", "replica_holders", "ring_order", "ring_successors"]

DomainOf = Callable[[str], str]


def host_domain(member: str) -> str:
    """The default ``domain_of`` for ``"<host>/<slot>"`` ids: the part before the last ``/``."""
    return member.rsplit("/", 1)[0]


def _members(members: Iterable[str]) -> list[str]:
    out = sorted(set(members))
    if any(not isinstance(m, str) or not m for m in out):
        raise ConfigError("member ids must be non-empty strings")
    return out


def ring_order(members: Iterable[str], *, domain_of: DomainOf | None = None) -> list[str]:
    """The ring: members dealt round-robin across their sorted domains (``h0/0, h1/0, h2/0,
    h0/1, ...``: with equally sized domains a member's next ``k`` neighbours lie in ``k``
    distinct other domains, ``k`` < the number of domains); without ``domain_of`` the sorted
    members. Input order is irrelevant."""
    ms = _members(members)
    if domain_of is None:
        return ms
    groups: dict[str, list[str]] = {}
    for m in ms:
        groups.setdefault(domain_of(m), []).append(m)
    ordered = [groups[d] for d in sorted(groups)]
    depth = max((len(g) for g in ordered), default=0)
    return [g[r] for r in range(depth) for g in ordered if r < len(g)]


def ring_successors(
    members: Iterable[str], member: str, k: int, *, domain_of: DomainOf | None = None
) -> list[str]:
    """The (up to) ``k`` members ``member`` pushes its chunks to, nearest ring successor first.

    Never includes ``member``; returns ``min(k, len(members) - 1)`` distinct members. Prefers
    members of distinct domains other than ``member``'s, then any other domain, and uses
    ``member``'s own domain (same host: survives a process crash, not a host loss) last.

    Raises:
        ConfigError: ``member`` is not in ``members``, ``k < 0``, or an id is empty.
    """
    ring = ring_order(members, domain_of=domain_of)
    if k < 0:
        raise ConfigError(f"k must be >= 0, got {k}")
    if member not in ring:
        raise ConfigError(f"member {member!r} is not live")
    i = ring.index(member)
    walk = [ring[(i + j) % len(ring)] for j in range(1, len(ring))]
    dom = domain_of or (lambda m: m)
    own = dom(member)
    picked: list[str] = []
    used: set[str] = set()
    # Pass 1: distinct foreign domains; pass 2: any foreign member; pass 3: own domain.
    for allow in ("distinct", "foreign", "any"):
        for m in walk:
            if len(picked) == k:
                return picked
            d = dom(m)
            if m in picked or (allow != "any" and d == own) or (allow == "distinct" and d in used):
                continue
            picked.append(m)
            used.add(d)
    return picked


def replica_holders(
    writer: str, members: Iterable[str], k: int, *, domain_of: DomainOf | None = None
) -> list[str]:
    """Members that may hold a chunk ``writer`` wrote: the writer, then its push targets.

    ``members`` must be the membership the chunk was *pushed* under (a later membership
    change moves the ring; then ask peers for their chunk lists instead).
    """
    return [writer, *ring_successors(members, writer, k, domain_of=domain_of)]


def relay_parent(
    member: str, holders: Iterable[str], relays: Iterable[str], *, fanout: int
) -> str | None:
    """Where ``member`` fetches a copy that ``holders`` hold and ``relays`` serve once they
    fetched theirs (e.g. a RAM step's manifest at a restore); None for a holder.

    The holders (sorted), then the relays (sorted, holders left out) form one list; entry
    ``j`` past the holders fetches from entry ``(j - len(holders)) // fanout`` (every member
    serves at most ``fanout``). A member on neither list gets a list member chosen by a
    stable hash of its id.

    Raises:
        ConfigError: no holder, ``fanout < 1``, or an id is empty.
    """
    if fanout < 1:
        raise ConfigError(f"fanout must be >= 1, got {fanout}")
    roots = _members(holders)
    if not roots:
        raise ConfigError("relay_parent needs at least one holder")
    if member in roots:
        return None
    held = set(roots)
    order = roots + [m for m in _members(relays) if m not in held]
    if member not in order:
        return order[zlib.crc32(member.encode()) % len(order)]
    return order[(order.index(member) - len(roots)) // fanout]
