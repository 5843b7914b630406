"""The batched reads of ``PeerClient.get_chunks``/``get_ranges``: how a request list is cut
into batches, and how a CHUNKS or RANGES reply is received and verified. An outcome is
reported only once the whole reply's payload verified (``Channel.end_payload``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from fastckpt._checksum import crc32c_combine
from fastckpt.errors import ConfigError, ProtocolError
from fastckpt.replicas import _wire as wire
from fastckpt.replicas._channel import Channel

__all__ = ["Outcome", "batches", "check_stream", "recv_chunks", "recv_ranges"]

Outcome = Literal["ok", "missing", "corrupt"]


def check_stream(batch_chunks: int, window: int) -> None:
    """Refuse a batch size or pipelining window a peer would refuse or that makes no sense."""
    if window < 1:
        raise ConfigError(f"window must be >= 1, got {window}")
    if not 0 < batch_chunks <= wire.MAX_BATCH_CHUNKS:
        raise ConfigError(f"batch_chunks must be in 1..{wire.MAX_BATCH_CHUNKS}, got {batch_chunks}")


def batches(
    ids: Sequence[str],
    sizes: Sequence[int],
    batch_chunks: int,
    max_payload_bytes: int,
    runs: Sequence[int] | None = None,
) -> list[tuple[int, int]]:
    """Consecutive ``[lo, hi)`` index ranges of at most ``batch_chunks`` distinct ids, at
    most ``max_payload_bytes`` (an item larger than that gets a batch of its own) and, with
    ``runs`` (per item), at most ``wire.MAX_BATCH_RUNS`` runs."""
    out: list[tuple[int, int]] = []
    seen: set[str] = set()
    lo, nbytes, nruns = 0, 0, 0
    for i, (cid, n) in enumerate(zip(ids, sizes)):
        r = runs[i] if runs is not None else 0
        if i > lo and (
            i - lo >= batch_chunks
            or nbytes + n > max_payload_bytes
            or cid in seen
            or nruns + r > wire.MAX_BATCH_RUNS
        ):
            out.append((lo, i))
            lo, nbytes, nruns, seen = i, 0, 0, set()
        nbytes += n
        nruns += r
        seen.add(cid)
    if lo < len(sizes):
        out.append((lo, len(sizes)))
    return out


def recv_chunks(
    chan: Channel,
    h: dict[str, Any],
    plen: int,
    dsts: Sequence[memoryview],
    expected: Sequence[int | None],
) -> list[Outcome]:
    """Receive one CHUNKS payload into ``dsts``, checksumming each chunk as it arrives; the
    outcomes are returned once the payload's tag verified."""
    lengths, crcs, missing = h["lengths"], h["crcs"], h["missing"]
    n = len(dsts)
    absent = set(missing)
    if (
        len(lengths) != n
        or len(crcs) != n
        or sum(lengths) != plen
        or len(absent) != len(missing)
        or any(i >= n or lengths[i] for i in absent)
    ):
        raise ProtocolError(
            f"CHUNKS reply for {n} chunks is inconsistent: {len(lengths)} lengths, "
            f"{len(crcs)} crcs, {len(missing)} missing, {sum(lengths)} of {plen} payload bytes"
        )
    out: list[Outcome] = []
    for i, dst in enumerate(dsts):
        if i in absent:
            out.append("missing")
        elif lengths[i] != dst.nbytes:
            chan.drain(lengths[i])
            out.append("corrupt")
        else:
            got = chan.recv_into(dst)
            out.append("ok" if got == crcs[i] and expected[i] in (None, got) else "corrupt")
    chan.end_payload()
    return out


def recv_ranges(
    chan: Channel,
    h: dict[str, Any],
    plen: int,
    dsts: Sequence[memoryview],
    runs: Sequence[Sequence[tuple[int, int]]],
    expected: Sequence[int],
) -> list[Outcome]:
    """Receive one RANGES payload into ``dsts``' runs; each chunk's runs must combine with
    the checksums around them into its expected crc32c; the outcomes are returned once the
    payload's tag verified."""
    lengths, gaps, missing = h["lengths"], h["gaps"], h["missing"]
    n = len(dsts)
    absent = set(missing)
    held = [i for i in range(n) if i not in absent]
    if (
        len(lengths) != n
        or len(absent) != len(missing)
        or any(i >= n or lengths[i] for i in absent)
        or len(gaps) != sum(len(runs[i]) + 1 for i in held)
        or plen != sum(k for i in held for _, k in runs[i])
        or any(lengths[i] < runs[i][-1][0] + runs[i][-1][1] for i in held)
    ):
        raise ProtocolError(
            f"RANGES reply for {n} chunks is inconsistent: {len(lengths)} lengths, "
            f"{len(gaps)} checksums, {len(missing)} missing, {plen} payload bytes"
        )
    out: list[Outcome] = []
    g = 0
    for i, (dst, rs) in enumerate(zip(dsts, runs)):
        if i in absent:
            out.append("missing")
            continue
        whole = gaps[g]  # the bytes before the first run
        for j, (a, k) in enumerate(rs):
            got = chan.recv_into(dst[a : a + k])
            gap = (rs[j + 1][0] if j + 1 < len(rs) else lengths[i]) - a - k
            whole = crc32c_combine(crc32c_combine(whole, got, k), gaps[g + 1 + j], gap)
        g += len(rs) + 1
        out.append("ok" if lengths[i] == dst.nbytes and whole == expected[i] else "corrupt")
    chan.end_payload()
    return out
