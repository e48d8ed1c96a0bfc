"""The generation's transitions alone (hostlib/generation.py, Generation.settle): what each event does in each
state, with no socket and no switch — the one place the loops' outcomes become transitions."""
from __future__ import annotations

import pytest

from hostlib import generation, wire
from hostlib.generation import EVENTS, TRANSITIONS, Generation

STATES = ("live", "pending", "ended", "broken")


def fresh(state: str = "live", pending=None) -> Generation:
    ack = wire.pack(wire.MSG_JOIN_ACK, job=1, session=7, boot=9, payload=wire.JOIN_ACK_PAYLOAD.pack(1, 4, 64, 4, 0))
    gen = Generation(wire.unpack(ack), ack)  # generation 1: 4 slots, 64 elements, a window of 4
    gen.state, gen.pending = state, pending
    return gen


def test_a_new_generation_is_live():
    gen = fresh()
    assert gen.state == "live" and not gen.ended and gen.pending is None and gen.window == 4


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("event", sorted(EVENTS))
def test_every_event_in_every_state_goes_where_the_table_says(state, event):
    told = RuntimeError("told")
    gen = fresh(state, pending=told if state == "pending" else None)
    gen.settle(event, RuntimeError("new") if event == "pending" else None)
    listed = {(a, e): b for a, e, b in TRANSITIONS}
    assert gen.state == listed.get((state, event), state)
    assert gen.ended == (gen.state != "live")
    if gen.state == "pending":  # the first failure told is the one the next call raises
        assert str(gen.pending) == ("told" if state == "pending" else "new")
    else:
        assert gen.pending is None


def test_a_failure_told_while_the_call_can_complete_is_raised_once_by_the_next_call():
    gen = fresh()
    first, second = RuntimeError("first"), RuntimeError("second")
    gen.settle("pending", first)
    gen.settle("pending", second)
    gen.settle("timeout")  # ending it meanwhile keeps what was told
    assert gen.state == "pending" and gen.take_pending() is first
    assert gen.state == "ended" and gen.take_pending() is None


def test_broken_is_final():
    gen = fresh()
    gen.settle("bad_result")
    for event in sorted(EVENTS):
        gen.settle(event, RuntimeError("x"))
        assert gen.state == "broken" and gen.pending is None


def test_an_unknown_event_is_an_error_not_a_silent_no_op():
    with pytest.raises(ValueError, match="unknown event"):
        fresh().settle("exploded")


def test_every_outcome_status_the_loops_report_is_an_event():
    """The C loop's statuses (fastpath.STATUS) and the Python loop's are all known to settle."""
    from hostlib import fastpath

    assert set(fastpath.STATUS.values()) | {"silent"} <= EVENTS
    assert {a for a, _, _ in TRANSITIONS} | {b for _, _, b in TRANSITIONS} == set(STATES)
    assert generation.DROP_NOTES_KEPT >= 1
