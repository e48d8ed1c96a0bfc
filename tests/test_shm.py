"""The shared-memory transport (shm://NAME, csrc/ina_shm*.c, hostlib/shm.py): the same packets and results
as UDP, impairments and strangers handled as on UDP, and clear errors for every way a port cannot be had."""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import hostlib
from hostlib import errors as ina_errors
from inabench.harness import ROOT, SwitchProcess, cpu_seconds
from inaproto import wire
from switchsim import native

from .test_e2e import run_workers

pytestmark = pytest.mark.skipif(not native.available(), reason="the C core is not built")


def shm_switch(name, jobs=None, **kw):
    """A C core on shared-memory rings, served from a thread of this process; (server, thread)."""
    server = native.CShmServer(native.CoreSwitch(jobs or {1: 2}), name, **kw)
    return server, server.start_thread()


def stop(server, thread):
    server.stop()
    thread.join(10)
    server.close()


def inputs(codec, n, size=50_000, seed=0):
    rs = np.random.default_rng(seed)
    if codec == "int32":
        return [rs.integers(-1000, 1000, size).astype(np.int32) for _ in range(n)]
    return [rs.standard_normal(size).astype(np.float32) for _ in range(n)]


@pytest.mark.parametrize("codec", ["int32", "fixed", "nc"])
def test_shm_gives_the_udp_results_bit_for_bit(codec):
    """One input, a C switch on UDP and one on shared memory (serve processes): every rank gets the same
    bytes on both, and int32 is the exact sum."""
    xs = inputs(codec, 3)
    outs = {}
    for backend in ("c", "shm"):
        sw = SwitchProcess("--workers", 3, "--elements-per-packet", 2048, backend=backend)
        try:
            got, errors, _ = run_workers(sw.address, xs, codec, elements_per_packet=2048, seed=5, timeout=20)
        finally:
            sw.stop()
        assert errors == [None] * 3, errors
        outs[backend] = got
    assert sw.address.startswith("shm://")
    for r in range(3):
        assert outs["shm"][r].tobytes() == outs["c"][r].tobytes()
        assert outs["shm"][r].tobytes() == outs["shm"][0].tobytes()
    if codec == "int32":
        assert np.array_equal(outs["shm"][0], np.sum(xs, axis=0))


@pytest.mark.parametrize("fast", [None, False])
def test_shm_int32_exact_under_loss_duplication_reordering(fast):
    """The switch loop's impairments (loss, duplication, reordering both ways) on the rings: the C and the
    Python worker loop recover every loss and stay exact."""
    server, thread = shm_switch(f"imp-{os.getpid()}-{fast}", {1: 3}, loss=0.05, dup=0.05, reorder=0.05, seed=3)
    xs = inputs("int32", 3, size=20_000)
    try:
        outs, errors, stats = run_workers(f"shm://imp-{os.getpid()}-{fast}", xs, "int32", calls=2, window=32,
                                          timeout=30, rto=0.005, fast=fast)
    finally:
        stop(server, thread)
    assert errors == [None] * 3, errors
    for out in outs:
        assert np.array_equal(out, np.sum(xs, axis=0))
    assert sum(s.retransmissions for s in stats) > 0
    imp = server.stats()["impairment"]
    assert imp["rx"]["dropped"] > 0 and imp["tx"]["duplicated"] > 0 and imp["rx"]["reordered"] > 0


def test_shm_stranger_on_a_port_changes_no_sum():
    """A process that claims a port and writes garbage, truncated packets and updates forged with a member's
    rank: the switch drops and counts them; the job's sums stay exact."""
    name = f"stranger-{os.getpid()}"
    server, thread = shm_switch(name)
    xs = inputs("int32", 2, size=100_000)
    stranger = hostlib.shm.ShmSocket(name)
    done = threading.Event()

    def flood():
        rs = np.random.default_rng(1)
        forged = wire.pack(wire.MSG_UPDATE, job=1, rank=0, packet_id=0, slot=0, count=256,
                           codec=wire.CODEC_INT32) + bytes(1024)
        while not done.is_set():
            for data in (rs.bytes(int(rs.integers(1, 2000))), forged, forged[:30], b""):
                try:
                    stranger.send(data)
                except BlockingIOError:
                    pass
            time.sleep(0.0005)

    t = threading.Thread(target=flood, daemon=True)
    t.start()
    try:
        outs, errors, _ = run_workers(f"shm://{name}", xs, "int32", calls=3, timeout=30)
    finally:
        done.set()
        t.join(5)
        stranger.close()
        stop(server, thread)
    assert errors == [None] * 2, errors
    assert all(np.array_equal(o, xs[0] + xs[1]) for o in outs)
    s = server.stats()
    assert s["dropped"]["malformed"] > 0 and s["dropped"]["spoofed"] > 0 and s["bad_records"] == 0


def test_shm_ports_names_and_owners():
    """No switch, every port taken, a bad or live name: clear errors. A port whose owner died is taken over."""
    with pytest.raises(ConnectionRefusedError, match="no switch serves that name"):
        hostlib.shm.ShmSocket(f"nobody-{os.getpid()}")
    with pytest.raises(OSError, match="name must be"):
        hostlib.shm.ShmSocket("a/b")
    with pytest.raises(ValueError, match="shared-memory name"):
        native.CShmServer(native.CoreSwitch({1: 2}), "a b")
    name = f"ports-{os.getpid()}"
    server, thread = shm_switch(name, ports=1)
    try:
        with pytest.raises(OSError) as e:
            native.CShmServer(native.CoreSwitch({1: 2}), name)
        assert e.value.errno == errno.EADDRINUSE
        # a child claims the one port and dies without closing it: the port is free again for us
        code = f"import hostlib.shm, os; s = hostlib.shm.ShmSocket({name!r}); print(s.port, flush=True); os._exit(0)"
        child = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert child.stdout.strip() == "0", child.stderr
        first = hostlib.shm.ShmSocket(name)
        with pytest.raises(OSError) as e:
            hostlib.shm.ShmSocket(name)
        assert e.value.errno == errno.EBUSY and "every port" in str(e.value)
        first.close()
        hostlib.shm.ShmSocket(name).close()  # closing frees it
    finally:
        stop(server, thread)
    assert not os.path.exists(f"/dev/shm/ina-{name}")


def join_both(address, timeout=30, **connect):
    """Rank 0 on the C loop, rank 1 on the Python loop, joined (a barrier); by default a long timeout, so only
    the switch-gone check can end a call fast."""
    comms = [None, None]

    def join(r):
        comms[r] = hostlib.connect(address, r, 2, timeout=timeout, join_timeout=30, fast=None if r == 0 else False,
                                   **connect)

    ts = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert all(comms), "a rank did not join"
    return comms


def assert_refused_fast(comms):
    """Each rank's next allreduce raises SwitchUnreachable well before its 30 s timeout."""
    try:
        for c in comms:
            start = time.monotonic()
            with pytest.raises(ina_errors.SwitchUnreachable):
                c.allreduce(np.ones(100_000, np.int32))
            assert time.monotonic() - start < 5
    finally:
        for c in comms:
            c.close()


def test_shm_switch_stopped_is_refused_fast():
    """Workers joined, then the switch stops (it removes its segment; its process, this one, lives on): both
    loops raise SwitchUnreachable at once instead of waiting for the timeout, also when a new switch took the
    name meanwhile (another segment); ShmSocket.switch_gone says so."""
    name = f"gone-{os.getpid()}"
    server, thread = shm_switch(name)
    comms = join_both(f"shm://{name}")
    assert not comms[0].sock.switch_gone()
    stop(server, thread)
    time.sleep(0.15)  # switch_gone looks again every 100 ms
    assert comms[0].sock.switch_gone()  # the name is gone
    server, thread = shm_switch(name)
    try:
        assert comms[1].sock.switch_gone()  # the name is another segment's
        assert_refused_fast(comms)
    finally:
        stop(server, thread)


def test_shm_switch_killed_is_refused_fast():
    """The switch's process is killed (its segment stays, with its pid): both loops raise SwitchUnreachable
    at once."""
    sw = SwitchProcess("--workers", 2, backend="shm")
    name = sw.address[len("shm://"):]
    try:
        comms = join_both(sw.address)
        assert not comms[1].sock.switch_gone()
        sw.proc.kill()
        sw.proc.wait(10)
        assert os.path.exists(f"/dev/shm/ina-{name}")  # no clean-up: only the pid tells
        assert_refused_fast(comms)
    finally:
        sw.stop()
        if os.path.exists(f"/dev/shm/ina-{name}"):
            os.unlink(f"/dev/shm/ina-{name}")


def test_stats_through_a_port():
    """`switchsim stats shm://NAME`: the control plane answers a stats request that came through a port
    (a shared-memory port is on this host, a control host), with the ring loop's counters."""
    from switchsim.server import query_stats

    name = f"stats-{os.getpid()}"
    server, thread = shm_switch(name, {1: 3})
    try:
        stats = query_stats(f"shm://{name}", timeout=5, per_slot=True)
        r = subprocess.run([sys.executable, "-m", "switchsim", "stats", f"shm://{name}"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    finally:
        stop(server, thread)
    assert stats["jobs"]["1"]["world_size"] == 3 and stats["bad_records"] == 0 and "wakeups" in stats
    assert r.returncode == 0 and '"bad_records"' in r.stdout
    with pytest.raises(ConnectionRefusedError):
        query_stats(f"shm://{name}", timeout=1)


def test_serve_shm_needs_the_c_backend():
    r = subprocess.run([sys.executable, "-m", "switchsim", "serve", "--backend", "python", "--shm", "x"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--backend c" in r.stderr


def test_an_idle_shm_switch_and_a_waiting_rank_sleep():
    """The shared-memory waits yield a few times, then sleep on the futex (csrc/ina_wait.h): a switch process
    with no traffic, and a rank whose call waits on a stopped one until its timeout, use a small part of a core
    (a wait that yielded without end would use all of it: sched_yield returns at once on an idle core)."""
    sw = SwitchProcess("--workers", 2, backend="shm")
    comms = []
    try:
        comms = join_both(sw.address, timeout=2, codec="int32")  # rank 0's call: the C loop's wait
        before = sum(cpu_seconds(sw.proc.pid))
        time.sleep(1.0)
        assert sum(cpu_seconds(sw.proc.pid)) - before < 0.2
        os.kill(sw.proc.pid, signal.SIGSTOP)
        t0, cpu0 = time.monotonic(), time.thread_time()
        with pytest.raises(ina_errors.INAError):
            comms[0].allreduce(np.ones(100_000, np.int32))
        took, cpu = time.monotonic() - t0, time.thread_time() - cpu0
        assert cpu < 0.25 * took, (cpu, took)
    finally:
        os.kill(sw.proc.pid, signal.SIGCONT)
        for c in comms:
            c.close()
        sw.stop()
