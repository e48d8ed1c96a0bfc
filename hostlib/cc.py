"""A worker's congestion window: how many of its packets may be in flight, following the path (csrc/ina_cc.c
is its twin in the C loop; tests/test_cc.py checks that both take the same steps on the same events).

It starts small and doubles per round trip (slow start), then grows by INCREASE packets per round trip (half
a standard TCP flow's) while results come back unmarked, and keeps BETA of itself, at most once per round trip, when a result carries
FLAG_CONGESTED. The switch ORs every counted contribution's mark into the round's result, so every worker of
the job sees the same signal and the windows stay alike. A worker marks its next update congested when a
result reached it CE-marked (its downlink's queue) or, with the "aimd" policy on a path where no link marks,
when BATCH round trips in a row were TARGET above the path's base (the delay signal). A loss is not a signal:
random loss is repaired (a gap resends at once, the timeout is the last resort), not slowed down for.
docs/protocol.md, "Congestion"."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields

from inaproto import timers, wire

# the policies: SwitchML's fixed window (every lane at once, a timeout per loss: the baseline a researcher
# compares against); the aggregate's mark from CE only; the default, CE or the delay signal
POLICIES = {"none": 0, "ecn": 1, "aimd": 2}
DEFAULT = "aimd"
NONE, ECN, AIMD = 0, 1, 2

INITIAL = 10  # packets in flight before the first result (RFC 6928's initial window)
MIN = 2  # never fewer
BETA = 0.7  # the share of the window kept on a congested round (CUBIC's beta)
# packets added per round trip after slow start: half a standard TCP flow's with this beta (RFC 8312 section
# 4.2, CUBIC's TCP-friendly region: 3 (1 - beta) / (1 + beta)). INA's round trip is short (worker, switch,
# worker) beside a TCP flow's between two workers (twice the links), and growing per round trip it grows faster
# in time: with TCP's increase INA took 72 % of a link beside CUBIC, with half of it 56-61 % (4 hosts,
# 100 Mbit/s, 1 ms, ECN links; `switchsim bench net --ecn`)
INCREASE = 1.5 * (1 - BETA) / (1 + BETA)
# seconds of queueing the delay signal allows, at least ... (above the queue where ECN links mark: 2.4 ms at
# 100 Mbit/s, switchsim/netns.py; there the marks are the signal, shared with the TCP flows beside)
TARGET_MIN = 0.005
TARGET_BASES = 1.0  # ... and this many base round trips
# the retransmission timeout's floors (inaproto/timers.py says which is which)
RTO_NONE, RTO_FLOOR, RTO_RTTS, START_RTO = timers.RTO_NONE, timers.RTO_FLOOR, timers.RTO_RTTS, timers.START_RTO
BATCH = 8  # the delay signal takes the smallest of this many round trips (CoDel's minimum over an interval)
DUPTHRESH = 3  # results of packets this much later than one still out: it was lost, resend it (fast retransmit)
# a call's tail probe and an early resend's own timer, in smoothed round trips (inaproto/timers.py says why)
TAIL_PROBE_RTTS, EARLY_RTO_RTTS = timers.TAIL_PROBE_RTTS, timers.EARLY_RTO_RTTS


def configure(name: str | None, local: bool, rto: float | None) -> tuple[int, float]:
    """A Communicator's policy (name, else $INA_CC, else DEFAULT; local, shared memory or loopback, has no path
    to follow: the rings are the window, a loopback round trip's delay is the CPU's: "none" unless asked) and
    its timeout's floor (rto, else RTO_FLOOR; RTO_NONE under "none")."""
    policy = policy_of(name or os.environ.get("INA_CC") or ("none" if local else DEFAULT))
    return policy, rto if rto is not None else RTO_NONE if policy == NONE else RTO_FLOOR


def policy_of(name: str) -> int:
    """The policy's number; a named error for a name that is none."""
    if name not in POLICIES:
        raise ValueError(f"cc={name!r}: no such congestion policy (one of {', '.join(POLICIES)})")
    return POLICIES[name]


@dataclass
class Window:
    """The C loop's ina_cc, field for field (fastpath copies it in and out by these names)."""

    policy: int = AIMD
    cwnd: float = 0.0
    ssthresh: float = 0.0
    base_rtt: float = 0.0  # the smallest round trip seen on the path (the join's first); 0: none yet
    batch_min: float = 0.0
    batch_n: int = 0
    sent: int = 0  # new packets sent: a packet's send number orders it against a reduction
    recover: int = 0  # a congested result of a packet sent before this does not shrink the window again
    marked: int = 0  # a CE mark reached this worker: the path marks, the delay signal is off
    echo: int = 0  # the next update carries FLAG_CONGESTED
    reductions: int = 0
    marks: int = 0
    delay_signals: int = 0

    @classmethod
    def fresh(cls, policy: int, cap: int, base_rtt: float = 0.0) -> "Window":
        """A new window (per generation): INITIAL packets (all of cap under "none"); base_rtt: the join's."""
        return cls(policy=policy, cwnd=float(cap if policy == NONE else min(cap, INITIAL)), ssthresh=float(cap),
                   base_rtt=base_rtt)

    def allowed(self, cap: int) -> int:
        if self.policy == NONE:
            return cap
        return min(max(int(self.cwnd), MIN), cap)

    def _target(self) -> float:
        return max(TARGET_BASES * self.base_rtt, TARGET_MIN)

    def _delay_sample(self, rtt: float):
        if self.base_rtt == 0 or rtt < self.base_rtt:
            self.base_rtt = rtt
        self.batch_min = self.batch_min if self.batch_n and self.batch_min < rtt else rtt
        self.batch_n += 1
        if self.batch_n < BATCH:
            return
        self.batch_n = 0
        if self.policy == AIMD and not self.marked and self.batch_min > self.base_rtt + self._target():
            self.echo = 1
            self.delay_signals += 1

    def result(self, seq: int, rtt: float, congested: bool, cap: int):
        """A result of the packet sent as number seq; rtt < 0 when it is not a round trip of the path (resent,
        or sent before the call's first result: the peers may not have started the call)."""
        if self.policy == NONE:
            return
        if rtt >= 0:
            self._delay_sample(rtt)
        if congested:
            if seq >= self.recover:  # once per round trip: packets sent before the last cut saw the old queue
                self.cwnd = max(self.cwnd * BETA, MIN)
                self.ssthresh, self.recover = self.cwnd, self.sent
                self.reductions += 1
            return
        self.cwnd = min(self.cwnd + (1.0 if self.cwnd < self.ssthresh else INCREASE / self.cwnd), cap)

    def mark(self):
        """A datagram reached this worker CE-marked."""
        self.marks += 1
        if self.policy != NONE:
            self.marked = self.echo = 1

    def early(self, first_result) -> bool:
        """Before the call's first result (the peers may not be in the call) or in slow start (no estimate
        has seen the queue a doubling window builds): a packet's first timeout is at least START_RTO."""
        return not first_result or self.cwnd < self.ssthresh

    def take_echo(self) -> int:
        """The flags of the update built now: FLAG_CONGESTED once after a signal."""
        e, self.echo = self.echo, 0
        return wire.FLAG_CONGESTED if e else 0



FIELDS = tuple(f.name for f in fields(Window))
COUNTERS = ("reductions", "marks", "delay_signals")  # kept over re-joins (a new generation's window starts afresh)


def spurious_floor(policy: int, min_rto: float, cap: float) -> float:
    """The floor after a spurious retransmission (a result later than the timeout, not lost: a loaded host, a
    queue the estimate missed): doubled under a policy, up to cap (START_RTO, SwitchML's constant)."""
    return min_rto if policy == NONE or min_rto >= cap else min(2 * min_rto, cap)


def rto_floor(policy: int, srtt: float, min_rto: float) -> float:
    """The retransmission timeout's floor: min_rto (the caller's), and under a policy a few round trips."""
    return min_rto if policy == NONE else max(RTO_RTTS * srtt, min_rto)
