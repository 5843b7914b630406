"""Subprocess: serve an existing RAM tier to authenticated peers until stdin closes.

Usage: ``python _serve.py ROOT``. Opens the :class:`~fastckpt.replicas._ram.RamTier` at ``ROOT``
(sealed by the parent), serves it with a :class:`~fastckpt.replicas._server.PeerServer` under
:data:`workers.SECRET`, prints the port, then waits for stdin EOF (or its SIGKILL).
"""

from __future__ import annotations

import importlib.util
import sys
import types

SECRET = (
    b"replicas-mp-secret-0123456789"  # = workers.SECRET (not imported: no numpy/ml_dtypes cost)
)


def _light_fastckpt() -> None:
    """Register ``fastckpt`` without running its ``__init__`` (which imports jax: seconds on a
    loaded machine); the replicas layer does not use jax."""
    spec = importlib.util.find_spec("fastckpt")
    assert spec is not None and spec.submodule_search_locations is not None
    pkg = types.ModuleType("fastckpt")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["fastckpt"] = pkg


def main(root: str) -> None:
    _light_fastckpt()
    from fastckpt.replicas._ram import RamTier
    from fastckpt.replicas._server import PeerServer

    with RamTier(root, budget_bytes=1 << 30) as tier, PeerServer(tier, secret=SECRET) as server:
        print(server.address[1], flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main(sys.argv[1])
