"""Where things are in an orbax-checkpoint directory, and what its metadata says.

Orbax's layout (as of orbax-checkpoint 0.12): a ``CheckpointManager`` root holds one
directory per step (``<step>``, finalized by an atomic rename locally or a
``commit_success.txt`` on object stores); a step directory holds one directory per item
(``default`` for a single ``StandardSave``); an item directory holds ``_METADATA`` (the tree:
key names, key kinds, value types, and whether arrays are OCDBT/zarr3), ``_sharding``
(base64 parameter name -> sharding JSON), ``array_metadatas/process_<i>`` (PRNG key
implementations), ``_strings.json`` (str leaves) and the array data (an OCDBT database, or
one kvstore directory per parameter). Local paths are read with ``os``; ``gs://`` with a
tensorstore kvstore. Nothing here imports orbax.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import re
from typing import Any

from fastckpt.errors import CheckpointNotFoundError, ConfigError, ManifestError
from fastckpt.format.manifest import KeyPath

__all__ = [
    "EMPTY_TYPES",
    "OrbaxEntry",
    "OrbaxItem",
    "is_orbax_dir",
    "kv_spec",
    "load_item",
    "read_json",
    "resolve_item_dir",
]

#: Orbax value types that carry no data (empty containers, None) and what they restore as.
EMPTY_TYPES: dict[str, Any] = {
    "None": None,
    "Dict": {},
    "List": [],
    "Tuple": (),
    "NamedTuple": (),
    "Unknown": None,
}
_STEP_DIR = re.compile(r"^(?:.*_)?(\d+)$")


def import_tensorstore() -> Any:
    """The ``tensorstore`` module, which only reading Orbax checkpoints needs
    (:class:`ConfigError` if it is not installed: it comes with the ``orbax`` extra)."""
    try:
        import tensorstore
    except ImportError as e:
        raise ConfigError(
            "reading an Orbax checkpoint needs tensorstore: pip install 'fastckpt[orbax]'"
        ) from e
    return tensorstore


# ---------------------------------------------------------------- paths (local or gs://)


def kv_spec(url: str) -> dict[str, Any]:
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
        raise ConfigError(
            f"unsupported Orbax checkpoint URL {url!r} (use a path, file:// or gs://)"
        )
    return {"driver": "file", "path": os.path.abspath(url).rstrip("/") + "/"}


def _join(url: str, name: str) -> str:
    return url.rstrip("/") + "/" + name


class _Dir:
    """A directory of an Orbax checkpoint: local (``os``) or remote (tensorstore kvstore)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.spec = kv_spec(url)
        self.local: str | None = self.spec["path"] if self.spec["driver"] == "file" else None
        """The local directory (with a trailing ``/``); None for a remote one."""
        self._kv: Any = None

    def _store(self) -> Any:
        if self._kv is None:
            self._kv = import_tensorstore().KvStore.open(self.spec).result()
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


def read_json(d: _Dir | str, name: str) -> Any:
    """Parse the JSON file ``name`` in directory ``d`` (or its URL); None if it does not exist."""
    d = _Dir(d) if isinstance(d, str) else d
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
        if d.local is None and d.child(name).read("commit_success.txt") is None:
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


def resolve_item_dir(
    url: str, *, step: int | None = None, item: str | None = None
) -> tuple[str, int | None]:
    """``(item_url, step)`` of the item directory in an Orbax item dir, step dir or manager
    root; ``step`` is parsed from the step directory name when there is one, and
    ``step=None`` on a manager root picks the newest finalized step.
    :class:`CheckpointNotFoundError`: nothing Orbax-like there, or no such step/item.
    """
    d = _Dir(url)
    picked = (
        d
        if d.read("_METADATA") is not None or d.read("checkpoint") is not None
        else _pick_item(d, item)
    )
    if picked is not None:
        m = _STEP_DIR.match(os.path.basename(url.rstrip("/")))
        return picked.url, (int(m.group(1)) if m else step)
    steps = _orbax_steps(d)
    if not steps:
        raise CheckpointNotFoundError(f"no Orbax checkpoint at {url}")
    step = max(steps) if step is None else step
    if step not in steps:
        raise CheckpointNotFoundError(
            f"no finalized Orbax step {step} in {url} (steps: {sorted(steps)})"
        )
    picked = _pick_item(d.child(steps[step]), item)
    if picked is None:
        raise CheckpointNotFoundError(
            f"Orbax step dir {_join(url, steps[step])} holds no PyTree item"
        )
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
    """``jax.Array``, ``np.ndarray``, ``scalar``, ``string`` or an empty type (``None``,
    ``Dict``...)."""

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
    """Parse ``_METADATA``, ``_sharding`` and ``array_metadatas`` of an item directory:
    CheckpointNotFoundError without ``_METADATA``, ManifestError (naming the file) for a
    metadata file that is not JSON or not shaped as Orbax writes it."""
    d = _Dir(url)
    meta = read_json(d, "_METADATA")
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
        key_impls.update(_key_impls(read_json(amd, name), _join(amd.url, name)))
    return OrbaxItem(
        url,
        entries,
        bool(meta.get("use_ocdbt", True)),
        bool(meta.get("use_zarr3", False)),
        key_impls,
        _shardings(read_json(d, "_sharding"), _join(url, "_sharding")),
    )


def _key_impls(doc: Any, where: str) -> dict[str, str]:
    """Parameter name -> PRNG implementation, from one ``array_metadatas/process_<i>`` document
    (:class:`ManifestError` if it is not shaped as Orbax writes it)."""
    if doc is None:
        return {}
    records = doc.get("array_metadatas", []) if isinstance(doc, dict) else None
    if not isinstance(records, list):
        raise ManifestError(f"{where}: expected an object with an 'array_metadatas' list")
    out: dict[str, str] = {}
    for i, record in enumerate(records):
        a = record.get("array_metadata", {}) if isinstance(record, dict) else None
        ext = (a.get("ext_metadata") or {}) if isinstance(a, dict) else None
        if not isinstance(ext, dict):
            raise ManifestError(f"{where}: array_metadatas[{i}] is malformed: {record!r:.80}")
        if ext.get("random_key_impl"):
            if "param_name" not in a:  # type: ignore[operator]
                raise ManifestError(
                    f"{where}: array_metadatas[{i}] has a key implementation but no param_name"
                )
            out[str(a["param_name"])] = str(ext["random_key_impl"])  # type: ignore[index]
    return out


def _shardings(doc: Any, where: str) -> dict[str, Any]:
    """Parameter name -> saved sharding JSON, from ``_sharding`` (:class:`ManifestError` if it
    is not a JSON object; entries that do not decode are skipped: they are informational)."""
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ManifestError(f"{where}: expected a JSON object, got {type(doc).__name__}")
    out: dict[str, Any] = {}
    for k, v in doc.items():
        try:
            out[base64.b64decode(k).decode()] = json.loads(v)
        except (ValueError, TypeError):
            continue
    return out
