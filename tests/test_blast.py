"""The benchmarks' C packet blaster (csrc/ina_blast.c, inabench.bench_bmv2.blast) against a UDP echo on
loopback: what it sends comes back and is counted, a rate paces it, a window bounds what is in flight, and
every call ends in bounded time, echo or none."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from switchsim import native

pytestmark = pytest.mark.skipif(not native.available(), reason="the C core is not built")


@pytest.fixture
def echo():
    """A UDP echo on 127.0.0.1 in a thread (the blaster releases the GIL); yields its address and the
    datagrams it answered (a list, appended to)."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    srv.bind(("127.0.0.1", 0))
    srv.settimeout(0.05)
    seen, stop = [], threading.Event()

    def serve():
        while not stop.is_set():
            try:
                data, addr = srv.recvfrom(2048)
            except socket.timeout:
                continue
            seen.append(data)
            srv.sendto(data, addr)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname(), seen
    stop.set()
    t.join(2)
    srv.close()


def _socks(n, dst):
    from inabench.bench_bmv2 import connected_sockets

    return connected_sockets(n, dst, "127.0.0.1")


def test_every_packet_sent_comes_back_and_is_counted(echo):
    from inabench.bench_bmv2 import blast

    dst, seen = echo
    socks = _socks(2, dst)
    packets = [(i % 2, i.to_bytes(4, "big") * 25) for i in range(3000)]
    t0 = time.monotonic()
    r = blast(socks, packets, window=32, seconds=10, quiet=0.5, expect=len(packets))
    assert time.monotonic() - t0 < 10
    assert (r["sent"], r["send_errors"], r["received"], r["stalls"]) == (3000, 0, 3000, 0)
    assert r["bytes_received"] == 3000 * 100 and r["pps"] > 0
    assert sorted(seen) == sorted(d for _, d in packets)  # each datagram once, on the wire as given
    for s in socks:
        s.close()


def test_a_rate_paces_the_sends(echo):
    from inabench.bench_bmv2 import blast

    dst, _ = echo
    socks = _socks(1, dst)
    r = blast(socks, [(0, b"x" * 64)] * 1001, rate=5000, seconds=10, quiet=0.2)
    assert r["received"] == r["sent"] == 1001
    assert 0.18 < r["last_send"] - r["first_send"] < 0.6  # packet k at k / rate: the last at 0.2 s
    socks[0].close()


def test_it_stops_in_time_and_counts_nothing_when_nothing_answers():
    from inabench.bench_bmv2 import blast

    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # bound, never read: no echo, no ICMP either
    sink.bind(("127.0.0.1", 0))
    socks = _socks(1, sink.getsockname())
    t0 = time.monotonic()
    r = blast(socks, [(0, b"y" * 10)] * 100_000, window=8, seconds=0.3, quiet=0.05)
    took = time.monotonic() - t0
    assert r["received"] == 0 and 0 < r["sent"] < 100_000
    assert r["stalls"] >= 1  # a full window that hears nothing gives its packets up and goes on
    assert 0.3 <= took < 1.5 and r["elapsed"] < 0.3 + 4 * 0.05 + 0.1
    socks[0].close()
    sink.close()


def test_a_bad_socket_index_is_refused():
    from inabench.bench_bmv2 import blast

    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.bind(("127.0.0.1", 0))
    socks = _socks(1, sink.getsockname())
    with pytest.raises(OSError):
        blast(socks, [(1, b"z")], seconds=0.1, quiet=0.01)
    socks[0].close()
    sink.close()
