"""Parity groups and striping of a RAM step (``RamOptions(redundancy="parity")``; the layout:
``docs/replicas.md``, "Parity"): pure functions, no I/O.

A member's *stream* of a RAM step is its own segment's bytes ``[0, L)``, ``L`` the end of its
last chunk; in a group of ``s`` members its part ``k`` (``S = ceil(L/(s-1))`` bytes, the last
ones shorter or empty) goes to the ``k``-th *other* member, which holds the XOR of the parts
it received: one loss per group is survived; a group of one member is unprotected.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from fastckpt.errors import ConfigError
from fastckpt.format.layout import ram_writer
from fastckpt.format.manifest import Manifest, chunk_ids
from fastckpt.replicas._placement import ring_order

__all__ = [
    "PARITY_PREFIX",
    "ChunkPlace",
    "ParityRecord",
    "RebuildPiece",
    "chunk_places",
    "find_parity",
    "group_of",
    "others",
    "parity_chunk_id",
    "parity_groups",
    "parse_parity_id",
    "part_index",
    "part_size",
    "part_span",
    "rebuild_pieces",
    "xor_into",
]

PARITY_PREFIX = "parity#"


def parity_groups(
    members: Iterable[str], group_size: int, *, domain_of: Callable[[str], str] | None = None
) -> list[list[str]]:
    """The members in ring order (:func:`~fastckpt.replicas._placement.ring_order`) cut into
    ``ceil(n / group_size)`` groups of consecutive members whose sizes differ by at most one
    (n = 6, g = 4: 3 + 3). Deterministic from the member set."""
    if group_size < 2:
        raise ConfigError(f"group_size must be >= 2, got {group_size}")
    ring = ring_order(members, domain_of=domain_of)
    if not ring:
        return []
    count = -(-len(ring) // group_size)
    base, extra = divmod(len(ring), count)  # the first ``extra`` groups get one more
    cuts = [g * base + min(g, extra) for g in range(count + 1)]
    return [ring[a:b] for a, b in itertools.pairwise(cuts)]


def group_of(member: str, groups: Sequence[Sequence[str]]) -> list[str]:
    """The group ``member`` belongs to."""
    for g in groups:
        if member in g:
            return list(g)
    raise ConfigError(f"member {member!r} is in no parity group")


def others(group: Sequence[str], member: str) -> list[str]:
    """The other members of ``member``'s group in group order: part ``k`` goes to entry ``k``."""
    return [m for m in group if m != member]


def part_index(group: Sequence[str], contributor: str, holder: str) -> int:
    """Which part of ``contributor``'s stream ``holder`` receives."""
    return others(group, contributor).index(holder)


def part_size(stream_len: int, group_len: int) -> int:
    """``S = ceil(L / (s - 1))``: the size of each part of a stream of ``L`` bytes."""
    if group_len < 2:
        raise ConfigError(f"a parity group needs >= 2 members, got {group_len}")
    return -(-stream_len // (group_len - 1))


def part_span(stream_len: int, size: int, k: int) -> tuple[int, int]:
    """Stream bytes ``[start, stop)`` of part ``k`` (empty past the stream's end)."""
    start = min(k * size, stream_len)
    return start, min(start + size, stream_len)


@dataclasses.dataclass(frozen=True)
class ParityRecord:
    """What a member's sealed parity of a step is: its group (in order), the holder, and
    each contributor's ``(stream length L, part size S)``."""

    group: tuple[str, ...]
    holder: str
    contributors: dict[str, tuple[int, int]]

    def complete(self) -> bool:
        """Whether every other member of the group contributed."""
        return set(self.contributors) == set(others(self.group, self.holder))


def parity_chunk_id(record: ParityRecord) -> str:
    """The reserved chunk id the parity is sealed under (no ``@``: never a manifest's id)."""
    doc = {
        "g": list(record.group),
        "h": record.holder,
        "c": {m: list(v) for m, v in sorted(record.contributors.items())},
    }
    return PARITY_PREFIX + json.dumps(doc, separators=(",", ":")).replace("@", "\\u0040")


def find_parity(chunk_ids: Iterable[str], holder: str) -> tuple[ParityRecord, str] | None:
    """The record and chunk id of ``holder``'s parity among ``chunk_ids``, or None."""
    for cid in chunk_ids:
        if cid.startswith(PARITY_PREFIX):
            rec = parse_parity_id(cid)
            if rec is not None and rec.holder == holder:
                return rec, cid
    return None


def parse_parity_id(chunk_id: str) -> ParityRecord | None:
    """The record a :func:`parity_chunk_id` names; None for any other id or a malformed one."""
    if not chunk_id.startswith(PARITY_PREFIX) or "@" in chunk_id:
        return None
    try:
        doc = json.loads(chunk_id[len(PARITY_PREFIX) :])
        group = tuple(str(m) for m in doc["g"])
        contributors = {str(m): (int(v[0]), int(v[1])) for m, v in doc["c"].items()}
        return ParityRecord(group, str(doc["h"]), contributors)
    except (ValueError, KeyError, TypeError, IndexError):
        return None


@dataclasses.dataclass(frozen=True)
class ChunkPlace:
    """Where a RAM step's chunk lies: its writer, offset in the writer's stream, length and
    raw crc32c (from the manifest)."""

    writer: str
    offset: int
    nbytes: int
    raw_crc32c: int


def chunk_places(manifest: Manifest) -> dict[str, ChunkPlace]:
    """Every chunk of a RAM step's ``manifest`` whose object key names a writer."""
    out: dict[str, ChunkPlace] = {}
    for leaf in manifest.arrays():
        cols = leaf.chunks.columns()
        writers = [ram_writer(manifest.step, k) for k in cols.keys]
        for i, cid in enumerate(chunk_ids(leaf)):
            w = writers[int(cols.object_index[i])]
            if w is not None:
                out[cid] = ChunkPlace(
                    w, int(cols.offsets[i]), int(cols.lengths[i]), int(cols.raw_crc32c[i])
                )
    return out


@dataclasses.dataclass(frozen=True)
class RebuildPiece:
    """One parity holder's share of rebuilding a range of a lost member's stream: bytes
    ``[u, u + n)`` of part ``k`` (held by ``holder``) land at ``at`` in the chunk."""

    holder: str
    k: int
    u: int
    n: int
    at: int


def rebuild_pieces(
    group: Sequence[str], lost: str, stream_len: int, offset: int, nbytes: int
) -> Iterator[RebuildPiece]:
    """The pieces of stream bytes ``[offset, offset + nbytes)`` of ``lost``, per part."""
    if offset < 0 or offset + nbytes > stream_len:
        raise ConfigError(f"range {offset}+{nbytes} outside a {stream_len}-byte stream")
    holders = others(group, lost)
    size = part_size(stream_len, len(group))
    pos, end = offset, offset + nbytes
    while pos < end:
        k = pos // size
        stop = min(end, (k + 1) * size)
        yield RebuildPiece(holders[k], k, pos - k * size, stop - pos, pos - offset)
        pos = stop


def xor_into(dst: np.ndarray, src: np.ndarray | memoryview | bytes) -> None:
    """``dst[:len(src)] ^= src`` on uint8 arrays (8 bytes at a time where both align; numpy
    releases the GIL)."""
    s = np.frombuffer(src, np.uint8) if not isinstance(src, np.ndarray) else src
    n = s.nbytes
    if n > dst.nbytes:
        raise ConfigError(f"cannot XOR {n} bytes into {dst.nbytes}")
    head = n - n % 8
    d8, s8 = dst[:head], s[:head]
    if head and d8.ctypes.data % 8 == 0 and s8.ctypes.data % 8 == 0:
        np.bitwise_xor(d8.view(np.uint64), s8.view(np.uint64), out=d8.view(np.uint64))
    else:
        np.bitwise_xor(d8, s8, out=d8)
    np.bitwise_xor(dst[head:n], s[head:n], out=dst[head:n])
