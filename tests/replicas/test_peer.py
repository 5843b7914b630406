"""PeerServer/PeerClient over real loopback sockets: data, auth, limits, misbehaving clients."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastckpt._checksum import crc32c
from fastckpt.errors import (
    AuthenticationError,
    ChecksumMismatchError,
    ConfigError,
    PeerRequestError,
    PeerUnavailableError,
)
from fastckpt.replicas import _wire as wire
from fastckpt.replicas import _wire_auth as wire_auth
from fastckpt.replicas._channel import Channel
from fastckpt.replicas._client import PeerClient
from fastckpt.replicas._connection import PeerOptions, server_handshake
from fastckpt.replicas._ram import RamTier
from fastckpt.replicas._server import PeerServer
from fastckpt.replicas._wire import MsgType
from tests.support.peer_read import get_one
from tests.support.tag_raw import tag_raw

from .conftest import SECRET, fill, raw_handshake, seal_chunks, verified_chunk

MakeTier = Callable[..., RamTier]
MakeServer = Callable[..., PeerServer]
FAST = PeerOptions(connect_timeout_s=2, handshake_timeout_s=1, io_timeout_s=2)


def read_to_eof(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def assert_refused(server: PeerServer, msg_type: MsgType, cases: list[tuple[dict, bytes]]) -> None:  # type: ignore[type-arg]
    """Each ``(header, payload)`` request, sent on its own authenticated connection, gets a
    ``bad_request`` ERROR and the connection closed."""
    for header, payload in cases:
        chan, t, _, _ = raw_handshake(server.address)
        assert t is MsgType.AUTH_OK
        chan.sock.sendall(
            tag_raw(chan, wire.encode_frame(msg_type, header, len(payload)) + payload)
        )
        reply = read_to_eof(chan.sock)
        chan.close()
        assert b'"bad_request"' in reply, (header, reply[:200])


@pytest.fixture
def served(
    make_tier: MakeTier, make_server: MakeServer
) -> tuple[RamTier, PeerServer, dict[str, np.ndarray]]:
    tier = make_tier("server")
    data = fill(1, {"a": 1, "b": 3 << 20, "params['w']@0:2,0:8": 64, "empty": 0})
    seal_chunks(tier, 1, data)
    tier.put_manifest(1, b'{"manifest": 1}')
    return tier, make_server(tier, options=FAST), data


def test_get_list_manifest_steps_bit_exact(served) -> None:  # type: ignore[no-untyped-def]
    tier, server, data = served
    with PeerClient(server.address, secret=SECRET, options=FAST) as c:
        for cid, a in data.items():
            assert get_one(c, 1, cid, a.nbytes, crc32c(a)) == a.tobytes()
        assert get_one(c, 1, "missing", 1) == "missing" == get_one(c, 2, "a", 1)
        assert c.list_chunks(1) == sorted(data) and c.list_chunks(9) == []
        assert c.get_manifest(1) == b'{"manifest": 1}' and c.get_manifest(2) is None
        assert c.step_lists() == ([1], [1], [1])
        seal_chunks(tier, 2, fill(2, {"x": 10}))  # sealed, not committed
        assert c.step_lists() == ([1, 2], [1], [1])
        tier.mark_committed(
            2
        )  # committed here, its manifest held elsewhere (retention drops step 1)
        assert c.step_lists()[1:] == ([2], []) and c.get_manifest(2) is None
        assert c.handshakes == 1  # one pooled connection served every call
        with pytest.raises(ConfigError):  # a caller bug, not a peer failure
            get_one(c, 1, "", 0)
        with pytest.raises(ConfigError):
            c.push_chunks(1, [("a\x00b", b"x", 0)])


def test_push_one_chunk_and_manifest(served) -> None:  # type: ignore[no-untyped-def]
    tier, server, _ = served
    a = fill(2, {"x": (1 << 20) + 3})["x"]
    with PeerClient(server.address, secret=SECRET, options=FAST) as c:
        c.push_chunks(2, [("x", a.data, crc32c(a))])
        c.put_manifest(2, b"m2")
        with pytest.raises(PeerRequestError) as e:
            c.push_chunks(1, [("late", b"z", crc32c(b"z"))])  # superseded by committed step 2
        assert e.value.code == "stale_step"
        assert c.steps() == [2]  # still usable after refusals
    assert bytes(verified_chunk(tier, 2, "x")) == a.tobytes()  # type: ignore[arg-type]
    assert tier.chunk_ids(2) == ["x"] and tier.get_manifest(2) == b"m2"


def test_push_over_budget_is_refused(make_tier: MakeTier, make_server: MakeServer) -> None:
    tier = make_tier(budget_bytes=1 << 20)
    server = make_server(tier, options=FAST)
    with PeerClient(server.address, secret=SECRET, options=FAST) as c:
        with pytest.raises(PeerRequestError) as e:
            c.push_chunks(1, [("big", np.zeros(2 << 20, np.uint8), 0)])
        assert e.value.code == "budget"
        c.push_chunks(1, [("small", b"ok", crc32c(b"ok"))])
        assert tier.chunk_ids(1) == ["small"]


def test_concurrent_clients(served) -> None:  # type: ignore[no-untyped-def]
    _, server, data = served
    shared = PeerClient(server.address, secret=SECRET, options=FAST)
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            own = PeerClient(server.address, secret=SECRET, options=FAST)
            for j in range(6):
                c = shared if (i + j) % 2 else own
                for cid, a in data.items():
                    assert get_one(c, 1, cid, a.nbytes) == a.tobytes()
            own.close()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert shared.handshakes <= 8
    shared.close()


def test_wrong_secret_gets_nothing(served) -> None:  # type: ignore[no-untyped-def]
    _, server, _ = served
    with pytest.raises(AuthenticationError):
        PeerClient(server.address, secret=b"wrong-secret-0123456789", options=FAST).steps()
    chan, t, h, _ = raw_handshake(server.address, secret=b"wrong-secret-0123456789")
    assert (t, h["code"]) == (MsgType.ERROR, "auth_failed")
    chan.sock.sendall(chan.encode(MsgType.LIST, {"step": 1}))
    assert read_to_eof(chan.sock) == b""  # disconnected; the request was never served
    chan.close()
    # The PeerClient gave up on the server's proof before answering; the raw one was refused.
    assert server.stats["auth_failures"] == 1 and server.stats["bytes_sent"] == 0


def test_client_refuses_server_without_the_secret(
    make_tier: MakeTier, make_server: MakeServer
) -> None:
    server = make_server(make_tier(), secret=b"other-secret-0123456789")
    with pytest.raises(AuthenticationError, match="secret"):
        PeerClient(server.address, secret=SECRET, options=FAST).steps()


def test_request_before_auth_is_refused(served) -> None:  # type: ignore[no-untyped-def]
    _, server, _ = served
    s = socket.create_connection(server.address, timeout=5)
    s.sendall(wire.encode_frame(MsgType.LIST, {"step": 1}))
    t, h, _ = Channel(s, limits=wire.AUTH_LIMITS).recv_head()
    assert (t, h["code"]) == (MsgType.ERROR, "bad_request")
    assert read_to_eof(s) == b""
    s.close()


def test_replayed_and_reflected_proofs_are_refused(served) -> None:  # type: ignore[no-untyped-def]
    _, server, _ = served
    # An eavesdropper records a legitimate handshake...
    nonce = wire_auth.new_nonce()
    s1, t1, _, sn1 = raw_handshake(server.address, nonce=nonce)
    assert t1 is MsgType.AUTH_OK
    s1.close()
    keys = wire_auth.session_keys(SECRET, client_nonce=nonce, server_nonce=sn1, frame_mac=True)
    # ...and replays the same HELLO and AUTH: the server's fresh nonce makes the proof stale.
    for proof in (keys.client_proof, keys.server_proof):
        s = socket.create_connection(server.address, timeout=5)
        plain = Channel(s, limits=wire.AUTH_LIMITS)
        plain.send(MsgType.HELLO, {"nonce": nonce.hex(), "frame_mac": True})
        _, h, _ = plain.recv_head()
        assert bytes.fromhex(h["nonce"]) != sn1
        plain.send(MsgType.AUTH, {"mac": proof.hex()})
        t, h, _ = plain.recv_head()
        assert (t, h["code"]) == (MsgType.ERROR, "auth_failed")
        assert read_to_eof(s) == b""
        s.close()
    # Reflection: the server's own proof for our nonces is not accepted as ours.
    s = socket.create_connection(server.address, timeout=5)
    plain = Channel(s, limits=wire.AUTH_LIMITS)
    plain.send(MsgType.HELLO, {"nonce": nonce.hex(), "frame_mac": True})
    _, h, _ = plain.recv_head()
    plain.send(MsgType.AUTH, {"mac": h["mac"]})
    t, h, _ = plain.recv_head()
    assert h["code"] == "auth_failed"
    s.close()


def test_oversized_requests_are_refused_and_others_served(served) -> None:  # type: ignore[no-untyped-def]
    _, server, data = served
    good = PeerClient(server.address, secret=SECRET, options=FAST)
    assert get_one(good, 1, "a", data["a"].nbytes) == data["a"].tobytes()
    chan, t, _, _ = raw_handshake(server.address)
    assert t is MsgType.AUTH_OK
    huge = wire.PREFIX.pack(
        wire.MAGIC, wire.VERSION, MsgType.PUT_CHUNKS, 0, 40, FAST.max_payload_bytes + 1
    )
    chan.sock.sendall(huge)  # refused from the prefix alone, before any tag is read
    t, h, _ = chan.recv_head()
    assert (t, h["code"]) == (MsgType.ERROR, "too_large")
    assert read_to_eof(chan.sock) == b""
    chan.close()
    chan, _, _, _ = raw_handshake(server.address)
    chan.sock.sendall(wire.PREFIX.pack(wire.MAGIC, wire.VERSION, MsgType.LIST, 0, 1 << 30, 0))
    assert chan.recv_head()[1]["code"] == "too_large"
    chan.close()
    assert get_one(good, 1, "b", data["b"].nbytes) == data["b"].tobytes()
    assert server.stats["protocol_errors"] == 2


def test_timeouts_and_refused_connections_are_unavailable() -> None:
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (via backlog), never answers
    address = silent.getsockname()
    try:
        opts = PeerOptions(connect_timeout_s=1, handshake_timeout_s=0.3)
        t0 = time.monotonic()
        with pytest.raises(PeerUnavailableError):
            PeerClient(address, secret=SECRET, options=opts).steps()
        assert time.monotonic() - t0 < 2
    finally:
        silent.close()
    with pytest.raises(PeerUnavailableError):
        PeerClient(address, secret=SECRET, options=FAST).steps()  # port now closed


def test_stale_pooled_connection_is_replaced(make_tier: MakeTier, make_server: MakeServer) -> None:
    tier = make_tier()
    seal_chunks(tier, 1, fill(1, {"a": 10}))
    server = make_server(tier, options=PeerOptions(idle_timeout_s=0.2))
    with PeerClient(server.address, secret=SECRET) as c:
        assert c.steps() == [1]
        time.sleep(0.5)  # the server drops the idle connection
        assert c.steps() == [1]
        assert c.handshakes == 2


def test_busy_server_refuses_extra_connections(served, make_server: MakeServer) -> None:  # type: ignore[no-untyped-def]
    tier, _, _ = served
    server = make_server(tier, options=PeerOptions(max_connections=1))
    holder = PeerClient(server.address, secret=SECRET)
    assert holder.steps() == [1]  # keeps its pooled connection open
    with pytest.raises(PeerRequestError) as e:
        PeerClient(server.address, secret=SECRET).steps()
    assert e.value.code == "busy"
    holder.close()


def _serve_corrupted(
    make_tier: MakeTier,
    make_server: MakeServer,
    shm_dir: Path,
    sizes: dict[str, int],
    offset: int,
    garbage: bytes,
) -> tuple[PeerServer, dict[str, np.ndarray]]:
    """A server over a tier whose step-1 segment (``sizes``' chunks, in order) has ``garbage``
    written at ``offset`` after it was sealed (as a scribbling process or bad memory would)."""
    tier = make_tier("srv")
    data = fill(1, sizes)
    seal_chunks(tier, 1, data)
    tier.close()
    (f,) = (shm_dir / "srv" / "step-1").glob("*.data")
    with f.open("r+b") as fh:
        fh.seek(offset)
        fh.write(garbage)
    return make_server(make_tier("srv"), options=FAST), data


def test_corrupt_server_copy_and_wrong_size_buffer(
    make_tier: MakeTier, make_server: MakeServer, shm_dir: Path
) -> None:
    server, data = _serve_corrupted(
        make_tier, make_server, shm_dir, {"a": 1 << 20, "b": 100}, 12345, b"\x00\x01\x02"
    )
    with PeerClient(server.address, secret=SECRET, options=FAST) as c:
        assert get_one(c, 1, "a", data["a"].nbytes) == "corrupt"
        assert get_one(c, 1, "b", 99) == "corrupt"
        assert get_one(c, 1, "b", 100, crc32c(data["b"]) ^ 1) == "corrupt"
        assert get_one(c, 1, "b", 100) == data["b"].tobytes()


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(garbage=st.binary(min_size=1, max_size=300), authenticate=st.booleans())
def test_fuzz_live_server_survives_garbage(served, garbage: bytes, authenticate: bool) -> None:  # type: ignore[no-untyped-def]
    _, server, data = served
    if (
        authenticate
    ):  # garbage from a client with the secret: tagged where the server looks for tags
        chan = raw_handshake(server.address)[0]
        s, garbage = chan.sock, tag_raw(chan, garbage)
    else:
        s = socket.create_connection(server.address, timeout=5)
    s.settimeout(3)
    try:
        s.sendall(garbage)
        s.shutdown(socket.SHUT_WR)
        reply = read_to_eof(s)  # the server answers (an ERROR at most) and hangs up
    except OSError:
        reply = b""
    finally:
        s.close()
    if reply:
        assert reply.startswith(wire.MAGIC)
    with PeerClient(server.address, secret=SECRET, options=FAST) as c:
        assert get_one(c, 1, "a", data["a"].nbytes) == data["a"].tobytes()


def test_large_chunks_use_pipelined_verification(
    make_tier: MakeTier, make_server: MakeServer, shm_dir: Path
) -> None:
    """Chunks over two crc windows (> 8 MiB) are checksummed on a helper thread: still exact."""
    big = fill(1, {"big": (12 << 20) + 5})["big"]
    tier = make_tier("big")
    seal_chunks(tier, 1, {"big": big})
    tier.close()
    (f,) = (shm_dir / "big" / "step-1").glob("*.data")
    server = make_server(make_tier("big", budget_bytes=64 << 20), options=FAST)
    with PeerClient(server.address, secret=SECRET, options=FAST) as c:
        assert get_one(c, 1, "big", big.nbytes, crc32c(big)) == big.tobytes()
        c.push_chunks(2, [("pushed", big, crc32c(big))])  # the server receives via that path
        with pytest.raises(ChecksumMismatchError):
            c.push_chunks(2, [("bad", big, crc32c(big) ^ 1)])
        with f.open("r+b") as fh:  # flip a byte in the last window of the served copy
            fh.seek(big.nbytes - 3)
            fh.write(b"\xff" if big[-3] != 0xFF else b"\x00")
        assert get_one(c, 1, "big", big.nbytes) == "corrupt"


def _segments(tier_dir: Path, step: int) -> list[Path]:
    return sorted((tier_dir / f"step-{step}").glob("*.data"))


def test_push_chunks_stores_one_segment_all_or_nothing(
    make_tier: MakeTier, make_server: MakeServer, shm_dir: Path
) -> None:
    tier = make_tier("dst")
    server = make_server(tier, options=FAST)
    data = fill(3, {"p@0:4": 1 << 20, "p@4:8": (1 << 20) + 5, "q": 1, "z": 0})
    batch = [(cid, a, crc32c(a)) for cid, a in data.items()]
    with PeerClient(server.address, secret=SECRET, options=FAST) as c:
        c.push_chunks(3, batch)
        assert tier.chunk_ids(3) == sorted(data)
        assert len(_segments(shm_dir / "dst", 3)) == 1
        for cid, a in data.items():
            assert bytes(verified_chunk(tier, 3, cid)) == a.tobytes()  # type: ignore[arg-type]
        hit = tier.lend_spans(3, [["p@0:4", "p@4:8"]])[0]  # back to back, in the order sent
        assert (
            hit is not None and bytes(hit[0]) == data["p@0:4"].tobytes() + data["p@4:8"].tobytes()
        )
        bad = [(cid, a, crc ^ (cid == "q")) for cid, a, crc in batch]
        with pytest.raises(ChecksumMismatchError):
            c.push_chunks(4, bad)
        assert tier.chunk_ids(4) == [] and c.steps() == [
            3
        ]  # nothing of the corrupt batch; still in sync
        tier.put_manifest(5, b"m")
        with pytest.raises(PeerRequestError) as e:
            c.push_chunks(4, batch)
        assert e.value.code == "stale_step"
        c.push_chunks(6, batch[:1])
        assert tier.chunk_ids(6) == ["p@0:4"]


def test_get_chunks_sends_one_request_per_batch(
    make_tier: MakeTier, make_server: MakeServer
) -> None:
    tier = make_tier("batches")
    sizes = {f"c{i}": (i * 7919) % 5000 for i in range(11)}
    data = fill(1, sizes)
    seal_chunks(tier, 1, data)
    server = make_server(tier, options=FAST)
    # 11 chunks + one absent id, in batches of 3: [c0 c1 c2] [c3 c4 nope] [c5 c6 c7] [c8 c9 c10];
    # then c2 asked twice in a row: the repeat starts a new batch (a request names each id once).
    ids = [f"c{i}" for i in range(5)] + ["nope"] + [f"c{i}" for i in range(5, 11)]
    cases = [(ids, 3, 2, 4), (["c2", "c2", "c3"], 16, 4, 2), (ids[:4], 1, 1, 4)]
    with PeerClient(server.address, secret=SECRET, options=FAST) as c:
        for want_ids, batch, window, requests in cases:
            intos = [np.zeros(sizes.get(cid, 1), np.uint8) for cid in want_ids]
            before = server.stats["requests"]
            got = c.get_chunks(
                1,
                [(cid, into, None) for cid, into in zip(want_ids, intos)],
                batch_chunks=batch,
                window=window,
            )
            assert server.stats["requests"] - before == requests
            assert got == ["missing" if cid == "nope" else "ok" for cid in want_ids]
            for cid, into in zip(want_ids, intos):
                if cid != "nope":
                    assert into.tobytes() == data[cid].tobytes()
        assert c.handshakes == 1
        with pytest.raises(ConfigError):
            c.get_chunks(
                1, [("c1", np.zeros(1, np.uint8), None)], batch_chunks=wire.MAX_BATCH_CHUNKS + 1
            )


def test_get_chunks_reply_over_the_servers_payload_limit_is_refused(
    make_tier: MakeTier, make_server: MakeServer
) -> None:
    tier = make_tier("limit")
    data = fill(1, {"x": 3000, "y": 3000})
    seal_chunks(tier, 1, data)
    server = make_server(tier, options=dataclasses.replace(FAST, max_payload_bytes=4096))
    with PeerClient(server.address, secret=SECRET, options=FAST) as c:
        with pytest.raises(
            PeerUnavailableError, match="too_large"
        ):  # the client's own limit is larger
            c.get_chunks(1, [(cid, np.zeros(3000, np.uint8), None) for cid in ("x", "y")])
    small = dataclasses.replace(FAST, max_payload_bytes=4096)
    with PeerClient(
        server.address, secret=SECRET, options=small
    ) as c:  # splits its requests by its limit
        intos = [np.zeros(3000, np.uint8) for _ in range(2)]
        assert c.get_chunks(1, [(cid, into, None) for cid, into in zip("xy", intos)]) == [
            "ok",
            "ok",
        ]
        assert [i.tobytes() for i in intos] == [data["x"].tobytes(), data["y"].tobytes()]


def test_malformed_push_chunks_is_refused(served) -> None:  # type: ignore[no-untyped-def]
    tier, server, _ = served
    cases = [
        (
            {"step": 7, "count": 2, "ids_len": 9, "lengths": [1], "crcs": [0, 0]},
            b'["a","b"]' + b"xy",
        ),
        (
            {"step": 7, "count": 1, "ids_len": 5, "lengths": [1], "crcs": [0]},
            b'["a"]' + b"x" + b"extra",
        ),
        (
            {"step": 7, "count": 2, "ids_len": 9, "lengths": [1, 1], "crcs": [0, 0]},
            b'["a","a"]' + b"xy",
        ),
        ({"step": 7, "count": 1, "ids_len": 5, "lengths": [1], "crcs": [0]}, b'["a",' + b"x"),
        ({"step": 7, "count": 0, "ids_len": 2, "lengths": [], "crcs": []}, b"[]"),
    ]
    assert_refused(server, MsgType.PUT_CHUNKS, cases)
    assert tier.chunk_ids(7) == []
    with PeerClient(server.address, secret=SECRET, options=FAST) as c:  # the server carries on
        assert c.steps() == [1]


def test_get_chunks_pipelined_with_misses_and_bad_sizes(served) -> None:  # type: ignore[no-untyped-def]
    _tier, server, data = served
    ids = ["b", "missing", "a", "params['w']@0:2,0:8", "empty", "b"]
    intos = [np.zeros(data[c].nbytes if c in data else 7, np.uint8) for c in ids]
    intos[2] = np.zeros(
        2, np.uint8
    )  # "a" has 1 byte: a wrong-size buffer is "corrupt", stream stays in sync
    expected = [crc32c(data[c]) if c in data else None for c in ids]
    expected[5] = expected[5] ^ 1  # the caller's checksum disagrees: "corrupt"
    with PeerClient(server.address, secret=SECRET, options=FAST) as c:
        got = c.get_chunks(1, list(zip(ids, intos, expected)), window=2)
        assert got == ["ok", "missing", "corrupt", "ok", "ok", "corrupt"]
        for k in (0, 3, 4):
            assert intos[k].tobytes() == data[ids[k]].tobytes()
        assert c.get_chunks(2, [("a", np.zeros(1, np.uint8), None)]) == ["missing"]
        assert c.get_chunks(1, []) == []
        assert c.handshakes == 1  # one pooled connection, still in sync after every case
        with pytest.raises(ConfigError):
            c.get_chunks(1, [("", np.zeros(1, np.uint8), None)])


def test_get_ranges_sends_only_the_ranges_and_checks_the_whole_chunk(served) -> None:  # type: ignore[no-untyped-def]
    _tier, server, data = served
    b = data["b"].tobytes()
    crc_b = crc32c(data["b"])
    w = "params['w']@0:2,0:8"
    cases = [  # (chunk id, runs, expected crc, chunk length)
        ("b", [(1000, 1 << 20)], crc_b, len(b)),  # one middle range
        ("b", [(0, 10), (100, 5000), (len(b) - 7, 7)], crc_b, len(b)),  # head, middle, tail
        ("b", [(0, len(b))], crc_b, len(b)),  # the whole chunk
        ("b", [(7, 0)], crc_b, len(b)),  # nothing received, still checked
        ("missing", [(0, 3)], 0, 3),
        ("a", [(0, 1)], crc32c(data["a"]) ^ 1, 1),  # the caller's checksum disagrees
        (w, [(10, 10)], crc32c(data[w]), 99),  # another length
    ]
    intos = [np.zeros(n, np.uint8) for _, _, _, n in cases]
    sent0 = server.stats["bytes_sent"]
    with PeerClient(server.address, secret=SECRET, options=FAST) as c:
        got = c.get_ranges(
            1,
            [(cid, into, crc, runs) for (cid, runs, crc, _), into in zip(cases, intos)],
            batch_chunks=3,
            window=2,
        )
        assert got == ["ok", "ok", "ok", "ok", "missing", "corrupt", "corrupt"]
        for (_, runs, _, _), into in list(zip(cases, intos))[:4]:
            for a, n in runs:
                assert into[a : a + n].tobytes() == b[a : a + n]
        assert (
            not intos[0][:1000].any() and not intos[0][1000 + (1 << 20) :].any()
        )  # only the runs were written
        # runs reaching past the peer's (shorter) copy are missing there; the stream stays in sync
        assert c.get_ranges(1, [("a", np.zeros(2, np.uint8), 0, [(0, 2)])]) == ["missing"]
        for bad in (
            [],
            [(5, 3), (4, 1)],
            [(0, 3), (2, 1)],
            [(len(b) - 2, 4)],
        ):  # empty, descending, overlapping, outside
            with pytest.raises(ConfigError):
                c.get_ranges(1, [("b", np.zeros(len(b), np.uint8), crc_b, bad)])
        assert c.handshakes == 1
    sent = sum(n for cid, runs, _, _ in cases if cid in data for _, n in runs)
    assert server.stats["bytes_sent"] - sent0 == sent


def test_get_ranges_batches_respect_the_run_limit(served) -> None:  # type: ignore[no-untyped-def]
    _tier, server, data = served
    b = data["b"]
    runs = [(2 * i, 1) for i in range(600)]  # 600 runs per item: two items never share a request
    intos = [np.zeros(b.nbytes, np.uint8) for _ in range(3)]
    with PeerClient(server.address, secret=SECRET, options=FAST) as c:
        requests0 = server.stats["requests"]
        assert c.get_ranges(1, [("b", into, crc32c(b), runs) for into in intos]) == ["ok"] * 3
        assert server.stats["requests"] - requests0 == 3
    for into in intos:
        assert into[0:1200:2].tobytes() == b[0:1200:2].tobytes()


def test_get_ranges_detects_corruption_inside_and_outside_the_ranges(
    make_tier: MakeTier, make_server: MakeServer, shm_dir: Path
) -> None:
    server, data = _serve_corrupted(
        make_tier, make_server, shm_dir, {"a": 1 << 20}, 5000, b"\xff\x00"
    )
    crc = crc32c(data["a"])
    with PeerClient(server.address, secret=SECRET, options=FAST) as c:
        # the bad bytes inside a run, before the runs, between two, after them
        for runs in ([(4096, 4096)], [(8192, 100)], [(0, 4096), (8192, 100)], [(0, 4000)]):
            into = np.zeros(1 << 20, np.uint8)
            assert c.get_ranges(1, [("a", into, crc, runs)]) == ["corrupt"], runs


def test_malformed_get_ranges_is_refused_and_bad_runs_are_missing(served) -> None:  # type: ignore[no-untyped-def]
    _tier, server, _data = served
    many = wire.MAX_BATCH_RUNS + 1
    cases = [
        (
            {"step": 1, "count": 2, "runs": [1], "starts": [0], "stops": [1]},
            b'["a","b"]',
        ),  # runs per id missing
        (
            {"step": 1, "count": 1, "runs": [0], "starts": [], "stops": []},
            b'["a"]',
        ),  # an id without runs
        (
            {"step": 1, "count": 1, "runs": [1], "starts": [0], "stops": []},
            b'["a"]',
        ),  # a run without its stop
        (
            {
                "step": 1,
                "count": 1,
                "runs": [many],
                "starts": list(range(many)),
                "stops": list(range(many)),
            },
            b'["b"]',
        ),
        (
            {"step": 1, "count": 2, "runs": [1, 1], "starts": [0, 0], "stops": [1, 1]},
            b'["a","a"]',
        ),  # duplicate ids
    ]
    assert_refused(server, MsgType.GET_RANGES, cases)
    # Well-formed, but the runs are descending, overlapping or outside the chunk: those ids are
    # missing.
    chan, t, _, _ = raw_handshake(server.address)
    header = {
        "step": 1,
        "count": 3,
        "runs": [2, 2, 1],
        "starts": [10, 0, 0, 5, 0],
        "stops": [20, 5, 10, 15, 2],
    }
    ids = b'["b","empty","a"]'
    chan.send_frames([(MsgType.GET_RANGES, header, ids)])
    t, h, plen = chan.recv_head()
    chan.close()
    assert t is MsgType.RANGES and h["missing"] == [0, 1, 2] and plen == 0 and h["gaps"] == [], h
    with PeerClient(server.address, secret=SECRET, options=FAST) as c:  # the server carries on
        assert c.steps() == [1]


def test_a_trickling_client_cannot_hold_a_connection_past_the_handshake_deadline(
    make_tier: MakeTier, make_server: MakeServer
) -> None:
    """The handshake timeout bounds the whole handshake, not each receive: unauthenticated
    clients sending a byte at a time (each within the timeout) lose their slots, and an
    honest client gets in."""
    server = make_server(
        make_tier("slow"),
        options=dataclasses.replace(FAST, handshake_timeout_s=0.5, max_connections=3),
    )
    hello = wire.encode_frame(MsgType.HELLO, {"nonce": "00" * 32, "frame_mac": True}, 0)
    stop = threading.Event()
    dropped: list[bool] = []

    def trickle(s: socket.socket) -> None:
        for b in hello[:-1]:  # never completes
            if stop.is_set():
                return
            try:
                s.send(bytes([b]))
            except OSError:
                dropped.append(True)
                return
            time.sleep(0.2)

    socks = [socket.create_connection(server.address) for _ in range(3)]
    threads = [threading.Thread(target=trickle, args=(s,), daemon=True) for s in socks]
    for t in threads:
        t.start()
    try:
        time.sleep(2.0)
        with PeerClient(server.address, secret=SECRET, options=FAST) as client:
            assert client.steps() == []
        assert len(dropped) == 3
    finally:
        stop.set()
        for s in socks:
            s.close()


def test_a_refused_connection_lingers_for_a_bounded_time(
    make_tier: MakeTier, make_server: MakeServer
) -> None:
    """After an error reply the server waits a little for the client's EOF (so the reply is
    not destroyed by a reset), but a client that keeps trickling bytes cannot keep the
    connection's thread alive."""
    server = make_server(make_tier("linger"), options=FAST)
    conns = [socket.create_connection(server.address) for _ in range(8)]
    stop = threading.Event()

    def trickle(s: socket.socket) -> None:
        with contextlib.suppress(OSError):
            s.sendall(b"XXXX" * 5)  # bad magic: refused at once
            while not stop.is_set():
                s.send(b"x")
                time.sleep(0.1)

    threads = [threading.Thread(target=trickle, args=(s,), daemon=True) for s in conns]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(
            t.name == "fastckpt-peer-conn" for t in threading.enumerate()
        ):
            time.sleep(0.1)
        assert not [t for t in threading.enumerate() if t.name == "fastckpt-peer-conn"]
        assert server.stats["protocol_errors"] == 8
    finally:
        stop.set()
        for s in conns:
            s.close()


@pytest.mark.parametrize("size", [2 << 20, 64 << 20])
def test_an_oversized_push_is_refused_as_too_large_once(
    make_tier: MakeTier, make_server: MakeServer, size: int
) -> None:
    """A push over the server's payload limit gets ``PeerRequestError("too_large")`` whether the
    refusal arrives before the client finished sending or after, with no retry, and the
    connection (which the server closed) is not reused."""
    server = make_server(
        make_tier("big"), options=dataclasses.replace(FAST, max_payload_bytes=1 << 20)
    )
    with PeerClient(server.address, secret=SECRET, options=FAST) as client:
        client.steps()  # a pooled connection: the retry path
        with pytest.raises(PeerRequestError) as e:
            client.push_chunks(1, [("big", np.zeros(size, np.uint8), 0)])
        assert e.value.code == "too_large"
        assert client.handshakes == 1  # not sent again on a new connection
        assert client.steps() == []  # a fresh connection, not the one the server closed
        assert client.handshakes == 2


def test_a_ranges_reply_shorter_than_its_runs_is_a_protocol_error() -> None:
    """A peer (with the secret) whose RANGES reply names a chunk shorter than the runs asked
    for: the client raises ProtocolError (the source then falls back), not a bare ValueError."""
    from fastckpt.errors import ProtocolError

    listener = socket.create_server(("127.0.0.1", 0))

    def fake_peer() -> None:
        s, _ = listener.accept()
        with s:
            chan = server_handshake(s, secret=SECRET, options=PeerOptions())
            chan.recv_head()
            chan.recv_payload()
            chan.send(
                MsgType.RANGES, {"lengths": [50], "gaps": [0, 0], "missing": []}, [b"\0" * 100]
            )
            with contextlib.suppress(OSError):  # the client drops the connection it cannot trust
                read_to_eof(s)

    t = threading.Thread(target=fake_peer, daemon=True)
    t.start()
    try:
        with PeerClient(listener.getsockname(), secret=SECRET, options=FAST) as client:
            with pytest.raises(ProtocolError):
                client.get_ranges(1, [("a", np.zeros(100, np.uint8), 123, [(0, 100)])])
    finally:
        listener.close()
        t.join(5)
