"""Liveness (protocol v3.1): silence means death only when nothing else can explain it. A busy rank (one that
holds the GIL) is never taken for dead; a stopped switch is named within seconds; a stranger's flood never
crowds out a member; a join's answers reach only that join; a rank that gave up or left is named.

Switch processes and rank processes are stopped by PID at the end, even on failure (conftest, procs).
"""
from __future__ import annotations

import os
import signal
import socket
import struct
import threading
import time

import numpy as np
import pytest

import hostlib
from hostlib import errors, wire
from hostlib.worker import AUTO_WINDOW_MAX, auto_window
from inabench.harness import SwitchProcess, cpu_seconds
from inaproto.net import parse_address
from switchsim import control
from switchsim.server import query_stats

from .conftest import confirmed_join, spoof_udp
from .test_admission import STRANGER
from .test_integrity import LOOPS, lines, procs, serve_on  # noqa: F401 - procs: a fixture

KEY = b"0123456789abcdef-liveness"


# ---------------------------------------------------------------- members first (every backend)


def each_rank(fn, world=2, timeout=60) -> list:
    """fn(rank) on a thread per rank; each rank's return value, or the exception it raised."""
    got = [None] * world

    def run(r):
        try:
            got[r] = fn(r)
        except Exception as e:  # noqa: BLE001 - the caller checks
            got[r] = e

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return got


def failed_call(comm, x):
    """(the INAError an allreduce raised, seconds until it did); None if it returned."""
    t0 = time.monotonic()
    try:
        comm.allreduce(x)
    except errors.INAError as e:
        return e, time.monotonic() - t0


def heartbeat(job, rank, session):
    return wire.pack(wire.MSG_HEARTBEAT, job=job, rank=rank, session=session)


@pytest.mark.parametrize("keyed", [False, True])
def test_a_members_heartbeat_is_answered_through_a_strangers_flood(switch_backend, keyed):
    """3000 control requests of every shape from a stranger (heartbeats, joins, aborts, leaves, stats),
    then a member's heartbeat: it is answered (members first), and the stranger's are rate-limited."""
    sw = switch_backend({1: 2}, slots=2, max_elements=64, **({"keys": {1: KEY}} if keyed else {}))
    shapes = [heartbeat(1, 0, sw.session ^ 1), wire.pack_join(1, 1, 7, 2, 64),
              wire.pack(wire.MSG_ABORT, job=1, rank=0, session=sw.session, payload=b"x"),
              wire.pack(wire.MSG_LEAVE, job=1, rank=1, session=sw.session), wire.pack(wire.MSG_STATS_REQ)]
    t0 = time.monotonic()
    sw.blast(STRANGER, shapes * 600)  # sent back to back, then the answers collected
    took = time.monotonic() - t0
    out = sw.send(0, heartbeat(1, 0, sw.session))
    beats = [d for p, d in out if p == 0 and d[1] == wire.MSG_HEARTBEAT]
    assert len(beats) == 1 and len(beats[0]) == wire.HEADER_SIZE and wire.unpack(beats[0]).session == sw.session
    stats = sw.stats()
    passed = 5 * control.SOURCE_RATE[1] + took * control.SOURCE_RATE[0] * 5  # a budget per source (the P4 meter:
    assert stats["dropped"]["rate_limited"] >= 3000 - passed, stats["dropped"]  # per hashed source, per shape)
    if took < control.PEER_SILENT - 0.5:  # a slow switch (bmv2) takes longer: the silent rank 1 is dead then
        assert out == [(0, beats[0])] and not stats["jobs"]["1"]["failed"]


def test_many_strangers_share_one_budget_and_a_member_goes_first():
    """The control plane alone (python): 5000 stranger addresses, one request each, use up the strangers'
    shared budget (what it refills while they come aside); a member's heartbeat is still answered."""
    from switchsim.model import Switch

    sw = Switch({1: 2}, first_packet_id=0)
    acks = [confirmed_join(sw.process, wire.pack_join(1, r, 5 + r, 2, 64), r) for r in (0, 1)]
    session = wire.unpack(acks[-1][-1][0]).session
    t0 = time.monotonic()
    for port in range(100, 5100):
        sw.process(heartbeat(1, 0, session), port)
    refilled = (time.monotonic() - t0) * control.CONTROL_RATE[0]
    assert sw.stats()["dropped"]["rate_limited"] >= 5000 - control.CONTROL_RATE[1] - refilled - 1
    assert [wire.unpack(d).msg_type for d, _ in sw.process(heartbeat(1, 1, session), 1)] == [wire.MSG_HEARTBEAT]


def test_a_switch_behind_its_queue_names_no_silent_member():
    """The control plane alone, on a fake clock: while the transport has not found its receive queue empty
    (a flood it cannot keep up with: the kernel drops members' packets too) a silent member is not dead;
    once the switch keeps up again, PEER_SILENT of silence from then on names it."""
    from switchsim.model import Switch

    now = [0.0]
    sw = Switch({1: 2}, first_packet_id=0, clock=lambda: now[0])
    acks = [confirmed_join(sw.process, wire.pack_join(1, r, 5 + r, 2, 64), r) for r in (0, 1)]
    session = wire.unpack(acks[-1][-1][0]).session
    sw.control.drained()
    now[0] = 0.5  # behind its queue from here (no drained() for more than SATURATED)
    for t in (1.0, 2.0, 4.0, 6.0):
        now[0] = t
        out = sw.process(heartbeat(1, 0, session), 0)  # rank 1 is silent
        assert [d[1] for d, _ in out] == [wire.MSG_HEARTBEAT], t
    for t in (6.1, 7.0, 8.0, 9.05):  # keeping up again
        now[0] = t
        sw.control.drained()
        out = sw.process(heartbeat(1, 0, session), 0)
    errors_ = [wire.unpack_error(d) for d, _ in out if d[1] == wire.MSG_ERROR]
    assert errors_ and errors_[0][:2] == (wire.ERR_PEER_DEAD, 1)


def test_join_answers_echo_the_nonce(switch_backend):
    """join_wait, join_ack and a join's error carry the low 32 bits of its nonce in packet_id."""
    sw = switch_backend({1: 2}, join=False, slots=2, max_elements=64)
    wait = sw.send(0, sw.join_packet(1, 0, 0x0102030411223344))
    assert [(wire.unpack(d).msg_type, wire.unpack(d).packet_id) for _, d in wait] == [(wire.MSG_JOIN_WAIT, 0x11223344)]
    bad = sw.send(1, wire.pack_join(1, 1, 0x55667788, 3, 64))  # a world size of 3: refused
    assert [(wire.unpack(d).msg_type, wire.unpack(d).packet_id) for _, d in bad] == [(wire.MSG_ERROR, 0x55667788)]
    sw.confirm(0, sw.join_packet(1, 0, 0x0102030411223344))
    acks = [a for a in sw.confirm(1, sw.join_packet(1, 1, 0xAABBCCDD)) if a[1][1] == wire.MSG_JOIN_ACK]
    assert sorted((p, wire.unpack(d).msg_type, wire.unpack(d).packet_id) for p, d in acks) == [
        (0, wire.MSG_JOIN_ACK, 0x11223344), (1, wire.MSG_JOIN_ACK, 0xAABBCCDD)]


def test_a_worker_takes_only_the_answers_to_its_own_join():
    """A switch (played here by a socket) first answers a forged join from the worker's address (another
    nonce) with an error, then the worker's own join: the worker ignores the first and joins."""
    fake = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    fake.bind(("127.0.0.1", 0))
    fake.settimeout(5)
    got = {}

    def connect():
        try:
            got["comm"] = hostlib.connect(f"127.0.0.1:{fake.getsockname()[1]}", 0, 1, codec="int32", timeout=5)
        except Exception as e:  # noqa: BLE001 - reported below
            got["error"] = e

    t = threading.Thread(target=connect, daemon=True)
    t.start()
    try:
        join, worker = fake.recvfrom(4096)
        nonce = struct.unpack_from(">Q", join, wire.HEADER_SIZE)[0] & wire.PACKET_ID_MASK
        fake.sendto(wire.pack_error(wire.ERR_REJECTED, "bad MAC", 1, 0, packet_id=nonce ^ 1), worker)
        fake.sendto(wire.pack(wire.MSG_JOIN_WAIT, job=1, rank=0, packet_id=nonce ^ 1,
                              payload=wire.JOIN_WAIT_PAYLOAD.pack(1)), worker)
        ack = wire.JOIN_ACK_PAYLOAD.pack(1, 8, 256, 8, 0)
        fake.sendto(wire.pack(wire.MSG_JOIN_ACK, job=1, rank=0, packet_id=nonce, session=77, payload=ack), worker)
        t.join(10)
        assert "error" not in got, got.get("error")
        assert got["comm"].session == 77 and got["comm"].window == 8
    finally:
        if "comm" in got:
            got["comm"].close()
        fake.close()


# ---------------------------------------------------------------- a busy rank, a stopped switch


@serve_on("c")
@pytest.mark.parametrize("native", [True, False])
def test_a_rank_holding_the_gil_is_alive_to_its_switch(switch_process, procs, native):  # noqa: F811
    """Rank 1 holds the GIL for 5 s (more than PEER_SILENT) before each call: with the native heartbeat
    thread every call is exact; with the Python thread's (INA_NATIVE_HEARTBEAT=0) the switch takes the busy
    rank for dead, which is the failure the native thread exists for."""
    sw = switch_process("--workers", 2)
    env = {"HOLD_GIL": "5", **({} if native else {"INA_NATIVE_HEARTBEAT": "0"})}
    peer = procs(sw.address, 1, 2, 2, 1000, 30, env=env)
    with hostlib.connect(sw.address, 0, 2, codec="int32", timeout=30) as comm:
        assert comm.allreduce(np.ones(1000, np.int32))[0] == 2
        if native:
            assert comm.allreduce(np.ones(1000, np.int32))[0] == 2
            assert [x.get("ok") for x in lines(peer, 3)] == [None, 2, 2]
        else:
            with pytest.raises(errors.PeerDead) as info:
                comm.allreduce(np.ones(1000, np.int32))
            assert info.value.rank == 1


@serve_on("python", "c")
@pytest.mark.parametrize("fast", LOOPS)
def test_a_stopped_switch_is_named_within_5_s(switch_process, fast):
    """SIGSTOP the switch between two calls: the next call raises SwitchSilent on every rank within 5 s
    (the timeout is 30 s); after SIGCONT the call after re-joins and is exact."""
    sw = switch_process("--workers", 2)
    x = np.ones(200_000, np.int32)
    comms = each_rank(lambda r: hostlib.connect(sw.address, r, 2, codec="int32", timeout=30, fast=fast))
    try:
        os.kill(sw.proc.pid, signal.SIGSTOP)

        seen = each_rank(lambda r: failed_call(comms[r], x))
        os.kill(sw.proc.pid, signal.SIGCONT)
        for e, took in seen:
            assert isinstance(e, errors.SwitchSilent), e
            assert took < 5.0 and sw.address in str(e)
        outs = each_rank(lambda r: comms[r].allreduce(x))
        assert all(np.array_equal(o, 2 * x) for o in outs), outs
    finally:
        os.kill(sw.proc.pid, signal.SIGCONT)
        for c in comms:
            if isinstance(c, hostlib.Communicator):
                c.close()


@serve_on("c")
@pytest.mark.parametrize("fast", LOOPS)
def test_heartbeat_answers_are_counted_apart_from_a_calls_traffic(switch_process, fast):
    """A call's packets_received and bytes_received are its results only, whenever a heartbeat's answer
    lands (as heartbeats are not in packets_sent): two equal calls, one after an idle second, count the same."""
    sw = switch_process("--workers", 1)
    x = np.arange(5000, dtype=np.int32)

    def received(comm):
        return comm.stats.packets_received, comm.stats.bytes_received

    with hostlib.connect(sw.address, 0, 1, codec="int32", fast=fast) as comm:
        comm.allreduce(x)  # the join's answers come with the first call
        joined = received(comm)
        comm.allreduce(x)
        once = received(comm)
        time.sleep(3 * hostlib.worker.HEARTBEAT_EVERY)
        comm.allreduce(x)
        stats = comm.stats
    assert once[0] > joined[0]
    assert received(comm) == (2 * once[0] - joined[0], 2 * once[1] - joined[1])
    assert stats.heartbeat_answers >= 2 and stats.heartbeats >= stats.heartbeat_answers


# ---------------------------------------------------------------- blame


@serve_on("c")
def test_a_late_rank_is_told_who_gave_up(switch_process):
    """Rank 0 times out waiting for rank 1 (2 s); rank 1 calls after 4 s: it raises CallAborted naming
    rank 0 and saying it timed out, instead of completing alone or blaming itself."""
    sw = switch_process("--workers", 2)

    def rank(r):
        with hostlib.connect(sw.address, r, 2, codec="int32", timeout=2 if r == 0 else 30) as comm:
            if r == 1:
                time.sleep(4)
            comm.allreduce(np.ones(100, np.int32))

    seen = each_rank(rank)
    assert isinstance(seen[0], errors.CallTimeout), seen
    assert isinstance(seen[1], errors.CallAborted) and seen[1].rank == 0 and "CallTimeout" in str(seen[1]), seen


@serve_on("python", "c")
def test_a_rank_that_left_is_named_at_the_next_join(switch_process):
    """After a call mismatch, rank 1 closes its communicator; rank 0's next call (a re-join) raises PeerDead
    naming rank 1 at once, not a join timeout."""
    sw = switch_process("--workers", 2)
    comms = each_rank(lambda r: hostlib.connect(sw.address, r, 2, codec="int32", timeout=20))
    seen = each_rank(lambda r: comms[r].allreduce(np.ones(100 + r, np.int32)))
    assert all(isinstance(e, errors.CallMismatch) for e in seen), seen
    comms[1].close()
    t0 = time.monotonic()
    with pytest.raises(errors.PeerDead) as info:
        comms[0].allreduce(np.ones(100, np.int32))
    assert time.monotonic() - t0 < 3.0 and info.value.rank == 1 and "left" in str(info.value)
    comms[0].close()


def test_stats_are_asked_again_under_loss():
    """`switchsim stats` repeats its request: 20 queries of a switch that drops 40 % of what it receives
    and sends all succeed."""
    sw = SwitchProcess("--workers", 2, "--loss", 0.4, "--seed", 3)
    try:
        host, port = sw.address.rsplit(":", 1)
        for _ in range(20):
            assert "packets_in" in query_stats((host, int(port)), timeout=5)
    finally:
        sw.stop()


# ---------------------------------------------------------------- the agreed window


def raw_int32_worker(address, rank, world, window, n, k=256):
    """A worker written from docs/protocol.md alone (int32, no key): join asking `window`, then one call of
    n elements of rank + 1 mapped with the window join_ack agreed; returns (agreed window, the sum)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect(address)
    s.settimeout(0.1)
    nonce = 0x1234 + rank
    join = wire.pack_join(1, rank, nonce, world, window, elements=k)
    ack = None
    deadline = time.monotonic() + 20
    while ack is None and time.monotonic() < deadline:
        s.send(join)
        try:
            while True:
                d = s.recv(4096)
                h = wire.unpack(d)
                if h.msg_type == wire.MSG_JOIN_WAIT and h.packet_id == nonce:
                    join = wire.confirm_join(join, d)  # its cookie: the join counts once repeated with it
                    s.send(join)
                if h.msg_type == wire.MSG_JOIN_ACK and h.packet_id == nonce:
                    ack = (h, wire.JOIN_ACK_PAYLOAD.unpack_from(d, wire.HEADER_SIZE))
                    break
        except socket.timeout:
            continue
    h, (_, _, kk, W, first) = ack
    assert kk == k
    x = np.full(n, rank + 1, dtype=np.int32)
    out = np.zeros(n, dtype=np.int64)
    blocks = -(-n // k)
    for i in range(-(-blocks // W)):  # round i: packets q = i W + j on lane (slot) j, the slot's i-th use
        todo = {q: (q % W, first + i) for q in range(i * W, min(blocks, (i + 1) * W))}
        while todo:
            for q, (slot, pid) in todo.items():
                part = x[q * k:(q + 1) * k]
                s.send(wire.pack(wire.MSG_UPDATE, 1, rank, pid, slot, pid & 1, part.size, wire.CODEC_INT32, 0,
                                 wire.EXP_NONE, 0, part.astype(">i4").tobytes(), h.session, call_kind=1, call=0, call_len=n,
                                 boot=h.boot))
            try:
                while todo:
                    d = s.recv(65536)
                    r = wire.unpack(d)
                    q = next((q for q, v in todo.items() if v == (r.slot, r.packet_id)), None)
                    if r.msg_type == wire.MSG_RESULT and q is not None:
                        out[q * k:q * k + r.count] = np.frombuffer(d, ">i4", r.count, wire.HEADER_SIZE)
                        del todo[q]
            except socket.timeout:
                continue
    s.close()
    return W, out


@serve_on("python", "c")
@pytest.mark.parametrize("hostlib_window", [None, 1024])
def test_an_independent_worker_with_the_agreed_window_and_hostlib(switch_process, hostlib_window):
    """A doc-only worker asks window 512, hostlib its automatic window (992 here) or 1024: both map slots with
    the one join_ack agreed (the smallest ask: 512), over a call of many rounds, and the sum is exact on both."""
    sw = switch_process("--workers", 2, "--slots", 1024)
    host, port = sw.address.rsplit(":", 1)
    n = 256 * 1500  # 1500 packets: several rounds of any window
    got = {}

    def independent():
        got["raw"] = raw_int32_worker((host, int(port)), 1, 2, 512, n)

    t = threading.Thread(target=independent, daemon=True)
    t.start()
    with hostlib.connect(sw.address, 0, 2, codec="int32", timeout=20, window=hostlib_window) as comm:
        res = comm.allreduce(np.ones(n, np.int32))
        window = comm.window
    t.join(30)
    W, raw = got["raw"]
    assert W == window == min(512, hostlib_window or auto_window(AUTO_WINDOW_MAX, 256 * 4, 2))
    assert np.all(res == 3) and np.all(raw == 3)


# ---------------------------------------------------------------- forged joins and junk (issue 57)


def _worker_address(comm) -> tuple[str, int]:
    host, port = comm.sock.getsockname()[:2]
    return ("127.0.0.1" if host == "0.0.0.0" else host), port


@serve_on("python", "c")
def test_forged_rejoins_from_the_members_addresses_fail_no_call(switch_process):
    """Keyless: joins for every rank forged from each member's own address and port (a raw socket), sent
    twice 100 ms apart while the job runs, carry no session: no call fails, every result is exact."""
    sw = switch_process("--workers", 2)
    switch = parse_address(sw.address)
    x = np.arange(60_000, dtype=np.int32)
    comms = each_rank(lambda r: hostlib.connect(sw.address, r, 2, codec="int32", timeout=20))
    try:
        assert all(isinstance(c, hostlib.Communicator) for c in comms), comms
        assert all(np.array_equal(o, 2 * x) for o in each_rank(lambda r: comms[r].allreduce(x)))
        for _ in range(2):
            for r, c in enumerate(comms):
                spoof_udp(_worker_address(c), switch, wire.pack_join(1, r, 0xBAD0 + r, 2, 64))
            time.sleep(0.1)
        outs = each_rank(lambda r: [comms[r].allreduce(x) for _ in range(3)])
        assert all(not isinstance(o, Exception) for o in outs), outs
        assert all(np.array_equal(y, 2 * x) for o in outs for y in o)
        stats = query_stats(switch)
        assert stats["jobs"]["1"]["generation"] == 1 and stats["dropped"]["spoofed"] >= 4
    finally:
        for c in comms:
            if isinstance(c, hostlib.Communicator):
                c.close()


@serve_on("python", "c")
@pytest.mark.parametrize("elements", [32, 0])
def test_a_stray_join_sent_twice_refuses_no_live_joiner(switch_process, elements):
    """Rank 1 waits in the barrier; a stray join for rank 0 (its own address, another packet size or the
    same) comes twice, 100 ms apart: rank 1 is neither refused nor joined with the stray; when rank 0
    comes, both join and the call is exact."""
    sw = switch_process("--workers", 2)
    x = np.arange(10_000, dtype=np.int32)
    got = [None, None]

    def rank(r):
        try:
            with hostlib.connect(sw.address, r, 2, codec="int32", timeout=20) as c:
                got[r] = c.allreduce(x)
        except Exception as e:  # noqa: BLE001 - the test checks
            got[r] = e

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in (1, 0)]
    threads[0].start()
    time.sleep(0.5)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stray:
        for _ in range(2):
            stray.sendto(wire.pack_join(1, 0, 0x5757, 2, 64, elements=elements), parse_address(sw.address))
            time.sleep(0.1)
    time.sleep(0.5)
    threads[1].start()
    for t in threads:
        t.join(40)
    assert all(isinstance(g, np.ndarray) and np.array_equal(g, 2 * x) for g in got), got


@serve_on("python", "c")
@pytest.mark.parametrize("fast", LOOPS)
def test_junk_from_the_switchs_address_does_not_hide_a_stopped_switch(switch_process, fast):
    """SIGSTOP the switch, then forge datagrams from its address to every rank every 20 ms (junk, a
    heartbeat answer and a result of another session, a truncated header): only a packet of the current
    generation counts as hearing the switch, so the call still raises SwitchSilent within 5 s."""
    sw = switch_process("--workers", 2)
    switch = parse_address(sw.address)
    x = np.ones(200_000, np.int32)
    comms = each_rank(lambda r: hostlib.connect(sw.address, r, 2, codec="int32", timeout=30, fast=fast))
    stop = threading.Event()

    def forge():
        junk = [bytes(range(64)), wire.pack(wire.MSG_HEARTBEAT, job=1, rank=0, session=1),
                wire.pack(wire.MSG_RESULT, 1, 0, 0, 0, 0, 0, wire.CODEC_INT32, session=2), bytes(8)]
        for _ in range(1000):
            if stop.wait(0.02):
                return
            for c in comms:
                for j in junk:
                    spoof_udp(switch, _worker_address(c), j)

    try:
        assert all(isinstance(c, hostlib.Communicator) for c in comms), comms
        os.kill(sw.proc.pid, signal.SIGSTOP)
        forger = threading.Thread(target=forge, daemon=True)
        forger.start()

        seen = each_rank(lambda r: failed_call(comms[r], x))
        stop.set()
        forger.join(5)
        os.kill(sw.proc.pid, signal.SIGCONT)
        for s in seen:
            assert isinstance(s, tuple) and isinstance(s[0], errors.SwitchSilent), s
            assert s[1] < 5.0
        outs = each_rank(lambda r: comms[r].allreduce(x))
        assert all(np.array_equal(o, 2 * x) for o in outs), outs
    finally:
        stop.set()
        os.kill(sw.proc.pid, signal.SIGCONT)
        for c in comms:
            if isinstance(c, hostlib.Communicator):
                c.close()


@serve_on("c")
def test_waiting_loops_yield_a_few_times_then_sleep(switch_process):
    """The C loops yield before they sleep in poll (csrc/ina_wait.h), a bounded number of times:
    a switch with no traffic and a rank whose call waits on a stopped switch each use a small part of a core
    (a loop that yielded without end would use all of it: sched_yield returns at once on an idle core)."""
    sw = switch_process("--workers", 2)
    comms = each_rank(lambda r: hostlib.connect(sw.address, r, 2, codec="int32", timeout=30, fast=True))
    try:
        before = sum(cpu_seconds(sw.proc.pid))
        time.sleep(1.0)
        assert sum(cpu_seconds(sw.proc.pid)) - before < 0.2  # ~0.02: a poll of IDLE_MS and its yields, 100 times
        x = np.ones(200_000, np.int32)
        os.kill(sw.proc.pid, signal.SIGSTOP)

        def waiting(r):
            t0 = time.thread_time()
            e, took = failed_call(comms[r], x)
            return e, took, time.thread_time() - t0

        seen = each_rank(waiting)
        for e, took, cpu in seen:
            assert isinstance(e, errors.SwitchSilent), e
            assert cpu < 0.25 * took, (cpu, took)
    finally:
        os.kill(sw.proc.pid, signal.SIGCONT)
        for c in comms:
            if isinstance(c, hostlib.Communicator):
                c.close()
