"""Dtype names in the manifest <-> numpy dtypes (including ml_dtypes' bfloat16, float8, int4)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from fastckpt.errors import ManifestError

__all__ = ["DTYPE_NAMES", "dtype_from_name", "dtype_name"]

_ML_DTYPE_NAMES = (
    "bfloat16 float8_e3m4 float8_e4m3 float8_e4m3b11fnuz float8_e4m3fn float8_e4m3fnuz "
    "float8_e5m2 float8_e5m2fnuz float8_e8m0fnu float6_e2m3fn float6_e3m2fn float4_e2m1fn "
    "int2 int4 uint2 uint4"
).split()
_BUILTIN_NAMES = (
    "bool int8 int16 int32 int64 uint8 uint16 uint32 uint64 float16 float32 float64 "
    "complex64 complex128"
).split()


def _table() -> dict[str, np.dtype]:
    table: dict[str, np.dtype] = {n: np.dtype(n) for n in _BUILTIN_NAMES}
    for n in _ML_DTYPE_NAMES:
        t = getattr(ml_dtypes, n, None)
        if t is not None:
            table[n] = np.dtype(t)
    return table


_BY_NAME = _table()
DTYPE_NAMES: tuple[str, ...] = tuple(sorted(_BY_NAME))
"""Every dtype name a manifest may carry (those this numpy/ml_dtypes supports)."""


def dtype_name(dtype: np.dtype | type) -> str:
    """Canonical manifest name of a dtype; raises ``ManifestError`` for unsupported ones."""
    dt = np.dtype(dtype)
    name = dt.name
    if name not in _BY_NAME or _BY_NAME[name] != dt:
        raise ManifestError(f"unsupported dtype {dt!r}")
    return name


def dtype_from_name(name: object) -> np.dtype:
    """The numpy dtype for a manifest dtype name; ``ManifestError`` if unknown."""
    if not isinstance(name, str) or name not in _BY_NAME:
        raise ManifestError(f"unknown dtype {name!r}")
    return _BY_NAME[name]
