"""The worker loop's bookkeeping of a packet's answer (pyloop._answered, the C loop's note_answer): a
round-trip sample from the first send, and a resend counted spurious when its result came sooner than half
a round trip after it went (the result answered an earlier send: the packet was late, not lost)."""
from __future__ import annotations

from types import SimpleNamespace

from hostlib.streams import InFlight, RttEstimator
from hostlib import pyloop
from hostlib.worker import CommStats


def answered(rec: InFlight, at: float, srtt: float | None) -> CommStats:
    rtt = RttEstimator(0.03, 1.0)
    rtt.srtt = srtt
    fake = SimpleNamespace(rtt=rtt, stats=CommStats())
    pyloop._answered(fake, SimpleNamespace(), rec, None, at, 0.0)  # not a dense stream: no window step
    return fake.stats


def test_a_resend_answered_at_once_was_spurious():
    rec = InFlight(first_sent=0.0, deadline=0.5 + 0.06, rto=0.06, tries=1)  # resent at 0.5 s
    stats = answered(rec, 0.501, srtt=0.01)
    assert stats.spurious_retransmissions == 1  # 1 ms after: the original's result
    assert stats.repair_rtts_p50 == 15.75  # 50.1 round trips from the first send: the last bin (16 or more)


def test_a_repair_is_counted_in_half_round_trips():
    rec = InFlight(first_sent=0.0, deadline=0.004 + 0.06, rto=0.06, tries=1)
    stats = answered(rec, 0.0151, srtt=0.01)  # 1.51 round trips after the first send
    assert stats.repairs[3] == 1 and sum(stats.repairs) == 1 and stats.repair_rtts_p50 == 1.75


def test_a_resend_answered_a_round_trip_later_was_not():
    rec = InFlight(first_sent=0.0, deadline=0.5 + 0.06, rto=0.06, tries=1)
    assert answered(rec, 0.51, srtt=0.01).spurious_retransmissions == 0  # a round trip after it: its own


def test_a_first_send_or_no_estimate_counts_nothing():
    assert answered(InFlight(0.0, 0.03, 0.03), 0.001, srtt=0.01).spurious_retransmissions == 0
    assert answered(InFlight(0.0, 0.56, 0.06, tries=2), 0.5, srtt=None).spurious_retransmissions == 0
