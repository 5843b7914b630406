"""One whole chunk from a peer through the batched path (``PeerClient.get_chunks``)."""

from __future__ import annotations

from typing import Any

import numpy as np


def get_one(
    client: Any, step: int, chunk_id: str, nbytes: int, expected_crc32c: int | None = None
) -> bytes | str:
    """The chunk's bytes (received into a buffer of ``nbytes``), else ``"missing"`` or
    ``"corrupt"`` (wrong length or checksum)."""
    dst = np.empty(nbytes, np.uint8)
    (outcome,) = client.get_chunks(step, [(chunk_id, dst, expected_crc32c)])
    return dst.tobytes() if outcome == "ok" else str(outcome)
