"""Link shaping, partitions and counters of simulated hosts."""

from __future__ import annotations

import json
import statistics
import sys
import time

import pytest

from fastckpt_examples.cluster.hosts import Host, HostDownError, LinkShape, SimulatedHosts
from tests.hosts._helpers import NETCAT, listen, netcat, result

pytestmark = pytest.mark.hosts

# TCP goodput through a tbf of rate R is at most 1448/1514 = 95.6% of R (it counts frames).
GOODPUT_LOW, GOODPUT_HIGH = 0.80, 1.0


def _goodput_mbit(sender: Host, receiver: Host, port: int, nbytes: int) -> float:
    server = listen(receiver, "recv", port)
    netcat(sender, "send", receiver.address, port, nbytes)
    got = result(server)
    assert got["bytes"] == nbytes
    return float(got["bytes"] * 8 / got["seconds"] / 1e6)


def test_shaped_rate_both_directions_and_reshaping() -> None:
    with SimulatedHosts(2, link=LinkShape(rate_mbit=400)) as hosts:
        a, b = hosts
        rate = _goodput_mbit(a, b, 7101, 12 << 20)
        assert GOODPUT_LOW * 400 <= rate <= GOODPUT_HIGH * 400, rate
        a.shape(LinkShape(rate_mbit=100))
        assert a.link == LinkShape(rate_mbit=100)
        out = _goodput_mbit(a, b, 7102, 4 << 20)  # a's egress
        into = _goodput_mbit(b, a, 7103, 4 << 20)  # a's ingress (the switch port's egress)
        for rate in (out, into):
            assert GOODPUT_LOW * 100 <= rate <= GOODPUT_HIGH * 100, (out, into)
        a.shape(LinkShape())  # unshaped: b's 400 Mbit/s link is the bottleneck again
        rate = _goodput_mbit(a, b, 7104, 12 << 20)
        assert GOODPUT_LOW * 400 <= rate <= GOODPUT_HIGH * 400, rate


def test_link_bytes_count_the_traffic() -> None:
    with SimulatedHosts(2) as hosts:
        a, b = hosts
        rx0, tx0 = a.link_bytes()
        brx0, _ = b.link_bytes()
        _goodput_mbit(a, b, 7105, 5 << 20)
        rx1, tx1 = a.link_bytes()
        assert 5 << 20 <= tx1 - tx0 < (5 << 20) * 1.1  # payload plus headers
        assert rx1 - rx0 < 1 << 20  # acknowledgements only
        assert b.link_bytes()[0] - brx0 >= 5 << 20
        b.kill()
        with pytest.raises(HostDownError):
            b.link_bytes()


def test_partition_stalls_a_transfer_silently_and_heal_resumes_it() -> None:
    nbytes = 30 << 20  # ~2.5 s at 100 Mbit/s
    with SimulatedHosts(2, link=LinkShape(rate_mbit=100)) as hosts:
        a, b = hosts
        server = listen(b, "recv", 7106)
        sender = a.popen([sys.executable, "-I", NETCAT, "send", b.hostname, "7106", str(nbytes)])
        time.sleep(0.5)
        assert b.link_bytes()[0] > 1 << 20  # flowing
        b.partition()
        assert b.is_partitioned
        time.sleep(0.3)  # what was in flight has landed
        stalled_at = b.link_bytes()[0]
        time.sleep(1.5)
        assert b.link_bytes()[0] == stalled_at  # no progress...
        assert sender.poll() is None and server.poll() is None  # ...and no error
        b.heal()
        assert not b.is_partitioned
        assert sender.wait(timeout=30) == 0
        assert result(server)["bytes"] == nbytes


@pytest.mark.hosts(delay=True)
def test_delay_shows_in_the_round_trip() -> None:
    delay_ms = 10.0
    with SimulatedHosts(2, link=LinkShape(delay_ms=delay_ms)) as hosts:
        a, b = hosts
        server = listen(b, "echo", 7107)
        rtts = json.loads(netcat(a, "ping", b.address, 7107, 20))
        server.communicate(timeout=30)
        rtt_ms = statistics.median(rtts) * 1000
        # Each packet crosses a's link and b's link: 2 x delay one way, 4 x a round trip.
        assert 4 * delay_ms <= rtt_ms <= 4 * delay_ms + 10, rtts
        a.shape(LinkShape())
        b.shape(LinkShape())
        server = listen(b, "echo", 7108)
        rtts = json.loads(netcat(a, "ping", b.address, 7108, 20))
        server.communicate(timeout=30)
        assert statistics.median(rtts) * 1000 < delay_ms, rtts
