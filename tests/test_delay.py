"""The link delay stage (switchsim/delay.py over csrc/ina_delay.c) on its own: a namespace with two veth
pairs a0-a1 and b0-b1, the stage between a1 and b1, numbered raw Ethernet frames sent on a0 (or b0) and read
on b0 (or a0) with the kernel's receive timestamps. Every frame arrives, in order, no sooner than the delay;
the limit drops and counts; the stage's final JSON counts them all.

The frames are sent and read by this file run as a script inside the namespace (`probe`), so the test
process never changes namespace."""
import json
import os
import select
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time

import pytest

from switchsim import native

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ETHERTYPE = 0x88B5  # IEEE local experimental
PACKET_OUTGOING, SO_TIMESTAMPNS, SO_RCVBUFFORCE = 4, 35, 33
HEADER = struct.Struct("!6s6sHQq")  # dst, src, type, sequence number, send time (CLOCK_REALTIME ns)

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates a network namespace and veth pairs"),
    pytest.mark.skipif(not (shutil.which("ip") and shutil.which("ethtool")),
                       reason="needs the ip and ethtool commands"),
    pytest.mark.skipif(not native.available(), reason="the C core (switchsim._native) is not built"),
]


def sh(*argv, **kw):
    return subprocess.run(list(map(str, argv)), check=True, capture_output=True, text=True, timeout=30, **kw)


@pytest.fixture
def ns():
    """A namespace with veth pairs a0-a1 and b0-b1, up, no IPv6 chatter, offloads off (as netns.py sets them)."""
    name = f"ina-delay-test-{os.getpid()}"
    sh("ip", "netns", "add", name)
    try:
        sh("ip", "netns", "exec", name, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
           "net.ipv6.conf.default.disable_ipv6=1")
        for x in "ab":
            sh("ip", "-n", name, "link", "add", f"{x}0", "type", "veth", "peer", "name", f"{x}1")
        for dev in ("a0", "a1", "b0", "b1"):
            sh("ip", "-n", name, "link", "set", dev, "up")
            sh("ip", "netns", "exec", name, "ethtool", "-K", dev, "tx", "off", "tso", "off", "gso", "off", "gro", "off")
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


class Stage:
    """`python -m switchsim.delay` inside the namespace; stop() SIGTERMs it and returns its JSON counters."""

    def __init__(self, ns: str, *args):
        self.p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "switchsim.delay", *map(str, args)],
                                  cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # the stage prints "ready" (whole, flushed) or exits: readline after select cannot hang
        line = self.p.stdout.readline() if select.select([self.p.stdout], [], [], 20)[0] else ""
        if line != "ready\n":
            self.kill()
            raise AssertionError(f"stage not ready: {line!r} {self.p.stderr.read()}")

    def stop(self) -> dict:
        os.kill(self.p.pid, signal.SIGTERM)  # `ip netns exec` execs: the PID is the stage's
        out, err = self.p.communicate(timeout=10)
        assert self.p.returncode == 0, err
        return json.loads(out.strip().splitlines()[-1])

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(timeout=10)


def probe(ns: str, src: str, dst: str, n: int, per_ms: int = 0) -> list[tuple[int, int]]:
    """n frames sent on src (per_ms a millisecond, or at once with 0) and read on dst, inside ns:
    [(sequence number, ns from its send to its kernel receive timestamp)] in arrival order."""
    r = subprocess.run(["ip", "netns", "exec", ns, sys.executable, __file__, src, dst, str(n), str(per_ms)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [tuple(x) for x in json.loads(r.stdout)]


def _probe(src: str, dst: str, n: int, per_ms: int):
    """Inside the namespace: send, then read until n frames came or 3 s passed without one."""
    tx = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETHERTYPE))
    tx.bind((src, ETHERTYPE))
    rx = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETHERTYPE))
    rx.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 32 << 20)  # all n wait here while we send
    rx.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    rx.bind((dst, ETHERTYPE))
    rx.settimeout(3.0)
    pad = bytes(100 - HEADER.size)
    for seq in range(n):
        tx.send(HEADER.pack(b"\x02\0\0\0\0\x02", b"\x02\0\0\0\0\x01", ETHERTYPE, seq, time.time_ns()) + pad)
        if per_ms and seq % per_ms == per_ms - 1:
            time.sleep(0.001)
    got = []
    for _ in range(n):
        try:
            frame, anc, _, addr = rx.recvmsg(2048, 64)
        except socket.timeout:
            break
        if addr[2] == PACKET_OUTGOING:
            continue
        stamp = [struct.unpack("qq", data[:16]) for level, kind, data in anc
                 if (level, kind) == (socket.SOL_SOCKET, SO_TIMESTAMPNS)]
        assert stamp, "no receive timestamp"
        _, _, _, seq, sent = HEADER.unpack_from(frame)
        got.append((seq, stamp[0][0] * 1_000_000_000 + stamp[0][1] - sent))
    print(json.dumps(got))


def test_every_frame_arrives_in_order_after_the_delay(ns):
    stage = Stage(ns, "--delay-ms", 5, "a1:b1")
    try:
        forth = probe(ns, "a0", "b0", 2000, per_ms=4)
        back = probe(ns, "b0", "a0", 500, per_ms=4)
        counters = stage.stop()
    finally:
        stage.kill()
    for got, n in ((forth, 2000), (back, 500)):
        assert [seq for seq, _ in got] == list(range(n))
        lat_ms = [lat / 1e6 for _, lat in got]
        # 20 us: the stage times on CLOCK_MONOTONIC, the frames carry CLOCK_REALTIME (NTP may slew it a little)
        assert min(lat_ms) >= 5.0 - 0.02, min(lat_ms)
        assert 5.0 <= statistics.median(lat_ms) <= 7.0, statistics.median(lat_ms)
    assert counters["received"] == counters["forwarded"] == 2500, counters
    assert counters["dropped"] == counters["send_errors"] == counters["oversized"] == counters["socket_drops"] == 0
    assert counters["queued"] == {"a1>b1": 0, "b1>a1": 0}
    assert 1 <= counters["max_queue"]["a1>b1"] <= 2000 and counters["max_queue"]["b1>a1"] >= 1
    assert counters["cpu_s"] >= 0


def test_the_limit_drops_and_counts(ns):
    """A burst of 100 into a limit of 10 with a 50 ms delay: the first ones wait, the rest are dropped."""
    stage = Stage(ns, "--delay-ms", 50, "--limit", 10, "a1:b1")
    try:
        got = probe(ns, "a0", "b0", 100)
        counters = stage.stop()
    finally:
        stage.kill()
    seqs = [seq for seq, _ in got]
    assert seqs == sorted(seqs) and len(seqs) == counters["forwarded"]
    assert counters["forwarded"] + counters["dropped"] == counters["received"] == 100, counters
    assert counters["dropped"] > 0 and counters["max_queue"]["a1>b1"] == 10, counters
    assert min(lat for _, lat in got) >= 50e6 - 20e3


if __name__ == "__main__":  # the probe, run inside the namespace by probe()
    _probe(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
