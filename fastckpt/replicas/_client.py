"""The peer client: reads chunks from and pushes chunks to one
:class:`~fastckpt.replicas._server.PeerServer`. A call reports a chunk ``"ok"`` or returns
bytes only after the payload's tag verified (see :mod:`~fastckpt.replicas._channel`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from fastckpt.errors import ConfigError
from fastckpt.replicas import _batched
from fastckpt.replicas import _wire as wire
from fastckpt.replicas import _wire_codec as wire_codec
from fastckpt.replicas._batched import Outcome
from fastckpt.replicas._pool import Conn, ConnectionPool, Request
from fastckpt.replicas._wire import MsgType

__all__ = ["PeerClient", "StepLists"]


class StepLists(NamedTuple):
    """A peer's steps, sorted: with any data, committed (manifest or commit record), with a
    manifest."""

    steps: list[int]
    committed: list[int]
    manifests: list[int]


class PeerClient(ConnectionPool):
    """Synchronous, thread-safe client of one :class:`PeerServer`; concurrent calls use
    separate pooled connections (:mod:`~fastckpt.replicas._pool`: reuse, one retry).

    Errors: unreachable/timeouts/disconnects → :class:`PeerUnavailableError`; handshake
    refused → :class:`AuthenticationError`; malformed replies → :class:`ProtocolError`; a
    reply that fails its tag (forged or altered on the way) →
    :class:`~fastckpt.errors.FrameAuthenticationError` (a ``ProtocolError``); ERROR replies
    → :class:`PeerRequestError`. A connection that saw any error other than a well-formed
    refusal is discarded.

    Args:
        address: ``(host, port)`` of the server.
        secret: Shared secret (>= 16 bytes).
        options: Timeouts and limits.
        name: Label used in messages and stats (default ``host:port``).
    """

    def get_chunks(
        self,
        step: int,
        items: Sequence[tuple[str, memoryview | np.ndarray, int | None]],
        *,
        batch_chunks: int = 16,
        window: int = 4,
    ) -> list[Outcome]:
        """Fetch several whole chunks over one connection, in batches, requests pipelined.

        Each batch of up to ``batch_chunks`` chunks (and at most ``max_payload_bytes``) is one
        GET_CHUNKS request answered by one CHUNKS frame that carries the chunks back to back,
        so per chunk there is no request, reply header or wake-up of its own; up to ``window``
        batch requests are in flight, so the peer streams batch after batch.

        Args:
            step: Step number.
            items: ``(chunk_id, into, expected_crc32c)``; each ``into`` is received into
                directly and must have the chunk's exact length.
            batch_chunks: Chunks per request (1..``wire.MAX_BATCH_CHUNKS``).
            window: Batch requests in flight at most.

        Returns:
            Per item: ``"ok"`` (``into`` holds the verified bytes), ``"missing"`` (the peer
            lacks it) or ``"corrupt"`` (wrong length or checksum; ``into`` may be garbage).

        Raises:
            PeerUnavailableError: the connection failed or the peer refused mid-stream (the
                connection is discarded; no item after the failure is done).
            ProtocolError: the peer's reply is malformed (the connection is discarded).
        """
        _batched.check_stream(batch_chunks, window)
        ids = [wire_codec.check_chunk_id(cid) for cid, _, _ in items]
        dsts = [
            (i.data if isinstance(i, np.ndarray) else memoryview(i)).cast("B") for _, i, _ in items
        ]

        def request(lo: int, hi: int) -> Request:
            payload = json.dumps(ids[lo:hi], separators=(",", ":")).encode()
            return MsgType.GET_CHUNKS, {"step": step, "count": hi - lo}, payload

        def receive(c: Conn, lo: int, hi: int) -> list[Outcome]:
            _, h, plen = self._reply(c, MsgType.CHUNKS, missing_ok=False)
            expected = [e for _, _, e in items[lo:hi]]
            return _batched.recv_chunks(c.chan, h, plen, dsts[lo:hi], expected)

        return self._stream(
            _batched.batches(
                ids, [d.nbytes for d in dsts], batch_chunks, self._limits.max_payload_bytes
            ),
            request,
            receive,
            window,
        )

    def get_ranges(
        self,
        step: int,
        items: Sequence[tuple[str, memoryview | np.ndarray, int, Sequence[tuple[int, int]]]],
        *,
        batch_chunks: int = 16,
        window: int = 4,
    ) -> list[Outcome]:
        """Fetch some byte ranges of each of several chunks, like :meth:`get_chunks` (batched,
        pipelined), with only the ranges on the wire.

        Each item is verified against the whole chunk's crc32c: the peer sends the crc32c of
        the chunk's bytes before, between and after the ranges, and the client combines them
        with the checksums of the bytes it received (``crc32c_combine``), so a byte corrupt
        anywhere in the peer's copy or on the wire fails the item, as it would a whole read.

        Args:
            step: Step number.
            items: ``(chunk_id, into, expected_crc32c, runs)``: ``into`` has the chunk's length
                (``expected_crc32c`` is the whole chunk's, e.g. from the manifest) and receives
                the bytes of each run ``(start, n)`` at their place; ``runs`` are ascending,
                disjoint and not empty.
            batch_chunks, window: As for :meth:`get_chunks` (a batch also holds at most
                ``wire.MAX_BATCH_RUNS`` runs).

        Returns:
            Per item: ``"ok"``, ``"missing"`` (the peer lacks the chunk or it is shorter than
            the runs) or ``"corrupt"`` (another length, or the checksums do not combine;
            ``into``'s runs may be garbage).

        Raises:
            PeerUnavailableError, ProtocolError: As for :meth:`get_chunks`.
        """
        _batched.check_stream(batch_chunks, window)
        ids = [wire_codec.check_chunk_id(cid) for cid, *_ in items]
        dsts = [
            (i.data if isinstance(i, np.ndarray) else memoryview(i)).cast("B") for _, i, *_ in items
        ]
        runs = [list(r) for *_, r in items]
        for cid, dst, rs in zip(ids, dsts, runs):
            if (
                not rs
                or len(rs) > wire.MAX_BATCH_RUNS
                or not wire_codec.spans_fit(((a, a + n) for a, n in rs), dst.nbytes)
            ):
                raise ConfigError(
                    f"runs {rs[:4]}... of chunk {cid!r} ({dst.nbytes} bytes) are not ascending, "
                    f"disjoint and inside it (1..{wire.MAX_BATCH_RUNS} of them)"
                )

        def request(lo: int, hi: int) -> Request:
            payload = json.dumps(ids[lo:hi], separators=(",", ":")).encode()
            header = {
                "step": step,
                "count": hi - lo,
                "runs": [len(r) for r in runs[lo:hi]],
                "starts": [a for r in runs[lo:hi] for a, _ in r],
                "stops": [a + n for r in runs[lo:hi] for a, n in r],
            }
            return MsgType.GET_RANGES, header, payload

        def receive(c: Conn, lo: int, hi: int) -> list[Outcome]:
            _, h, plen = self._reply(c, MsgType.RANGES, missing_ok=False)
            expected = [e for _, _, e, _ in items[lo:hi]]
            return _batched.recv_ranges(c.chan, h, plen, dsts[lo:hi], runs[lo:hi], expected)

        sizes = [sum(n for _, n in r) for r in runs]
        return self._stream(
            _batched.batches(
                ids,
                sizes,
                batch_chunks,
                self._limits.max_payload_bytes,
                runs=[len(r) for r in runs],
            ),
            request,
            receive,
            window,
        )

    def push_chunks(
        self, step: int, chunks: Sequence[tuple[str, memoryview | bytes | np.ndarray, int]]
    ) -> None:
        """Store several chunks of ``step`` in the peer's tier as one segment, all or none.

        ``chunks`` are ``(chunk_id, data, raw_crc32c)``; the bytes are sent straight from
        ``data``. One request and one segment on the peer instead of one per chunk (each
        segment is a file, a mapping and an index on the receiving side).

        Raises:
            PeerRequestError: refused (``stale_step``, ``budget``, ``bad_request``).
            ChecksumMismatchError: a chunk arrived corrupt (nothing was stored).
        """
        if not chunks:
            return
        ids = [wire_codec.check_chunk_id(cid) for cid, _, _ in chunks]
        views = [
            d.reshape(-1).view(np.uint8).data
            if isinstance(d, np.ndarray)
            else memoryview(d).cast("B")
            for _, d, _ in chunks
        ]
        id_bytes = json.dumps(ids, separators=(",", ":")).encode()
        header = {
            "step": step,
            "count": len(ids),
            "ids_len": len(id_bytes),
            "lengths": [v.nbytes for v in views],
            "crcs": [crc for _, _, crc in chunks],
        }

        def op(c: Conn) -> None:
            self._send_push(c, MsgType.PUT_CHUNKS, header, [id_bytes, *views])
            self._reply(c, MsgType.OK, missing_ok=False)

        self._call(op)

    def list_chunks(self, step: int) -> list[str]:
        """Sorted ids of the chunks the peer holds for ``step``."""

        def op(c: Conn) -> list[str]:
            c.chan.send(MsgType.LIST, {"step": step})
            _, h, _ = self._reply(c, MsgType.CHUNK_LIST, missing_ok=False)
            return wire_codec.decode_json_list(c.chan.recv_payload(), count=h["count"])

        return self._call(op)

    def get_manifest(self, step: int) -> bytes | None:
        """The manifest the peer holds for ``step``, or None."""

        def op(c: Conn) -> bytes | None:
            c.chan.send(MsgType.GET_MANIFEST, {"step": step})
            mtype, _, _ = self._reply(c, MsgType.MANIFEST)
            if mtype is MsgType.ERROR:
                return None
            return bytes(c.chan.recv_payload())

        return self._call(op)

    def put_manifest(self, step: int, data: bytes | memoryview) -> None:
        """Store ``data`` as the manifest of ``step`` in the peer's tier."""

        def op(c: Conn) -> None:
            c.chan.send(MsgType.PUT_MANIFEST, {"step": step}, [memoryview(data)])
            self._reply(c, MsgType.OK, missing_ok=False)

        self._call(op)

    def steps(self) -> list[int]:
        """Sorted steps the peer holds any data for."""
        return self.step_lists().steps

    def committed_steps(self) -> list[int]:
        """Sorted steps committed on the peer (it holds their manifest or a commit record)."""
        return self.step_lists().committed

    def manifest_steps(self) -> list[int]:
        """Sorted steps whose manifest the peer holds."""
        return self.step_lists().manifests

    def step_lists(self) -> StepLists:
        """All three step lists of the peer, in one request."""

        def op(c: Conn) -> StepLists:
            c.chan.send(MsgType.STEPS, {})
            _, h, _ = self._reply(c, MsgType.STEP_LIST, missing_ok=False)
            return StepLists(sorted(h["steps"]), sorted(h["committed"]), sorted(h["manifests"]))

        return self._call(op)
