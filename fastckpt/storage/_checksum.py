"""crc32c over payloads without copying them."""

from __future__ import annotations

from collections.abc import Iterable

import google_crc32c
import numpy as np

from fastckpt.storage._protocol import Buffer

__all__ = ["crc32c"]


def crc32c(parts: Iterable[Buffer], initial: int = 0) -> int:
    """Return the crc32c (Castagnoli) of the concatenation of ``parts``, continuing ``initial``.

    ``google_crc32c`` accepts only ``bytes`` or buffers without a release hook; a numpy view
    over each part satisfies that without a copy.
    """
    crc = initial
    for part in parts:
        if isinstance(part, bytes):
            crc = google_crc32c.extend(crc, part)
            continue
        view = memoryview(part).cast("B")
        if view.nbytes:
            crc = google_crc32c.extend(crc, np.frombuffer(view, dtype=np.uint8))
    return int(crc)
