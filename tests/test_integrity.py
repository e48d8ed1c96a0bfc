"""Collective integrity (protocol v3), end to end through `switchsim serve`: a call is exact on every rank or
raises on every rank, quickly and by name, and the next call is exact again.

Ranks run as threads (hostlib.connect) where nothing is killed, as processes (tests/scripts/ina_rank.py)
where a rank dies. Every switch and rank process is stopped by PID at the end, even on failure.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import hostlib
from hostlib import errors, wire
from inabench.harness import free_port

from .test_e2e import run_workers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANK_SCRIPT = os.path.join(ROOT, "tests", "scripts", "ina_rank.py")
LOOPS = [True, False]  # the C worker loop, the Python loop


def serve_on(*backends):
    """The tests' switch processes (conftest's switch_process) on these serve backends only: they kill and
    restart switches, which the DPDK namespace does not take."""
    return pytest.mark.parametrize("switch_process", backends, indirect=True)


@pytest.fixture
def procs():
    """Rank processes (ina_rank.py), killed by PID at the end."""
    started = []

    def start(address, rank, world, calls, *extra, env=None):
        p = subprocess.Popen([sys.executable, RANK_SCRIPT, address, str(rank), str(world), str(calls),
                              *map(str, extra)], cwd=ROOT, stdout=subprocess.PIPE,
                             env={**os.environ, **(env or {})})
        started.append(p)
        return p

    yield start
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(10)


_pending: dict[int, bytes] = {}


def lines(p, n, timeout=30.0) -> list[dict]:
    """The next n JSON lines a rank process prints (fewer if it is silent for `timeout`). Reads the pipe's
    descriptor itself: a buffered reader would hold lines that select() no longer sees."""
    fd, out = p.stdout.fileno(), []
    buf = _pending.pop(fd, b"")
    while len(out) < n:
        if b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            out.append(json.loads(line))
            continue
        ready, _, _ = select.select([fd], [], [], timeout)
        chunk = os.read(fd, 65536) if ready else b""
        if not chunk:
            break
        buf += chunk
    _pending[fd] = buf
    return out


def ranks(address, plans, codec="int32", **kw):
    """Rank r runs plans[r] (a list of inputs, one per call) in a thread (test_e2e.run_workers); returns per
    rank a list of ("ok", output, seconds) or (exception, seconds) per call."""

    def call(comm, r, i):
        if i >= len(plans[r]):
            return None  # a rank with fewer calls: it has left
        t = time.monotonic()
        try:
            return "ok", comm.allreduce(plans[r][i]), time.monotonic() - t
        except Exception as e:  # noqa: BLE001 - what each call raised is the result
            return e, time.monotonic() - t

    calls = list(range(max(map(len, plans))))
    outs, errs, _ = run_workers(address, [None] * len(plans), codec, sparse=calls, every_call=True, call=call,
                                timeout=20, **kw)
    assert errs == [None] * len(plans), errs
    return [[o for o in out if o is not None] for out in outs]


def assert_exact(result, expected):
    assert result[0] == "ok", result
    assert np.array_equal(result[1], expected)


@serve_on("python", "c")
@pytest.mark.parametrize("fast", LOOPS, ids=["c-loop", "py-loop"])
@pytest.mark.parametrize("codec", ["int32", "fixed", "nc"])
def test_lengths_that_differ_fail_every_rank_by_name_and_the_next_call_is_exact(switch_process, codec, fast):
    """The issue's case: rank 0 calls with 1M elements twice, rank 1 once with 2M. Both raise CallMismatch
    naming both lengths within 1 s; their next calls (the same length) are exact."""
    sw = switch_process("--workers", 2)
    dtype = np.int32 if codec == "int32" else np.float32
    small, big, ones = (np.ones(n, dtype) for n in (1 << 20, 2 << 20, 4096))
    res = ranks(sw.address, [[small, ones, ones], [big, ones]], codec=codec, fast=fast)
    for r in range(2):
        e, seconds = res[r][0]
        assert isinstance(e, errors.CallMismatch), e
        assert "1048576" in str(e) and "2097152" in str(e) and e.cause == "call_mismatch"
        assert seconds < 1.0 and e.rank in (0, 1) and e.switch == sw.address
    for r in range(2):
        assert res[r][1][0] == "ok" and np.allclose(res[r][1][1], 2, rtol=1e-3)  # exact for int32 and nc
    assert isinstance(res[0][2][0], errors.PeerDead)  # rank 0's third call: rank 1 left after its second
    report = json.loads(sw.stop())
    assert report["dropped"]["call_mismatch"] >= 1


@serve_on("python", "c")
def test_codecs_that_differ_are_named(switch_process):
    """int32 and fixed both send int32 elements: only the call identity tells them apart."""
    sw = switch_process("--workers", 2)
    res = [None, None]

    def work(r, codec, x):
        with hostlib.connect(sw.address, r, 2, codec=codec, timeout=20) as comm:
            try:
                comm.allreduce(x)
            except errors.CallMismatch as e:
                res[r] = e

    ts = [threading.Thread(target=work, args=(0, "int32", np.ones(1000, np.int32))),
          threading.Thread(target=work, args=(1, "fixed", np.ones(1000, np.float32)))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert all(isinstance(e, errors.CallMismatch) for e in res), res
    assert "codec int32" in str(res[0]) and "codec fixed" in str(res[0])


LOCAL_ERRORS = {
    "overflow": (np.full(100, 2**31, np.int64), OverflowError),
    "dtype": (np.ones(100, np.float32), TypeError),
}


@serve_on("python", "c")
@pytest.mark.parametrize("fast", LOOPS, ids=["c-loop", "py-loop"])
@pytest.mark.parametrize("case", sorted(LOCAL_ERRORS))
def test_a_local_error_is_agreed_and_the_next_call_is_exact(switch_process, case, fast):
    """Rank 0's call fails on its own input before anything is sent: it raises its own error, rank 1 raises
    CallAborted naming rank 0 and the reason within 1 s, and the next call on both is exact."""
    sw = switch_process("--workers", 2)
    bad, exc = LOCAL_ERRORS[case]
    x = np.arange(1000, dtype=np.int32)
    res = ranks(sw.address, [[x, bad, x], [x, x, x]], fast=fast)
    assert isinstance(res[0][1][0], exc)
    e, seconds = res[1][1]
    assert isinstance(e, errors.CallAborted) and e.rank == 0 and seconds < 1.0
    assert exc.__name__ in str(e) and "rank 0 aborted call 1" in str(e)
    for r in range(2):
        assert_exact(res[r][0], 2 * x)
        assert_exact(res[r][2], 2 * x)


@serve_on("python", "c")
def test_an_empty_call_on_one_rank_only_is_a_mismatch(switch_process):
    sw = switch_process("--workers", 2)
    x = np.arange(10, dtype=np.int32)
    res = ranks(sw.address, [[np.zeros(0, np.int32), x], [x, x]])
    for r in range(2):
        assert isinstance(res[r][0][0], errors.CallMismatch) and "0 elements" in str(res[r][0][0])
        assert_exact(res[r][1], 2 * x)
    both = ranks(sw.address, [[np.zeros(0, np.int32)], [np.zeros(0, np.int32)]])
    assert all(b[0][0] == "ok" and b[0][1].size == 0 for b in both)


@serve_on("python", "c")
def test_nan_is_agreed_and_the_next_call_is_exact(switch_process):
    sw = switch_process("--workers", 2)
    x = np.ones(1000, np.float32)
    nan = x.copy()
    nan[7] = np.nan
    res = ranks(sw.address, [[nan, x], [x, x]], codec="fixed")
    assert all(isinstance(r[0][0], ValueError) and not isinstance(r[0][0], hostlib.INAError) for r in res)
    assert all(r[1][0] == "ok" for r in res)


@serve_on("python", "c")
@pytest.mark.parametrize("fast", LOOPS, ids=["c-loop", "py-loop"])
def test_a_killed_switch_is_named_within_a_second(switch_process, fast):
    sw = switch_process("--workers", 1)
    with hostlib.connect(sw.address, 0, 1, codec="int32", timeout=30, fast=fast) as comm:
        assert comm.allreduce(np.ones(10, np.int32))[0] == 1
        os.kill(sw.proc.pid, signal.SIGKILL)
        sw.proc.wait(10)
        t = time.monotonic()
        with pytest.raises(errors.SwitchUnreachable) as info:
            comm.allreduce(np.ones(100000, np.int32))
        assert time.monotonic() - t < 1.0
        assert sw.address in str(info.value) and info.value.switch == sw.address


@serve_on("python", "c")
@pytest.mark.parametrize("fast", LOOPS, ids=["c-loop", "py-loop"])
def test_a_restarted_switch_is_recognised_and_the_job_rejoins(switch_process, fast):
    """Killed and started again on the same port: the old generation's packets get the new switch's
    not-member answer with another boot id: SwitchRestarted within 2 s; the next call re-joins and is exact."""
    port = free_port()
    sw = switch_process("--workers", 2, "--port", port)
    out = [None, None]
    barrier = threading.Barrier(2)

    def work(r):
        res = []
        with hostlib.connect(sw.address, r, 2, codec="int32", timeout=30, fast=fast) as comm:
            res.append(comm.allreduce(np.ones(1000, np.int32))[0])
            barrier.wait()
            if r == 0:
                os.kill(sw.proc.pid, signal.SIGKILL)
                sw.proc.wait(10)
                switch_process("--workers", 2, "--port", port)
            barrier.wait()
            t = time.monotonic()
            try:
                comm.allreduce(np.ones(1000, np.int32))
            except hostlib.INAError as e:
                res.append((e, time.monotonic() - t))
            res.append(comm.allreduce(np.ones(1000, np.int32))[0])
        out[r] = res

    ts = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(90)
    for res in out:
        assert res is not None and res[0] == 2
        e, seconds = res[1]
        assert isinstance(e, errors.SwitchRestarted) and seconds < 2.0, (e, seconds)
        assert res[2] == 2


@serve_on("python", "c")
def test_a_dead_peer_is_named_and_a_busy_one_is_not(switch_process, procs):
    """Rank 1 in its own process: alive but idle for twice the switch's silence limit, it causes no error
    (heartbeats); SIGKILLed, rank 0's next call raises PeerDead naming rank 1 within 5 s."""
    sw = switch_process("--workers", 2)
    peer = procs(sw.address, 1, 2, 2)
    with hostlib.connect(sw.address, 0, 2, codec="int32", timeout=60) as comm:
        assert comm.allreduce(np.ones(1000, np.int32))[0] == 2
        time.sleep(6.5)  # the peer computes between calls
        assert comm.allreduce(np.ones(1000, np.int32))[0] == 2
        assert [x.get("ok") for x in lines(peer, 3)] == [None, 2, 2]
        peer.kill()
        peer.wait(10)
        t = time.monotonic()
        with pytest.raises(errors.PeerDead) as info:
            comm.allreduce(np.ones(1000, np.int32))
        assert time.monotonic() - t < 5.0
        assert info.value.rank == 1 and "rank 1" in str(info.value)


@serve_on("python", "c")
def test_a_job_reforms_while_a_member_of_the_old_one_lingers(switch_process, procs):
    """A crashed job: rank 0 killed, rank 1 lingering in a call that cannot complete (retransmitting). The
    job started again from two new processes forms, and its calls are exact; the lingering rank is told."""
    sw = switch_process("--workers", 2)
    old0 = procs(sw.address, 0, 2, 1)
    old1 = procs(sw.address, 1, 2, 1, 1000, 60, env={"LINGER_CALL": "1"})
    assert lines(old0, 2)[-1] == {"call": 0, "ok": 2} and lines(old1, 2)[-1] == {"call": 0, "ok": 2}
    old0.kill()
    old0.wait(10)
    new = [procs(sw.address, r, 2, 2) for r in range(2)]
    for p in new:
        got = lines(p, 3, timeout=20)
        assert [x.get("ok") for x in got[1:]] == [2, 2], got
    lingering = lines(old1, 1, timeout=10)
    assert lingering and lingering[0]["error"] in ("peer_dead", "not_member"), lingering
    report = json.loads(sw.stop())
    assert report["jobs"]["1"]["generation"] >= 2


@serve_on("python", "c")
def test_a_strangers_join_before_the_job_names_the_holder_at_once(switch_process):
    """A keyless stranger keeps claiming rank 0 before the job starts: the honest rank 0 gets RankTaken at
    once (not a timeout), naming the rank and advising --key-file, never the holder's address (a stranger
    learns no member's address from the switch)."""
    sw = switch_process("--workers", 2)
    host, port = sw.address.rsplit(":", 1)
    stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    stop = threading.Event()

    def claim():  # a live process: it reads the join_wait and repeats its join with the cookie
        join = wire.pack_join(1, 0, 12345, 2, 8)
        stranger.settimeout(0.05)
        while not stop.is_set():
            stranger.sendto(join, (host, int(port)))
            try:
                wait = stranger.recv(2048)
                join = wire.confirm_join(join, wait) if wait[1] == wire.MSG_JOIN_WAIT else join
            except OSError:
                pass
            stop.wait(0.05)

    t = threading.Thread(target=claim, daemon=True)
    t.start()
    try:
        time.sleep(0.3)
        start = time.monotonic()
        with pytest.raises(errors.RankTaken) as info:
            hostlib.connect(sw.address, 0, 2, codec="int32", timeout=20)
        assert time.monotonic() - start < 2.0
        assert "rank 0" in str(info.value) and "--key-file" in str(info.value)
        assert str(stranger.getsockname()[1]) not in str(info.value)
    finally:
        stop.set()
        t.join(5)
        stranger.close()


@serve_on("python", "c")
def test_packet_sizes_are_agreed_at_the_join(switch_process):
    """Ranks asking for different packet sizes are refused at the join, both at once and by name (not a
    generation that hangs on `mismatch`); the same size is granted and enforced: a larger packet is dropped."""
    sw = switch_process("--workers", 2)
    box = [None, None]

    def join(r, k):
        try:
            box[r] = hostlib.connect(sw.address, r, 2, codec="int32", elements_per_packet=k, timeout=10)
        except hostlib.INAError as e:
            box[r] = e

    t0 = time.monotonic()
    ts = [threading.Thread(target=join, args=(r, k)) for r, k in ((0, 64), (1, 128))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert time.monotonic() - t0 < 3
    for e in box:
        assert isinstance(e, errors.JoinRejected), e
        assert "different packet sizes" in str(e) and "128" in str(e) and "64" in str(e)
    ts = [threading.Thread(target=join, args=(r, 100)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    try:
        assert [c.k for c in box] == [100, 100]
        gen = box[0].gen
        big = wire.pack(wire.MSG_UPDATE, 1, 0, gen.first_id, 0, 0, 101, wire.CODEC_INT32, 0, wire.EXP_NONE, 0,
                        bytes(404), gen.session, 0, 0, 0, gen.boot)
        box[0].sock.send(big)
        x = np.arange(1000, dtype=np.int32)
        res = ranks_on(box, [x, x])
        assert all(np.array_equal(r, 2 * x) for r in res)
    finally:
        for c in box:
            c.close()
    assert json.loads(sw.stop())["dropped"]["bad_slot"] == 1


def ranks_on(comms, xs):
    """One allreduce on each of these communicators, in threads; their outputs."""
    out = [None] * len(comms)

    def work(r):
        out[r] = comms[r].allreduce(xs[r])

    ts = [threading.Thread(target=work, args=(r,)) for r in range(len(comms))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    return out
