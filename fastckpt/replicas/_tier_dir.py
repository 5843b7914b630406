"""A RAM tier's directory (internal): claiming it so that no other user can plant or swap its
files, and its layout (``docs/replicas.md``, "Layout"; a segment's index is written last, as
its seal).

A restore trusts a tier's bytes once their crc32c matches, so the directory must be this
user's alone: created ``0700``; an existing one refused when another user owns it, when group
or others may write it, or when it is a symlink; and every existing ancestor owned by root or
this user, and sticky wherever group or others may write it (as ``/dev/shm`` and ``/tmp``),
so nobody else can swap the directory. Inside a user namespace that does not map root,
root's files show the overflow uid (usually 65534): that uid counts as root there (hazard: a
real user with that uid outside is trusted as well).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import stat
import uuid
from pathlib import Path

from fastckpt.errors import ConfigError

__all__ = [
    "ChunkLocation",
    "atomic_write",
    "claim_tier_dir",
    "index_document",
    "new_name",
    "parse_step_dir",
    "unlink",
]

INDEX_SUFFIX = ".index.json"
DATA_SUFFIX = ".data"
MANIFEST = "manifest.json"
COMMIT = "commit.json"  # a step committed here whose manifest other hosts hold
INDEX_VERSION = 1


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkLocation:
    """Where one chunk lies in a segment."""

    offset: int
    """Byte offset of the chunk in the segment."""
    length: int
    """Raw length of the chunk in bytes."""
    raw_crc32c: int
    """crc32c of the chunk's raw bytes (``ChunkEntry.raw_crc32c``)."""


def claim_tier_dir(root: str | Path) -> Path:
    """Create ``root`` (mode 0700; missing ancestors with the default mode) or check the
    existing one, and return it as an absolute path.

    Raises:
        ConfigError: the directory or an ancestor fails the rules in the module docstring.
    """
    path = Path(os.path.abspath(root))
    euid = os.geteuid()
    trusted = {0, euid, *_unmapped_root_uid()}
    for ancestor in reversed(path.parents):
        try:
            st = os.stat(ancestor)  # an ancestor may be a symlink (e.g. /var/run): judge its target
        except FileNotFoundError:
            break
        if st.st_uid not in trusted:
            raise ConfigError(
                f"RAM tier {path}: its ancestor {ancestor} belongs to uid {st.st_uid}, who could "
                "replace the tier's directory; use a directory of your own"
            )
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            raise ConfigError(
                f"RAM tier {path}: its ancestor {ancestor} is writable by others and not sticky "
                f"(mode {stat.S_IMODE(st.st_mode):o}), so others could replace the tier's directory"
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(
            f"RAM tier {path} is a symlink; a tier directory must be a real directory"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"RAM tier {path} exists and is not a directory")
    if st.st_uid != euid:
        raise ConfigError(
            f"RAM tier {path} belongs to uid {st.st_uid}, not to this process's uid {euid}"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(
            f"RAM tier {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}): "
            "others could plant chunks in it; it must be 0700"
        )
    return path


def _unmapped_root_uid() -> tuple[int, ...]:
    """The overflow uid, as which root's files appear inside a user namespace that does not
    map outside uid 0; empty where root is mapped (or the kernel does not say)."""
    try:
        with open("/proc/self/uid_map") as f:
            ranges = [tuple(map(int, line.split())) for line in f if line.strip()]
        if any(outside <= 0 < outside + count for _, outside, count in ranges):
            return ()
        with open("/proc/sys/kernel/overflowuid") as f:
            return (int(f.read()),)
    except (OSError, ValueError):
        return ()


def index_document(
    step: int, data_name: str, nbytes: int, index: dict[str, ChunkLocation]
) -> bytes:
    """The JSON index of a segment."""
    doc = {
        "version": INDEX_VERSION,
        "step": step,
        "data": data_name,
        "nbytes": nbytes,
        "chunks": [[cid, loc.offset, loc.length, loc.raw_crc32c] for cid, loc in index.items()],
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def new_name() -> str:
    """A fresh, collision-free data file name."""
    return f"{uuid.uuid4().hex}{DATA_SUFFIX}"


def parse_step_dir(name: str) -> int | None:
    if not name.startswith("step-"):
        return None
    digits = name[5:]
    return int(digits) if digits.isdigit() and digits == str(int(digits)) else None


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    os.rename(tmp, path)


def unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink()
