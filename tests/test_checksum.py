"""crc32c_combine against crc32c of the concatenation (the identity a ranged peer read relies
on)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastckpt._checksum import crc32c, crc32c_combine


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.binary(max_size=300), st.binary(max_size=300))
def test_combine_equals_the_checksum_of_the_concatenation(a: bytes, b: bytes, c: bytes) -> None:
    ab = crc32c_combine(crc32c(a), crc32c(b), len(b))
    assert ab == crc32c(a + b)
    assert crc32c_combine(ab, crc32c(c), len(c)) == crc32c(a + b + c)


@pytest.mark.parametrize("len_b", [1 << 20, (1 << 26) + 12345])
def test_combine_long_parts(len_b: int) -> None:
    a, b = bytes(range(256)) * 3, bytes([7]) * len_b
    assert crc32c_combine(crc32c(a), crc32c(b), len_b) == crc32c(a + b)


def test_combine_changes_with_any_flipped_bit() -> None:
    a, b = b"prefix bytes", b"the range a peer sends"
    good = crc32c_combine(crc32c(a), crc32c(b), len(b))
    for i in range(len(b) * 8):
        flipped = bytearray(b)
        flipped[i // 8] ^= 1 << (i % 8)
        assert crc32c_combine(crc32c(a), crc32c(bytes(flipped)), len(b)) != good


def test_negative_length_is_refused() -> None:
    with pytest.raises(ValueError):
        crc32c_combine(0, 0, -1)
