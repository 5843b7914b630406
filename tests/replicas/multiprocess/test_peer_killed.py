"""A peer SIGKILLed while it sends a large chunk: the restore falls back to persistent storage.

``tests/replicas/test_sources.py::test_peer_sigkilled_mid_transfer_falls_back_to_next_peer``
shows the fall-through to the *next peer* at the source level. Here the dying peer is the
only RAM copy, and the whole reader runs: a :class:`~fastckpt.CheckpointManager` restore
whose chunk source asks that peer (a real server process, SIGKILLed while it is sending the
chunk and the client holds part of it) finishes bit for bit from storage.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np

from fastckpt import CheckpointManager, ManagerOptions, SaveOptions
from fastckpt.format.manifest import chunk_id
from fastckpt.replicas._client import PeerClient
from fastckpt.replicas._connection import PeerOptions
from fastckpt.replicas._ram import ChunkLocation, RamTier
from fastckpt.replicas._sources import TieredChunkSource

from . import workers as w

SERVE = Path(__file__).with_name("_serve.py")
NBYTES = 32 << 20


class _HoldingRelay:
    """A faithful TCP relay in front of the peer server that pauses the server-to-client
    direction once ``hold_after`` bytes went through, until :attr:`release` is set.

    It makes "killed mid-transfer" deterministic: while it holds, the server is blocked
    sending the chunk (its socket buffers full), the client has part of it, and the test
    kills the server. After the release the relay forwards whatever the dead server's
    kernel still delivers, then the server's end of file, like a direct connection would.
    """

    def __init__(self, upstream: tuple[str, int], *, hold_after: int) -> None:
        self._upstream = upstream
        self._hold_after = hold_after
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self.forwarded = 0
        """Server-to-client bytes forwarded so far."""
        self.holding = threading.Event()
        self.release = threading.Event()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
                server = socket.create_connection(self._upstream, timeout=5)
            except OSError:
                return
            server.settimeout(None)
            self._socks += [client, server]
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, from_server: bool) -> None:
        try:
            while True:
                if from_server and self.forwarded >= self._hold_after and not self.release.is_set():
                    self.holding.set()
                    self.release.wait(30)
                data = src.recv(1 << 16)
                if not data:
                    break
                dst.sendall(data)
                if from_server:
                    self.forwarded += len(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.release.set()
        self._listener.close()
        for s in self._socks:
            s.close()


def test_peer_killed_mid_transfer_restore_falls_back_to_storage(
    tmp_path: Path, shm_dir: Path
) -> None:
    big = w.expected("u", 0)  # any deterministic bytes: repeat the hash pattern to NBYTES
    big = np.resize(big.view(np.uint8), NBYTES).reshape(NBYTES // 4096, 4096)
    big[:, 0] = np.arange(big.shape[0]) % 251  # not periodic
    root = str(tmp_path / "ckpt")
    opts = ManagerOptions(
        save=SaveOptions(compression="none", max_chunk_bytes=NBYTES, object_bytes=NBYTES)
    )
    with CheckpointManager(root, options=opts) as mgr:
        assert mgr.save(1, {"big": big})
        mgr.wait()
        (leaf,) = mgr.manifest(1).arrays()
    (chunk,) = leaf.chunks
    cid = chunk_id(leaf.path, chunk.box)
    # The peer's RAM tier holds the same chunk (as a replica would).
    with RamTier(shm_dir / "peer", budget_bytes=2 * NBYTES) as tier:
        seg = tier.allocate(1, NBYTES)
        seg.buffer[:] = big.reshape(-1)
        tier.seal(1, seg, {cid: ChunkLocation(0, NBYTES, chunk.raw_crc32c)})
    proc = subprocess.Popen(
        [sys.executable, str(SERVE), str(shm_dir / "peer")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    relay = None
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        relay = _HoldingRelay(("127.0.0.1", port), hold_after=1 << 20)

        def kill_when_mid_transfer() -> None:
            if relay.holding.wait(60):
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
            relay.release.set()

        killer = threading.Thread(target=kill_when_mid_transfer)
        killer.start()
        source = TieredChunkSource(
            None,
            [
                PeerClient(
                    relay.address,
                    secret=w.SECRET,
                    name="victim",
                    options=PeerOptions(connect_timeout_s=3, io_timeout_s=10),
                )
            ],
        )
        try:
            with CheckpointManager(root, chunk_source=source) as mgr:
                got = mgr.restore(1, target={"big": np.zeros_like(big)})
                stats = mgr.last_restore_stats
        finally:
            relay.release.set()
            relay.holding.set()
            killer.join()
        assert proc.returncode == -signal.SIGKILL
        assert 1 << 20 <= relay.forwarded < NBYTES  # the peer died part-way through the chunk
        assert got["big"].tobytes() == big.tobytes()
        assert stats.bytes_by_tier == {"storage": NBYTES} and stats.bytes_read_storage == NBYTES
        sst = source.stats()
        assert sst.fallbacks == {"unavailable": 1} and sst.dead_peers == ["victim"], sst
        assert sst.not_found == 1 and sst.tiers == {}
    finally:
        if relay is not None:
            relay.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                f.close()
