"""Frames as a hostile but authenticated peer sends them: :func:`tag_raw`."""

from __future__ import annotations

from fastckpt.replicas import _wire as wire
from fastckpt.replicas import _wire_auth as wire_auth
from fastckpt.replicas._channel import Channel


def tag_raw(chan: Channel, raw: bytes) -> bytes:
    """``raw`` bytes (a frame, possibly malformed, lying or cut short) with tags inserted where
    a receiver looks for them by the prefix's declared lengths, as ``chan``'s authenticated
    sender would. Takes ``chan``'s next frame number."""
    tagger = chan._out
    if tagger is None or len(raw) < wire.PREFIX.size:
        return raw
    *_, hlen, plen = wire.PREFIX.unpack(raw[: wire.PREFIX.size])
    cut = wire.PREFIX.size + hlen
    if len(raw) < cut:
        return raw
    htag = tagger.header_tag(raw[:cut])
    out = raw[:cut] + htag + raw[cut : cut + plen]
    if plen and len(raw) >= cut + plen:
        ctx = tagger.payload_mac(htag)
        ctx.authenticate_additional_data(raw[cut : cut + plen])
        out += wire_auth.final_tag(ctx) + raw[cut + plen :]
    tagger.next_frame()
    return out
