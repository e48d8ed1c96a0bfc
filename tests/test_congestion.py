"""Congestion signalled through the aggregate (docs/protocol.md, "Congestion"), on the reference model: a round's
result carries FLAG_CONGESTED when a counted contribution did (its flag, or CE on arrival: the servers set the
flag), never from a duplicate, a stranger or another session, cleared when the slot's set starts a new round;
dense and sparse; and the leaf passes it up and down. Every backend against the model: test_conformance.py
(test_congestion_matches_the_model)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from inaproto import wire
from switchsim.config import SwitchConfig
from switchsim.leaf import LeafSwitch
from switchsim.server import congested

from .conftest import ModelHarness

F = wire.FLAG_CONGESTED
SPARSE_INT32 = wire.call_kind("int32") | wire.CALL_SPARSE


def upd(rank, pid, slot=0, flags=0, session=0):
    return wire.pack(wire.MSG_UPDATE, job=1, rank=rank, packet_id=pid, slot=slot, set=pid & 1, count=4,
                     codec=wire.CODEC_INT32, payload=np.arange(4, dtype=">i4").tobytes(), flags=flags,
                     session=session, call_kind=wire.call_kind("int32"), call_len=4)


def sparse(rank, pid, slot=0, flags=0):
    return wire.pack_sparse(wire.MSG_SPARSE_UPDATE, 1, rank, pid, slot, pid & 1, 4, wire.CODEC_INT32, 0, 0, flags,
                            0, wire.BLOCK_NONE, np.ones(4, ">i4").tobytes(), 0, SPARSE_INT32, 0, 4)


def flags_of(out):
    return [wire.unpack(d).flags for _, d in out]


def test_a_flagged_contribution_flags_the_result_for_every_member():
    sw = ModelHarness({1: 3}, slots=2, max_elements=4)
    assert sw.send(0, upd(0, 0)) == [] and sw.send(1, upd(1, 0, flags=F)) == []
    assert flags_of(sw.send(2, upd(2, 0))) == [F] * 3
    assert flags_of(sw.send(2, upd(2, 0))) == [F]  # a resend carries its first copy's flags
    for r in range(3):
        sw.send(r, upd(r, 1))
    assert flags_of(sw.send(0, upd(0, 1))) == [0]  # a round without a congested contribution
    assert sw.stats()["jobs"]["1"]["congested"] == 1


def test_only_counted_contributions_count():
    """A flagged duplicate of a counted contribution, a stranger's flagged packet and one of another session
    change nothing; the set's next round starts clean."""
    sw = ModelHarness({1: 2}, slots=1, max_elements=4)
    sw.send(0, upd(0, 0, flags=F))
    assert flags_of(sw.send(1, upd(1, 0))) == [F, F]
    sw.send(0, upd(0, 1))
    assert sw.send(0, upd(0, 1, flags=F)) == []  # a duplicate into the open round
    assert sw.send(7, upd(1, 1, flags=F)) == []  # a stranger claiming rank 1
    assert [wire.unpack(d).msg_type for _, d in sw.send(1, upd(1, 1, flags=F, session=0xDEAD))] == [wire.MSG_ERROR]
    assert flags_of(sw.send(1, upd(1, 1))) == [0, 0]
    sw.send(0, upd(0, 2))  # set 0 again: its round of packet 0 was congested, this one is not
    assert flags_of(sw.send(1, upd(1, 2))) == [0, 0]
    assert sw.switch.stats(per_slot=True)["jobs"]["1"]["per_slot"]["congested"] == [1]  # the counted one only


def test_sparse_rounds_carry_it_too():
    sw = ModelHarness({1: 2}, slots=1, max_elements=4)
    sw.send(0, sparse(0, 0, flags=F))
    out = sw.send(1, sparse(1, 0))
    assert [(wire.unpack(d).msg_type, wire.unpack(d).flags) for _, d in out] == [(wire.MSG_SPARSE_RESULT, F)] * 2
    sw.send(0, sparse(0, 1))
    assert flags_of(sw.send(1, sparse(1, 1))) == [0, 0]


def test_ce_on_arrival_is_the_flag_for_data_packets_only():
    data = upd(0, 0)
    assert congested(data) == upd(0, 0, flags=F)
    assert congested(congested(data)) == congested(data)
    join = wire.pack_join(1, 0, 5, 2, 4)
    assert congested(join) == join and congested(b"\x03") == b"\x03"


def test_a_leaf_sends_its_congestion_up_and_the_roots_down():
    up = SimpleNamespace(job=1, rank=0, world_size=2, session=77, address="root", gen=SimpleNamespace(first_id=0))
    leaf = LeafSwitch(SwitchConfig({1: 2}, slots=2, max_elements=4), up)
    leaf.admit(1, 1, 5, 0, [0, 1])
    up_pid0 = [d for d, _ in leaf.process(upd(0, 0, flags=F, session=5), 0) + leaf.process(upd(1, 0, session=5), 1)]
    assert [wire.unpack(d).flags for d in up_pid0] == [F]  # the leaf's contribution to the root is congested
    result = wire.pack(wire.MSG_RESULT, job=1, rank=0, packet_id=0, slot=0, set=0, count=4, codec=wire.CODEC_INT32,
                       payload=bytes(16), session=77)
    assert [wire.unpack(d).flags for d, _ in leaf.process(result, "root")] == [F, F]
    for r in range(2):  # a round the leaf's workers were not congested in, whose result came down CE-marked
        sent = leaf.process(upd(r, 1, session=5), r)
    assert [wire.unpack(d).flags for d, _ in sent] == [0]
    down = wire.pack(wire.MSG_RESULT, job=1, rank=0, packet_id=1, slot=0, set=1, count=4, codec=wire.CODEC_INT32,
                     payload=bytes(16), session=77)
    assert [wire.unpack(d).flags for d, _ in leaf.process(congested(down), "root")] == [F, F]
