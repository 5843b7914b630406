"""Hypothesis strategies for fastckpt's pure layers: shapes, boxes, chunk tilings, manifests.

Test-only (needs ``hypothesis``); import it directly, ``fastckpt.testing`` imports nothing.
Everything here is plain data: no jax, no devices, no I/O.
"""

from __future__ import annotations

import itertools
import string
from typing import Any, get_args

from hypothesis import strategies as st

from fastckpt.format.chunk_table import CODECS, table_from_entries
from fastckpt.format.dtypes import DTYPE_NAMES, dtype_from_name
from fastckpt.format.manifest import (
    ArrayKind,
    ArrayLeaf,
    Box,
    ChunkEntry,
    Codec,
    KeyPath,
    Leaf,
    Manifest,
    ShardingSpec,
    ValueLeaf,
    box_volume,
)

__all__ = [
    "DTYPE_NAMES",
    "boxes_in",
    "grid_tilings",
    "json_values",
    "key_paths",
    "manifests",
    "object_keys",
    "shapes",
    "sharding_specs",
    "tilings",
]


def shapes(
    *, max_rank: int = 4, max_side: int = 7, min_side: int = 0
) -> st.SearchStrategy[tuple[int, ...]]:
    """Array shapes (rank 0 included)."""
    return st.lists(st.integers(min_side, max_side), max_size=max_rank).map(tuple)


@st.composite
def boxes_in(draw: st.DrawFn, shape: tuple[int, ...], *, allow_empty: bool = False) -> Box:
    """A box inside ``shape`` (non-empty unless ``allow_empty``)."""
    out = []
    for n in shape:
        gap = 0 if n == 0 or allow_empty else 1  # the least extent on this side
        a = draw(st.integers(0, n - gap))
        out.append((a, draw(st.integers(a + gap, n))))
    return tuple(out)


@st.composite
def tilings(draw: st.DrawFn, shape: tuple[int, ...], *, max_pieces: int = 12) -> list[Box]:
    """A random exact tiling of ``shape`` by boxes (recursive guillotine cuts).

    A shape with a zero extent is tiled by its one (empty) full box.
    """
    full = tuple((0, n) for n in shape)
    if not shape or 0 in shape:
        return [full]
    pieces = [full]
    for _ in range(draw(st.integers(0, max_pieces - 1))):
        splittable = [i for i, b in enumerate(pieces) if any(hi - lo > 1 for lo, hi in b)]
        if not splittable:
            break
        i = draw(st.sampled_from(splittable))
        box = pieces[i]
        dims = [d for d, (lo, hi) in enumerate(box) if hi - lo > 1]
        d = draw(st.sampled_from(dims))
        lo, hi = box[d]
        cut = draw(st.integers(lo + 1, hi - 1))
        pieces[i : i + 1] = [box[:d] + (half,) + box[d + 1 :] for half in ((lo, cut), (cut, hi))]
    return pieces


_SEGMENT = st.text(string.ascii_letters + string.digits + "_-.", min_size=1, max_size=8).filter(
    lambda s: s not in (".", "..") and not s.endswith(".fastckpt-tmp")
)


def object_keys() -> st.SearchStrategy[str]:
    """Safe relative object keys (``a/b.c``)."""
    return st.lists(_SEGMENT, min_size=1, max_size=4).map("/".join)


_OBJECT_KEYS = object_keys()


def key_paths(*, max_depth: int = 4) -> st.SearchStrategy[KeyPath]:
    """Manifest key paths."""
    entry = st.one_of(
        st.tuples(st.just("d"), st.one_of(st.text(max_size=6), st.integers(-5, 5))),
        st.tuples(st.just("i"), st.integers(0, 20)),
        st.tuples(st.just("a"), st.text(string.ascii_letters + "_", min_size=1, max_size=6)),
        st.tuples(st.just("f"), st.integers(0, 20)),
    )
    return st.lists(entry, max_size=max_depth).map(tuple)  # type: ignore[arg-type]


def json_values(*, max_leaves: int = 10) -> st.SearchStrategy[Any]:
    """JSON-representable values (finite floats only: strict JSON has no nan/inf)."""
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=10),
    )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
        ),
        max_leaves=max_leaves,
    )


@st.composite
def sharding_specs(draw: st.DrawFn, rank: int) -> ShardingSpec | None:
    """A (valid) saved-sharding description for an array of ``rank``, or None."""
    if draw(st.booleans()):
        return None
    names = tuple(draw(st.lists(st.sampled_from("xyzw"), min_size=1, max_size=3, unique=True)))
    mesh_shape = tuple(draw(st.integers(1, 4)) for _ in names)
    free = list(names)
    spec: list[str | tuple[str, ...] | None] = []
    for _ in range(draw(st.integers(0, rank))):
        choice = draw(st.integers(0, 2)) if free else 0
        if choice == 0:
            spec.append(None)
        elif choice == 1:
            spec.append(free.pop(draw(st.integers(0, len(free) - 1))))
        else:
            k = draw(st.integers(1, len(free)))
            spec.append(tuple(free.pop(0) for _ in range(k)))
    return ShardingSpec(names, mesh_shape, tuple(spec))


_U32 = st.integers(0, 2**32 - 1)
_CODECS: st.SearchStrategy[Codec] = st.sampled_from(CODECS)
_OFFSETS = st.integers(0, 2**40)
_KINDS: st.SearchStrategy[ArrayKind] = st.sampled_from(get_args(ArrayKind))
_KEY_IMPLS = st.sampled_from(["threefry2x32", "rbg"])
_DTYPES = st.sampled_from(DTYPE_NAMES)
_SHAPES = shapes(max_rank=3, max_side=6)


@st.composite
def grid_tilings(draw: st.DrawFn, shape: tuple[int, ...], *, max_cuts: int = 3) -> list[Box]:
    """The cells, in C order, of a random grid over ``shape`` (what a sharding saves; cells
    may be empty where cuts repeat)."""
    cuts = [[0, *sorted(draw(st.lists(st.integers(0, n), max_size=max_cuts))), n] for n in shape]
    return [tuple(cell) for cell in itertools.product(*[list(itertools.pairwise(c)) for c in cuts])]


@st.composite
def _chunk_entries(
    draw: st.DrawFn, shape: tuple[int, ...], itemsize: int
) -> tuple[ChunkEntry, ...]:
    out = []
    for box in draw(st.one_of(tilings(shape, max_pieces=6), grid_tilings(shape, max_cuts=2))):
        raw_length = box_volume(box) * itemsize
        codec = draw(_CODECS)
        length = raw_length if codec == "raw" else draw(st.integers(0, raw_length + 64))
        crc = draw(_U32)
        key, offset = draw(_OBJECT_KEYS), draw(_OFFSETS)
        raw_crc = crc if codec == "raw" else draw(_U32)
        out.append(ChunkEntry(box, key, offset, length, raw_length, codec, crc, raw_crc))
    return tuple(out)


@st.composite
def _array_leaf(draw: st.DrawFn, path: KeyPath) -> ArrayLeaf:
    shape = draw(_SHAPES)
    dtype = draw(_DTYPES)
    kind = draw(_KINDS)
    key_impl = draw(_KEY_IMPLS) if kind == "prng_key" else None
    itemsize = dtype_from_name(dtype).itemsize
    entries = draw(_chunk_entries(shape, itemsize))
    chunks = table_from_entries(entries, shape=shape, itemsize=itemsize)
    sharding = None if kind == "numpy" else draw(sharding_specs(len(shape)))
    return ArrayLeaf(
        path=path,
        shape=shape,
        dtype=dtype,
        chunks=chunks,
        kind=kind,
        sharding=sharding,
        key_impl=key_impl,
    )


_FLOATS = st.floats(allow_nan=True, allow_infinity=True)
_VTYPES = st.sampled_from(["none", "bool", "int", "float", "complex", "str"])
_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "none": st.none(),
    "bool": st.booleans(),
    "int": st.integers(-(2**80), 2**80),
    "float": _FLOATS,
    "complex": st.tuples(_FLOATS, _FLOATS),
    "str": st.text(max_size=12),
}


@st.composite
def _value_leaf(draw: st.DrawFn, path: KeyPath) -> ValueLeaf:
    vtype = draw(_VTYPES)
    return ValueLeaf(path=path, vtype=vtype, value=draw(_VALUES[vtype]))  # type: ignore[arg-type]


_PATH_LISTS = st.lists(key_paths(), max_size=8, unique=True)
_METADATA = st.dictionaries(st.text(max_size=6), json_values(), max_size=4)


@st.composite
def manifests(draw: st.DrawFn, *, max_leaves: int = 5) -> Manifest:
    """Valid manifests: unique paths, exact chunk tilings, any dtype, sharding and metadata."""
    paths = draw(_PATH_LISTS)[:max_leaves]
    leaves: list[Leaf] = [
        draw(_array_leaf(p)) if draw(st.booleans()) else draw(_value_leaf(p)) for p in paths
    ]
    return Manifest(
        step=draw(st.integers(0, 2**62)),
        leaves=tuple(leaves),
        num_processes=draw(st.integers(1, 4096)),
        created_unix=draw(st.floats(0, 2e9)),
        writer_version=draw(st.text(max_size=8)),
        metadata=draw(_METADATA),
    )
