"""Getting a RAM step's manifest to every restoring host without all of them asking the same few
(``docs/replicas.md``, "Where a RAM step's manifest lives"): who holds it (*holders*) and who
serves it once fetched (*relays*), process 0's candidates message, and one polling helper.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping, Sequence

from fastckpt.errors import DistributedError, PeerError
from fastckpt.replicas._client import PeerClient, StepLists

__all__ = [
    "ManifestSources",
    "decode_candidates",
    "encode_candidates",
    "manifest_sources",
    "wait_for_manifest",
]

_POLL_FIRST_S = 0.002
_POLL_MAX_S = 0.05


@dataclasses.dataclass(frozen=True)
class ManifestSources:
    """Who serves one RAM step's manifest: ``holders`` now, ``relays`` once they fetched it."""

    holders: tuple[str, ...]
    relays: tuple[str, ...]


def manifest_sources(lists: Mapping[str, StepLists]) -> dict[int, ManifestSources]:
    """Per committed step of any member in ``lists`` (member -> its step lists): the members
    holding its manifest and those holding only its commit record (sorted)."""
    out: dict[int, tuple[list[str], list[str]]] = {}
    for member in sorted(lists):
        held = set(lists[member].manifests)
        for step in lists[member].committed:
            out.setdefault(step, ([], []))[0 if step in held else 1].append(member)
    return {step: ManifestSources(tuple(h), tuple(r)) for step, (h, r) in out.items()}


def encode_candidates(steps: Sequence[int], sources: Mapping[int, ManifestSources]) -> str:
    """Process 0's message: the candidate steps (newest first) and their manifest sources."""
    listed = {
        str(s): [list(sources[s].holders), list(sources[s].relays)] for s in steps if s in sources
    }
    return json.dumps({"steps": list(steps), "sources": listed}, separators=(",", ":"))


def decode_candidates(text: str) -> tuple[list[int], dict[int, ManifestSources]]:
    """Inverse of :func:`encode_candidates`.

    Raises:
        DistributedError: ``text`` is not such a message.
    """

    def bad(why: str) -> DistributedError:
        return DistributedError(f"RAM step candidates: {why}, got {text[:80]!r}")

    try:
        doc = json.loads(text)
    except ValueError:
        raise bad("not JSON") from None
    if (
        type(doc) is not dict
        or set(doc) != {"steps", "sources"}
        or type(doc["sources"]) is not dict
    ):
        raise bad('expected {"steps": [...], "sources": {...}}')
    steps = doc["steps"]
    if type(steps) is not list or any(type(v) is not int or v < 0 for v in steps):
        raise bad("expected a list of step numbers")
    sources: dict[int, ManifestSources] = {}
    for key, value in doc["sources"].items():
        if not (key.isascii() and key.isdigit()) or int(key) not in steps:
            raise bad(f"sources of {key!r}, which is not a candidate")
        if (
            type(value) is not list
            or len(value) != 2
            or any(
                type(ms) is not list or any(type(m) is not str or not m for m in ms) for ms in value
            )
        ):
            raise bad(f"sources of step {key}: expected [[holders], [relays]] of member ids")
        sources[int(key)] = ManifestSources(tuple(value[0]), tuple(value[1]))
    return steps, sources


def wait_for_manifest(client: PeerClient, step: int, *, wait_s: float) -> bytes | None:
    """The manifest of ``step`` from ``client``, polling (2 ms, doubling to 50 ms) while the
    peer does not hold it yet, for at most ``wait_s``; None if it never did or failed."""
    deadline = time.monotonic() + wait_s
    pause = _POLL_FIRST_S
    while True:
        try:
            data = client.get_manifest(step)
        except PeerError:
            return None
        if data is not None:
            return data
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        time.sleep(min(pause, left))
        pause = min(2 * pause, _POLL_MAX_S)
