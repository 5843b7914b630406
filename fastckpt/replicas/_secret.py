"""The job's peer secret: the launcher gives every process the same one, in
``FASTCKPT_PEER_SECRET`` or in a file named by ``FASTCKPT_PEER_SECRET_FILE`` (e.g. a mounted
Kubernetes Secret); the job reads it with :func:`peer_secret_from_env` and passes it as
``RamOptions(secret=...)``. A launcher makes a new one per job with :func:`new_peer_secret`,
so a process of an earlier job cannot talk to this one's. The secret never appears in a
message, a log line or an option's ``repr``.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping

from fastckpt.errors import ConfigError

__all__ = [
    "MIN_SECRET_BYTES",
    "SECRET_ENV",
    "SECRET_FILE_ENV",
    "new_peer_secret",
    "peer_secret_from_env",
]

SECRET_ENV = "FASTCKPT_PEER_SECRET"
SECRET_FILE_ENV = "FASTCKPT_PEER_SECRET_FILE"
MIN_SECRET_BYTES = 16
_MAX_SECRET_FILE_BYTES = 1 << 16


def new_peer_secret() -> str:
    """A fresh secret for one job: 32 random bytes as 64 hex characters (fits an
    environment variable; a launcher sets ``FASTCKPT_PEER_SECRET`` to it)."""
    return secrets.token_hex(32)


def peer_secret_from_env(environ: Mapping[str, str] | None = None) -> bytes:
    """The job's peer secret from ``FASTCKPT_PEER_SECRET`` (its UTF-8 bytes) or from the file
    ``FASTCKPT_PEER_SECRET_FILE`` names (its bytes, trailing whitespace removed).

    Args:
        environ: Where to look (default ``os.environ``).

    Raises:
        ConfigError: neither is set, both are, the file cannot be read, or the secret is
            shorter than 16 bytes. The message never contains the secret.
    """
    env = os.environ if environ is None else environ
    text, path = env.get(SECRET_ENV), env.get(SECRET_FILE_ENV)
    if text is not None and path is not None:
        raise ConfigError(f"both {SECRET_ENV} and {SECRET_FILE_ENV} are set: set one")
    if text is not None:
        secret, where = text.encode("utf-8"), SECRET_ENV
    elif path is not None:
        try:
            with open(path, "rb") as f:
                secret = f.read(_MAX_SECRET_FILE_BYTES + 1)
        except OSError as e:
            raise ConfigError(
                f"cannot read the peer secret file {SECRET_FILE_ENV}={path!r}: {e.strerror or e}"
            ) from None
        if len(secret) > _MAX_SECRET_FILE_BYTES:
            raise ConfigError(
                f"the peer secret file {path!r} is over {_MAX_SECRET_FILE_BYTES} bytes"
            )
        secret, where = secret.rstrip(b" \t\r\n"), f"the file {path!r}"
    else:
        raise ConfigError(
            f"no peer secret: the launcher must set {SECRET_ENV} (e.g. to "
            f"fastckpt.new_peer_secret()) or {SECRET_FILE_ENV} on every process of the job"
        )
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"the peer secret in {where} has {len(secret)} bytes; at least {MIN_SECRET_BYTES} "
            "are needed (use fastckpt.new_peer_secret())"
        )
    return secret
