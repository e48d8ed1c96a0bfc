"""`switchsim bench net` run small (2 hosts, seconds per phase): INA beside TCP and short flows on one
bottleneck. Its counts add up (shares, Jain's index, flows started against the rate asked), every result is
exact, an ECN link marks INA's packets and they reach the switch with CE, and nothing of a topology is
left afterwards, also after a failure."""
from __future__ import annotations

import ast
import subprocess
import sys
import tempfile

import pytest

from inaproto import wire
from switchsim.netns import Topology
from topologies import net
from topologies.run import Spec

from .test_topo import leftovers

pytestmark = pytest.mark.skipif(bool(Topology.why_not(0.0, 1.0, True)), reason=Topology.why_not(0.0, 1.0, True) or "-")


@pytest.fixture(autouse=True)
def nothing_left_behind():
    before = set(leftovers())
    yield
    assert not set(leftovers()) - before


def test_jain_index():
    assert net.jain([10.0, 10.0]) == 1.0
    assert net.jain([10.0, 0.0]) == 0.5
    assert abs(net.jain([3.0, 1.0]) - 16 / 20) < 1e-12
    assert net.jain([0.0, 0.0]) is None


def test_goodput_counts_the_share_of_a_call_inside_the_phase():
    """Calls back to back, 1 s and 1 MB each: a window from 0.5 s to 2.5 s holds half of the first, all of the
    second and half of the third (2 MB: 8 Mbit/s); the slowest rank's counts."""
    fast = {"bytes_per_call": 1_000_000, "calls": [[1.0, 1.0], [2.0, 1.0], [3.0, 1.0]]}
    slow = {"bytes_per_call": 1_000_000, "calls": [[2.0, 2.0], [4.0, 2.0]]}  # 2 s a call: 0.75 + 0.25
    assert abs(net._goodput([fast], 0.5, 2.0) - 8.0) < 1e-9
    assert abs(net._goodput([fast, slow], 0.5, 2.0) - 4.0) < 1e-9
    assert net._goodput([fast], 5.0, 1.0) == 0.0


@pytest.mark.parametrize("ecn", [False, True])
def test_bench_net_counts_add_up(ecn):
    seconds, rate = 1.5, 20.0
    policy = "aimd" if ecn else "none"  # ECN links: the congestion window; tail-drop: SwitchML's fixed window
    rows = net.bench_net(hosts=2, bw=50.0, delay_ms=1.0, seconds=seconds, ecn=ecn, ccs=(policy,),
                         elements=1 << 17, window=64, short_rate=rate, short_kb=8)
    idle, tcp, ina, both = rows
    assert ina["cc"] == both["cc"] == policy
    assert [r["phase"] for r in rows] == ["idle (short flows)", "tcp alone", "ina alone", "ina + tcp + short"]
    for r in (idle, both):  # flows start at the rate asked, for the phase's length, and all complete
        assert abs(r["short flows"] - rate * seconds) <= 2 and r["short failed"] == 0
        assert r["short p50 ms"] <= r["short p99 ms"]
    assert 0 < tcp["tcp Mbit/s"] <= 50.0 * 1.05
    assert ina["exact"] is True and both["exact"] is True
    assert 0 <= ina["spurious"] <= ina["retx"] and 0 <= both["spurious"] <= both["retx"]
    assert 0 < ina["ina Mbit/s"] <= 50.0 * 1.05 and 0 < both["ina Mbit/s"] <= 50.0 * 1.05
    total = both["ina Mbit/s"] + both["tcp Mbit/s"]
    assert both["ina share"] == round(both["ina Mbit/s"] / total, 3)
    assert both["jain"] == round(net.jain([both["ina Mbit/s"], both["tcp Mbit/s"]]), 3)
    assert total <= 50.0 * 1.1  # two flows on one 50 Mbit/s link share it
    assert both["short p99 x idle"] == round(both["short p99 ms"] / idle["short p99 ms"], 2)
    assert 0 <= ina["fast retx"] <= ina["retx"]
    if ecn:
        assert ina["marked"] > 0 and both["marked"] > 0  # INA alone fills the link's queue past the threshold
        assert ina["cuts"] > 0 and both["cuts"] > 0  # the marks reach the window, through the aggregate
    else:
        assert not ina["marked"] and not both["marked"]  # no marking queue: 0 (a delay stage) or None
        assert ina["cuts"] == 0 and ina["cwnd"] == 64  # SwitchML's fixed window


def test_a_second_ina_job_shares_the_links():
    """A second INA job of 2 ranks on the same hosts and switch: both exact, both move data, and the share
    and Jain's index are of the two jobs."""
    r = net.phase(Spec(2, "c", 50.0, 1.0), 2.0, ina=True, tcp=False, short=False, elements=1 << 16, window=32,
                  job2=True)
    assert r["exact"] is True and r["job2 exact"] is True
    assert r["ina Mbit/s"] > 0 and r["job2 Mbit/s"] > 0
    assert r["ina Mbit/s"] + r["job2 Mbit/s"] <= 50.0 * 1.1
    assert r["jain"] == round(net.jain([r["ina Mbit/s"], r["job2 Mbit/s"]]), 3)


def test_bench_net_failure_leaves_nothing():
    """A phase whose INA ranks fail (an unknown connect argument): a named error, the topology gone."""
    with pytest.raises(RuntimeError, match="INA rank"):
        net.phase(Spec(2, "c", 50.0, 1.0), 2.0, ina=True, tcp=True, short=False, window=16, cc="no-such-policy")


SNIFF = r"""
import signal, socket, struct, sys, time
told = []  # SIGTERM: what is queued is read, then the counts printed
signal.signal(signal.SIGTERM, lambda *_: told.append(1))
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0800))
s.bind((sys.argv[3], 0))  # the bridge: what the switch's socket receives, each datagram once
s.settimeout(0.1)
print("ready", flush=True)
port, end, seen = int(sys.argv[1]), time.monotonic() + float(sys.argv[2]), {}
while time.monotonic() < end:
    try:
        frame = s.recv(65536)
    except socket.timeout:
        if told:
            break
        continue
    ip = frame[14:]
    if ip[9] != 17 or struct.unpack(">H", ip[(ip[0] & 15) * 4 + 2:][:2])[0] != port:
        continue
    ecn = ip[1] & 3
    seen[ecn] = seen.get(ecn, 0) + 1
print(seen, flush=True)
"""


def test_a_marked_packet_reaches_the_switch_with_ce():
    """INA's datagrams are ECN-capable (ECT(0)); on an --ecn star whose link INA fills past the threshold,
    the switch's host receives some of them marked CE, as many as the links counted, and the int32 result
    is still exact (a mark is not a loss). The "ecn" policy: its window grows until a mark comes (the default
    "aimd" may stop first on the delay signal, 5 ms of queue here below the 12 ms where the link marks)."""
    from topologies.run import Deployment, allreduce

    spec = Spec(2, "c", 20.0, 0.5, ecn=True)
    with tempfile.TemporaryDirectory() as logs, Deployment(spec, logs) as dep:
        port = int(dep.members[0].switch.rsplit(":", 1)[1])
        sniff = dep.topo.popen(dep.topo.switch_ns, [sys.executable, "-c", SNIFF, port, 20, "br0"],
                               stdout=subprocess.PIPE, text=True)
        assert sniff.stdout.readline() == "ready\n"  # bound to the bridge before the first datagram
        report = allreduce(dep, "int32", 1 << 18, window=256, timeout=30, cc="ecn")
        sniff.terminate()  # the call is over: every datagram it sent the switch is on the bridge already
        seen = ast.literal_eval(sniff.communicate(timeout=20)[0])
        marked = sum(c.get("marked", 0) for c in dep.topo.stage_counters().values())
    assert report["exact"] is True
    assert seen.get(wire.CE, 0) > 0 and seen.get(wire.ECT0, 0) > 0, seen  # marked above the threshold only
    assert seen[wire.CE] <= marked
