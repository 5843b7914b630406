"""crc32c over any buffer (bytes, memoryview, numpy), hardware-accelerated, GIL released."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import crc32c as _crc32c

__all__ = ["crc32c", "crc32c_combine", "crc32c_parts"]


def crc32c(data: Any, value: int = 0) -> int:
    """The crc32c (Castagnoli) checksum of ``data``'s bytes, as GCS reports it; ``value``
    continues a checksum (``crc32c(a + b) == crc32c(b, crc32c(a))``)."""
    return int(_crc32c.crc32c(data, value))


def crc32c_parts(parts: Iterable[Any], value: int = 0) -> int:
    """The crc32c of the concatenation of ``parts`` (buffers), without joining them."""
    for part in parts:
        value = int(_crc32c.crc32c(part, value))
    return value


_POLY = 0x82F63B78  # crc32c, reflected


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the crc32c polynomial (reflected bit order, as in zlib)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


@functools.cache
def _x2n(k: int) -> int:
    """``x**(2**k)`` modulo the polynomial."""
    return 1 << 30 if k == 0 else _multmodp(_x2n(k - 1), _x2n(k - 1))


@functools.lru_cache(maxsize=1024)
def _shift(nbytes: int) -> int:
    """``x**(8 * nbytes)`` modulo the polynomial (a restore combines a few lengths often)."""
    p, k = 1 << 31, 3
    while nbytes:
        if nbytes & 1:
            p = _multmodp(_x2n(k), p)
        nbytes >>= 1
        k += 1
    return p


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """``crc32c(a + b)`` from ``crc32c(a)``, ``crc32c(b)`` and ``len(b)``, without the bytes
    (zlib's ``crc32_combine`` for the Castagnoli polynomial). A ranged peer read uses it to
    check the bytes it received against the whole chunk's checksum."""
    if len_b < 0:
        raise ValueError(f"len_b must be >= 0, got {len_b}")
    return _multmodp(_shift(len_b), crc_a) ^ crc_b
