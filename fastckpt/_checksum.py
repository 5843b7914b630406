"""crc32c over any buffer (bytes, memoryview, numpy), hardware-accelerated, GIL released."""

from __future__ import annotations

from typing import Any

import crc32c as _crc32c

__all__ = ["crc32c"]


def crc32c(data: Any, value: int = 0) -> int:
    """The crc32c (Castagnoli) checksum of ``data``'s bytes, as GCS reports it; ``value``
    continues a checksum (``crc32c(a + b) == crc32c(b, crc32c(a))``)."""
    return int(_crc32c.crc32c(data, value))
