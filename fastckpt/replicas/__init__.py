"""RAM replicas: a shared-memory tier per process, peer replication and peer-to-peer restore.

The job's peer secret (from the launcher), :class:`ReplicationReport` (what
``CheckpointManager.wait_replication`` returns) and :class:`RamReplication` (the RAM tier as
the manager builds it); the rest is internal (``docs/replicas.md``). Errors are in
:mod:`fastckpt.errors`. Importing this package has no side effects.
"""

from __future__ import annotations

from fastckpt.replicas._replicator import ReplicationReport as ReplicationReport
from fastckpt.replicas._secret import SECRET_ENV as SECRET_ENV
from fastckpt.replicas._secret import SECRET_FILE_ENV as SECRET_FILE_ENV
from fastckpt.replicas._secret import new_peer_secret as new_peer_secret
from fastckpt.replicas._secret import peer_secret_from_env as peer_secret_from_env
from fastckpt.replicas._tiered import RamReplication as RamReplication

__all__ = [
    "SECRET_ENV",
    "SECRET_FILE_ENV",
    "RamReplication",
    "ReplicationReport",
    "new_peer_secret",
    "peer_secret_from_env",
]
