"""Strict validators for decoded JSON, shared by the manifest codec, the chunk table and the
commit protocol's fragments.

Each validator returns its (type-checked) input or raises
:class:`~fastckpt.errors.ManifestError` naming the field. No I/O."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NoReturn

from fastckpt.errors import ManifestError
from fastckpt.format.manifest import Box, box_volume

__all__ = [
    "MAX_INT",
    "check_tiling",
    "fail",
    "json_dict",
    "json_float",
    "json_int",
    "json_list",
    "json_str",
]

MAX_INT = 2**63 - 1


def fail(msg: str) -> NoReturn:
    raise ManifestError(msg)


def json_int(obj: Any, what: str, *, lo: int = 0) -> int:
    if type(obj) is not int or not lo <= obj <= MAX_INT:
        fail(f"{what}: expected an int >= {lo}, got {obj!r:.80}")
    return obj


def json_str(obj: Any, what: str) -> str:
    if type(obj) is not str:
        fail(f"{what}: expected a string, got {obj!r:.80}")
    return obj


def json_list(obj: Any, what: str) -> list[Any]:
    if type(obj) is not list:
        fail(f"{what}: expected a list, got {type(obj).__name__}")
    return obj


def json_dict(obj: Any, what: str, keys: tuple[str, ...]) -> Mapping[str, Any]:
    if type(obj) is not dict:
        fail(f"{what}: expected an object, got {type(obj).__name__}")
    missing = [k for k in keys if k not in obj]
    if missing:
        fail(f"{what}: missing field(s) {missing}")
    return obj


def json_float(obj: Any, what: str) -> float:
    if obj in ("nan", "inf", "-inf"):
        return float(obj)
    if type(obj) not in (int, float):
        fail(f"{what}: expected a number, got {obj!r:.80}")
    try:
        return float(obj)
    except OverflowError:  # an int of hundreds of digits
        fail(f"{what}: {str(obj)[:40]}... is out of a float's range")


def check_tiling(boxes: list[Box], shape: tuple[int, ...], what: str) -> None:
    """Fail unless ``boxes`` tile an array of ``shape`` exactly: their volumes add up to its
    size and no two non-empty ones overlap. The overlap test sweeps along the dimension with
    the most distinct starts, comparing only boxes still open along it (near-linear for the
    grid-like tilings fastckpt writes)."""
    if sum(box_volume(b) for b in boxes) != math.prod(shape):
        fail(f"{what}: chunks do not tile the array (volumes != {math.prod(shape)})")
    boxes = [b for b in boxes if box_volume(b) > 0]
    if len(boxes) < 2:
        return
    ndim = len(boxes[0])
    if ndim == 0:
        fail(f"{what}: several chunks of a 0-d array")
    d = max(range(ndim), key=lambda k: len({b[k][0] for b in boxes}))
    boxes.sort(key=lambda b: b[d][0])
    active: list[Box] = []
    for b in boxes:
        active = [a for a in active if a[d][1] > b[d][0]]
        for a in active:
            if all(a0 < b1 and b0 < a1 for (a0, a1), (b0, b1) in zip(a, b)):
                fail(f"{what}: chunks {list(a)} and {list(b)} overlap")
        active.append(b)
