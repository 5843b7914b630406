"""RAM replicas: a shared-memory tier per process, peer replication and peer-to-peer restore.

Pieces (see ``docs/replicas.md``):

* :class:`RamTier`: raw chunk bytes of recent steps in ``/dev/shm`` files; survives a
  process restart, not a host loss.
* :class:`PeerServer` / :class:`PeerClient`: serve a tier to authenticated peers over TCP.
* :mod:`~fastckpt.replicas.placement`: which ring peers each member pushes to.
* :class:`Replicator`: pushes a sealed step to those peers in the background.
* :class:`TieredChunkSource`: per-chunk restore from own RAM, then peers.
* :mod:`~fastckpt.replicas.discovery`: publishing and finding peer addresses.
* :func:`peer_secret_from_env` / :func:`new_peer_secret`: the job's peer secret, from the
  launcher (``FASTCKPT_PEER_SECRET`` or ``FASTCKPT_PEER_SECRET_FILE``).

Importing this package has no side effects.
"""

from __future__ import annotations

from fastckpt.replicas._secret import SECRET_ENV as SECRET_ENV
from fastckpt.replicas._secret import SECRET_FILE_ENV as SECRET_FILE_ENV
from fastckpt.replicas._secret import new_peer_secret as new_peer_secret
from fastckpt.replicas._secret import peer_secret_from_env as peer_secret_from_env
from fastckpt.replicas.discovery import CallbackDirectory as CallbackDirectory
from fastckpt.replicas.discovery import CoordinatorDirectory as CoordinatorDirectory
from fastckpt.replicas.discovery import PeerDirectory as PeerDirectory
from fastckpt.replicas.discovery import PeerRecord as PeerRecord
from fastckpt.replicas.discovery import StoreDirectory as StoreDirectory
from fastckpt.replicas.discovery import make_record as make_record
from fastckpt.replicas.peer import PeerClient as PeerClient
from fastckpt.replicas.peer import PeerOptions as PeerOptions
from fastckpt.replicas.peer import PeerRequestError as PeerRequestError
from fastckpt.replicas.peer import PeerServer as PeerServer
from fastckpt.replicas.placement import host_domain as host_domain
from fastckpt.replicas.placement import push_targets as push_targets
from fastckpt.replicas.placement import replica_holders as replica_holders
from fastckpt.replicas.placement import ring_order as ring_order
from fastckpt.replicas.placement import ring_successors as ring_successors
from fastckpt.replicas.ram import ChunkLocation as ChunkLocation
from fastckpt.replicas.ram import RamBudgetError as RamBudgetError
from fastckpt.replicas.ram import RamTier as RamTier
from fastckpt.replicas.ram import Segment as Segment
from fastckpt.replicas.ram import StaleStepError as StaleStepError
from fastckpt.replicas.replicator import ReplicationError as ReplicationError
from fastckpt.replicas.replicator import ReplicationHandle as ReplicationHandle
from fastckpt.replicas.replicator import ReplicationReport as ReplicationReport
from fastckpt.replicas.replicator import ReplicationTimeoutError as ReplicationTimeoutError
from fastckpt.replicas.replicator import Replicator as Replicator
from fastckpt.replicas.replicator import ReplicatorOptions as ReplicatorOptions
from fastckpt.replicas.sources import Fallback as Fallback
from fastckpt.replicas.sources import SourceStats as SourceStats
from fastckpt.replicas.sources import TieredChunkSource as TieredChunkSource
from fastckpt.replicas.sources import TierStats as TierStats

__all__ = [
    "CallbackDirectory",
    "ChunkLocation",
    "CoordinatorDirectory",
    "Fallback",
    "PeerClient",
    "PeerDirectory",
    "PeerOptions",
    "PeerRecord",
    "PeerRequestError",
    "PeerServer",
    "RamBudgetError",
    "SECRET_ENV",
    "SECRET_FILE_ENV",
    "RamTier",
    "ReplicationError",
    "ReplicationHandle",
    "ReplicationReport",
    "ReplicationTimeoutError",
    "Replicator",
    "ReplicatorOptions",
    "Segment",
    "SourceStats",
    "StaleStepError",
    "StoreDirectory",
    "TierStats",
    "TieredChunkSource",
    "host_domain",
    "make_record",
    "new_peer_secret",
    "peer_secret_from_env",
    "push_targets",
    "replica_holders",
    "ring_order",
    "ring_successors",
]
