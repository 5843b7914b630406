"""Claiming a RAM tier's directory so that no other user can plant or swap its files (internal).

A tier's files are checkpoint bytes that a restore trusts once their crc32c matches, and
crc32c protects against accidents, not against someone who writes the files. So the
directory must be this user's alone: created ``0700``; an existing one refused when another
user owns it, when group or others may write it, or when it is a symlink; and every existing
ancestor owned by root or this user, and sticky wherever group or others may write it (as
``/dev/shm`` and ``/tmp`` are), so nobody else can rename the directory away and put their own
in its place.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from fastckpt.errors import ConfigError

__all__ = ["claim_tier_dir"]


def claim_tier_dir(root: str | Path) -> Path:
    """Create ``root`` (mode 0700; missing ancestors with the default mode) or check the
    existing one, and return it as an absolute path.

    Raises:
        ConfigError: the directory or an ancestor fails the rules in the module docstring.
    """
    path = Path(os.path.abspath(root))
    euid = os.geteuid()
    for ancestor in reversed(path.parents):
        try:
            st = os.stat(ancestor)  # an ancestor may be a symlink (e.g. /var/run): judge its target
        except FileNotFoundError:
            break
        if st.st_uid not in (0, euid):
            raise ConfigError(f"RAM tier {path}: its ancestor {ancestor} belongs to uid {st.st_uid}, who could "
                              "replace the tier's directory; use a directory of your own")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            raise ConfigError(f"RAM tier {path}: its ancestor {ancestor} is writable by others and not sticky "
                              f"(mode {stat.S_IMODE(st.st_mode):o}), so others could replace the tier's directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(f"RAM tier {path} is a symlink; a tier directory must be a real directory")
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"RAM tier {path} exists and is not a directory")
    if st.st_uid != euid:
        raise ConfigError(f"RAM tier {path} belongs to uid {st.st_uid}, not to this process's uid {euid}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(f"RAM tier {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}): "
                          "others could plant chunks in it; it must be 0700")
    return path
