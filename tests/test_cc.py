"""The congestion window (hostlib/cc.py and its twin csrc/ina_cc.c): both take the same steps on the same events;
slow start, the cut once per round trip, additive increase, the delay signal's batch, the echo, the policies;
and on a lossy switch, the gap's resend in either loop."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hyp

from hostlib import cc, kernels, wire

needs_c = pytest.mark.skipif(kernels.lib is None, reason="the C kernels are not built (INA_KERNELS=numpy)")

EVENT = hyp.one_of(
    hyp.tuples(hyp.just("result"), hyp.integers(0, 3), hyp.one_of(hyp.just(-1.0), hyp.floats(1e-5, 0.05)),
               hyp.booleans()),
    hyp.tuples(hyp.just("mark")), hyp.tuples(hyp.just("send")), hyp.tuples(hyp.just("echo")))


def c_window(w: cc.Window):
    c = kernels.ffi.new("ina_cc *")
    for name in cc.FIELDS:
        setattr(c, name, getattr(w, name))
    return c


def same(c, w: cc.Window):
    return {n: getattr(c, n) for n in cc.FIELDS} == {n: getattr(w, n) for n in cc.FIELDS}


@needs_c
@settings(max_examples=60, deadline=None)
@given(policy=hyp.sampled_from([cc.NONE, cc.ECN, cc.AIMD]), cap=hyp.integers(1, 600),
       base=hyp.sampled_from([0.0, 2e-4, 2e-3]), events=hyp.lists(EVENT, max_size=120))
def test_the_c_window_takes_the_python_windows_steps(policy, cap, base, events):
    lib = kernels.lib
    w = cc.Window.fresh(policy, cap, base)
    c = kernels.ffi.new("ina_cc *")
    lib.ina_cc_init(c, policy, cap)
    c.base_rtt = base
    assert same(c, w)
    for ev in events:
        if ev[0] == "result":
            back, rtt, congested = ev[1:]
            seq = max(0, w.sent - 1 - back)
            w.result(seq, rtt, congested, cap)
            lib.ina_cc_result(c, seq, rtt, int(congested), cap)
        elif ev[0] == "mark":
            w.mark()
            lib.ina_cc_marked(c)
        elif ev[0] == "send":
            w.sent += 1
            c.sent += 1
        else:
            assert w.take_echo() == lib.ina_cc_echo(c)
        assert same(c, w), ev
        assert w.allowed(cap) == lib.ina_cc_allowed(c, cap)
        assert lib.ina_cc_rto_floor(c, 0.004, 0.005) == cc.rto_floor(policy, 0.004, 0.005)
        assert lib.ina_cc_spurious_floor(c, 0.005, 0.03) == cc.spurious_floor(policy, 0.005, 0.03)
        assert lib.ina_cc_spurious_floor(c, 0.1, 0.03) == cc.spurious_floor(policy, 0.1, 0.03)


def test_slow_start_then_one_packet_a_round_trip():
    w = cc.Window.fresh(cc.AIMD, 500)
    assert w.allowed(500) == cc.INITIAL
    for seq in range(10):  # a round trip of 10 results: the window doubles
        w.sent += 1
        w.result(seq, -1.0, False, 500)
    assert w.allowed(500) == 20
    w.sent += 20
    w.result(15, -1.0, True, 500)  # a congested round: cut to BETA of it, and out of slow start
    assert w.cwnd == pytest.approx(20 * cc.BETA) and w.ssthresh == w.cwnd and w.reductions == 1
    w.result(16, -1.0, True, 500)  # the same round trip's packets: no second cut
    assert w.reductions == 1
    before = w.cwnd
    for seq in range(30, 44):  # one round trip of results: INCREASE packets more
        w.result(seq, -1.0, False, 500)
    assert 0.9 * cc.INCREASE < w.cwnd - before < 1.1 * cc.INCREASE
    w.result(w.sent, -1.0, True, 500)  # a packet sent after the cut: a new round trip's congestion
    assert w.reductions == 2


def test_the_window_stays_within_its_bounds():
    w = cc.Window.fresh(cc.AIMD, 6)
    assert w.allowed(6) == 6  # a cap below the initial window
    for _ in range(100):
        w.result(w.sent, -1.0, True, 6)
        w.sent += 1
    assert w.allowed(6) == cc.MIN
    for seq in range(10_000):
        w.result(seq, -1.0, False, 6)
    assert w.cwnd == 6


def test_the_delay_signal_needs_a_whole_batch_above_the_target():
    base = 0.002
    w = cc.Window.fresh(cc.AIMD, 500, base)
    for _ in range(cc.BATCH - 1):
        w.result(0, base + 0.01, False, 500)
    w.result(0, base, False, 500)  # one round trip of the batch at the base: no signal
    assert w.delay_signals == 0 and w.take_echo() == 0
    for _ in range(cc.BATCH):
        w.result(0, base + max(base, cc.TARGET_MIN) + 1e-4, False, 500)
    assert w.delay_signals == 1 and w.take_echo() == wire.FLAG_CONGESTED and w.take_echo() == 0


def test_a_mark_is_echoed_once_and_turns_the_delay_signal_off():
    w = cc.Window.fresh(cc.AIMD, 500, 0.001)
    w.mark()
    assert w.take_echo() == wire.FLAG_CONGESTED and w.take_echo() == 0 and w.marked
    for _ in range(cc.BATCH):
        w.result(0, 1.0, False, 500)
    assert w.delay_signals == 0  # a path that marks: its marks are the signal


def test_ecn_ignores_delay_and_none_ignores_everything():
    e = cc.Window.fresh(cc.ECN, 500, 0.001)
    for _ in range(cc.BATCH):
        e.result(0, 1.0, False, 500)
    assert e.delay_signals == 0 and e.take_echo() == 0
    n = cc.Window.fresh(cc.NONE, 500)
    n.mark()
    n.result(0, 1.0, True, 500)
    assert n.allowed(500) == 500 and n.take_echo() == 0 and n.reductions == 0 and n.marks == 1


def test_a_spurious_retransmission_doubles_the_floor_up_to_switchmls_constant():
    assert cc.spurious_floor(cc.AIMD, 0.005, 0.03) == 0.01 and cc.spurious_floor(cc.AIMD, 0.02, 0.03) == 0.03
    assert cc.spurious_floor(cc.AIMD, 0.05, 0.03) == 0.05  # a floor the caller set above the cap stays
    assert cc.spurious_floor(cc.NONE, 0.03, 0.1) == 0.03  # SwitchML's constant
    assert cc.rto_floor(cc.AIMD, 0.004, 0.005) == 0.016 and cc.rto_floor(cc.NONE, 0.004, 0.03) == 0.03


def test_a_policy_by_name():
    assert cc.policy_of("aimd") == cc.AIMD and cc.policy_of("none") == cc.NONE
    with pytest.raises(ValueError, match="no such congestion policy"):
        cc.policy_of("reno")


def test_the_default_policy_follows_a_path_only_where_there_is_one(monkeypatch):
    """Across a network "aimd"; on loopback or shared memory (no path: a round trip's delay is the CPU's)
    SwitchML's fixed window and timeout, unless asked by name or $INA_CC."""
    monkeypatch.delenv("INA_CC", raising=False)
    assert cc.configure(None, False, None) == (cc.AIMD, cc.RTO_FLOOR)
    assert cc.configure(None, True, None) == (cc.NONE, cc.RTO_NONE)
    assert cc.configure("ecn", True, 0.002) == (cc.ECN, 0.002)
    monkeypatch.setenv("INA_CC", "aimd")
    assert cc.configure(None, True, None) == (cc.AIMD, cc.RTO_FLOOR)


@pytest.mark.parametrize("fast", [False, True], ids=["python-loop", "c-loop"])
def test_a_loss_is_resent_at_the_gap_and_the_sum_stays_exact(fast):
    """A lossy switch (5 % of datagrams each way): under "aimd" the gaps resend (fast retransmits, most repairs
    within a few round trips), under "none" only the timeout does; every sum exact either way."""
    if fast and not kernels.enabled():
        pytest.skip("the C worker loop is off here: the C kernels are not built, or INA_KERNELS=numpy")
    from .conftest import SwitchProcess
    from .test_e2e import run_workers

    sw = SwitchProcess("--workers", 2, "--loss", 0.05, "--seed", 7, backend="python")
    try:
        rs = np.random.default_rng(3)
        xs = [rs.integers(-(2**24), 2**24, 20000).astype(np.int32) for _ in range(2)]
        got = {}
        for policy in ("aimd", "none"):
            outs, errors, stats = run_workers(sw.address, xs, "int32", job=1, calls=2, elements_per_packet=64,
                                              window=32, timeout=30, cc=policy, fast=fast)
            assert errors == [None, None]
            assert all(np.array_equal(o, xs[0].astype(np.int64) + xs[1]) for o in outs)
            got[policy] = stats
        assert all(s.fast_retransmits > 0 and s.retransmissions >= s.fast_retransmits for s in got["aimd"])
        assert all(s.fast_retransmits == 0 and s.retransmissions > 0 for s in got["none"])
        assert all(sum(s.repairs) > 0 for s in got["aimd"] + got["none"])
    finally:
        sw.stop()


class _ResultDropper:
    """A UDP relay between workers and a switch on loopback that drops rank 0's n-th result datagram once: the
    last result of a call, after which no later result can show the loss as a gap. Bounded: it stops with
    stop() (its thread polls every 50 ms)."""

    def __init__(self, switch, n: int):
        import socket
        import threading

        self.switch, self.n, self.results, self.dropped = switch, n, 0, 0
        self.front = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.front.bind(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.front.getsockname()[1]
        self.backs, self.rank_of = {}, {}  # worker address -> its socket toward the switch, its rank
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        import select
        import socket

        while not self.stopping.is_set():
            socks = [self.front, *self.backs.values()]
            for s in select.select(socks, [], [], 0.05)[0]:
                data, src = s.recvfrom(65536)
                if s is self.front:
                    if src not in self.backs:
                        back = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                        back.connect(self.switch)
                        self.backs[src] = back
                    h = wire.unpack(data) if len(data) >= wire.HEADER_SIZE else None
                    if h is not None and h.msg_type == wire.MSG_UPDATE:
                        self.rank_of[src] = h.rank
                    self.backs[src].send(data)
                    continue
                worker = next(w for w, b in self.backs.items() if b is s)
                h = wire.unpack(data) if len(data) >= wire.HEADER_SIZE else None
                if self.rank_of.get(worker) == 0 and h is not None and h.msg_type == wire.MSG_RESULT:
                    self.results += 1
                    if self.results == self.n:
                        self.dropped += 1
                        continue
                self.front.sendto(data, worker)

    def stop(self):
        self.stopping.set()
        self.thread.join(5)
        for s in [self.front, *self.backs.values()]:
            s.close()


@pytest.mark.parametrize("fast", [False, True], ids=["python-loop", "c-loop"])
def test_a_calls_last_result_lost_is_probed_not_left_to_the_timeout(fast, monkeypatch):
    """Rank 0 loses its call's last result: no later result shows a gap, so under "aimd" the tail probe
    resends that packet a few round trips later (a fast retransmit), long before the timeout's 2 s floor;
    the sum is exact. Under "none" the same loss waits for the timer. On loopback a round trip is ~100 us:
    a loaded machine may delay an answer past the probe's own timer (3 round trips) and add spurious
    resends, so the probe's count is a floor and its time the check."""
    if fast and not kernels.enabled():
        pytest.skip("the C worker loop is off here: the C kernels are not built, or INA_KERNELS=numpy")
    from .conftest import SwitchProcess
    from .test_e2e import run_workers

    monkeypatch.setenv("INA_GROUP", "0")  # results come through the relay, one per worker
    sw = SwitchProcess("--workers", 2, backend="python")
    try:
        host, port = sw.address.rsplit(":", 1)
        xs = [np.arange(512, dtype=np.int32) * (r + 1) for r in range(2)]
        for policy, fast_resends in (("aimd", 1), ("none", 0)):
            relay = _ResultDropper((host, int(port)), 8)  # 512 int32 in packets of 64: the 8th result is the last
            try:
                # two calls: rank 1 stays in the job (a rank that leaves fails the call its peers are still in)
                outs, errors, stats = run_workers(relay.address, xs, "int32", job=1, calls=2, elements_per_packet=64,
                                                  window=4, timeout=30, cc=policy, fast=fast, rto=2.0, max_rto=2.0)
            finally:
                relay.stop()
            assert errors == [None, None] and relay.dropped == 1
            assert all(np.array_equal(o, xs[0] + xs[1]) for o in outs)
            if policy == "aimd":  # probed: the two calls took a fraction of the timer's floor
                assert stats[0].fast_retransmits >= 1 and stats[0].seconds < 1.0, (policy, stats[0])
            else:  # the timer's one resend, after its 2 s floor
                assert stats[0].retransmissions == 1 and stats[0].fast_retransmits == 0, (policy, stats[0])
                assert stats[0].seconds >= 2.0, (policy, stats[0])
    finally:
        sw.stop()
