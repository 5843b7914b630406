"""Frozen, keyword-only option dataclasses. No globals, no environment reads.

Defaults are tuned for large states on pods; every knob is explicit at the call site. The
worker thread counts default to :func:`default_threads` of the machine, read when an options
object is made.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Literal

from fastckpt.errors import ConfigError

__all__ = [
    "DistributedOptions",
    "ManagerOptions",
    "RamOptions",
    "RestoreOptions",
    "RetentionOptions",
    "SaveOptions",
    "default_threads",
    "host_threads",
]

KiB = 1 << 10
MiB = 1 << 20


def default_threads(cpus: int | None = None) -> int:
    """Worker threads per process by default: a quarter of ``cpus`` (default: the CPUs this
    process may run on), at least 2 and at most 8.

    Staging copies, crc32c, zstd and placement copies release the GIL and scale with cores
    until memory bandwidth binds (hence at most 8); a quarter of the cores leaves the rest to the
    training loop's own host work and to other processes on the host (one per accelerator).
    On a 2-core machine 2, a 16-core one 4, a pod host 8.
    """
    if cpus is None:
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # not Linux
            cpus = os.cpu_count() or 2
    return min(8, max(2, cpus // 4))


def _positive(name: str, value: int | float | None, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or not 0 < value < math.inf:  # (NaN and inf fail too)
        raise ConfigError(f"{name} must be > 0 and finite, got {value!r}")


def host_threads(cpus: int | None = None) -> int:
    """Threads for the deferred pinned-host copies of a save by default: every CPU this
    process may run on (``cpus``), at most 16. Those copies exist only where the step runs on
    an accelerator, whose step leaves the host's CPUs idle; past 16, memory bandwidth binds."""
    if cpus is None:
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # not Linux
            cpus = os.cpu_count() or 2
    return min(16, max(2, cpus))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SaveOptions:
    """How a save stages, encodes and uploads data."""

    compression: Literal["zstd", "none"] = "zstd"
    """Codec for persistent storage. RAM tiers always hold raw bytes."""
    zstd_level: int = 1
    """zstd level (1: the fastest; higher levels trade encode speed for size)."""
    min_compression_gain: float = 0.10
    """A chunk is stored zstd-compressed only if that saves at least this fraction of its
    bytes (bf16/int/sparse data usually does; dense float32 weights usually do not and
    are stored raw: faster restores, no encode buffers). Big chunks are judged by a 1 MiB
    trial compression first."""
    encode_threads: int = dataclasses.field(default_factory=default_threads)
    """Threads staging, compressing and checksumming (copies, zstd and crc32c release the
    GIL); default :func:`default_threads`. A manager runs one pool of
    ``max(encode_threads, decode_threads)`` threads."""
    max_chunk_bytes: int = 16 * MiB
    """Shards larger than this are split into contiguous sub-chunks."""
    object_bytes: int = 64 * MiB
    """Target size of one data object; chunks are packed until it is reached."""
    max_inflight_bytes: int = 96 * MiB
    """Host memory for encoded-but-not-yet-uploaded bytes (beyond the staged copy)."""
    upload_concurrency: int = 4
    """Concurrent object uploads per process."""
    device_copy: Literal["auto", "pinned_host", "pageable"] = "auto"
    """How shards reach the staging buffer. ``"auto"``: through ``pinned_host`` memory where
    accelerators have it (full DMA speed; the copy into the staging buffer then runs in the
    background part of the save, so ``save()`` waits for the DMA alone), else
    ``copy_to_host_async`` into pageable memory; shards on host-platform (CPU) devices are
    copied in the background too, straight from their buffers (``save()`` waits for no copy;
    until copied, jax declines to donate those buffers, so a donating step allocates anew).
    ``"pinned_host"``: pinned wherever it exists, CPU devices too (ConfigError where it does
    not). ``"pageable"``: never pinned, and CPU shards copied before ``save()`` returns. A
    pinned copy holds a save's device shards in pinned host memory until that background copy
    is made."""
    pinned_copy_threads: int = dataclasses.field(default_factory=host_threads)
    """Threads copying a save's shards from pinned host memory into its staging buffer (the
    RAM segment) and checksumming each chunk as it lands, in the background part of the
    save: how soon a RAM step is committed after the DMA. Default :func:`host_threads`."""
    if_busy: Literal["wait", "skip"] = "wait"
    """A save while another is in flight (or, for a RAM step, while this process's push of the
    previous RAM step to its peers still runs; process 0's view decides for all): wait for
    it, or skip this step."""

    def __post_init__(self) -> None:
        if self.compression not in ("zstd", "none"):
            raise ConfigError(f"compression must be 'zstd' or 'none', got {self.compression!r}")
        if self.device_copy not in ("auto", "pinned_host", "pageable"):
            raise ConfigError(
                f"device_copy must be 'auto', 'pinned_host' or 'pageable', got {self.device_copy!r}"
            )
        if self.if_busy not in ("wait", "skip"):
            raise ConfigError(f"if_busy must be 'wait' or 'skip', got {self.if_busy!r}")
        if not 0.0 <= self.min_compression_gain < 1.0:
            raise ConfigError(
                f"min_compression_gain must be in [0, 1), got {self.min_compression_gain}"
            )
        if not -7 <= self.zstd_level <= 22:
            raise ConfigError(f"zstd_level must be in [-7, 22], got {self.zstd_level}")
        for name in (
            "encode_threads",
            "pinned_copy_threads",
            "max_chunk_bytes",
            "object_bytes",
            "max_inflight_bytes",
            "upload_concurrency",
        ):
            _positive(name, getattr(self, name))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RestoreOptions:
    """How a restore fetches and decodes data."""

    read_concurrency: int = 8
    """Concurrent ranged reads per process."""
    decode_threads: int = dataclasses.field(default_factory=default_threads)
    """Threads decompressing, verifying and copying chunks; default :func:`default_threads`."""
    max_gap_bytes: int = 1 * MiB
    """Chunks of one object closer than this are fetched in one ranged read."""
    max_request_bytes: int = 64 * MiB
    """Upper bound of one coalesced ranged read."""
    max_scratch_bytes: int = 64 * MiB
    """Host memory, over all concurrent reads, for fetched bytes that cannot be received
    straight into their destination (compressed chunks, chunks scattered over several
    destination rows, gaps between chunks); raw chunks that map onto a contiguous
    destination span need none. A read needing more than this runs alone."""
    reuse_host_buffers: bool = True
    """Keep the host memory of restored arrays once they are freed and reuse it for the next
    restore of the same shapes (its pages are already faulted in). Up to one restore's worth
    of memory stays mapped after the arrays are gone, until the manager is closed."""
    verify_checksums: bool = True
    """Verify crc32c of every chunk (strongly recommended; it is cheap)."""
    min_range_saving_bytes: int = 64 * KiB
    """A resharding restore asks the RAM tiers (own, peers) for only the bytes of a chunk it
    uses when that spares at least this many bytes of the chunk; otherwise it reads the
    whole chunk (a range costs a request entry, and the peer checksums the bytes around it
    so that the whole chunk is still verified). Persistent storage always serves whole
    chunks (its checksums cover whole stored chunks)."""

    def __post_init__(self) -> None:
        for name in (
            "read_concurrency",
            "decode_threads",
            "max_request_bytes",
            "max_scratch_bytes",
        ):
            _positive(name, getattr(self, name))
        for name in ("max_gap_bytes", "min_range_saving_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RetentionOptions:
    """Which committed persistent steps to keep. A step kept by either rule survives."""

    keep_last: int | None = 3
    """Keep the newest N committed steps (None: keep all)."""
    keep_every: int | None = None
    """Also keep every step divisible by K forever (None: no such rule)."""

    def __post_init__(self) -> None:
        _positive("keep_last", self.keep_last, allow_none=True)
        _positive("keep_every", self.keep_every, allow_none=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedOptions:
    """Cross-process coordination."""

    barrier_timeout_s: float = 300.0
    """Longest wait for other processes at a save's commit or a restore barrier."""

    def __post_init__(self) -> None:
        _positive("barrier_timeout_s", self.barrier_timeout_s)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ManagerOptions:
    """Everything a :class:`~fastckpt.CheckpointManager` can be told."""

    save: SaveOptions = dataclasses.field(default_factory=SaveOptions)
    restore: RestoreOptions = dataclasses.field(default_factory=RestoreOptions)
    retention: RetentionOptions = dataclasses.field(default_factory=RetentionOptions)
    distributed: DistributedOptions = dataclasses.field(default_factory=DistributedOptions)
    save_interval_steps: int = 1
    """``save(step, ...)`` writes persistently only when ``step % save_interval_steps == 0``
    (or ``force=True``)."""
    ram: RamOptions | None = None
    """RAM tier + peer replicas (None: persistent storage only)."""
    pause_gc: bool = True
    """Pause Python's cyclic garbage collector during ``save()``'s blocking part and during a
    restore, and re-enable it after (only if it was enabled: see ``_pygc.paused_gc`` for the
    hazards of the process-wide switch). A state of thousands of leaves allocates enough
    objects to trigger full collections, which then cost more than the work itself
    (``docs/benchmarks.md``, leaf scaling)."""

    def __post_init__(self) -> None:
        _positive("save_interval_steps", self.save_interval_steps)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RamOptions:
    """The RAM tier and peer replication (see ``docs/replicas.md``).

    Each host keeps the latest RAM step's chunks in shared memory under ``root`` and pushes
    them to ``replicas`` ring successors; every process serves its tier to authenticated
    peers. ``root`` must identify the *host slot* (it survives a process restart on the same
    host), e.g. ``/dev/shm/fastckpt/<run>/<host>``.
    """

    root: str
    """Tier directory of this host (on tmpfs)."""
    member_id: str | None = None
    """Stable identity of this host in the replica ring (default: ``root``'s last component)."""
    interval_steps: int = 10
    """``save(step)`` takes a RAM checkpoint when ``step % interval_steps == 0``."""
    budget_bytes: int = 16 << 30
    """Upper bound of shared memory held by the tier (own chunks + replicas + spares)."""
    keep_steps: int = 1
    """RAM steps retained per host, plus one with peers (the newest step is complete across
    hosts only once every host's push finished; see docs/replicas.md)."""
    replicas: int = 1
    """Peers each host pushes its chunks to (k). With ``redundancy="parity"``: the ring
    successors that receive each RAM step's manifest (no chunk copies; >= 1)."""
    redundancy: Literal["replicas", "parity"] = "replicas"
    """How a RAM step survives a lost host: ``"replicas"``, full copies on ``replicas`` ring
    successors (RAM per host ~ (1 + k)x its share); ``"parity"``, XOR parity over groups of
    ``group_size`` hosts taken along the ring (across failure domains): each host holds its
    share plus ~1/(g - 1) of it, one lost host per group is rebuilt from the survivors at a
    restore (two lost in a group: that step is not restorable from RAM; an older one or
    storage is used). Needs ``secret`` in a multi-process job. See docs/replicas.md."""
    group_size: int = 4
    """Hosts per parity group (g >= 2; ``redundancy="parity"`` only)."""
    secret: bytes | None = dataclasses.field(default=None, repr=False)
    """The job's shared peer secret (>= 16 bytes; every process the same), e.g.
    ``fastckpt.peer_secret_from_env()`` (the launcher sets ``FASTCKPT_PEER_SECRET`` or
    ``FASTCKPT_PEER_SECRET_FILE``). It keys the peer handshake and the per-frame
    authentication of the peer wire. None: no peer service; a multi-process job then needs
    ``replicas=0`` (each host keeps only its own RAM copy). Never shown in ``repr``."""
    host: str | None = None
    """Address the peer server binds to and advertises to the other hosts. None: in a
    multi-process job, this host's address on the route to the ``jax.distributed``
    coordinator (what the other hosts reach it by; IPv4 or IPv6), alone ``127.0.0.1``. An
    explicit address or name wins; ``"0.0.0.0"``/``"::"`` binds every interface and
    advertises that default address."""
    port: int = 0
    """Peer server port (0: any free port)."""
    peer_connect_timeout_s: float = 5.0
    peer_io_timeout_s: float = 30.0
    discovery_timeout_s: float = 60.0
    """How long to wait for every process to publish its peer address."""
    manifest_fanout: int = 4
    """At a restore, a host that fetched a RAM step's manifest serves it to at most this many
    others (a relay tree rooted at the hosts that hold it; see docs/replicas.md)."""
    manifest_relay_wait_s: float = 10.0
    """Longest a restoring host waits for its relay parent's copy of the manifest before it
    reads the holders instead."""

    def __post_init__(self) -> None:
        if not self.root:
            raise ConfigError("RamOptions.root is required")
        for name in (
            "interval_steps",
            "budget_bytes",
            "keep_steps",
            "manifest_fanout",
            "manifest_relay_wait_s",
        ):
            _positive(name, getattr(self, name))
        if self.replicas < 0:
            raise ConfigError("replicas must be >= 0")
        if self.redundancy not in ("replicas", "parity"):
            raise ConfigError(f"redundancy must be 'replicas' or 'parity', got {self.redundancy!r}")
        if self.group_size < 2:
            raise ConfigError(f"group_size must be >= 2, got {self.group_size}")
        if self.redundancy == "parity" and self.replicas < 1:
            raise ConfigError(
                "redundancy='parity' needs replicas >= 1 (the ring successors that receive "
                "each RAM step's manifest)"
            )
        if self.secret is not None and len(self.secret) < 16:
            raise ConfigError("secret must be at least 16 bytes")
