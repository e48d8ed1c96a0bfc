"""Protocol v3's collective integrity on the switch side, on every backend (conftest.BACKENDS): a round keeps
the call identity of its first packet, a rank in another call fails the job's generation for every member
with the same named error (the C core words it as wire.call_mismatch_text), a failed generation answers
every new packet with that error but still resends completed rounds, data packets of a generation the
switch does not have get a header-only answer, everything the switch sends carries its boot id, a new
generation starts clean, and every datagram a switch takes in is counted as some outcome. A member's packet
dropped for its own mistake is told (ERR_DROPPED) once per generation, rank and reason; a stranger's is not."""
from __future__ import annotations

import numpy as np
import pytest

from hostlib import wire
from switchsim import control

from .conftest import CShmHarness, CUDPHarness, DPDKHarness, ServedHarness
from .test_conformance import V

INT32, FIXED = wire.call_kind("int32"), wire.call_kind("fixed")
CALL = (7, INT32, 640)  # (call, call_kind, call_len) of the ranks' call
DEVIANT = {"call_len": (7, INT32, 641), "call": (8, INT32, 640), "call_kind": (7, FIXED, 640),
           "sparse": (7, INT32 | wire.CALL_SPARSE, 640)}
C_LOOPS = (CUDPHarness, CShmHarness, DPDKHarness)  # C loops with a punt queue in front of the control plane


def data(rank, slot=0, pid=0, k=1, call=CALL, session=0):
    """Rank's update of V(k) for (slot, set of pid) in call `call` (session 0: the harness stamps the job's)."""
    number, kind, n = call
    return wire.pack(wire.MSG_UPDATE, job=1, rank=rank, packet_id=pid, slot=slot, set=pid & 1, count=64,
                     codec=wire.CODEC_INT32, exp_cur=0, exp_next=0, payload=V(k).astype(">i4").tobytes(),
                     session=session, call_kind=kind, call=number, call_len=n)


def sparse(rank, call, pid=0, slot=0):
    """Rank's block-sparse update of block 0 (64 elements of 1) in call `call`."""
    number, kind, n = call
    return wire.pack_sparse(wire.MSG_SPARSE_UPDATE, 1, rank, pid, slot, pid & 1, 64, wire.CODEC_INT32, 0, 0, 0,
                            0, wire.BLOCK_NONE, np.ones(64, ">i4").tobytes(), 0, kind, number, n)


def headers(out):
    return sorted(((port, wire.unpack(d)) for port, d in out), key=lambda x: x[0])


def check_results(out, ranks, boot, session, k, call=CALL):
    """A result of V(k) for each rank on its port, echoing the round's call, with the boot id and session."""
    got = headers(out)
    assert [p for p, _ in got] == list(ranks), got
    for port, h in got:
        assert (h.msg_type, h.rank, h.session, h.boot) == (wire.MSG_RESULT, port, session, boot)
        assert (h.call, h.call_kind, h.call_len) == call
    assert all(np.array_equal(wire.payload_view(d, wire.unpack(d)), V(k)) for _, d in out)


def check_error(port_data, rank, boot, session, error, answered=None):
    """The generation's error to rank: (code, named rank, text); as the answer to a data packet (answered:
    (packet_id, slot, set)) it echoes that packet with FLAG_REPLY, else packet id and pool are 0."""
    port, d = port_data
    h = wire.unpack(d)
    got = (port, h.msg_type, h.job, h.rank, h.session, h.boot, h.count)
    assert got == (rank, wire.MSG_ERROR, 1, rank, session, boot, 0)
    reply = (wire.FLAG_REPLY, *answered) if answered else (0, 0, 0, 0)
    assert (h.flags, h.packet_id, h.slot, h.set) == reply
    assert wire.unpack_error(d) == error


@pytest.mark.parametrize("differs", sorted(DEVIANT))
def test_a_call_mismatch_fails_the_generation_for_every_member(switch_backend, differs):
    sw = switch_backend({1: 3}, slots=4, max_elements=64)
    boot, session = sw.stats()["boot"], sw.session
    assert boot != 0
    # a round of the call completes: the result carries its call and the switch's boot
    assert sw.send(0, data(0)) == [] and sw.send(1, data(1)) == []
    check_results(sw.send(2, data(2)), range(3), boot, session, 3)
    # slot 1: ranks 0 and 1 in the call, rank 2 in another one
    assert sw.send(0, data(0, slot=1)) == []
    out = sw.send(2, data(2, slot=1, call=DEVIANT[differs]))
    error = (wire.ERR_CALL_MISMATCH, 2, wire.call_mismatch_text(1, 2, DEVIANT[differs], 0, CALL))
    assert len(out) == 3
    for port_data in sorted(out):  # every member, the same error, naming rank 2 and wording the difference
        check_error(port_data, port_data[0], boot, session, error)
    stats = sw.stats()
    assert stats["dropped"]["call_mismatch"] == 1 and stats["jobs"]["1"]["failed"] is True
    # no new contribution: rank 1 into the open round, rank 0 again into it, rank 0 into a new round
    for rank, pkt, answered in ((1, data(1, slot=1), (0, 1, 0)), (0, data(0, slot=1), (0, 1, 0)),
                                (0, data(0, slot=2), (0, 2, 0))):
        out = sw.send(rank, pkt)
        assert len(out) == 1
        check_error(out[0], rank, boot, session, error, answered)
    # a call that completed stays completed: a duplicate of its round is answered with the result
    check_results(sw.send(1, data(1)), [1], boot, session, 3)
    stats = sw.stats()
    assert stats["dropped"]["failed"] == 3 and stats["jobs"]["1"]["resent"] == 1


def test_a_call_mismatch_in_a_sparse_round_fails_the_generation(switch_backend):
    sw = switch_backend({1: 2}, slots=4, max_elements=64)
    boot, session = sw.stats()["boot"], sw.session
    call = (3, INT32 | wire.CALL_SPARSE, 640)
    assert sw.send(0, sparse(0, call)) == []
    other = (4, INT32 | wire.CALL_SPARSE, 640)
    out = sw.send(1, sparse(1, other))
    error = (wire.ERR_CALL_MISMATCH, 1, wire.call_mismatch_text(1, 1, other, 0, call))
    assert len(out) == 2
    for port_data in sorted(out):
        check_error(port_data, port_data[0], boot, session, error)
    assert sw.stats()["dropped"]["call_mismatch"] == 1


def test_a_new_generation_clears_the_failure(switch_backend):
    sw = switch_backend({1: 2}, slots=4, max_elements=64)
    assert sw.send(0, data(0)) == []
    assert len(sw.send(1, data(1, call=DEVIANT["call"]))) == 2
    old = sw.session
    assert sw.join_all(nonce=50)[1] != old  # the ranks re-join: a new generation, slots and failure cleared
    stats = sw.stats()
    assert stats["jobs"]["1"]["failed"] is False and stats["jobs"]["1"]["generation"] == 2
    boot = stats["boot"]
    assert sw.send(0, data(0, call=DEVIANT["call"])) == []  # any call, as long as the ranks agree
    check_results(sw.send(1, data(1, call=DEVIANT["call"])), range(2), boot, sw.session, 2, DEVIANT["call"])


def test_an_abort_is_sent_to_every_member(switch_backend):
    """A control-plane failure (a member's abort) leaves through the backend's loop to every member, and the
    data plane answers the generation's packets with it from then on."""
    sw = switch_backend({1: 3}, slots=4, max_elements=64)
    boot, session = sw.stats()["boot"], sw.session
    abort = wire.pack(wire.MSG_ABORT, job=1, rank=1, session=session, call=7, call_kind=INT32, call_len=640,
                      payload=b"the tensor is on the wrong device")
    out = sw.send(1, abort)
    error = (wire.ERR_ABORTED, 1, "job 1: rank 1 aborted call 7: the tensor is on the wrong device")
    assert len(out) == 3
    for port_data in sorted(out):
        check_error(port_data, port_data[0], boot, session, error)
    out = sw.send(2, data(2))
    assert len(out) == 1
    check_error(out[0], 2, boot, session, error, (0, 0, 0))
    assert sw.stats()["jobs"]["1"]["failed"] is True


def not_member_answer(out, port, rank, session, boot, pid, slot):
    """Header only (never larger than the packet), the packet's session echoed, the switch's boot id."""
    assert len(out) == 1 and out[0][0] == port
    d = out[0][1]
    h = wire.unpack(d)
    assert len(d) == wire.HEADER_SIZE and wire.unpack_error(d)[0] == wire.ERR_NOT_MEMBER
    assert (h.msg_type, h.job, h.rank, h.session, h.boot) == (wire.MSG_ERROR, 1, rank, session, boot)
    assert (h.flags, h.packet_id, h.slot, h.set, h.count, h.codec) == (wire.FLAG_REPLY, pid, slot, pid & 1, 0, 0)
    assert (h.call, h.call_kind, h.call_len) == (0, 0, 0)


def test_a_packet_of_another_session_is_told_it_is_no_member(switch_backend):
    sw = switch_backend({1: 2}, slots=4, max_elements=64)
    boot, wrong = sw.stats()["boot"], sw.session ^ 0x5A5A
    out = sw.send(1, data(1, slot=3, pid=1, session=wrong))
    not_member_answer(out, 1, 1, wrong, boot, 1, 3)
    stats = sw.stats()
    assert stats["dropped"]["wrong_session"] == 1 and stats["jobs"]["1"]["received"] == 0


def test_a_packet_without_a_generation_is_told_it_is_no_member(switch_backend):
    sw = switch_backend({1: 2}, join=False, slots=4, max_elements=64)
    boot = sw.stats()["boot"]
    out = sw.send(0, data(0, slot=2, session=0x1234ABCD))  # e.g. after the switch restarted
    not_member_answer(out, 0, 0, 0x1234ABCD, boot, 0, 2)
    assert sw.stats()["dropped"]["unknown_worker"] == 1
    # a spoofed or unknown-job packet is not answered
    assert sw.send(0, wire.pack(wire.MSG_UPDATE, job=9, rank=0, count=0, codec=wire.CODEC_INT32, session=5)) == []


def test_every_datagram_is_counted_as_an_outcome(switch_backend):
    """packets_in is the sum of the outcomes: here every packet is a drop, including control requests too
    long for a C loop's punt queue (oversized there; the Python control plane drops them as strangers')."""
    sw = switch_backend({1: 2}, slots=4, max_elements=64)
    before = sw.stats()
    heartbeat = wire.pack(wire.MSG_HEARTBEAT, job=1, rank=9)  # no such member
    oversized = wire.pack(wire.MSG_HEARTBEAT, job=1, rank=9, payload=bytes(600))
    stranger = data(9)  # rank outside the job: answered, and counted
    packets = [heartbeat] * 5 + [oversized] * 4 + [b"\x03\x00garbage"] * 3 + [stranger] * 2
    sw.blast(0, packets)
    stats = sw.stats()
    dropped = {k: v - before["dropped"][k] for k, v in stats["dropped"].items()}
    asked = isinstance(sw, ServedHarness)  # a served switch counts the stats request that asked for these
    assert stats["packets_in"] - before["packets_in"] - asked == len(packets) == sum(dropped.values()), dropped
    assert dropped["malformed"] == 3
    if isinstance(sw, C_LOOPS):
        assert (dropped["oversized"], dropped["unknown_worker"]) == (4, 7), dropped
    else:
        assert (dropped["oversized"], dropped["unknown_worker"]) == (0, 11), dropped


def test_a_full_punt_queue_is_counted():
    """The shared-memory loop takes up to 64 records from every port before it hands the control requests
    up. Strangers' heartbeats waiting on two ports: each port's budget (SOURCE_RATE burst 20) passes 20, the
    rest is rate_limited; strangers may fill half the punt queue of 64 (the rest is the members'), so of the
    40 the first pass keeps 32 and the others overflow; each one it drops is counted."""
    import os
    import time

    from hostlib.shm import ShmSocket
    from switchsim import native

    native.require()
    name = f"punt-{os.getpid()}"
    server = native.CShmServer(native.CoreSwitch({1: 2}), name, ports=4)
    socks = [ShmSocket(name) for _ in range(2)]
    try:
        heartbeat = wire.pack(wire.MSG_HEARTBEAT, job=1, rank=9)  # no such member: each handled one is a drop
        for s in socks:
            for _ in range(100):
                s.send(heartbeat)
        thread = server.start_thread()  # after the rings filled: the first pass sees both ports full
        deadline = time.monotonic() + 10
        while server.backend.stats()["packets_in"] < 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        server.stop()
        thread.join(5)
    finally:
        for s in socks:
            s.close()
        server.close()
    stats = server.backend.stats()
    dropped = stats["dropped"]
    assert stats["packets_in"] == 200 == sum(dropped.values()), dropped
    burst = control.SOURCE_RATE[1]
    handled = dropped["unknown_worker"] + dropped["punt_overflow"]
    assert 2 * burst <= handled <= 2 * burst + 4, dropped  # + what the budgets refill while the pass runs
    assert dropped["rate_limited"] == 200 - handled and dropped["punt_overflow"] >= 2 * burst - 32, dropped


# ---------------------------------------------------------------- a member's mistakes told (ERR_DROPPED)
def told(sw, port, pkt):
    """Send pkt from port: the switch's ERR_DROPPED answers to it (the harness keeps them in sw.told), after
    checking that nothing else came back."""
    before = len(sw.told)
    assert sw.send(port, pkt) == []
    return sw.told[before:]


def check_told(answers, port, rank, reason, session, boot, size, answered=(0, 0, 0)):
    """One ERR_DROPPED to port: the reason's index (not a rank) and UTF-8 words, a reply (FLAG_REPLY) echoing
    the dropped packet's (packet_id, slot, set) when it parsed (else 0), the generation's session, the switch's
    boot, never larger than the dropped packet (size bytes)."""
    assert len(answers) == 1, answers
    got_port, d = answers[0]
    h = wire.unpack(d)
    assert got_port == port and len(d) <= size, (got_port, len(d), size)
    assert (h.msg_type, h.job, h.rank, h.session, h.boot, h.count) == (wire.MSG_ERROR, 1, rank, session, boot, 0)
    assert (h.flags, h.packet_id, h.slot, h.set) == (wire.FLAG_REPLY, *answered)
    code, index, _ = wire.unpack_error(d)
    assert (code, index) == (wire.ERR_DROPPED, wire.DROP_REASONS.index(reason))
    d[wire.HEADER_SIZE + wire.ERROR_PAYLOAD.size:].decode()  # the details: the backend's words, UTF-8


def shaped(rank, slot=0, pid=0, count=64, exp_cur=0):
    """data() with another element count or exponent (the round's call, another shape)."""
    number, kind, n = CALL
    return wire.pack(wire.MSG_UPDATE, job=1, rank=rank, packet_id=pid, slot=slot, set=pid & 1, count=count,
                     codec=wire.CODEC_INT32, exp_cur=exp_cur, exp_next=0, payload=V(1)[:count].astype(">i4").tobytes(),
                     call_kind=kind, call=number, call_len=n)


def version2(pkt):
    """pkt as a protocol v2 worker would send it: the version byte says 2 (job and rank stay at 4 and 6)."""
    return bytes([2]) + pkt[1:]


def test_a_members_mistakes_are_told_once_per_reason(switch_backend):
    sw = switch_backend({1: 2}, slots=4, max_elements=64)
    boot, session = sw.stats()["boot"], sw.session
    size = len(data(0))
    # bad_slot: a slot the job does not have; told once for rank 0, once for rank 1, never again
    check_told(told(sw, 0, data(0, slot=9)), 0, 0, "bad_slot", session, boot, size, (0, 9, 0))
    assert told(sw, 0, data(0, slot=9)) == []
    check_told(told(sw, 1, data(1, slot=9, pid=1)), 1, 1, "bad_slot", session, boot, size, (1, 9, 1))
    # stale: rank 0's late retransmission of round 0 after it moved on to round 1 (rank 1 has not yet)
    assert sw.send(0, data(0)) == [] and len(sw.send(1, data(1))) == 2
    assert sw.send(0, data(0, pid=1)) == []
    check_told(told(sw, 0, data(0)), 0, 0, "stale", session, boot, size, (0, 0, 0))
    assert told(sw, 0, data(0)) == []
    # ahead: rank 0 in slot 1's round 0, then a packet two rounds on in the same set
    assert sw.send(0, data(0, slot=1)) == []
    check_told(told(sw, 0, data(0, slot=1, pid=2)), 0, 0, "ahead", session, boot, size, (2, 1, 0))
    assert told(sw, 0, data(0, slot=1, pid=2)) == []
    # mismatch: rank 1 joins slot 1's round with another exponent, then another element count
    check_told(told(sw, 1, shaped(1, slot=1, exp_cur=3)), 1, 1, "mismatch", session, boot, size, (0, 1, 0))
    small = shaped(1, slot=1, count=32)
    assert told(sw, 1, small) == []
    # malformed: a protocol v2 packet from a member's address, naming it; not echoed (it did not parse)
    check_told(told(sw, 1, version2(data(1, slot=2))), 1, 1, "malformed", session, boot, size)
    assert told(sw, 1, version2(data(1, slot=2))) == []
    assert told(sw, 0, version2(data(0, slot=2)))  # another rank: told
    dropped = sw.stats()["dropped"]
    assert (dropped["bad_slot"], dropped["stale"], dropped["ahead"], dropped["mismatch"], dropped["malformed"]) == (
        3, 2, 2, 2, 3), dropped  # every one still counted as its drop
    # the rounds go on: slot 1's round completes with the right packet
    check_results(sw.send(1, data(1, slot=1)), range(2), boot, session, 2)


def test_the_answer_is_never_larger_than_the_packet(switch_backend):
    sw = switch_backend({1: 2}, slots=4, max_elements=64)
    boot, session = sw.stats()["boot"], sw.session
    # no room for the two code bytes: counted, not told (and the next one still is)
    assert told(sw, 0, shaped(0, slot=9, count=0)) == []
    assert told(sw, 0, version2(shaped(0, count=0)) + b"\x00") == []
    # room for the code bytes and 2 bytes of words: the answer is cut to the packet's 36 bytes
    tiny = shaped(0, slot=9, count=1)
    answer = told(sw, 0, tiny)
    check_told(answer, 0, 0, "bad_slot", session, boot, len(tiny), (0, 9, 0))
    assert len(answer[0][1]) <= len(tiny) == wire.HEADER_SIZE + 4
    assert sw.stats()["dropped"]["bad_slot"] == 2 and sw.stats()["dropped"]["malformed"] == 1


def test_a_strangers_malformed_packet_is_not_told(switch_backend):
    sw = switch_backend({1: 2}, slots=4, max_elements=64)
    assert told(sw, 5, version2(data(0))) == []  # rank 0's job and rank bytes, another address
    assert told(sw, 1, version2(data(0))) == []  # a member, but naming another rank
    assert told(sw, 0, version2(data(0))[:6]) == []  # too short to name a rank
    other_job = version2(data(0))[:4] + (7).to_bytes(2, "big") + version2(data(0))[6:]
    assert told(sw, 0, other_job) == []  # a job the switch does not serve
    assert sw.stats()["dropped"]["malformed"] == 4


def test_nothing_is_told_without_a_generation(switch_backend):
    sw = switch_backend({1: 2}, join=False, slots=4, max_elements=64)
    assert told(sw, 0, version2(data(0))) == []
    assert sw.stats()["dropped"]["malformed"] == 1


def test_a_new_generation_tells_again(switch_backend):
    sw = switch_backend({1: 2}, slots=4, max_elements=64)
    boot, size = sw.stats()["boot"], len(data(0))
    check_told(told(sw, 0, data(0, slot=9)), 0, 0, "bad_slot", sw.session, boot, size, (0, 9, 0))
    check_told(told(sw, 0, version2(data(0))), 0, 0, "malformed", sw.session, boot, size)
    assert told(sw, 0, data(0, slot=9)) == [] and told(sw, 0, version2(data(0))) == []
    old = sw.session
    assert sw.join_all(nonce=50, proven=True)[1] != old  # re-admitted (the members re-join): told again, in the new generation's session
    check_told(told(sw, 0, data(0, slot=9)), 0, 0, "bad_slot", sw.session, boot, size, (0, 9, 0))
    check_told(told(sw, 0, version2(data(0))), 0, 0, "malformed", sw.session, boot, size)
