"""crc32c over any buffer (bytes, memoryview, numpy), hardware-accelerated, GIL released."""

from __future__ import annotations

from typing import Any

import crc32c as _crc32c

__all__ = ["crc32c"]


def crc32c(data: Any) -> int:
    """The crc32c (Castagnoli) checksum of ``data``'s bytes, as GCS reports it."""
    return int(_crc32c.crc32c(data))
