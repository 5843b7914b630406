"""The peer layer's public face: serving a RAM tier to peers over TCP, and the client.

Threads and blocking sockets, not asyncio: a payload leaves with ``sendall`` straight from
the tier's mmap and arrives with ``recv_into`` straight into the caller's buffer (both release
the GIL), which is what keeps a peer transfer near raw loopback TCP speed. The client API is
synchronous and thread-safe; run it on a pool of threads for parallel streams.

Security (``docs/replicas.md``, "Security properties"): every connection starts with a
mutual challenge/response over fresh nonces from both sides; the proofs and the
connection's two frame keys (one per direction) are HMAC-SHA256 of the shared secret and a
transcript of the whole handshake, so an altered or downgraded handshake fails. Until it
succeeds the server accepts only tiny frames and reveals nothing. After it, every frame in
both directions carries GMAC tags over its header and payload and its implicit sequence
number: a frame injected, altered, replayed, reordered or dropped on the way is refused
(:class:`~fastckpt.errors.FrameAuthenticationError` on the client, which then falls back to
another source; an unanswered disconnect on the server, which stores nothing of it).

Not provided: confidentiality (traffic is authenticated, not encrypted: anyone on the path
reads checkpoint contents, so bind to a trusted interface; loopback by default) and
availability (anyone on the path can drop connections). A holder of the secret is a peer,
and can serve or push data of its choosing. ``PeerOptions(frame_mac=False)`` (both sides)
turns the frame tags off, to measure their cost only: such connections accept forged frames.

Implementation: :mod:`~fastckpt.replicas.server`, :mod:`~fastckpt.replicas.client`.
"""

from __future__ import annotations

from fastckpt.replicas._transport import PeerOptions as PeerOptions
from fastckpt.replicas._transport import PeerRequestError as PeerRequestError
from fastckpt.replicas.client import PeerClient as PeerClient
from fastckpt.replicas.server import PeerServer as PeerServer

__all__ = ["PeerClient", "PeerOptions", "PeerRequestError", "PeerServer"]
