"""The peer layer's public face: serving a RAM tier to peers over TCP, and the client.

Threads and blocking sockets, not asyncio: a payload leaves with ``sendall`` straight from
the tier's mmap and arrives with ``recv_into`` straight into the caller's buffer (both release
the GIL), which is what keeps a peer transfer near raw loopback TCP speed. The client API is
synchronous and thread-safe; run it on a pool of threads for parallel streams.

Security: every connection starts with a mutual HMAC-SHA256 challenge/response (see
:mod:`fastckpt.replicas.wire`). Until it succeeds the server accepts only tiny frames and
reveals nothing; a failed handshake is answered with ``ERROR auth_failed`` and a disconnect.
The secret only authenticates: traffic is not encrypted, so bind to a trusted interface
(loopback by default).

Implementation: :mod:`~fastckpt.replicas.server`, :mod:`~fastckpt.replicas.client`.
"""

from __future__ import annotations

from fastckpt.replicas._transport import PeerOptions as PeerOptions
from fastckpt.replicas._transport import PeerRequestError as PeerRequestError
from fastckpt.replicas.client import PeerClient as PeerClient
from fastckpt.replicas.server import PeerServer as PeerServer

__all__ = ["PeerClient", "PeerOptions", "PeerRequestError", "PeerServer"]
