"""Protocol v2 on every backend (conftest.BACKENDS): a job only its own workers can touch. One test per
attack that worked on protocol v1 (spoofed rank, stranger joins, a stray join, the previous generation,
far-ahead ids, amplification, stats to anyone), each with the check that the real job is untouched."""
from __future__ import annotations

import time

import numpy as np
import pytest

from hostlib import wire
from switchsim import control

from .conftest import confirmed_join
from .test_conformance import V, update

STRANGER = 50  # a port no rank joined from


def results(out):
    return sorted((port, wire.unpack(d).msg_type, wire.unpack(d).packet_id) for port, d in out)


def summed(out, k):
    """Every packet is a result carrying V(k)."""
    return all(np.array_equal(wire.payload_view(d, wire.unpack(d)), V(k)) for _, d in out)


def test_spoofed_rank_changes_no_sum_and_gets_nothing(switch_backend):
    sw = switch_backend({1: 2}, slots=2, max_elements=64)
    assert sw.send(0, update(0, 0, 0, 1, 0, 0)) == []
    # the attacker knows job, rank, slot, packet id, even the session: it is not rank 1's address
    forged = wire.pack(wire.MSG_UPDATE, 1, 1, 0, 0, 0, 64, wire.CODEC_INT32, 0, 0, 0,
                       (V(1) * 1000).astype(">i4").tobytes(), sw.session)
    empty = wire.pack(wire.MSG_UPDATE, 1, 0, 0, 0, 0, 0, wire.CODEC_INT32, session=sw.session)
    assert sw.blast(STRANGER, [forged] * 4 + [empty] * 4) == []
    out = sw.send(1, update(1, 0, 0, 1, 0, 0))
    assert sorted(p for p, _ in out) == [0, 1]
    assert summed(out, 2)  # 1 + 1, not 1 + 1000
    assert sw.send(STRANGER, empty) == []  # a completed round is resent to members only
    assert sw.stats()["dropped"]["spoofed"] == 9


def test_stranger_joins_cannot_take_over_a_live_job(switch_backend):
    sw = switch_backend({1: 2}, slots=2, max_elements=64)
    replies = sw.blast(STRANGER, [wire.pack_join(1, r, 77 + r, 2, 64) for r in (0, 1)] * 3)
    assert all(wire.unpack(d).msg_type == wire.MSG_JOIN_WAIT and len(d) <= wire.JOIN_SIZE for _, d in replies)
    assert {p for p, _ in replies} <= {STRANGER}
    sw.send(0, update(0, 0, 0, 1, 0, 0))
    out = sw.send(1, update(1, 0, 0, 1, 0, 0))
    assert sorted(p for p, _ in out) == [0, 1] and summed(out, 2)
    assert sw.stats()["jobs"]["1"]["generation"] == 1


def test_a_stray_join_cannot_wedge_the_barrier(switch_backend):
    sw = switch_backend({1: 2}, slots=2, max_elements=64)
    sw.send(STRANGER, wire.pack_join(1, 0, 99, 2, 64))  # left pending
    # a member whose ack was lost re-sends its join: answered at once, whatever is pending
    again = sw.send(1, sw.join_packet(1, 1, 2))
    assert [(p, wire.unpack(d).msg_type) for p, d in again] == [(1, wire.MSG_JOIN_ACK)]
    # the job ends (leave) and restarts from the same ports: the stray is replaced, not obeyed. The first
    # leave fails the generation for the member still in it (it is told, naming the rank that left)
    first = sw.send(0, wire.pack(wire.MSG_LEAVE, job=1, rank=0))
    assert [(p, wire.unpack_error(d)[:2]) for p, d in first] == [(0, (wire.ERR_PEER_DEAD, 0)), (1, (wire.ERR_PEER_DEAD, 0))]
    assert sw.send(1, wire.pack(wire.MSG_LEAVE, job=1, rank=1)) == []
    sessions = sw.join_all(nonce=10)
    assert sw.stats()["jobs"]["1"]["generation"] == 2 and sessions[1]
    sw.send(0, update(0, 0, 0, 1, 0, 0))
    out = sw.send(1, update(1, 0, 0, 1, 0, 0))
    assert sorted(p for p, _ in out) == [0, 1] and summed(out, 2)


def test_a_forged_rejoin_from_members_addresses_does_not_reform_the_job(switch_backend):
    """Issue 57, 1: keyless, joins for every rank forged from each member's own address (sent twice, and
    even confirmed with the cookie an on-path reader would see) carry no session: they re-form nothing,
    and the running generation's rounds stay exact. A member's own re-join, proven by its session, does."""
    sw = switch_backend({1: 2}, slots=2, max_elements=64)
    alive = [(r, wire.pack(wire.MSG_HEARTBEAT, job=1, rank=r, session=sw.session)) for r in (0, 1)]  # as workers beat
    forged = {r: wire.pack_join(1, r, 0xF0F0 + r, 2, 64) for r in (0, 1)}
    out = sw.send_from(alive + list(forged.items()) * 2)
    waits = {p: d for p, d in out if d[1] == wire.MSG_JOIN_WAIT}
    sw.send_from(alive + [(r, wire.confirm_join(forged[r], waits[r])) for r in waits])
    assert len(waits) == 2 and sw.stats()["jobs"]["1"]["generation"] == 1
    assert sw.stats()["dropped"]["spoofed"] >= 2
    sw.send(0, update(0, 0, 0, 1, 0, 0))
    out = sw.send(1, update(1, 0, 0, 1, 0, 0))
    assert sorted(p for p, _ in out) == [0, 1] and summed(out, 2)
    old = sw.session  # the members re-join (a worker whose call gave up does): each proves it with its session
    assert sw.join_all(nonce=0xABC0, proven=True)[1] != old and sw.stats()["jobs"]["1"]["generation"] == 2


@pytest.mark.parametrize("elements", [32, 64])
def test_a_stray_join_sent_twice_never_completes_a_barrier(switch_backend, elements):
    """Issue 57, 2: rank 1 waits in the barrier; a stray join for rank 0 comes twice, 100 ms apart, from
    the stray's own address (asking another packet size, or the same): it never reads the join_wait, so it
    never counts. Rank 1 is not refused and keeps waiting; rank 0's real join then starts the generation
    with the real ranks, and its rounds are exact."""
    sw = switch_backend({1: 2}, join=False, slots=2, max_elements=64)
    sw.confirm(1, sw.join_packet(1, 1, 21))
    stray = wire.pack_join(1, 0, 0x5757, 2, 64, elements=elements)
    first = sw.send(STRANGER, stray)
    sw.send(1, sw.join_packet(1, 1, 21))  # rank 1 repeats its join as it waits (its cookie not needed any more)
    time.sleep(0.1)
    second = sw.send(STRANGER, stray)
    assert [wire.unpack(d).msg_type for _, d in first + second] == [wire.MSG_JOIN_WAIT] * 2
    again = sw.send(1, sw.join_packet(1, 1, 21))
    assert [(p, wire.unpack(d).msg_type) for p, d in again] == [(1, wire.MSG_JOIN_WAIT)]
    assert wire.JOIN_WAIT_PAYLOAD.unpack_from(again[0][1], wire.HEADER_SIZE)[0] == 0b10  # rank 1 alone counts
    acks = [(p, wire.unpack(d)) for p, d in sw.confirm(0, sw.join_packet(1, 0, 20)) if d[1] == wire.MSG_JOIN_ACK]
    assert sorted(p for p, _ in acks) == [0, 1] and sw.stats()["jobs"]["1"]["generation"] == 1
    sw.sessions[1] = acks[0][1].session
    sw.send(0, update(0, 0, 0, 1, 0, 0))
    out = sw.send(1, update(1, 0, 0, 1, 0, 0))
    assert sorted(p for p, _ in out) == [0, 1] and summed(out, 2)


def test_previous_generation_cannot_touch_the_next(switch_backend):
    sw = switch_backend({1: 2}, slots=2, max_elements=64)
    old = sw.session
    assert sw.send(0, update(0, 0, 0, 1, 0, 0)) == []  # a round of generation 1, never completed
    for r in (0, 1):
        sw.send(r, wire.pack(wire.MSG_LEAVE, job=1, rank=r))
    assert sw.join_all(nonce=20)[1] != old
    zombie = wire.pack(wire.MSG_UPDATE, 1, 1, 0, 0, 0, 64, wire.CODEC_INT32, 0, 0, 0,
                       (V(1) * 500).astype(">i4").tobytes(), old)
    # rank 1's zombie, still retransmitting from its old port: dropped, and told (header only, its own
    # session echoed) that it is no member of this generation
    answers = [(p, len(d), wire.unpack(d).msg_type, wire.unpack(d).session) for p, d in sw.blast(1, [zombie] * 3)]
    assert answers == [(1, wire.HEADER_SIZE, wire.MSG_ERROR, old)] * 3
    sw.send(0, update(0, 0, 0, 1, 0, 0))
    out = sw.send(1, update(1, 0, 0, 1, 0, 0))
    assert sorted(p for p, _ in out) == [0, 1] and summed(out, 2)  # not 502
    assert sw.stats()["dropped"]["wrong_session"] == 3


def test_far_ahead_ids_cannot_claim_a_set(switch_backend):
    sw = switch_backend({1: 2}, slots=2, max_elements=64)
    wedge = [update(r, s, x, 1, pid, 0) for r in (0, 1) for s in (0, 1) for x in (0, 1) for pid in (x + 2, x + 1000)]
    assert sw.blast(0, [p for p in wedge if p[6] == 0]) == []  # from rank 0 itself
    assert sw.blast(1, [p for p in wedge if p[6] == 1]) == []
    assert sw.stats()["dropped"]["ahead"] == len(wedge)
    for slot in (0, 1):  # every slot still runs its rounds 0 and 1
        for pid in (0, 1):
            sw.send(0, update(0, slot, pid, 1, pid, 0))
            out = sw.send(1, update(1, slot, pid, 1, pid, 0))
            assert sorted(p for p, _ in out) == [0, 1] and summed(out, 2)


def test_answers_to_strangers_are_small_and_rate_limited(switch_backend):
    sw = switch_backend({1: 2}, slots=2, max_elements=64)
    join = wire.pack_join(9, 0, 5, 2, 64)
    out = sw.send(STRANGER, join)
    assert len(out) == 1 and len(out[0][1]) <= len(join)
    assert wire.unpack_error(out[0][1]) == (wire.ERR_REJECTED, wire.NO_RANK, "unknown job 9")  # no list of jobs served
    n = control.ERROR_RATE[1] + 100
    t0 = time.monotonic()
    flood = sw.blast(STRANGER, [join] * n)
    refill = control.ERROR_RATE[0] * (time.monotonic() - t0)  # a slower switch answers over a longer time
    assert len(flood) <= control.ERROR_RATE[1] + refill + 5  # the burst, and what the rate refilled meanwhile
    assert sw.stats()["dropped"]["rate_limited"] >= n - len(flood) - 10  # refused, not lost
    sw.send(0, update(0, 0, 0, 1, 0, 0))
    assert summed(sw.send(1, update(1, 0, 0, 1, 0, 0)), 2)


def test_keyed_job_admits_only_joins_with_the_mac(switch_backend):
    key = b"0123456789abcdef-key"
    sw = switch_backend({1: 2}, join=False, slots=2, max_elements=64, keys={1: key})
    unsigned = [wire.pack_join(1, r, 5 + r, 2, 64) for r in (0, 1)]
    out = sw.blast(STRANGER, unsigned)
    assert all(wire.unpack(d).msg_type == wire.MSG_ERROR and b"MAC" in d for _, d in out) and len(out) == 2
    assert sw.stats()["dropped"]["bad_mac"] == 2
    assert sw.join_all()[1]  # with the key's MAC
    sw.send(0, update(0, 0, 0, 1, 0, 0))
    assert summed(sw.send(1, update(1, 0, 0, 1, 0, 0)), 2)
    # with a key, the holder may restart the job from new ports at once (no liveness wait)
    sw.sessions.clear()
    for r in (0, 1):
        out = sw.confirm(10 + r, sw.join_packet(1, r, 40 + r))
    assert sorted(p for p, d in out if wire.unpack(d).msg_type == wire.MSG_JOIN_ACK) == [10, 11]


@pytest.mark.parametrize("host,answered", [("127.0.0.1", True), ("10.9.9.9", False)])
def test_stats_go_to_control_hosts_only(host, answered):
    """In-process (model and C core alike): the control plane answers loopback and --control hosts."""
    from switchsim.model import Switch
    from switchsim.native import CoreSwitch

    req = wire.pack(wire.MSG_STATS_REQ)
    for cls in (Switch, CoreSwitch):
        sw = cls({1: 2})
        out = sw.process(req, (host, 5000))
        assert (len(out) == 1 and wire.unpack(out[0][0]).msg_type == wire.MSG_STATS) == answered
        assert sw.stats()["dropped"]["not_control"] == (0 if answered else 1)
        assert len(cls({1: 2}, control_hosts=["10.9.9.9"]).process(req, ("10.9.9.9", 1))) == 1


def _attacker(address, stop, sent, zombie_session):
    """Everything a stranger on the same network sends at a running job, bounded in count and time:
    forged updates for every rank (guessed sessions, and the previous generation's from its zombie's
    socket), far-ahead ids, empty updates asking for resends, and a flood of joins for every rank."""
    import socket
    import time

    rs = np.random.default_rng(7)
    deadline = time.monotonic() + 30
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        while not stop.is_set() and sent[0] < 20000 and time.monotonic() < deadline:
            rank, slot, pid = int(rs.integers(0, 3)), int(rs.integers(0, 16)), int(rs.integers(0, 40))
            session = zombie_session if rs.random() < 0.3 else int(rs.integers(1, 2**32))
            if rs.random() < 0.2:
                pid += 1 << 20  # far ahead
            count = int(rs.choice([0, 64]))
            pkts = [wire.pack(wire.MSG_UPDATE, 1, rank, pid, slot, pid & 1, count, wire.CODEC_INT32, 0, 0, 0,
                              rs.integers(-1000, 1000, count).astype(">i4").tobytes(), session),
                    wire.pack_join(1, rank, int(rs.integers(1, 2**60)), 3, 16)]
            for p in pkts:
                try:
                    s.sendto(p, address)
                except OSError:
                    pass
            sent[0] += len(pkts)
            time.sleep(0.0002)


def test_real_job_stays_exact_under_attack(switch_process):
    """`switchsim serve` (every backend): a job re-joins after a first generation, with a stray join left
    pending and the old generation's zombie still sending, then runs int32 allreduces while a stranger
    floods forged updates, far-ahead ids and joins. Every result is exact; the switch counted the drops."""
    import socket
    import threading

    import hostlib
    from inaproto.net import parse_address
    from switchsim.server import query_stats

    sw = switch_process("--workers", 3, "--slots", 16)
    address = parse_address(sw.address)
    rs = np.random.default_rng(3)
    xs = [rs.integers(-1000, 1000, 100_000).astype(np.int32) for _ in range(3)]
    # generation 1: rank 0 keeps its socket after leaving (the zombie); a stranger's join is left pending
    zombie, first_errors = [None], [None] * 3

    def first(r):
        try:
            c = hostlib.connect(sw.address, r, 3, window=16, timeout=20)
            c.allreduce(xs[r])
        except Exception as e:  # noqa: BLE001 - reported to the test
            first_errors[r] = e
            return
        if r:
            c.close()
        else:
            zombie[0] = c

    threads = [threading.Thread(target=first, args=(r,)) for r in range(3)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert first_errors == [None] * 3, [repr(e) for e in first_errors]
    z = zombie[0]
    z.sock.send(wire.pack(wire.MSG_LEAVE, job=1, rank=0, session=z.session))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(wire.pack_join(1, 1, 12345, 3, 16), address)
    stop, sent = threading.Event(), [0]
    attack = threading.Thread(target=_attacker, args=(address, stop, sent, z.session), daemon=True)

    def zombie_retransmits():
        for pid in range(200):
            if stop.is_set():
                return
            z.sock.send(wire.pack(wire.MSG_UPDATE, 1, 0, pid % 4, pid % 16, pid % 2, 64, wire.CODEC_INT32, 0, 0,
                                  0, (np.ones(64) * 777).astype(">i4").tobytes(), z.session))
            stop.wait(0.005)

    zt = threading.Thread(target=zombie_retransmits, daemon=True)
    during = []
    joined = threading.Barrier(3, action=lambda: (attack.start(), zt.start(), stop.wait(0.2), during.append(sent[0])))
    outs, errors = [None] * 3, [None] * 3

    def second(r):  # generation 2: the attack starts once all ranks joined (its members are live)
        try:
            with hostlib.connect(sw.address, r, 3, window=16, timeout=30) as c:
                joined.wait(30)
                for _ in range(6):
                    outs[r] = c.allreduce(xs[r])
        except Exception as e:  # noqa: BLE001 - reported to the test
            errors[r] = e

    threads = [threading.Thread(target=second, args=(r,), daemon=True) for r in range(3)]
    try:
        [t.start() for t in threads]
        [t.join(120) for t in threads]
    finally:
        stop.set()
        for t in (attack, zt):
            if t.is_alive():
                t.join(10)
        z.sock.close()
    assert errors == [None] * 3, [repr(e) for e in errors]
    exact = np.sum(np.array(xs, dtype=np.int64), axis=0)
    assert all(np.array_equal(o, exact) for o in outs)
    assert 0 < during[0] < sent[0]  # the attack ran before and during the allreduces
    stats = query_stats(address)
    dropped = stats["dropped"]
    assert dropped["spoofed"] > 0, dropped
    assert stats["jobs"]["1"]["generation"] == 2


def test_the_switch_does_not_load_the_worker():
    """Protocol v2 lives in inaproto: importing the switch's modules loads nothing of hostlib."""
    import subprocess
    import sys

    code = ("import sys, switchsim.model, switchsim.control, switchsim.server, switchsim.native, switchsim.cli; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'hostlib'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_stats_answer_is_the_same_message_on_every_server(switch_process):
    from inaproto.net import parse_address
    from switchsim.server import query_stats

    sw = switch_process("--workers", 2)
    stats = query_stats(parse_address(sw.address))  # parses the reply with wire.unpack: version 2, MSG_STATS
    assert list(stats["dropped"]) == list(wire.DROP_REASONS)
    assert stats["jobs"]["1"]["members"] == 0 and stats["jobs"]["1"]["generation"] == 0



def test_switch_that_drops_bursts_grants_a_window_within_its_limit():
    """A switch told how many packets a job may have in flight (BMv2: ~30-packet bursts) agrees on a window
    of at most that divided by the world size, however large the workers ask."""
    from switchsim.model import Switch

    sw = Switch({1: 4, 2: 40}, in_flight=24, first_packet_id=0)
    for job, n, expected in ((1, 4, 6), (2, 40, 1)):
        acks = []
        for r in range(n):
            join = wire.pack_join(job, r, 100 + r, n, 64)
            acks += [d for d, _ in confirmed_join(sw.process, join, (job, r)) if d[1] == wire.MSG_JOIN_ACK]
        windows = {wire.JOIN_ACK_PAYLOAD.unpack_from(d, wire.HEADER_SIZE)[3] for d in acks}
        assert len(acks) == n and windows == {expected}


# ---------------------------------------------------------------- a shared switch (serve without --job)
# a long liveness window: BMv2's control path is slow, and only the silence test lets a job fall silent
SHARED = dict(shared=True, slots=4, pool=8, max_elements=64, peer_silent=30.0)


def round_exact(sw, job: int, slot: int = 0, k: int = 1) -> bool:
    """One round on the slot (its first: packet id 0) by every rank of the job: each member gets the sum."""
    n, out = sw.jobs[job], []
    for r in range(n):
        out += sw.send(sw.port_of(job, r), update(r, slot, 0, k, 0, 0, job=job))
    return sorted(p for p, _ in out) == sorted(sw.port_of(job, r) for r in range(n)) and summed(out, k * n)


def errors_in(out) -> list[tuple[int, int, str]]:
    return [wire.unpack_error(d) for _, d in out if d[1] == wire.MSG_ERROR]


def poke(sw):
    """A control request: a shared switch looks for ended jobs with the requests it handles."""
    sw.send(STRANGER, wire.pack(wire.MSG_STATS_REQ))


def test_a_shared_switch_admits_jobs_as_they_join_and_lends_each_a_run_of_its_pool(switch_backend):
    sw = switch_backend({1: 2, 2: 3}, **SHARED)  # no job at start: both admitted at their first join
    assert round_exact(sw, 1) and round_exact(sw, 2)
    stats = sw.stats()
    jobs, pool = stats["jobs"], stats["pool"]
    assert (jobs["1"]["slots"], jobs["2"]["slots"], jobs["2"]["world_size"]) == (4, 4, 3)
    assert {jobs["1"]["slot_base"], jobs["2"]["slot_base"]} == {0, 4} and (pool["in_use"], pool["jobs"]) == (8, 2)
    sw.send(0, update(0, 4, 0, 1, 0, 0))  # beyond its run: its own bad_slot, never another job's slot
    assert sw.stats()["dropped"]["bad_slot"] == 1
    sw.jobs[3] = 2  # a third job: refused at its first join, saying what is in use; it holds nothing
    out = errors_in(sw.send(3000, sw.join_packet(3, 0, 7)))
    assert out and out[0][0] == wire.ERR_POOL_FULL and "8 of 8 slots in use by 2 jobs" in out[0][2], out
    assert "3" not in sw.stats()["jobs"] and sw.stats()["dropped"]["pool_full"] == 1
    for r in (0, 1):  # job 1 closes: its run goes back at its last leave, and job 3 gets it
        sw.send(r, wire.pack(wire.MSG_LEAVE, job=1, rank=r, session=sw.sessions[1]))
    stats = sw.stats()
    assert "1" not in stats["jobs"] and (stats["pool"]["in_use"], stats["pool"]["ended"]) == (4, 1)
    sw.join_job(3, nonce=20)
    assert sw.stats()["jobs"]["3"]["slot_base"] == jobs["1"]["slot_base"]
    assert round_exact(sw, 3) and round_exact(sw, 2, slot=1)
    sw.send(0, update(0, 0, 0, 1, 0, 0, job=1))  # the ended job's packets change nothing
    assert sw.stats()["dropped"]["unknown_job"] >= 1 and round_exact(sw, 3, slot=1)


def test_a_shared_jobs_slots_go_back_when_its_members_fall_silent(switch_backend, request):
    slow = request.node.callspec.params["switch_backend"] == "bmv2"  # its control requests take ~0.1 s each
    sw = switch_backend({1: 2, 2: 2}, **{**SHARED, "peer_silent": 3.0 if slow else 0.5})  # both admitted
    beats = [(sw.port_of(2, r), wire.pack(wire.MSG_HEARTBEAT, job=2, rank=r, session=sw.sessions[2])) for r in (0, 1)]
    deadline = time.monotonic() + 8
    while "1" in sw.stats()["jobs"] and time.monotonic() < deadline:  # job 1 is silent, job 2 beats
        sw.send_from(beats)
        time.sleep(0.2)
    stats = sw.stats()
    assert "1" not in stats["jobs"] and stats["jobs"]["2"]["members"] == 2, stats["jobs"]
    assert (stats["pool"]["in_use"], stats["pool"]["ended"]) == (4, 1)
    assert round_exact(sw, 2)


def test_a_keyed_shared_switch_admits_only_the_jobs_whose_key_it_issued(switch_backend, tmp_path):
    from inaproto import auth

    issued, made_up = b"issued-key-0123456789", b"made-up-key-0123456789"
    (tmp_path / "7.key").write_bytes(issued)
    sw = switch_backend({7: 2}, join=False, **SHARED, admit="keyed", key_dir=str(tmp_path), keys={7: issued})
    signed = [wire.pack_join(job, 0, 5, 2, 64, auth.join_mac(key, job, 0, 5, 2, 64)) for job, key in
              ((8, made_up), (8, issued), (7, made_up))] + [wire.pack_join(7, 0, 6, 2, 64)]
    out = errors_in(sw.send_from([(STRANGER, j) for j in signed]))
    assert [e[0] for e in out] == [wire.ERR_REJECTED] * 4, out
    assert sum("no key was issued" in e[2] for e in out) == 2 and sum("bad MAC" in e[2] for e in out) == 2
    stats = sw.stats()
    assert stats["jobs"] == {} and stats["pool"]["in_use"] == 0 and stats["dropped"]["bad_mac"] == 4
    sw.join_all()  # with the issued key's MAC
    assert sw.stats()["jobs"]["7"]["keyed"] and round_exact(sw, 7)


def test_a_stranger_cannot_end_a_shared_job_or_take_its_slots(switch_backend, tmp_path):
    key = b"issued-key-0123456789"
    (tmp_path / "1.key").write_bytes(key)
    sw = switch_backend({1: 2}, **SHARED, admit="keyed", key_dir=str(tmp_path), keys={1: key})
    s = sw.sessions[1]
    leaves = [wire.pack(wire.MSG_LEAVE, job=1, rank=r, session=x) for r in (0, 1) for x in (0, s)]
    aborts = [wire.pack(wire.MSG_ABORT, job=1, rank=0, session=s, payload=b"stranger")]
    joins = [sw.join_packet(1, 0, 99), wire.pack_join(1, 0, 98, 2, 64)]  # even with the key's MAC: not its address
    out = sw.send_from([(STRANGER, p) for p in leaves + aborts + joins])
    poke(sw)
    stats = sw.stats()
    assert all(e[0] == wire.ERR_REJECTED for e in errors_in(out)), out  # the unsigned join; no peer_dead, no abort
    assert (stats["jobs"]["1"]["generation"], stats["jobs"]["1"]["members"], stats["pool"]["in_use"]) == (1, 2, 4)
    assert not stats["jobs"]["1"]["failed"] and round_exact(sw, 1)
