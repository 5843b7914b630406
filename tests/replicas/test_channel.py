"""The authenticated peer wire (version 2): per-frame MACs, their ordering, the handshake.

Part 1 drives two :class:`Channel` ends over a socket pair; part 2 puts a frame-aware man
in the middle (:class:`PeerRelay`, no secret) between a real client and server. The attacks
are the ones crc32c cannot stop: it is linear, so the relay rewrites chunk bytes and keeps
their crc32c (:func:`forge_crc32c`); ``frame_mac=False`` lets the same forgery through,
which is what shows each attack is real.

What breaks what (each a one-line change in ``wire``/``_channel``): a tag input without the
prefix (prefix flips), without the sequence number (replays, swaps, drops), keys derived
without the nonces (replays into another connection), a payload tag not checked before
``end_payload`` returns (forged chunks reported ``ok``), the ``frame_mac`` flag outside the
transcript (the downgrade below).
"""

from __future__ import annotations

import dataclasses
import socket
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from fastckpt._checksum import crc32c
from fastckpt.errors import (
    AuthenticationError,
    FrameAuthenticationError,
    PeerError,
    PeerUnavailableError,
    ProtocolError,
)
from fastckpt.replicas import _wire as wire
from fastckpt.replicas import _wire_auth as wire_auth
from fastckpt.replicas._channel import Channel
from fastckpt.replicas._client import PeerClient
from fastckpt.replicas._connection import PeerOptions
from fastckpt.replicas._ram import RamTier
from fastckpt.replicas._server import PeerServer
from fastckpt.replicas._sources import TieredChunkSource
from fastckpt.replicas._wire import MsgType
from tests.support.peer_read import get_one
from tests.support.peer_relay import PeerRelay, RelayedFrame, forge_crc32c

from .conftest import SECRET, fill, seal_chunks

FAST = PeerOptions(connect_timeout_s=2, handshake_timeout_s=1, io_timeout_s=2)
UNMAC = dataclasses.replace(FAST, frame_mac=False)
SIZES = {"a": 5000, "b": 3000, "c": 64}
REGIONS = ["prefix", "header", "header_tag", "payload", "payload_tag"]

# ============================================================================ channel ends


def _pair(
    frame_mac: bool = True, seed: bytes = b"n"
) -> tuple[Channel, Channel, socket.socket, socket.socket]:
    """(client end, server end, client socket, server socket) of one connection's keys."""
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    keys = wire_auth.session_keys(
        SECRET, client_nonce=seed * 32, server_nonce=b"s" * 32, frame_mac=frame_mac
    )
    ck, sk = (keys.client_key, keys.server_key) if frame_mac else (None, None)
    client = Channel(a, limits=wire.WireLimits(), role="client", send_key=ck, recv_key=sk)
    server = Channel(b, limits=wire.WireLimits(), role="server", send_key=sk, recv_key=ck)
    return client, server, a, b


def _push_frame(chan: Channel, step: int = 3, data: bytes = b"chunk-bytes" * 10) -> bytes:
    ids = b'["x"]'
    header = {
        "step": step,
        "count": 1,
        "ids_len": len(ids),
        "lengths": [len(data)],
        "crcs": [crc32c(data)],
    }
    return chan.encode(MsgType.PUT_CHUNKS, header, ids + data)


def _receive_all(chan: Channel) -> tuple[MsgType, dict, bytes]:  # type: ignore[type-arg]
    t, h, n = chan.recv_head()
    data = chan.recv_bytes(n)
    chan.end_payload()
    return t, h, bytes(data)


def _flip(raw: bytes, f: RelayedFrame | None, region: str) -> bytes:
    """``raw`` (one tagged frame) with one bit flipped in ``region``: the prefix's lowest
    payload_len byte, the first digit of the JSON header (still valid JSON: a forged value),
    a tag, the payload's middle."""
    if f is None:
        *_, hlen, plen = wire.PREFIX.unpack(raw[: wire.PREFIX.size])
        header = raw[wire.PREFIX.size : wire.PREFIX.size + hlen]
    else:
        hlen, plen, header = len(f.header), len(f.payload), f.header
    p, t = wire.PREFIX.size, wire.TAG_BYTES
    digit = next(i for i, c in enumerate(header) if chr(c).isdigit())
    pos = {
        "prefix": p - 1,
        "header": p + digit,
        "header_tag": p + hlen + 5,
        "payload": p + hlen + t + plen // 2,
        "payload_tag": p + hlen + t + plen + 7,
    }[region]
    out = bytearray(raw)
    out[pos] ^= 1
    return bytes(out)


@pytest.mark.parametrize("frame_mac", [True, False])
def test_frames_round_trip_both_ways_with_tags_where_agreed(frame_mac: bool) -> None:
    client, server, a, b = _pair(frame_mac)
    big = np.frombuffer(
        np.random.default_rng(1).bytes((9 << 20) + 3), np.uint8
    )  # > 2 windows: helper thread
    for payload in (b"", b"x", bytes(70_000), big):
        ids = b'["p"]'
        header = {
            "step": 1,
            "count": 1,
            "ids_len": len(ids),
            "lengths": [len(payload)],
            "crcs": [crc32c(payload)],
        }
        sender = threading.Thread(
            target=client.send,
            args=(MsgType.PUT_CHUNKS, header, [ids, memoryview(payload).cast("B")]),
        )
        sender.start()
        t, h, n = server.recv_head()
        assert (t, h, n) == (MsgType.PUT_CHUNKS, header, len(ids) + len(payload))
        assert server.recv_bytes(len(ids)) == ids
        dst = np.zeros(len(payload), np.uint8)
        assert server.recv_into(dst.data) == crc32c(payload)
        server.end_payload()
        sender.join()
        assert dst.tobytes() == bytes(payload)
        server.send(MsgType.OK, {"stored": True})
        assert client.recv_head() == (MsgType.OK, {"stored": True}, 0)
    # Three small frames encoded in one go keep their order; the tags add 16 bytes per part.
    frames = [
        (MsgType.STEPS, {}, b""),
        (MsgType.GET_CHUNKS, {"step": 2, "count": 1}, b'["q"]'),
        (MsgType.LIST, {"step": 4}, b""),
    ]
    client.send_frames(frames)
    got = [_receive_all(server) for _ in frames]
    assert got == [(t, h, p) for t, h, p in frames]
    plain = sum(len(wire.encode_frame(t, h, len(p))) + len(p) for t, h, p in frames)
    tagged = len(b"".join(_pair(frame_mac)[0].encode(*f) for f in frames))
    assert tagged == plain + (
        4 * wire.TAG_BYTES if frame_mac else 0
    )  # 3 header tags, 1 payload tag
    for s in (a, b):
        s.close()


@pytest.mark.parametrize("region", REGIONS)
def test_a_flipped_bit_anywhere_in_a_frame_is_refused_and_the_channel_is_dead(region: str) -> None:
    client, server, a, b = _pair()
    a.sendall(_flip(_push_frame(client), None, region))
    a.sendall(_push_frame(client, step=4))  # a genuine frame after it is never reached
    with pytest.raises(FrameAuthenticationError):
        _t, _h, n = server.recv_head()  # prefix, header, header tag: here
        server.drain(n)
        server.end_payload()  # payload, payload tag: here, before anything may be used
    with pytest.raises(ProtocolError, match="out of sync"):
        server.recv_head()
    for s in (a, b):
        s.close()


def test_replayed_reordered_dropped_and_foreign_frames_are_refused() -> None:
    cases: dict[str, Callable[[list[bytes], bytes], list[bytes]]] = {
        "replayed": lambda fs, other: [fs[0], fs[0]],
        "reordered": lambda fs, other: [fs[1], fs[0]],
        "dropped": lambda fs, other: [fs[0], fs[2]],
        "from another connection": lambda fs, other: [other],  # its frame 0, another key
    }
    for schedule in cases.values():
        client, server, a, b = _pair()
        frames = [_push_frame(client, step=s) for s in (1, 2, 3)]
        other = _push_frame(_pair(seed=b"m")[0], step=1)  # same frame number, same content
        sent = schedule(frames, other)
        a.sendall(b"".join(sent))
        with pytest.raises(FrameAuthenticationError):
            for _ in sent:
                _receive_all(server)
        for s in (a, b):
            s.close()
    # The genuine order is accepted.
    client, server, a, b = _pair()
    a.sendall(b"".join(_push_frame(client, step=s) for s in (1, 2, 3)))
    assert [_receive_all(server)[1]["step"] for _ in range(3)] == [1, 2, 3]


def test_without_frame_mac_a_forged_frame_with_a_valid_crc_is_accepted() -> None:
    """The hazard ``frame_mac=False`` documents: a frame built by anyone is taken."""
    _, server, a, _ = _pair(frame_mac=False)
    forged = b"written by the attacker"
    ids = b'["x"]'
    header = {
        "step": 3,
        "count": 1,
        "ids_len": len(ids),
        "lengths": [len(forged)],
        "crcs": [crc32c(forged)],
    }
    a.sendall(wire.encode_frame(MsgType.PUT_CHUNKS, header, len(ids) + len(forged)) + ids + forged)
    assert _receive_all(server)[2] == ids + forged


# ============================================================================ man in the middle


@pytest.fixture
def peer(
    make_tier: Callable[..., RamTier],
) -> Iterator[tuple[RamTier, dict[str, np.ndarray], Callable[..., PeerServer]]]:
    """(served tier, its step-1 chunks, ``serve(options)`` -> a started server over it)."""
    tier = make_tier("served")
    data = fill(1, SIZES)
    seal_chunks(tier, 1, data)
    servers: list[PeerServer] = []

    def serve(options: PeerOptions = FAST) -> PeerServer:
        servers.append(PeerServer(tier, secret=SECRET, options=options).start())
        return servers[-1]

    yield tier, data, serve
    for s in servers:
        s.close()


def _forge_chunks_payload(f: RelayedFrame) -> bytes:
    """A CHUNKS reply whose first chunk says something else, its crc32c unchanged."""
    payload = bytearray(f.payload)
    n = f.json()["lengths"][0]
    payload[10:20] = b"EVIL BYTES"
    chunk = bytearray(payload[:n])
    forge_crc32c(chunk, 20, crc32c(f.payload[:n]))
    payload[:n] = chunk
    return f.replace(payload=bytes(payload)).raw


def _forge_chunks_header(f: RelayedFrame) -> bytes:
    """A CHUNKS reply with forged bytes and the header's crcs rewritten to match them."""
    payload = bytearray(f.payload)
    payload[10:20] = b"EVIL BYTES"
    h = f.json()
    n = h["lengths"][0]
    h["crcs"][0] = crc32c(bytes(payload[:n]))
    return f.with_header(h).replace(payload=bytes(payload)).raw


def _on(
    kind: MsgType, direction: str, change: Callable[[RelayedFrame], bytes]
) -> Callable[[RelayedFrame], list[bytes]]:
    def tamper(f: RelayedFrame) -> list[bytes]:
        return [change(f)] if f.type is kind and f.direction == direction else [f.raw]

    return tamper


def _items(
    data: dict[str, np.ndarray], *, expected: bool = True
) -> list[tuple[str, np.ndarray, int | None]]:
    """get_chunks items; without ``expected`` the caller relies on the crc32c the peer sends."""
    return [
        (cid, np.zeros(a.nbytes, np.uint8), crc32c(a) if expected else None)
        for cid, a in data.items()
    ]


@pytest.mark.parametrize(
    "forge", [_forge_chunks_payload, _forge_chunks_header], ids=["payload", "header"]
)
def test_a_reply_forged_with_matching_crc32c_is_never_returned(peer, forge) -> None:  # type: ignore[no-untyped-def]
    _tier, data, serve = peer
    # Without MACs the forgery works: the chunk comes back "ok" with the attacker's bytes (a
    # rewritten header needs a caller that takes the peer's crc32c; a forged payload does not).
    with PeerRelay(serve(UNMAC).address, tamper=_on(MsgType.CHUNKS, "down", forge)) as relay:
        items = _items(data, expected=forge is _forge_chunks_payload)
        assert (
            PeerClient(relay.address, secret=SECRET, options=UNMAC).get_chunks(1, items)
            == ["ok"] * 3
        )
        assert b"EVIL BYTES" in items[0][1].tobytes()
    # With them, the reply is refused as a whole.
    with PeerRelay(serve().address, tamper=_on(MsgType.CHUNKS, "down", forge)) as relay:
        client = PeerClient(relay.address, secret=SECRET, options=FAST)
        with pytest.raises(FrameAuthenticationError):
            client.get_chunks(1, _items(data, expected=False))
        assert client.steps() == [1] and client.handshakes == 2  # the connection was dropped


@pytest.mark.parametrize("region", REGIONS)
def test_a_reply_flipped_anywhere_is_refused(peer, region: str) -> None:  # type: ignore[no-untyped-def]
    _, data, serve = peer
    tamper = _on(MsgType.CHUNKS, "down", lambda f: _flip(f.raw, f, region))
    with (
        PeerRelay(serve().address, tamper=tamper) as relay,
        PeerClient(relay.address, secret=SECRET, options=FAST) as client,
    ):
        with pytest.raises(FrameAuthenticationError):
            client.get_chunks(1, _items(data))


@pytest.mark.parametrize("region", REGIONS)
def test_a_push_flipped_anywhere_is_dropped_unanswered_and_nothing_stored(
    peer, region: str
) -> None:  # type: ignore[no-untyped-def]
    tier, data, serve = peer
    server = serve()
    tamper = _on(MsgType.PUT_CHUNKS, "up", lambda f: _flip(f.raw, f, region))
    with (
        PeerRelay(server.address, tamper=tamper) as relay,
        PeerClient(relay.address, secret=SECRET, options=FAST) as client,
    ):
        with pytest.raises(PeerUnavailableError):  # no ERROR: the server says nothing to a forgery
            client.push_chunks(3, [(cid, a, crc32c(a)) for cid, a in data.items()])
    assert tier.steps() == [1] and server.stats["frame_auth_failures"] == 1
    assert server.stats["bytes_received"] == 0


@pytest.mark.parametrize("tags", [b"", bytes(16)], ids=["untagged", "zero-tags"])
def test_an_injected_push_is_refused_and_nothing_stored(peer, tags: bytes) -> None:  # type: ignore[no-untyped-def]
    tier, _data, serve = peer
    server = serve()
    evil = b"injected chunk bytes"
    ids = b'["a"]'
    header = {
        "step": 5,
        "count": 1,
        "ids_len": len(ids),
        "lengths": [len(evil)],
        "crcs": [crc32c(evil)],
    }
    head = wire.encode_frame(MsgType.PUT_CHUNKS, header, len(ids) + len(evil))
    injected = head + tags + ids + evil + tags

    def tamper(f: RelayedFrame) -> list[bytes]:
        return [injected, f.raw] if f.direction == "up" and f.type is MsgType.STEPS else [f.raw]

    with (
        PeerRelay(server.address, tamper=tamper) as relay,
        PeerClient(relay.address, secret=SECRET, options=FAST) as client,
    ):
        with pytest.raises(PeerUnavailableError):
            client.steps()
    assert tier.steps() == [1] and tier.chunk_ids(5) == []
    assert server.stats["frame_auth_failures"] == 1 and server.stats["requests"] == 0


@pytest.mark.parametrize("frame_mac", [True, False])
def test_a_recorded_push_replayed_later_or_on_another_connection_is_refused(
    peer, frame_mac: bool
) -> None:  # type: ignore[no-untyped-def]
    """The relay records a push of step 3; the tier then drops step 3; the push is replayed
    on the same connection (before the next request) and on a new connection (at the same
    frame number, other keys). Without MACs both replays store step 3 again, which shows
    they reach the server."""
    tier, data, serve = peer
    opts = FAST if frame_mac else UNMAC
    server = serve(opts)
    recorded: list[RelayedFrame] = []
    replay = {"mode": ""}

    def tamper(f: RelayedFrame) -> list[bytes]:
        if f.direction != "up":
            return [f.raw]
        if f.type is MsgType.PUT_CHUNKS and not recorded:
            recorded.append(f)
        elif (replay["mode"] == "same" and f.conn == recorded[0].conn) or (
            replay["mode"] == "other"
            and f.conn != recorded[0].conn
            and f.index == recorded[0].index
        ):
            replay["mode"] = ""
            return [recorded[0].raw, f.raw]  # the old push, right before this frame
        return [f.raw]

    with PeerRelay(server.address, tamper=tamper) as relay:
        with PeerClient(relay.address, secret=SECRET, options=opts) as client:
            client.push_chunks(3, [("x", data["a"], crc32c(data["a"]))])
            tier.drop_step(3)
            replay["mode"] = "same"
            try:  # the client may retry on a new connection: the replay is not repeated there
                client.steps()
            except PeerError:
                pass
        same_connection = tier.chunk_ids(3)
        tier.drop_step(3)
        replay["mode"] = "other"
        with PeerClient(relay.address, secret=SECRET, options=opts) as client:
            try:
                client.push_chunks(4, [("y", data["b"], crc32c(data["b"]))])
            except PeerError:
                pass
        other_connection = tier.chunk_ids(3)
    assert replay["mode"] == "" and len(recorded) == 1  # both replays were sent
    if frame_mac:
        assert same_connection == [] and other_connection == []
        assert server.stats["frame_auth_failures"] == 2
    else:
        assert same_connection == ["x"] and other_connection == ["x"]


@pytest.mark.parametrize("direction", ["up", "down"])
def test_swapped_or_dropped_frames_are_refused(peer, direction: str) -> None:  # type: ignore[no-untyped-def]
    """Two pipelined requests (or their replies) swapped, or the first one dropped."""
    _, data, serve = peer
    kind = MsgType.GET_CHUNKS if direction == "up" else MsgType.CHUNKS
    for action in ("swap", "drop"):
        held: list[RelayedFrame] = []
        server = serve()

        def tamper(
            f: RelayedFrame, held: list[RelayedFrame] = held, action: str = action
        ) -> list[bytes]:
            if f.direction != direction or f.type is not kind:
                return [f.raw]
            if not held:
                held.append(f)
                return []
            if len(held) == 1:
                held.append(f)
                return [f.raw, held[0].raw] if action == "swap" else [f.raw]
            return [f.raw]

        with (
            PeerRelay(server.address, tamper=tamper) as relay,
            PeerClient(relay.address, secret=SECRET, options=FAST) as client,
        ):
            expected = (PeerUnavailableError, FrameAuthenticationError)
            with pytest.raises(expected[direction == "down"]):
                client.get_chunks(1, _items(data), batch_chunks=1, window=3)
        if direction == "up":
            assert server.stats["frame_auth_failures"] == 1 and server.stats["requests"] == 0


def test_a_restore_falls_back_past_a_forging_peer_to_the_right_bytes(peer, make_tier) -> None:  # type: ignore[no-untyped-def]
    _tier, data, serve = peer
    backup = make_tier("backup")
    seal_chunks(backup, 1, data)
    good = PeerServer(backup, secret=SECRET, options=FAST).start()

    def tamper(f: RelayedFrame) -> list[bytes]:
        if f.direction == "down" and f.type is MsgType.CHUNKS:
            return [_forge_chunks_payload(f)]
        return [f.raw]

    try:
        with PeerRelay(serve().address, tamper=tamper) as relay:
            mitm = PeerClient(relay.address, secret=SECRET, options=FAST, name="mitm")
            source = TieredChunkSource(
                None, [mitm, PeerClient(good.address, secret=SECRET, name="good")]
            )
            intos = [np.zeros(a.nbytes, np.uint8) for a in data.values()]
            items = [
                (cid, a.nbytes, crc32c(a), into) for (cid, a), into in zip(data.items(), intos)
            ]
            assert source.fetch_many(1, items) == ["peer:good"] * 3
            assert [i.tobytes() for i in intos] == [a.tobytes() for a in data.values()]
            stats = source.stats()
            assert stats.fallbacks == {"protocol": 1} and stats.dead_peers == ["mitm"]
            assert "failed its tag" in stats.recent_fallbacks[0].detail
            # With no other peer: None, storage's turn.
            lone = TieredChunkSource(
                None, [PeerClient(relay.address, secret=SECRET, options=FAST, name="mitm")]
            )
            into = np.zeros(SIZES["a"], np.uint8)
            assert lone.fetch_many(1, [("a", SIZES["a"], crc32c(data["a"]), into)])[0] is None
            assert lone.stats().fallbacks == {"protocol": 1}
    finally:
        good.close()


# ============================================================================ handshake


def _rewrite(kind: MsgType, **fields: object) -> Callable[[RelayedFrame], list[bytes]]:
    def tamper(f: RelayedFrame) -> list[bytes]:
        if f.index == 0 and f.type is kind:
            return [f.with_header({**f.json(), **fields}).raw]
        return [f.raw]

    return tamper


@pytest.mark.parametrize(
    ("case", "client_mac", "server_mac", "tamper"),
    [
        ("client nonce", True, True, _rewrite(MsgType.HELLO, nonce="ab" * 32)),
        ("server nonce", True, True, _rewrite(MsgType.CHALLENGE, nonce="cd" * 32)),
        ("server proof", True, True, _rewrite(MsgType.CHALLENGE, mac="00" * 32)),
        ("hello flag", True, True, _rewrite(MsgType.HELLO, frame_mac=False)),
        ("challenge flag", True, True, _rewrite(MsgType.CHALLENGE, frame_mac=False)),
        # A downgrade: the client wants MACs, the server runs without; the relay tells each side
        # what it expects to hear. Only the transcript inside the proofs reveals it.
        (
            "both flags",
            True,
            False,
            lambda f: (
                [f.with_header({**f.json(), "frame_mac": not f.json()["frame_mac"]}).raw]
                if f.index == 0 and f.type in (MsgType.HELLO, MsgType.CHALLENGE)
                else [f.raw]
            ),
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_an_altered_handshake_fails(
    peer, case: str, client_mac: bool, server_mac: bool, tamper
) -> None:  # type: ignore[no-untyped-def]
    _, _, serve = peer
    server = serve(dataclasses.replace(FAST, frame_mac=server_mac))
    with PeerRelay(server.address, tamper=tamper) as relay:
        client = PeerClient(
            relay.address, secret=SECRET, options=dataclasses.replace(FAST, frame_mac=client_mac)
        )
        with pytest.raises(AuthenticationError) as info:
            client.steps()
    if case == "both flags":
        assert "altered" in str(info.value)
    if "flag" in case and case != "both flags":
        assert "frame_mac" in str(info.value)
    assert server.stats["requests"] == 0


def test_frame_mac_off_on_both_sides_works_and_a_mismatch_fails_clearly(peer) -> None:  # type: ignore[no-untyped-def]
    _tier, data, serve = peer
    plain = serve(UNMAC)
    with PeerClient(plain.address, secret=SECRET, options=UNMAC) as c:
        items = _items(data)
        assert c.get_chunks(1, items) == ["ok"] * 3 and c.list_chunks(1) == sorted(data)
        c.push_chunks(2, [("z", data["c"], crc32c(data["c"]))])
        c.put_manifest(2, b"m")
        assert c.get_manifest(2) == b"m"
        assert get_one(c, 2, "z", data["c"].nbytes) == data["c"].tobytes()
    with pytest.raises(
        AuthenticationError, match="frame_mac"
    ):  # a client with MACs, a server without
        PeerClient(plain.address, secret=SECRET, options=FAST).steps()
    with pytest.raises(AuthenticationError, match="frame_mac"):  # and the other way round
        PeerClient(serve().address, secret=SECRET, options=UNMAC).steps()
    assert plain.stats["auth_failures"] == 1
