"""The SwitchML PTF conformance matrix (the project's switchml-conformance notes, from SwitchML's PTF tests)
for 2 and 3 workers, plus the stale-packet cases where this emulator deliberately differs from SwitchML's
P4 (it drops instead of corrupting). Packet steps are mapped by meaning: slot 0, whose uses get packet ids
0 (set 0), 1 (set 1), 2 (set 0), 3 (set 1). Protocol v2 accepts a slot's rounds only in that order, so the
cases that start in set 1 (OtherSetReduction, IgnoreRetransmissions, RetransmitFromPreviousSet) run after
a first round in set 0, and a packet from another port than the rank joined from is dropped, not followed.
Runs against every backend in conftest.BACKENDS, each job joined first (conftest.Harness)."""
from __future__ import annotations

import socket

import numpy as np
import pytest

from hostlib import wire

R = 37  # the exponent every packet carries; SwitchML's tests expect it back


def V(k):
    return np.arange(64, dtype=np.int64) * k


def W(worker, slot, set_, k, pid, port=None, exp=R):
    return ("send", worker, worker if port is None else port, slot, set_, k, pid, exp)


NONE = ("none",)


def MC(slot, set_, k, pid, exp=R):
    return ("mc", slot, set_, k, pid, exp)


def UC(rank, port, slot, set_, k, pid):
    return ("uc", rank, port, slot, set_, k, pid)


def rnd(n, slot, set_, k, pid):
    """One round: every worker sends; nothing comes back until the last, then a multicast."""
    return [(W(w, slot, set_, k, pid), NONE) for w in range(n - 1)] + [(W(n - 1, slot, set_, k, pid), MC(slot, set_, n * k, pid))]


def cases(n):
    basic = rnd(n, 0, 0, 1, 0)
    first = rnd(n, 0, 0, 2, 0)  # v2: set 1's first round follows set 0's
    c = {
        "BasicReduction": basic,
        "OtherSetReduction": first + rnd(n, 0, 1, 1, 1),
        "BothSetsReduction": basic + rnd(n, 0, 1, 3, 1),
        "SlotReuse": rnd(n, 0, 0, 1, 0) + rnd(n, 0, 1, 1, 1) + rnd(n, 0, 0, 3, 2) + rnd(n, 0, 1, 3, 3),
        "IgnoreRetransmissions": first + [(W(0, 0, 1, 1, 1), NONE)] * 3
        + [(W(w, 0, 1, 1, 1), NONE) for w in range(1, n - 1)] + [(W(n - 1, 0, 1, 1, 1), MC(0, 1, n, 1))],
        "RetransmitFromPreviousSet": first + rnd(n, 0, 1, 1, 1) + [(W(1, 0, 0, 3 if n == 2 else 1, 2), NONE)]
        + [(W(0, 0, 1, 1, 1), UC(0, 0, 0, 1, n, 1))] * 3,
        "SlotReuseAndRetransmit": rnd(n, 0, 0, 1, 0) + rnd(n, 0, 1, 1, 1) + rnd(n, 0, 0, 3, 2)
        + [(W(1, 0, 1, 3, 3), NONE), (W(0, 0, 0, 3, 2), UC(0, 0, 0, 0, 3 * n, 2))]
        + ([(W(2, 0, 0, 3, 2), UC(2, 2, 0, 0, 9, 2))] if n == 3 else []),
    }
    ra = basic + [(W(1, 0, 0, 1, 0), UC(1, 1, 0, 0, n, 0))] * 3 + [(W(0, 0, 0, 1, 0), UC(0, 0, 0, 0, n, 0))] * 2
    if n == 3:  # W2's retransmission arrives from port 0: v2 drops it (spoofed), SwitchML answered port 0
        ra += [(W(2, 0, 0, 1, 0, port=0), NONE)]
    c["RetransmitAfterReduction"] = ra
    if n == 2:  # workers "move" to other UDP ports: v2 drops them (a rank's packets come from its join address)
        c["DifferentPortsAreNotFollowed"] = basic + [(W(0, 1, 0, 1, 0, port=10), NONE), (W(1, 1, 0, 1, 0, port=11), NONE),
                                                     (W(0, 1, 0, 1, 0), NONE), (W(1, 1, 0, 1, 0), MC(1, 0, 2, 0))]
    # beyond SwitchML: stale packets are detected by packet id and dropped instead of corrupting a sum
    c["LateDuplicateAfterMoveIsDropped"] = (rnd(n, 0, 0, 1, 0) + rnd(n, 0, 1, 1, 1)
                                            + [(W(0, 0, 0, 1, 0), NONE)]  # W0 moved on: old packet is stale
                                            + rnd(n, 0, 0, 5, 2))  # next round on set 0 sums only fresh data
    c["WorkerTwoAheadIsDropped"] = (rnd(n, 0, 0, 1, 0) + [(W(0, 0, 0, 7, 2), NONE)]  # others still in set 0
                                    + [(W(0, 0, 0, 1, 0), UC(0, 0, 0, 0, n, 0))])  # the stored result is intact
    return c


MATRIX = [(n, name) for n in (2, 3) for name in cases(n)]


def update(worker, slot, set_, k, pid, exp, job=1):
    return wire.pack(wire.MSG_UPDATE, job=job, rank=worker, packet_id=pid, slot=slot, set=set_, count=64,
                     codec=wire.CODEC_INT32, exp_cur=0, exp_next=exp, payload=V(k).astype(">i4").tobytes())


def check_result(port_pkt, rank, slot, set_, k, pid, exp=R):
    port, data = port_pkt
    h = wire.unpack(data)
    assert (h.msg_type, h.job, h.rank, h.slot, h.set, h.packet_id) == (wire.MSG_RESULT, 1, rank, slot, set_, pid)
    assert h.exp_next == exp and h.flags == 0
    np.testing.assert_array_equal(wire.payload_view(data, h), V(k))


@pytest.mark.parametrize("n,case", MATRIX, ids=[f"{n}w-{c}" for n, c in MATRIX])
def test_conformance(switch_backend, n, case):
    sw = switch_backend({1: n}, slots=4, max_elements=64)
    for step, (send, expect) in enumerate(cases(n)[case]):
        _, worker, port, slot, set_, k, pid, exp = send
        out = sw.send(port, update(worker, slot, set_, k, pid, exp))
        where = f"step {step}: W{worker}>({slot},{set_},V{k},pid {pid}) from port {port}"
        if expect[0] == "none":
            assert out == [], f"{where}: expected nothing, got {len(out)} packets"
        elif expect[0] == "mc":
            _, s, x, k2, p = expect[:5]
            ports = tuple(range(n))
            assert sorted(o[0] for o in out) == sorted(ports), f"{where}: multicast reached {[o[0] for o in out]}"
            for o in out:
                check_result(o, ports.index(o[0]), s, x, k2, p)
        else:
            _, rank, p_out, s, x, k2, p = expect
            assert len(out) == 1 and out[0][0] == p_out, f"{where}: expected one unicast on port {p_out}, got {out}"
            check_result(out[0], rank, s, x, k2, p)


def test_exponent_is_max_over_workers(switch_backend):
    sw = switch_backend({1: 3}, slots=2, max_elements=64)
    assert sw.send(0, update(0, 1, 0, 1, 0, exp=-5)) == []
    assert sw.send(1, update(1, 1, 0, 1, 0, exp=12)) == []
    out = sw.send(2, update(2, 1, 0, 1, 0, exp=wire.EXP_NONE))
    assert len(out) == 3 and all(wire.unpack(d).exp_next == 12 for _, d in out)


def test_bad_packets_are_dropped_and_counted(switch_backend):
    sw = switch_backend({1: 2}, slots=2, max_elements=64)
    assert sw.send(0, update(0, 0, 0, 1, 0, R, job=9)) == []  # unknown job
    out = sw.send(0, update(5, 0, 0, 1, 0, R))  # rank outside the job: dropped, and told it is not a member
    assert [(port, len(d), wire.unpack(d).msg_type) for port, d in out] == [(0, wire.HEADER_SIZE, wire.MSG_ERROR)]
    assert sw.send(0, update(0, 3, 0, 1, 0, R)) == []  # slot beyond the pool
    assert sw.send(0, update(0, 0, 0, 1, 0, R)[:-3]) == []  # truncated payload
    assert sw.send(0, b"\x00" * 7) == []  # not even a header
    d = sw.stats()["dropped"]
    assert (d["unknown_job"], d["unknown_worker"], d["bad_slot"], d["malformed"]) == (1, 1, 1, 2)
    # and the switch still works
    sw.send(0, update(0, 0, 0, 1, 0, R))
    assert len(sw.send(1, update(1, 0, 0, 1, 0, R))) == 2


def test_int32_overflow_is_flagged(switch_backend):
    sw = switch_backend({1: 2}, slots=1, max_elements=64)
    big = np.full(64, 2**31 - 1, dtype=">i4").tobytes()
    pkts = [wire.pack(wire.MSG_UPDATE, job=1, rank=r, count=64, codec=wire.CODEC_INT32, payload=big) for r in (0, 1)]
    sw.send(0, pkts[0])
    out = sw.send(1, pkts[1])
    assert len(out) == 2 and all(wire.unpack(d).flags & wire.FLAG_OVERFLOW for _, d in out)
    assert sw.stats()["overflows"] == 1


def test_mismatched_round_is_dropped(switch_backend):
    """A packet of the same round whose element count or agreed exponent differs is not summed."""
    sw = switch_backend({1: 2}, slots=1, max_elements=64)
    sw.send(0, update(0, 0, 0, 1, 0, R))
    bad = wire.pack(wire.MSG_UPDATE, job=1, rank=1, count=32, codec=wire.CODEC_INT32, exp_next=R,
                    payload=V(1)[:32].astype(">i4").tobytes())
    assert sw.send(1, bad) == []
    assert sw.stats()["dropped"]["mismatch"] == 1
    assert len(sw.send(1, update(1, 0, 0, 1, 0, R))) == 2


# ------------------------------------------------------------------ congestion (docs/protocol.md, "Congestion")
F = wire.FLAG_CONGESTED
CE_ROUND = 3  # the packet id whose rank 0 update arrives CE-marked where the backend has an IP header


def congested_update(rank, pid, slot=0, flags=0, session=0, sparse=False):
    kind = wire.call_kind("int32") | (wire.CALL_SPARSE if sparse else 0)
    if sparse:
        return wire.pack_sparse(wire.MSG_SPARSE_UPDATE, 1, rank, pid, slot, pid & 1, 64, wire.CODEC_INT32, 0, 0,
                                flags, 0, wire.BLOCK_NONE, V(rank + 1).astype(">i4").tobytes(), session, kind, 0, 64)
    return wire.pack(wire.MSG_UPDATE, job=1, rank=rank, packet_id=pid, slot=slot, set=pid & 1, count=64,
                     codec=wire.CODEC_INT32, exp_cur=0, exp_next=R, payload=V(rank + 1).astype(">i4").tobytes(),
                     flags=flags, session=session, call_kind=kind, call_len=64)


# (port, packet): a flagged round and its resends, a duplicate / a stranger's / another session's flagged packet
# that must not count, the set's next round clean, a round with CE on arrival (the flag for the model), sparse
CONGESTION = [(0, congested_update(0, 0, flags=F)), (1, congested_update(1, 0)), (0, congested_update(0, 0, flags=F)),
              (1, congested_update(1, 0)), (0, congested_update(0, 1)), (0, congested_update(0, 1, flags=F)),
              (7, congested_update(1, 1, flags=F)), (1, congested_update(1, 1, flags=F, session=0xDEAD)),
              (1, congested_update(1, 1)), (0, congested_update(0, 2)), (1, congested_update(1, 2)),
              (1, congested_update(1, CE_ROUND)), (0, congested_update(0, CE_ROUND, flags=F)),
              (1, congested_update(1, 0, slot=1, flags=F, sparse=True)), (0, congested_update(0, 0, slot=1, sparse=True))]
WANT_FLAGS = [[], [F, F], [F], [F], [], [], [], [wire.FLAG_REPLY], [0, 0], [], [0, 0], [], [F, F], [], [F, F]]


def _ip_socket(sw, port):
    """The backend's socket for port where the switch sees an IP header (UDP, DPDK, BMv2), else None."""
    s = sw._sock(port) if hasattr(sw, "_sock") else None
    return s if isinstance(s, socket.socket) else None


def _send_ce(sw, port, data):
    """data from port's socket with ECN CE and its flag clear (the switch sets it); what came back, each with
    the ECN field it arrived with."""
    import select
    import time

    for s in sw.socks.values():
        s.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
    sock = _ip_socket(sw, port)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, wire.CE)
    try:
        sw._emit(port, data[:3] + bytes([data[3] & ~F]) + data[4:])
    finally:
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, 0)
    got, by_fd, deadline = [], {s.fileno(): p for p, s in sw.socks.items()}, time.monotonic() + sw.quiet
    while (left := deadline - time.monotonic()) > 0:
        for s in select.select(list(sw.socks.values()), [], [], left)[0]:
            pkt, anc, _, _ = s.recvmsg(65536, socket.CMSG_SPACE(4))
            tos = [d[0] for level, kind, d in anc if (level, kind) == (socket.IPPROTO_IP, socket.IP_TOS)]
            got.append(((by_fd[s.fileno()], pkt), tos[0] & 3 if tos else None))
    return sw.untold([g for g, _ in got]), [ecn for _, ecn in got]


def _anonymous(out):
    """(port, packet) with the session and boot id zeroed: they differ between two switches."""
    cut = wire.OFFSETS["session"], wire.OFFSETS["boot"]
    return sorted((p, d[:cut[0]] + bytes(4) + d[cut[0] + 4:cut[1]] + bytes(4) + d[cut[1] + 4:]) for p, d in out)


def test_congestion_matches_the_model(switch_backend):
    """FLAG_CONGESTED ORed over a round's counted contributions, byte for byte as the model; where the switch
    reads an IP header, a CE-marked update counts as flagged and results leave ECT(0)."""
    from .conftest import ModelHarness

    sw, model = switch_backend({1: 2}, slots=2, max_elements=64), ModelHarness({1: 2}, slots=2, max_elements=64)
    for step, ((port, data), flags) in enumerate(zip(CONGESTION, WANT_FLAGS)):
        want = model.send(port, data)
        ce = wire.unpack(data).packet_id == CE_ROUND and port == 0 and _ip_socket(sw, port) is not None
        got, ecn = _send_ce(sw, port, data) if ce else (sw.send(port, data), None)
        assert _anonymous(got) == _anonymous(want), f"step {step}"
        assert sorted(wire.unpack(d).flags for _, d in want) == flags, f"step {step}"
        if ce:
            assert ecn == [wire.ECT0] * 2, "results leave ECN-capable"
    if _ip_socket(sw, 0) is not None:  # a result's resend leaves ECT(0) too; the switch's answers do not
        out, ecn = _send_ce(sw, 1, congested_update(1, CE_ROUND))  # a duplicate: CE on it counts for nothing
        assert [wire.unpack(d).flags for _, d in out] == [F] and ecn == [wire.ECT0]
        out, ecn = _send_ce(sw, 1, congested_update(1, 1, flags=F, session=0xDEAD))
        assert [wire.unpack(d).msg_type for _, d in out] == [wire.MSG_ERROR] and ecn == [0]
    assert sw.stats()["jobs"]["1"]["congested"] == model.stats()["jobs"]["1"]["congested"] == 3
