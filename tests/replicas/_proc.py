"""Subprocess helper for the replicas tests (run as a script; importing it has no effects).

``_proc.py write ROOT``: seals step 1 (chunk "a"), then stages step 2 without sealing,
prints ``ready`` and sleeps until killed.
``_proc.py serve ROOT NBYTES``: seals step 1 with one chunk "big" of NBYTES (content from
:func:`big_chunk`), serves it with a PeerServer, prints the port, waits for stdin EOF.
"""

from __future__ import annotations

import importlib.util
import sys
import time
import types

import numpy as np

SECRET = b"test-secret-0123456789abcdef"


def big_chunk(nbytes: int) -> np.ndarray:
    """The seeded content of the served chunk."""
    return np.frombuffer(np.random.default_rng(7).bytes(nbytes), np.uint8)


def _light_fastckpt() -> None:
    """Register ``fastckpt`` without running its ``__init__`` (which imports jax: seconds).

    Only for this subprocess: the replicas layer does not use jax, and skipping the import
    keeps the subprocess tests fast on a loaded 2-core machine.
    """
    spec = importlib.util.find_spec("fastckpt")
    assert spec is not None and spec.submodule_search_locations is not None
    pkg = types.ModuleType("fastckpt")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["fastckpt"] = pkg


def main() -> None:
    _light_fastckpt()
    from fastckpt._checksum import crc32c
    from fastckpt.replicas._ram import ChunkLocation, RamTier
    from fastckpt.replicas._server import PeerServer

    mode, root = sys.argv[1], sys.argv[2]
    if mode == "write":
        tier = RamTier(root, budget_bytes=64 << 20)
        seg = tier.allocate(1, 1000)
        seg.buffer[:] = 7
        tier.seal(1, seg, {"a": ChunkLocation(0, 1000, crc32c(seg.buffer))})
        seg2 = tier.allocate(2, 4 << 20)
        seg2.buffer[:] = 9
        print("ready", flush=True)
        time.sleep(600)
    elif mode == "serve":
        nbytes = int(sys.argv[3])
        tier = RamTier(root, budget_bytes=2 * nbytes + (1 << 20))
        data = big_chunk(nbytes)
        seg = tier.allocate(1, nbytes)
        seg.buffer[:] = data
        tier.seal(1, seg, {"big": ChunkLocation(0, nbytes, crc32c(data))})
        with PeerServer(tier, secret=SECRET) as server:
            print(server.address[1], flush=True)
            sys.stdin.read()


if __name__ == "__main__":
    main()
