""":class:`ParityClient`: a peer client that also pushes windows of parity, reads a
survivor's stream range and asks a parity holder to rebuild a lost member's range."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import numpy as np

from fastckpt.errors import ProtocolError
from fastckpt.replicas._client import Conn, PeerClient
from fastckpt.replicas._wire import MsgType

__all__ = ["ParityClient"]


class ParityClient(PeerClient):
    """A :class:`PeerClient` that also speaks the parity messages (see ``_parity``); replies
    are used only after their payload's tag verified."""

    def put_parity(
        self,
        step: int,
        *,
        group: Sequence[str],
        contributor: str,
        stream_len: int,
        part_size: int,
        offset: int,
        data: memoryview,
    ) -> bool:
        """XOR ``data`` (bytes ``[offset, offset + len)`` of ``contributor``'s part for this
        peer) into the peer's parity of ``step``. False: the peer had applied it already.

        Raises:
            PeerRequestError: refused (``stale_step``, ``budget``, ``bad_request``).
        """
        header = {
            "step": step,
            "group": json.dumps(list(group), separators=(",", ":")),
            "contributor": contributor,
            "stream_len": stream_len,
            "part_size": part_size,
            "offset": offset,
        }

        def op(c: Conn) -> bool:
            self._send_push(c, MsgType.PUT_PARITY, header, [data])
            _, h, _ = self._reply(c, MsgType.OK, missing_ok=False)
            return bool(h["stored"])

        return self._call(op)

    def get_stream(
        self, step: int, anchor: str, offset: int, stream_len: int, *, into: np.ndarray
    ) -> bool:
        """Fill ``into`` with the peer's own stream bytes ``[offset, offset + len(into))`` of
        ``step`` (its segment holding chunk ``anchor``; zeros past ``stream_len``). False: the
        peer does not hold that stream."""
        req = {
            "step": step,
            "anchor": anchor,
            "offset": offset,
            "length": into.nbytes,
            "stream_len": stream_len,
        }
        want = max(0, min(offset + into.nbytes, stream_len) - offset)
        return self._ranged(MsgType.GET_STREAM, req, MsgType.STREAM, into, want)

    def rebuild(
        self,
        step: int,
        *,
        lost: str,
        stream_len: int,
        offset: int,
        anchors: Mapping[str, str],
        into: np.ndarray,
    ) -> bool:
        """Fill ``into`` with bytes ``[offset, offset + len(into))`` of ``lost``'s part whose
        parity the peer holds, rebuilt there. False: the peer cannot (no complete parity
        covering ``lost``, or a survivor unreadable). Unverified: check the chunk's crc32c."""
        req = {
            "step": step,
            "lost": lost,
            "stream_len": stream_len,
            "offset": offset,
            "length": into.nbytes,
            "anchors": json.dumps(dict(anchors), separators=(",", ":")),
        }
        return self._ranged(MsgType.REBUILD, req, MsgType.REBUILT, into, into.nbytes)

    def _ranged(
        self, mtype: MsgType, req: dict[str, object], want_type: MsgType, into: np.ndarray, n: int
    ) -> bool:
        dst = into.reshape(-1).view(np.uint8)

        def op(c: Conn) -> bool:
            c.chan.send(mtype, req)
            rtype, _, plen = self._reply(c, want_type)
            if rtype is MsgType.ERROR:
                return False
            if plen != n:
                c.chan.drain(plen)
                c.chan.end_payload()
                raise ProtocolError(f"{want_type.name} of {plen} bytes from {self.name}, asked {n}")
            c.chan.recv_into(dst[:n].data)
            c.chan.end_payload()  # authentic from here on
            dst[n:] = 0
            return True

        return self._call(op)
