"""The worker loop's bookkeeping of a packet's answer (pyloop._answered, the C loop's note_answer): a
round-trip sample from the first send, and a resend counted spurious when its result came sooner than half
a round trip after it went (the result answered an earlier send: the packet was late, not lost)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from hostlib import wire
from hostlib.codecs.int32 import Int32Codec
from hostlib.streams import CallSlots, DenseStream, InFlight, RttEstimator
from hostlib import pyloop
from hostlib.worker import CommStats


def answered(rec: InFlight, at: float, srtt: float | None) -> CommStats:
    rtt = RttEstimator(0.03, 1.0)
    rtt.srtt = srtt
    fake = SimpleNamespace(rtt=rtt, stats=CommStats())
    pyloop._answered(fake, SimpleNamespace(), rec, None, at, 0.0)  # not a dense stream: no window step
    return fake.stats


def test_a_resend_answered_at_once_was_spurious():
    rec = InFlight(first_sent=0.0, deadline=0.5 + 0.06, rto=0.06, tries=1, last_sent=0.5)  # resent at 0.5 s
    stats = answered(rec, 0.501, srtt=0.01)
    assert stats.spurious_retransmissions == 1  # 1 ms after: the original's result
    assert stats.repair_rtts_p50 == 15.75  # 50.1 round trips from the first send: the last bin (16 or more)


def test_a_repair_is_counted_in_half_round_trips():
    rec = InFlight(first_sent=0.0, deadline=0.004 + 0.06, rto=0.06, tries=1, last_sent=0.004)
    stats = answered(rec, 0.0151, srtt=0.01)  # 1.51 round trips after the first send
    assert stats.repairs[3] == 1 and sum(stats.repairs) == 1 and stats.repair_rtts_p50 == 1.75


def test_a_resend_answered_a_round_trip_later_was_not():
    rec = InFlight(first_sent=0.0, deadline=0.5 + 0.06, rto=0.06, tries=1, last_sent=0.5)
    assert answered(rec, 0.51, srtt=0.01).spurious_retransmissions == 0  # a round trip after it: its own


def test_a_first_send_or_no_estimate_counts_nothing():
    assert answered(InFlight(0.0, 0.03, 0.03), 0.001, srtt=0.01).spurious_retransmissions == 0
    assert answered(InFlight(0.0, 0.56, 0.06, tries=2), 0.5, srtt=None).spurious_retransmissions == 0


def dense_stream(lanes: int, packets: int):
    """A DenseStream of int32 over `lanes` lanes and `packets` packets of one element, no switch behind it."""
    call = SimpleNamespace(seed=0, slots=CallSlots(0, np.zeros(lanes, np.uint32)), codec=Int32Codec(), k=1,
                           gen=SimpleNamespace(window=lanes))
    return DenseStream(SimpleNamespace(world_size=2), call, np.zeros(packets, np.int32), None)


def result_of(s: DenseStream, q: int):
    pid, slot = s.where(q)
    h = SimpleNamespace(msg_type=wire.MSG_RESULT, slot=slot, packet_id=pid, count=1, codec=wire.CODEC_INT32,
                        flags=0, exp_next=wire.EXP_NONE)
    assert s.on_result(h, b"\0" * (wire.HEADER_SIZE + 4), None) == q


def sends(s: DenseStream) -> list[int]:
    return list(s.ready(lambda: False))


def test_a_gap_is_in_send_order_so_a_lane_held_back_is_not_taken_for_lost():
    """Packet 0 is lost; its lane's next packet (4) goes only once 0's repair is done, after 5, 6 and 7: their
    results are no gap for 4 (by packet number they would be). The C loop's gap is in send order too
    (test_cc's lossy switch runs both loops; test_fastpath compares their packets)."""
    s = dense_stream(lanes=4, packets=12)
    assert sends(s) == [0, 1, 2, 3]
    for q in (1, 2, 3):
        result_of(s, q)
    assert list(s.gaps()) == [0]  # DUPTHRESH packets sent after 0 came back: 0 (or its result) was lost
    assert sends(s) == [5, 6, 7]  # 4 waits for its lane
    result_of(s, 0)  # the repair
    assert sends(s) == [4]
    for q in (5, 6, 7):
        result_of(s, q)
    assert list(s.gaps()) == []  # sent before 4
    assert sends(s) == [9, 10, 11]
    for q in (9, 10):
        result_of(s, q)
    assert list(s.gaps()) == []  # two sent after 4 came back
    result_of(s, 11)
    assert list(s.gaps()) == [4]  # three: now it was lost
    assert list(s.gaps()) == []  # each send is looked at once
