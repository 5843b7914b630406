"""fastckpt's exception tree.

Every error fastckpt raises on purpose derives from :class:`FastckptError`. Backend and
library errors are translated at the layer boundary (``storage/`` translates HTTP and OS
errors), so callers never need to catch ``requests`` or ``OSError`` types. Where a builtin
exception has the same meaning, the fastckpt class also inherits from it (``NotFoundError``
is a ``FileNotFoundError``), so generic handlers keep working.

Tree::

    FastckptError
    ├── ConfigError (ValueError)               bad option, URL or argument
    │   └── RamBudgetError                     a RAM-tier step does not fit its budget (or tmpfs)
    ├── StorageError
    │   ├── NotFoundError (FileNotFoundError)  object does not exist
    │   ├── AlreadyExistsError (FileExistsError) create-only put refused
    │   ├── PermissionDeniedError (PermissionError)
    │   ├── TransientStorageError              429/5xx/connection reset/timeout; retryable
    │   └── RetriesExhaustedError              a transient error persisted past the retry budget
    ├── CorruptionError                        data failed verification
    │   └── ChecksumMismatchError              crc32c mismatch on a chunk
    ├── ManifestError (ValueError)             malformed manifest
    │   └── UnsupportedFormatVersionError
    ├── CheckpointNotFoundError (LookupError)  no such committed step
    │   └── NoCheckpointError                  no committed step at all (a job starting afresh)
    ├── StepAlreadyCommittedError              a step that is already committed
    ├── StaleStepError                         RAM data for a step older than all it retains
    ├── TargetMismatchError (ValueError)       restore target disagrees with the checkpoint
    │   ├── TreeStructureError
    │   ├── ShapeMismatchError
    │   └── DtypeMismatchError
    ├── SaveError                              a background save failed (wraps the cause)
    ├── DistributedError
    │   └── BarrierTimeoutError (TimeoutError)
    └── PeerError
        ├── PeerUnavailableError               connect/transfer failure or timeout
        │   └── PeersUnreachableError          at start: hosts cannot reach their peers
        ├── PeerRequestError                   a peer answered a request with an ERROR frame
        ├── ReplicationError                   pushes of a RAM step failed (``reports``)
        ├── ReplicationTimeoutError (TimeoutError) pushes still running when a wait timed out
        ├── AuthenticationError                HMAC handshake failed
        └── ProtocolError (ValueError)         malformed or oversized peer message
            └── FrameAuthenticationError       a frame failed its per-frame MAC
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "AlreadyExistsError",
    "AuthenticationError",
    "BarrierTimeoutError",
    "CheckpointNotFoundError",
    "ChecksumMismatchError",
    "ConfigError",
    "CorruptionError",
    "DistributedError",
    "DtypeMismatchError",
    "FastckptError",
    "FrameAuthenticationError",
    "ManifestError",
    "NoCheckpointError",
    "NotFoundError",
    "PeerError",
    "PeerRequestError",
    "PeerUnavailableError",
    "PeersUnreachableError",
    "PermissionDeniedError",
    "ProtocolError",
    "RamBudgetError",
    "ReplicationError",
    "ReplicationTimeoutError",
    "RetriesExhaustedError",
    "SaveError",
    "ShapeMismatchError",
    "StaleStepError",
    "StepAlreadyCommittedError",
    "StorageError",
    "TargetMismatchError",
    "TransientStorageError",
    "TreeStructureError",
    "UnsupportedFormatVersionError",
]


class FastckptError(Exception):
    """Root of every error fastckpt raises on purpose."""


class ConfigError(FastckptError, ValueError):
    """An option, URL or argument is invalid."""


class RamBudgetError(ConfigError):
    """A RAM-tier allocation cannot fit in ``budget_bytes`` (or tmpfs is full)."""


class StorageError(FastckptError):
    """A storage backend operation failed."""


class NotFoundError(StorageError, FileNotFoundError):
    """The requested object (or range of it) does not exist."""


class AlreadyExistsError(StorageError, FileExistsError):
    """A create-only put found an existing object (GCS precondition 412)."""


class PermissionDeniedError(StorageError, PermissionError):
    """The backend refused access (401/403, EACCES)."""


class TransientStorageError(StorageError):
    """A retryable failure: 408/429/5xx, connection reset, truncated body, timeout."""


class RetriesExhaustedError(StorageError):
    """A transient failure persisted through every retry; ``__cause__`` is the last error."""


class CorruptionError(FastckptError):
    """Stored data failed verification."""


class ChecksumMismatchError(CorruptionError):
    """A chunk's crc32c does not match the manifest."""


class ManifestError(FastckptError, ValueError):
    """A manifest is malformed: bad JSON, wrong types, inconsistent boxes, unsafe keys."""


class UnsupportedFormatVersionError(ManifestError):
    """The manifest's ``format_version`` is not 3, the one format this fastckpt reads."""


class CheckpointNotFoundError(FastckptError, LookupError):
    """No committed checkpoint for the requested step (or no checkpoint at all)."""


class NoCheckpointError(CheckpointNotFoundError):
    """No committed checkpoint in any tier (a job starting afresh may initialise instead).
    Every other :class:`CheckpointNotFoundError` means a checkpoint exists but the one asked
    for (or the data of a RAM-only step) cannot be read."""


class StepAlreadyCommittedError(FastckptError):
    """The step is already committed; checkpoints are immutable once committed."""


class StaleStepError(FastckptError):
    """RAM-tier data for a step older than every retained committed step: it would be
    dropped at once, so the tier refuses it (a peer answers ``stale_step``)."""


class TargetMismatchError(FastckptError, ValueError):
    """The restore target does not match what the checkpoint holds."""


class TreeStructureError(TargetMismatchError):
    """The target's pytree paths differ from the checkpoint's."""


class ShapeMismatchError(TargetMismatchError):
    """A target leaf's shape differs from the stored array's global shape."""


class DtypeMismatchError(TargetMismatchError):
    """A target leaf's dtype differs from the stored dtype."""


class SaveError(FastckptError):
    """A background save failed; the step was not committed. ``__cause__`` holds why."""


class DistributedError(FastckptError):
    """Coordination between processes failed (a peer process reported an error)."""


class BarrierTimeoutError(DistributedError, TimeoutError):
    """A cross-process barrier or key wait did not complete in time."""


class PeerError(FastckptError):
    """A peer (RAM-tier replica) operation failed."""


class PeerUnavailableError(PeerError):
    """A peer could not be reached or timed out."""


class PeersUnreachableError(PeerUnavailableError):
    """At a job's start, some hosts could not reach (or authenticate to) the peers they
    replicate RAM steps to; the message names the members and addresses."""


class PeerRequestError(PeerError):
    """The peer answered a request with an ERROR frame (``code`` says which)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"peer error {code}: {message}")
        self.code = code


class ReplicationError(PeerError):
    """Pushes of a RAM step to its peers failed (raised only when a wait asks for it:
    ``Replicator.wait(raise_on_error=True)``); ``reports`` holds every step's
    :class:`fastckpt.replicas.ReplicationReport` (typed loosely: this module imports no layer)."""

    def __init__(self, message: str, reports: Sequence[object]) -> None:
        super().__init__(message)
        self.reports = list(reports)


class ReplicationTimeoutError(PeerError, TimeoutError):
    """A wait for pushes of RAM steps timed out with pushes still running."""


class AuthenticationError(PeerError):
    """The peer handshake failed: wrong or missing secret, or a replayed challenge."""


class ProtocolError(PeerError, ValueError):
    """A peer message was malformed, truncated or oversized."""


class FrameAuthenticationError(ProtocolError):
    """A peer frame failed verification of its MAC tag (forged, altered, replayed, reordered
    or dropped on the way): the connection is out of sync and must be dropped; nothing the
    frame carried may be used."""
