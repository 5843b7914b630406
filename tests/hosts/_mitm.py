"""A man in the middle on its own simulated host: ``python _mitm.py BIND PORT UPSTREAM_HOST
UPSTREAM_PORT CONTROL_DIR``.

Relays peer connections to the upstream peer server frame by frame
(``tests.support.peer_relay``), holding no secret. While ``CONTROL_DIR/tamper-pushes``
exists it rewrites every pushed chunk batch (``PUT_CHUNKS``, client to server); while
``CONTROL_DIR/tamper-replies`` exists, every chunk, range and manifest reply (server to
client). Each rewrite flips a byte of the first chunk and patches the 4 bytes after it so
that the chunk's crc32c is unchanged (crc32c is linear): a receiver that trusted crc32c
would take the forged bytes. Counts go to ``CONTROL_DIR/mitm.json`` after every frame.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(
    0, str(Path(__file__).resolve().parents[2])
)  # run as a script: the checkout, for tests.support

from fastckpt._checksum import crc32c
from fastckpt.replicas._wire import MsgType
from tests.support.peer_relay import PeerRelay, RelayedFrame, forge_crc32c

_REPLIES = {MsgType.CHUNKS, MsgType.RANGES, MsgType.MANIFEST}


def _forged(payload: bytes, first_length: int) -> bytes | None:
    """``payload`` with its first chunk rewritten, crc32c kept (None if too short)."""
    n = min(first_length, len(payload))
    if n < 8:
        return None
    chunk = bytearray(payload[:n])
    crc = crc32c(bytes(chunk))
    chunk[0] ^= 0xFF
    forge_crc32c(chunk, 1, crc)
    assert crc32c(bytes(chunk)) == crc
    return bytes(chunk) + payload[n:]


def main(bind: str, port: str, upstream_host: str, upstream_port: str, control: str) -> None:
    ctl = Path(control)
    counts = {"frames": 0, "forged_pushes": 0, "forged_replies": 0}
    lock = threading.Lock()

    def tamper(f: RelayedFrame) -> list[bytes]:
        forged = None
        if f.payload:
            if (
                f.direction == "up"
                and f.type is MsgType.PUT_CHUNKS
                and (ctl / "tamper-pushes").exists()
            ):
                h = f.json()
                forged = _forged(f.payload[h["ids_len"] :], h["lengths"][0])
                forged = None if forged is None else f.payload[: h["ids_len"]] + forged
                kind = "forged_pushes"
            elif f.direction == "down" and f.type in _REPLIES and (ctl / "tamper-replies").exists():
                h = f.json()
                first = next((n for n in h.get("lengths", [len(f.payload)]) if n), len(f.payload))
                forged = _forged(f.payload, first)
                kind = "forged_replies"
        with lock:
            counts["frames"] += 1
            if forged is not None:
                counts[kind] += 1
            tmp = ctl / f".mitm.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(counts))
            os.replace(tmp, ctl / "mitm.json")
        return [f.raw if forged is None else f.replace(payload=forged).raw]

    relay = PeerRelay((upstream_host, int(upstream_port)), tamper=tamper, bind=(bind, int(port)))
    relay.frames = _Forgetful()  # a long job's frames need not be kept
    print("listening", flush=True)
    while True:
        time.sleep(3600)


class _Forgetful(list):  # type: ignore[type-arg]
    def append(self, item: object) -> None:
        pass


if __name__ == "__main__":
    main(*sys.argv[1:])
