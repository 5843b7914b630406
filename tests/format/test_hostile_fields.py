"""Hostile or out-of-range manifest fields are ManifestErrors at decode, in every format."""

from __future__ import annotations

import json

import pytest

from fastckpt.errors import ManifestError
from fastckpt.format import decode_manifest
from fastckpt.format.chunk_table import encode_column

KEY = "steps/000000000001/a/p00000-00000.fck"


def _v1(chunk: dict[str, object], shape: list[int] | None = None, dtype: str = "uint8") -> bytes:
    return json.dumps({"format_version": 1, "step": 1, "leaves": [{
        "path": [["d", "x"]], "type": "array", "shape": shape or [4], "dtype": dtype,
        "chunks": [{"box": [[0, 4]], "key": KEY, "offset": 0, "length": 4, "raw_length": 4, "codec": "raw",
                    "crc32c": 0, "raw_crc32c": 0, **chunk}]}]}).encode()


@pytest.mark.parametrize(("vtype", "value"), [("float", 10**400), ("complex", [10**400, 0])])
def test_a_float_value_past_a_floats_range(vtype: str, value: object) -> None:
    doc = {"format_version": 3, "step": 1, "objects": [], "leaves": [
        {"path": [["d", "x"]], "type": "value", "vtype": vtype, "value": value}]}
    with pytest.raises(ManifestError, match="out of a float's range"):
        decode_manifest(json.dumps(doc).encode())


@pytest.mark.parametrize("field", ["crc32c", "raw_crc32c"])
def test_a_format_1_checksum_past_32_bits(field: str) -> None:
    with pytest.raises(ManifestError, match=r"\[0, 4294967295\]"):
        decode_manifest(_v1({field: 2**40}))


def test_an_object_key_that_is_not_utf8() -> None:
    with pytest.raises(ManifestError, match="not valid UTF-8"):
        decode_manifest(_v1({"key": "steps/\ud800"}))


def test_a_compressed_array_too_large_for_its_raw_lengths() -> None:
    """A zstd leaf of 2**124 elements: raw lengths past 2**63-1 are refused in formats 2/3
    as format 1 refuses them."""
    shape = [2**62, 2**62]
    col = lambda v: encode_column([v])  # noqa: E731
    doc = {"format_version": 3, "step": 1, "objects": [KEY], "leaves": [{
        "path": [["d", "x"]], "type": "array", "shape": shape, "dtype": "float32",
        "chunks": {"grid": [[0, shape[0]], [0, shape[1]]], "object": col(0), "offset": col(0), "length": col(10),
                   "codec": "zstd", "crc32c": col(0), "raw_crc32c": col(0)}}]}
    with pytest.raises(ManifestError, match="too large"):
        decode_manifest(json.dumps(doc).encode())
