"""Read checkpoints written by orbax-checkpoint with tensorstore directly (no handler stack).

What is read: the item directory of an Orbax PyTree/Standard checkpoint (``_METADATA``,
OCDBT or per-array kvstores, zarr v2 or zarr3 arrays, ``_sharding``, ``_strings.json``,
``array_metadatas/process_*`` for PRNG key implementations). Orbax itself is not imported;
only ``tensorstore`` (a core dependency) is.

Call order inside :func:`read_item`: parse metadata (pure) -> match the target's leaves by
their Orbax parameter names -> open every array's tensorstore (concurrently) -> check shapes
and dtypes (typed errors) -> per leaf, read only the boxes this process's devices need ->
``jax.make_array_from_single_device_arrays``. Host memory held at once is bounded by
``max_inflight_bytes`` (plus one leaf's boxes).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import re
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from fastckpt._tree import is_prng_key, unflatten_from_paths
from fastckpt.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptionError,
    DtypeMismatchError,
    ManifestError,
    ShapeMismatchError,
    TreeStructureError,
)
from fastckpt.format.manifest import Box, KeyPath
from fastckpt.planning import box_from_index, box_to_slices, full_box

__all__ = ["OrbaxEntry", "OrbaxItem", "is_orbax_dir", "load_item", "read_item", "resolve_item_dir"]

#: Orbax value types that carry no data (empty containers, None).
EMPTY_TYPES = {"None": None, "Dict": {}, "List": [], "Tuple": (), "NamedTuple": (), "Unknown": None}
_ARRAY_TYPES = ("jax.Array", "np.ndarray", "scalar")
_STEP_DIR = re.compile(r"^(?:.*_)?(\d+)$")


# ---------------------------------------------------------------- paths (local or gs://)


def _kv_spec(url: str) -> dict[str, Any]:
    """tensorstore kvstore spec of a directory URL (trailing ``/`` in ``path``)."""
    if url.startswith("gs://"):
        bucket, _, prefix = url[5:].partition("/")
        if not bucket:
            raise ConfigError(f"malformed GCS URL {url!r}")
        prefix = prefix.strip("/")
        return {"driver": "gcs", "bucket": bucket, "path": prefix + "/" if prefix else ""}
    if url.startswith("file://"):
        url = url[len("file://") :]
    elif re.match(r"^[A-Za-z][A-Za-z0-9+.\-]*://", url):
        raise ConfigError(f"unsupported Orbax checkpoint URL {url!r} (use a path, file:// or gs://)")
    return {"driver": "file", "path": os.path.abspath(url).rstrip("/") + "/"}


def _join(url: str, name: str) -> str:
    return url.rstrip("/") + "/" + name


class _Dir:
    """A directory of an Orbax checkpoint: local (``os``) or remote (tensorstore kvstore)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.spec = _kv_spec(url)
        self._kv: Any = None

    @property
    def local(self) -> str | None:
        return self.spec["path"] if self.spec["driver"] == "file" else None

    def _store(self) -> Any:
        if self._kv is None:
            import tensorstore as ts

            self._kv = ts.KvStore.open(self.spec).result()
        return self._kv

    def read(self, name: str) -> bytes | None:
        if self.local is not None:
            try:
                with open(os.path.join(self.local, name), "rb") as f:
                    return f.read()
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                return None
        r = self._store().read(name).result()
        return None if r.state == "missing" else bytes(r.value)

    def children(self) -> set[str]:
        """Names of the entries directly below this directory."""
        if self.local is not None:
            try:
                return set(os.listdir(self.local))
            except (FileNotFoundError, NotADirectoryError):
                return set()
        return {k.decode().split("/", 1)[0] for k in self._store().list().result()}

    def child(self, name: str) -> _Dir:
        return _Dir(_join(self.url, name))


def _load_json(d: _Dir, name: str) -> Any:
    data = d.read(name)
    if data is None:
        return None
    try:
        return json.loads(data)
    except ValueError as e:
        raise ManifestError(f"{_join(d.url, name)} is not valid JSON: {e}") from e


def is_orbax_dir(url: str) -> bool:
    """Whether ``url`` looks like an Orbax item dir, step dir or manager root."""
    try:
        resolve_item_dir(url)
    except (CheckpointNotFoundError, ConfigError):
        return False
    return True


def _orbax_steps(d: _Dir) -> dict[int, str]:
    """Finalized step directories of an Orbax manager root: step -> name."""
    out: dict[int, str] = {}
    for name in d.children():
        m = _STEP_DIR.match(name)
        if m is None or "tmp" in name:
            continue
        child = d.child(name)
        if d.local is None and child.read("commit_success.txt") is None:
            continue  # not finalized (object stores have no atomic rename)
        out[int(m.group(1))] = name
    return out


def _pick_item(d: _Dir, item: str | None) -> _Dir | None:
    names = sorted(n for n in d.children() if d.child(n).read("_METADATA") is not None)
    if not names:
        return None
    if item is not None:
        if item not in names:
            raise CheckpointNotFoundError(f"no item {item!r} in {d.url} (items: {names})")
        return d.child(item)
    if "default" in names:
        return d.child("default")
    if len(names) == 1:
        return d.child(names[0])
    raise ConfigError(f"{d.url} holds several items {names}; pass item=")


def resolve_item_dir(url: str, *, step: int | None = None, item: str | None = None) -> tuple[str, int | None]:
    """Find the item directory in an Orbax item dir, step dir or manager root.

    Returns ``(item_url, step)``; ``step`` is parsed from the step directory name when
    there is one. ``step=None`` on a manager root picks the newest finalized step.

    Raises:
        CheckpointNotFoundError: nothing Orbax-like there, or no such step/item.
    """
    d = _Dir(url)
    if d.read("_METADATA") is not None or d.read("checkpoint") is not None:
        m = _STEP_DIR.match(os.path.basename(url.rstrip("/")))
        return url, (int(m.group(1)) if m else step)
    picked = _pick_item(d, item)
    if picked is not None:
        m = _STEP_DIR.match(os.path.basename(url.rstrip("/")))
        return picked.url, (int(m.group(1)) if m else step)
    steps = _orbax_steps(d)
    if not steps:
        raise CheckpointNotFoundError(f"no Orbax checkpoint at {url}")
    if step is None:
        step = max(steps)
    if step not in steps:
        raise CheckpointNotFoundError(f"no finalized Orbax step {step} in {url} (steps: {sorted(steps)})")
    picked = _pick_item(d.child(steps[step]), item)
    if picked is None:
        raise CheckpointNotFoundError(f"Orbax step dir {_join(url, steps[step])} holds no PyTree item")
    return picked.url, step


# ---------------------------------------------------------------- metadata


@dataclasses.dataclass(frozen=True, slots=True)
class OrbaxEntry:
    """One leaf of an Orbax item, as ``_METADATA`` describes it."""

    names: tuple[str, ...]
    """Key names along the path (Orbax stores every key as a string)."""
    sequence: tuple[bool, ...]
    """Per key: a sequence index (True) or a dict key / attribute (False)."""
    value_type: str
    """``jax.Array``, ``np.ndarray``, ``scalar``, ``string`` or an empty type (``None``, ``Dict``...)."""

    @property
    def param_name(self) -> str:
        """Orbax's parameter name: the key names joined by ``.``."""
        return ".".join(self.names)

    @property
    def keypath(self) -> KeyPath:
        """The fastckpt key path (dict keys and list indices)."""
        return tuple(("i", int(n)) if s else ("d", n) for n, s in zip(self.names, self.sequence))


@dataclasses.dataclass
class OrbaxItem:
    """Parsed metadata of one Orbax item directory."""

    url: str
    entries: dict[tuple[str, ...], OrbaxEntry]
    use_ocdbt: bool
    use_zarr3: bool
    key_impls: dict[str, str]
    """Parameter name -> PRNG implementation, for typed-key leaves."""
    shardings: dict[str, Any]
    """Parameter name -> the saved sharding description (JSON)."""


def load_item(url: str) -> OrbaxItem:
    """Parse ``_METADATA``, ``_sharding`` and ``array_metadatas`` of an item directory."""
    d = _Dir(url)
    meta = _load_json(d, "_METADATA")
    if meta is None:
        raise CheckpointNotFoundError(f"{url} has no _METADATA (not an Orbax PyTree item)")
    tree = meta.get("tree_metadata") if isinstance(meta, dict) else None
    if not isinstance(tree, dict):
        raise ManifestError(f"{url}/_METADATA has no tree_metadata")
    entries: dict[tuple[str, ...], OrbaxEntry] = {}
    for raw_key, entry in tree.items():
        try:
            keys = entry["key_metadata"]
            names = tuple(str(k["key"]) for k in keys)
            seq = tuple(int(k["key_type"]) == 1 for k in keys)
            vtype = str(entry["value_metadata"]["value_type"])
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"{url}/_METADATA: malformed entry {raw_key!r}: {e}") from e
        entries[names] = OrbaxEntry(names, seq, vtype)
    key_impls: dict[str, str] = {}
    amd = d.child("array_metadatas")
    for name in sorted(amd.children()):
        doc = _load_json(amd, name) or {}
        for a in doc.get("array_metadatas", []):
            a = a.get("array_metadata", {})
            ext = a.get("ext_metadata") or {}
            if ext.get("random_key_impl"):
                key_impls[str(a["param_name"])] = str(ext["random_key_impl"])
    shardings: dict[str, Any] = {}
    for k, v in (_load_json(d, "_sharding") or {}).items():
        try:
            shardings[base64.b64decode(k).decode()] = json.loads(v)
        except (ValueError, TypeError):
            continue  # informational only
    return OrbaxItem(url, entries, bool(meta.get("use_ocdbt", True)), bool(meta.get("use_zarr3", False)),
                     key_impls, shardings)


# ---------------------------------------------------------------- restore planning


def _names_of(jax_path: tuple[Any, ...]) -> tuple[str, ...]:
    """Orbax's key names of a jax key path (``str`` of the dict key / index / attribute)."""
    out = []
    for k in jax_path:
        if isinstance(k, jax.tree_util.DictKey):
            out.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            out.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            out.append(k.name)
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            out.append(str(k.key))
        else:
            raise ConfigError(f"unsupported pytree key {k!r}")
    return tuple(out)


def _device_ids(node: Any) -> list[Any]:
    if isinstance(node, dict):
        return [node.get("id")]
    if isinstance(node, list):
        return [i for child in node for i in _device_ids(child)]
    return []


def _saved_sharding(desc: Any) -> jax.sharding.Sharding | None:
    """Rebuild a saved NamedSharding on this job's devices if the device count matches."""
    if not isinstance(desc, dict) or desc.get("sharding_type") != "NamedSharding":
        return None
    shape = tuple(int(n) for n in desc.get("shape", ()))
    devices = jax.devices()
    if not shape or int(np.prod(shape)) != len(devices):
        return None
    by_id = {d.id: d for d in devices}
    ids = _device_ids((desc.get("device_mesh") or {}).get("mesh", []))
    if len(ids) == len(devices) and all(i in by_id for i in ids):
        mesh_devices = np.asarray([by_id[i] for i in ids], dtype=object).reshape(shape)
    else:
        mesh_devices = np.asarray(devices, dtype=object).reshape(shape)
    spec = [tuple(p) if isinstance(p, list) else p for p in desc.get("partition_spec", [])]
    mesh = jax.sharding.Mesh(mesh_devices, tuple(desc.get("axis_names", ())))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))


def _key_data_sharding(sharding: jax.sharding.Sharding, extra: int) -> jax.sharding.Sharding:
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*tuple(sharding.spec), *(None,) * extra))
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    raise ConfigError(f"PRNG key targets need a NamedSharding or SingleDeviceSharding, got {type(sharding).__name__}")


@dataclasses.dataclass
class _Leaf:
    entry: OrbaxEntry
    target: Any
    mode: str  # "jax" | "key" | "numpy" | "npscalar" | "pyscalar" | "string" | "empty"
    store: Any = None
    shape: tuple[int, ...] = ()
    dtype: np.dtype | None = None
    sharding: jax.sharding.Sharding | None = None
    key_impl: str | None = None
    device_boxes: list[tuple[jax.Device, Box]] = dataclasses.field(default_factory=list)


def _mode_of(entry: OrbaxEntry, tgt: Any, item: OrbaxItem) -> str:
    where = entry.param_name
    if entry.value_type in EMPTY_TYPES:
        return "empty"
    if entry.value_type == "string":
        if tgt is not None and not isinstance(tgt, str):
            raise TreeStructureError(f"{where}: checkpoint holds a string, target is {type(tgt).__name__}")
        return "string"
    if entry.value_type not in _ARRAY_TYPES:
        raise ConfigError(f"{where}: unsupported Orbax value type {entry.value_type!r}")
    if tgt is None:
        if entry.value_type == "scalar":
            return "pyscalar"
        if entry.value_type == "np.ndarray":
            return "numpy"
        return "key" if where in item.key_impls else "jax"
    if is_prng_key(tgt):
        return "key"
    if isinstance(tgt, np.generic):
        return "npscalar"
    if isinstance(tgt, np.ndarray):
        return "numpy"
    if isinstance(tgt, (jax.Array, jax.ShapeDtypeStruct)):
        return "jax"
    if isinstance(tgt, (bool, int, float, complex)):
        return "pyscalar"
    raise ConfigError(f"{where}: unsupported target leaf type {type(tgt).__name__}")


def _spec(item: OrbaxItem, name: str) -> dict[str, Any]:
    base = _kv_spec(item.url)
    if item.use_ocdbt:
        kv: dict[str, Any] = {"driver": "ocdbt", "base": base, "path": name, "cache_pool": "cache_pool#ocdbt"}
    else:
        kv = dict(base, path=base["path"] + name + "/")
    return {"driver": "zarr3" if item.use_zarr3 else "zarr", "kvstore": kv,
            "recheck_cached_data": False, "recheck_cached_metadata": False}


def _plan(leaf: _Leaf, item: OrbaxItem, *, allow_cast: bool) -> None:
    """Check the opened store against the target and plan per-device boxes (jax/key modes)."""
    where = leaf.entry.param_name
    stored_shape = tuple(int(n) for n in leaf.store.shape)
    stored_dtype = np.dtype(leaf.store.dtype.numpy_dtype)
    tgt = leaf.target
    leaf.shape, leaf.dtype = stored_shape, stored_dtype
    if leaf.mode == "key":
        impl = item.key_impls.get(where)
        if impl is None:
            raise DtypeMismatchError(f"{where}: target is a PRNG key array but the checkpoint holds plain {stored_dtype}")
        leaf.key_impl = impl
        key_shape = tuple(tgt.shape) if tgt is not None else stored_shape[:-1]
        if stored_shape[: len(key_shape)] != key_shape or len(key_shape) > len(stored_shape):
            raise ShapeMismatchError(f"{where}: key array shape {key_shape} != stored {stored_shape[:len(key_shape)]}")
        extra = len(stored_shape) - len(key_shape)
    elif tgt is not None and leaf.mode in ("jax", "numpy", "npscalar"):
        if tuple(tgt.shape) != stored_shape:
            raise ShapeMismatchError(f"{where}: target shape {tuple(tgt.shape)} != stored shape {stored_shape}")
        if np.dtype(tgt.dtype) != stored_dtype:
            if not allow_cast:
                raise DtypeMismatchError(f"{where}: target dtype {tgt.dtype} != stored dtype {stored_dtype} "
                                         "(pass allow_dtype_cast=True to convert)")
            leaf.dtype = np.dtype(tgt.dtype)
    elif leaf.mode == "pyscalar" and stored_shape != ():
        raise ShapeMismatchError(f"{where}: target is a scalar, stored shape is {stored_shape}")
    if leaf.mode not in ("jax", "key"):
        leaf.device_boxes = [(None, full_box(stored_shape))]  # type: ignore[list-item]
        return
    sharding = getattr(tgt, "sharding", None) if tgt is not None else None
    if sharding is None:
        sharding = _saved_sharding(item.shardings.get(where))
    if sharding is None:
        if jax.process_count() > 1:
            raise ConfigError(f"{where}: cannot rebuild the saved sharding here; pass a target with .sharding")
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    if isinstance(getattr(sharding, "mesh", None), jax.sharding.AbstractMesh):
        raise ConfigError(f"{where}: the target's sharding is over an AbstractMesh; pass concrete shardings "
                          "(fastckpt.integrations.pytree.abstract_state(target, mesh=mesh))")
    if leaf.mode == "key":
        idx_shape = stored_shape[: len(stored_shape) - extra]
        index_map = {d: tuple(idx) + (slice(None),) * extra
                     for d, idx in sharding.addressable_devices_indices_map(idx_shape).items()}
        leaf.sharding = _key_data_sharding(sharding, extra)
    else:
        index_map = sharding.addressable_devices_indices_map(stored_shape)
        leaf.sharding = sharding
    leaf.device_boxes = [(d, box_from_index(idx, stored_shape)) for d, idx in index_map.items()]


def _translate(e: Exception, what: str) -> Exception:
    msg = str(e)
    if "NOT_FOUND" in msg:
        return CheckpointNotFoundError(f"{what}: {msg}")
    return CorruptionError(f"{what}: {msg}")


def _finish(leaf: _Leaf, futures: dict[Box, Any], strings: dict[str, Any]) -> Any:
    where = leaf.entry.param_name
    if leaf.mode == "empty":
        return leaf.target if leaf.target is not None else EMPTY_TYPES[leaf.entry.value_type]
    if leaf.mode == "string":
        if where not in strings:
            raise CheckpointNotFoundError(f"string leaf {where} is missing from _strings.json")
        return str(strings[where])
    bufs: dict[Box, np.ndarray] = {}
    for box, fut in futures.items():
        try:
            arr = np.asarray(fut.result())
        except Exception as e:  # tensorstore raises ValueError subclasses
            raise _translate(e, f"reading {where}") from e
        assert leaf.dtype is not None
        bufs[box] = arr if arr.dtype == leaf.dtype else arr.astype(leaf.dtype)
    if leaf.mode in ("numpy", "npscalar", "pyscalar"):
        (arr,) = bufs.values()
        if leaf.mode == "numpy":
            return arr
        if leaf.mode == "npscalar":
            return arr[()]
        value = arr.item()
        return type(leaf.target)(value) if leaf.target is not None else value
    assert leaf.sharding is not None
    singles = [jax.device_put(bufs[box], d) for d, box in leaf.device_boxes]
    out = jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, singles)
    if leaf.mode == "key":
        out = jax.random.wrap_key_data(out, impl=leaf.key_impl)
    return out


def _match(item: OrbaxItem, target: Any, *, partial: bool) -> tuple[list[tuple[OrbaxEntry, Any]], Any]:
    """Pair target leaves with entries; returns ``([(entry, target_leaf)], treedef)``."""
    if target is None:
        return [(e, None) for e in item.entries.values()], None
    pairs, treedef = jax.tree_util.tree_flatten_with_path(target)
    out = []
    seen: set[tuple[str, ...]] = set()
    missing = []
    for path, leaf in pairs:
        names = _names_of(path)
        entry = item.entries.get(names)
        if entry is None:
            missing.append(".".join(names))
            continue
        seen.add(names)
        out.append((entry, leaf))
    if missing:
        raise TreeStructureError(f"target leaves not in the Orbax checkpoint {item.url}: {sorted(missing)[:10]}")
    extra = [e.param_name for n, e in item.entries.items() if n not in seen and e.value_type not in EMPTY_TYPES]
    if extra and not partial:
        raise TreeStructureError(f"the Orbax checkpoint has leaves the target lacks: {sorted(extra)[:10]} "
                                 "(pass partial=True to restore a subtree)")
    return out, treedef


def read_item(
    item: OrbaxItem,
    target: Any = None,
    *,
    partial: bool = False,
    allow_dtype_cast: bool = False,
    max_inflight_bytes: int = 1 << 30,
) -> Any:
    """Restore an Orbax item laid out as ``target`` (see :func:`fastckpt.integrations.orbax.restore_orbax`)."""
    import tensorstore as ts

    matched, treedef = _match(item, target, partial=partial)
    leaves = [_Leaf(e, t, _mode_of(e, t, item)) for e, t in matched]
    context = ts.Context({"cache_pool#ocdbt": {"total_bytes_limit": 100_000_000}})
    opens = {id(lf): ts.open(_spec(item, lf.entry.param_name), open=True, read=True, context=context)
             for lf in leaves if lf.mode not in ("empty", "string")}
    for lf in leaves:
        if id(lf) in opens:
            try:
                lf.store = opens[id(lf)].result()
            except Exception as e:
                raise _translate(e, f"opening {lf.entry.param_name} in {item.url}") from e
            _plan(lf, item, allow_cast=allow_dtype_cast)
    strings: dict[str, Any] = {}
    if any(lf.mode == "string" for lf in leaves):
        strings = _load_json(_Dir(item.url), "_strings.json") or {}
    results: list[Any] = [None] * len(leaves)
    pending: list[tuple[int, dict[Box, Any]]] = []
    inflight = 0

    def drain() -> None:
        nonlocal inflight
        for i, futs in pending:
            results[i] = _finish(leaves[i], futs, strings)
        pending.clear()
        inflight = 0

    for i, lf in enumerate(leaves):
        futs: dict[Box, Any] = {}
        for _, box in lf.device_boxes:
            if box not in futs:
                futs[box] = (lf.store[box_to_slices(box)] if box else lf.store).read()
                inflight += int(np.prod([b - a for a, b in box], dtype=np.int64)) * lf.store.dtype.numpy_dtype.itemsize
        pending.append((i, futs))
        if inflight >= max_inflight_bytes:
            drain()
    drain()
    if treedef is None:
        return unflatten_from_paths({lf.entry.keypath: r for lf, r in zip(leaves, results)})
    return jax.tree_util.tree_unflatten(treedef, results)

