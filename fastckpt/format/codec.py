"""Manifest <-> JSON. Strict: every field is type-checked on decode; never pickle.

The JSON layout, field by field: ``docs/format.md``; an array leaf's ``"chunks"`` is a chunk
table (:mod:`fastckpt.format.chunk_table`). ``format_version`` 3 is the only format: any
other is refused with ``UnsupportedFormatVersionError``. Floats JSON cannot hold are written
as ``"nan"``, ``"inf"``, ``"-inf"``; complex values as ``[re, im]``; numbers that overflow a
float (``1e400``) are refused.

Integrity: the encoder writes ``"manifest_crc32c"`` first, the crc32c of the canonical JSON
(sorted keys, compact separators) of every other field, so a corrupted manifest (a change the
chunk checksums cannot see) fails to decode. It is mandatory (``ManifestError`` without it)
and checked after the structural checks (a malformed manifest still reports its first flaw),
on the raw bytes when laid out as the encoder writes them, else on the canonical re-encoding.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any, NoReturn

import numpy as np

from fastckpt._checksum import crc32c
from fastckpt._pygc import paused_gc
from fastckpt.errors import ManifestError, UnsupportedFormatVersionError
from fastckpt.format.checks import fail as _fail
from fastckpt.format.checks import json_dict as _dict
from fastckpt.format.checks import json_float as _float_from_json
from fastckpt.format.checks import json_int as _int
from fastckpt.format.checks import json_list as _list
from fastckpt.format.checks import json_str as _str
from fastckpt.format.chunk_table import decode_chunk_table, decode_object_keys, encode_table
from fastckpt.format.dtypes import dtype_from_name
from fastckpt.format.manifest import (
    FORMAT_VERSION,
    ArrayLeaf,
    KeyPath,
    Leaf,
    Manifest,
    ShardingSpec,
    ValueLeaf,
)

__all__ = [
    "CHECKSUM_FIELD",
    "MAX_MANIFEST_BYTES",
    "decode_manifest",
    "encode_manifest",
    "leaf_to_json",
    "seal_document",
]

#: Manifests larger than this are refused before parsing (hostile-input guard).
MAX_MANIFEST_BYTES = 512 * 1024 * 1024
_MAX_NDIM = 64
#: Name of the integrity field; the encoder writes it first.
CHECKSUM_FIELD = "manifest_crc32c"
_CHECKSUM_PREFIX = re.compile(rb'\A\{"manifest_crc32c":(0|[1-9][0-9]{0,9}),')


def _float_to_json(x: float) -> float | str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def leaf_to_json(leaf: Leaf) -> dict[str, Any]:
    """``leaf`` as a manifest's JSON holds it, less an array's ``"chunks"``."""
    path = [[k, v] for k, v in leaf.path]
    if isinstance(leaf, ValueLeaf):
        value: Any = leaf.value
        if leaf.vtype == "float":
            value = _float_to_json(float(value))
        elif leaf.vtype == "complex":
            re, im = value
            value = [_float_to_json(re), _float_to_json(im)]
        return {"path": path, "type": "value", "vtype": leaf.vtype, "value": value}
    sharding = None
    if leaf.sharding is not None:
        sharding = {
            "mesh_axis_names": list(leaf.sharding.mesh_axis_names),
            "mesh_shape": list(leaf.sharding.mesh_shape),
            "partition_spec": [
                list(p) if isinstance(p, tuple) else p for p in leaf.sharding.partition_spec
            ],
        }
    return {
        "path": path,
        "type": "array",
        "kind": leaf.kind,
        "shape": list(leaf.shape),
        "dtype": leaf.dtype,
        "key_impl": leaf.key_impl,
        "sharding": sharding,
    }


def _leaf_to_json(leaf: Leaf, objects: dict[str, int] | None) -> dict[str, Any]:
    doc = leaf_to_json(leaf)
    if isinstance(leaf, ArrayLeaf):
        remap = None if objects is None else _remap(leaf, objects)
        doc["chunks"] = encode_table(leaf.chunks, shape=leaf.shape, remap=remap)
    return doc


def _remap(leaf: ArrayLeaf, objects: dict[str, int]) -> np.ndarray:
    """``leaf``'s table's object indices -> indices in ``objects`` (the keys it references
    added in order of their index)."""
    cols = leaf.chunks.columns()
    remap = np.zeros(len(cols.keys), np.int64)
    for k in np.unique(cols.object_index).tolist():
        remap[k] = objects.setdefault(cols.keys[k], len(objects))
    return remap


def encode_manifest(manifest: Manifest) -> bytes:
    """Serialise a manifest to UTF-8 JSON bytes (deterministic key order), checksum first.
    ``"objects"`` is the one key list every table indexes when they share one, else the keys
    the tables reference, each once. The caller vouches for the tables (the decoder checks)."""
    keys = [a.chunks.columns().keys for a in manifest.arrays()]
    shared = keys[0] if keys and all(k is keys[0] for k in keys) else None
    objects: dict[str, int] | None = None if shared is not None else {}
    leaves = [_leaf_to_json(leaf, objects) for leaf in manifest.leaves]
    doc: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "step": manifest.step,
        "num_processes": manifest.num_processes,
        "created_unix": manifest.created_unix,
        "writer_version": manifest.writer_version,
        "metadata": manifest.metadata,
        "leaves": leaves,
        "objects": list(shared if shared is not None else objects or ()),
    }
    return seal_document(doc)


def seal_document(doc: Mapping[str, Any]) -> bytes:
    """The bytes of a manifest document (decoded JSON; a ``manifest_crc32c`` in it is
    replaced): its canonical JSON with the checksum first, as :func:`encode_manifest` writes
    it. For tools and tests that edit a manifest's JSON; ``ManifestError`` if ``doc`` is not
    JSON-serialisable."""
    body = _canonical({k: v for k, v in doc.items() if k != CHECKSUM_FIELD})
    return b'{"%s":%d,' % (CHECKSUM_FIELD.encode(), crc32c(body)) + body[1:]


def _canonical(doc: Mapping[str, Any]) -> bytes:
    try:
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError, RecursionError) as e:
        raise ManifestError(f"manifest is not JSON-serialisable: {e}") from e


def _check_integrity(data: bytes, doc: dict[str, Any]) -> None:
    """Verify ``manifest_crc32c`` (popped from ``doc``); ``ManifestError`` if absent or wrong."""
    if CHECKSUM_FIELD not in doc:
        _fail(
            f"manifest has no {CHECKSUM_FIELD}: refused (every manifest fastckpt writes carries "
            "it; without it a corrupted manifest could restore wrong state)"
        )
    stored = doc.pop(CHECKSUM_FIELD)
    if type(stored) is not int or not 0 <= stored <= 0xFFFFFFFF:
        _fail(f"{CHECKSUM_FIELD}: expected a u32, got {stored!r:.40}")
    m = _CHECKSUM_PREFIX.match(data)
    if m is not None and int(m.group(1)) == stored and crc32c(b"{" + data[m.end() :]) == stored:
        return  # the encoder's own layout, intact
    if crc32c(_canonical(doc)) != stored:
        _fail("manifest checksum mismatch: the manifest is corrupted (or was edited)")


def _path(obj: Any, what: str) -> KeyPath:
    out = []
    for i, entry in enumerate(_list(obj, what)):
        e = _list(entry, f"{what}[{i}]")
        if len(e) != 2 or e[0] not in ("d", "i", "a", "f"):
            _fail(f"{what}[{i}]: bad key entry {e!r:.80}")
        kind, key = e
        if kind == "d":
            if type(key) not in (str, int):
                _fail(f"{what}[{i}]: dict key must be str or int")
        elif kind == "a":
            _str(key, f"{what}[{i}]")
        else:
            _int(key, f"{what}[{i}]")
        out.append((kind, key))
    return tuple(out)


def _sharding(obj: Any, rank: int, what: str) -> ShardingSpec | None:
    if obj is None:
        return None
    d = _dict(obj, what, ("mesh_axis_names", "mesh_shape", "partition_spec"))
    names = tuple(_str(n, f"{what}.mesh_axis_names") for n in _list(d["mesh_axis_names"], what))
    mshape = tuple(_int(n, f"{what}.mesh_shape", lo=1) for n in _list(d["mesh_shape"], what))
    if len(names) != len(mshape):
        _fail(f"{what}: {len(names)} axis names but mesh rank {len(mshape)}")
    if len(set(names)) != len(names):
        _fail(f"{what}: duplicate mesh axis names")
    spec: list[str | tuple[str, ...] | None] = []
    used: list[str] = []
    for p in _list(d["partition_spec"], f"{what}.partition_spec"):
        if p is None:
            spec.append(None)
        elif type(p) is str:
            spec.append(p)
            used.append(p)
        else:
            axes = tuple(_str(x, f"{what}.partition_spec") for x in _list(p, what))
            spec.append(axes)
            used.extend(axes)
    if len(spec) > rank:
        _fail(f"{what}: partition_spec has {len(spec)} entries for an array of rank {rank}")
    if any(a not in names for a in used) or len(set(used)) != len(used):
        _fail(f"{what}: partition_spec must name distinct mesh axes of {list(names)}")
    return ShardingSpec(names, mshape, tuple(spec))


def _value_leaf(d: Mapping[str, Any], path: KeyPath, what: str) -> ValueLeaf:
    vtype, value = d.get("vtype"), d.get("value")
    if vtype == "none":
        if value is not None:
            _fail(f"{what}: none leaf with a value")
    elif vtype == "bool":
        if type(value) is not bool:
            _fail(f"{what}: expected a bool")
    elif vtype == "int":
        if type(value) is not int:
            _fail(f"{what}: expected an int")
    elif vtype == "float":
        value = _float_from_json(value, what)
    elif vtype == "complex":
        pair = _list(value, what)
        if len(pair) != 2:
            _fail(f"{what}: complex needs [re, im]")
        value = (_float_from_json(pair[0], what), _float_from_json(pair[1], what))
    elif vtype == "str":
        value = _str(value, what)
    else:
        _fail(f"{what}: unknown vtype {vtype!r:.40}")
    return ValueLeaf(path=path, vtype=vtype, value=value)


def _array_leaf(d: Mapping[str, Any], path: KeyPath, what: str, objects: list[str]) -> ArrayLeaf:
    d = _dict(d, what, ("shape", "dtype", "chunks"))
    shape_l = _list(d["shape"], f"{what}.shape")
    if len(shape_l) > _MAX_NDIM:
        _fail(f"{what}.shape: rank {len(shape_l)} too large")
    shape = tuple(_int(n, f"{what}.shape") for n in shape_l)
    dtype = dtype_from_name(d["dtype"])
    kind = d.get("kind", "jax")
    if kind not in ("jax", "numpy", "prng_key"):
        _fail(f"{what}.kind: unknown kind {kind!r:.40}")
    key_impl = d.get("key_impl")
    if key_impl is not None:
        _str(key_impl, f"{what}.key_impl")
    if kind == "prng_key" and key_impl is None:
        _fail(f"{what}: prng_key leaf without key_impl")
    # validated (tiling included) column by column
    chunks = decode_chunk_table(
        d["chunks"], shape=shape, itemsize=dtype.itemsize, objects=objects, what=f"{what}.chunks"
    )
    return ArrayLeaf(
        path=path,
        shape=shape,
        dtype=dtype.name,
        chunks=chunks,
        kind=kind,
        sharding=_sharding(d.get("sharding"), len(shape), f"{what}.sharding"),
        key_impl=key_impl,
    )


def _reject_constant(name: str) -> NoReturn:
    # Strict JSON: NaN/Infinity are not JSON, and encode_manifest could not write them back.
    raise ValueError(f"non-standard JSON constant {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: encode_manifest could not write it back
        raise ValueError(f"number {text[:40]} overflows a float")
    return value


def decode_manifest(data: bytes | bytearray | memoryview) -> Manifest:
    """Parse and validate manifest JSON; raises ``ManifestError`` (or a subclass) on any flaw:
    ``UnsupportedFormatVersionError`` for a ``format_version`` other than 3, ``ManifestError``
    for a manifest without its ``manifest_crc32c`` or whose checksum does not match. Every
    array leaf's chunks decode to one :class:`~fastckpt.format.manifest.ChunkTable`, all
    indexing one object key list. Runs with the cyclic garbage collector paused."""
    with paused_gc():
        return _decode(data)


def _decode(data: bytes | bytearray | memoryview) -> Manifest:
    if len(data) > MAX_MANIFEST_BYTES:
        _fail(f"manifest of {len(data)} bytes exceeds the {MAX_MANIFEST_BYTES}-byte limit")
    data = bytes(data)
    try:
        doc = json.loads(data, parse_constant=_reject_constant, parse_float=_finite_float)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ManifestError(f"manifest is not valid JSON: {e}") from e
    d = _dict(doc, "manifest", ("format_version", "step", "leaves"))
    version = d["format_version"]
    if type(version) is not int:
        _fail(f"format_version must be an int, got {version!r:.40}")
    if version != FORMAT_VERSION:
        raise UnsupportedFormatVersionError(
            f"manifest format_version {version} is not supported (this fastckpt reads "
            f"format_version {FORMAT_VERSION} only)"
        )
    objects = decode_object_keys(d.get("objects"), "objects")
    leaves: list[Leaf] = []
    seen: set[KeyPath] = set()
    for i, raw in enumerate(_list(d["leaves"], "leaves")):
        what = f"leaves[{i}]"
        ld = _dict(raw, what, ("path", "type"))
        path = _path(ld["path"], f"{what}.path")
        if path in seen:
            _fail(f"{what}: duplicate path")
        seen.add(path)
        if ld["type"] == "array":
            leaves.append(_array_leaf(ld, path, what, objects))
        elif ld["type"] == "value":
            leaves.append(_value_leaf(ld, path, what))
        else:
            _fail(f"{what}.type: unknown leaf type {ld['type']!r:.40}")
    metadata = d.get("metadata", {})
    if type(metadata) is not dict:
        _fail("metadata must be an object")
    created = d.get("created_unix", 0.0)
    if type(created) not in (int, float) or not -1e18 < created < 1e18:
        _fail(f"created_unix must be a number of seconds, got {created!r:.40}")
    manifest = Manifest(
        step=_int(d["step"], "step"),
        leaves=tuple(leaves),
        num_processes=_int(d.get("num_processes", 1), "num_processes", lo=1),
        created_unix=float(created),
        writer_version=_str(d.get("writer_version", ""), "writer_version"),
        metadata=metadata,
    )
    _check_integrity(data, doc)
    return manifest
