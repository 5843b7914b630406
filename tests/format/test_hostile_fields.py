"""Hostile or out-of-range manifest fields are ManifestErrors at decode (each document sealed
with a matching checksum, so that the check made for the field is what refuses it)."""

from __future__ import annotations

from typing import Any

import pytest

from fastckpt.errors import ManifestError
from fastckpt.format import decode_manifest
from fastckpt.format.chunk_table import encode_column
from fastckpt.format.codec import seal_document

KEY = "steps/000000000001/a/p00000-00000.fck"


def _doc(
    *,
    objects: list[str] | None = None,
    shape: list[int] | None = None,
    dtype: str = "uint8",
    **columns: Any,
) -> bytes:
    """A one-leaf manifest of ``shape`` (default ``[4]``, one raw chunk), columns overridden."""
    shape = shape or [4]
    table = {
        "grid": [[0, n] for n in shape],
        "object": encode_column([0]),
        "offset": encode_column([0]),
        "length": encode_column([4]),
        "codec": "raw",
        "crc32c": encode_column([0]),
        "raw_crc32c": encode_column([0]),
        **columns,
    }
    return seal_document(
        {
            "format_version": 3,
            "step": 1,
            "objects": objects or [KEY],
            "leaves": [
                {
                    "path": [["d", "x"]],
                    "type": "array",
                    "shape": shape,
                    "dtype": dtype,
                    "chunks": table,
                }
            ],
        }
    )


def test_the_base_document_decodes() -> None:
    assert decode_manifest(_doc()).arrays()[0].chunks[0].key == KEY


@pytest.mark.parametrize(("vtype", "value"), [("float", 10**400), ("complex", [10**400, 0])])
def test_a_float_value_past_a_floats_range(vtype: str, value: object) -> None:
    doc = {
        "format_version": 3,
        "step": 1,
        "objects": [],
        "leaves": [{"path": [["d", "x"]], "type": "value", "vtype": vtype, "value": value}],
    }
    with pytest.raises(ManifestError, match="out of a float's range"):
        decode_manifest(seal_document(doc))


@pytest.mark.parametrize("field", ["crc32c", "raw_crc32c"])
def test_a_checksum_past_32_bits(field: str) -> None:
    with pytest.raises(ManifestError, match=r"\[0, 4294967295\]"):
        decode_manifest(_doc(**{field: encode_column([2**40])}))


def test_an_object_key_that_is_not_utf8() -> None:
    with pytest.raises(ManifestError, match="not valid UTF-8"):
        decode_manifest(_doc(objects=["steps/\ud800"]))


def test_a_compressed_array_too_large_for_its_raw_lengths() -> None:
    """A zstd leaf of 2**124 elements: raw lengths past 2**63-1 are refused."""
    with pytest.raises(ManifestError, match="too large"):
        decode_manifest(
            _doc(shape=[2**62, 2**62], dtype="float32", codec="zstd", length=encode_column([10]))
        )
