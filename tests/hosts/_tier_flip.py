"""Flip one byte of a RAM tier's segment file, run inside a simulated host (its own /dev/shm).

``python _tier_flip.py TIER STEP KIND``: KIND ``own`` flips a byte in the middle of the first
chunk of the host's own data segment of ``step-STEP`` (the one whose index lists the most
chunks), ``parity`` the second byte of the parity stripe it holds for its group (the chunk
whose id starts with ``parity#``; every contributor's part covers its first bytes), so the
byte lies in what a restore or a rebuild reads. Prints ``{"file", "offset", "chunk"}`` as
JSON; running it again with the same arguments flips the same byte back.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _segments(step_dir: Path) -> list[tuple[dict[str, Any], Path]]:
    out = []
    for index in sorted(step_dir.glob("*.index.json")):
        doc = json.loads(index.read_text())
        out.append((doc, step_dir / doc["data"]))
    return out


def main(tier: str, step: int, kind: str) -> dict[str, Any]:
    segments = _segments(Path(tier) / f"step-{step}")
    if not segments:
        raise SystemExit(f"{tier} holds no segment of step {step}")
    if kind == "own":
        doc, data = max(segments, key=lambda s: len(s[0]["chunks"]))
        cid, offset, length = doc["chunks"][0][:3]
        at = int(offset) + int(length) // 2
    elif kind == "parity":
        found = [
            (c, d) for doc, d in segments for c in doc["chunks"] if str(c[0]).startswith("parity#")
        ]
        if len(found) != 1:
            raise SystemExit(f"{tier} holds {len(found)} parity stripes of step {step}")
        (cid, offset, _length, _crc), data = found[0]
        at = int(offset) + 1
    else:
        raise SystemExit(f"unknown kind {kind!r}")
    with open(data, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x20]))
    return {"file": str(data), "offset": at, "chunk": cid}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), sys.argv[3])))
