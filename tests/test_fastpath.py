"""The worker loop in C (csrc/ina_worker.c) against the Python loop it replaces: the same packets, the
same results, the same errors; and the C loop's own recovery paths (loss, timeouts, switch errors, a switch
that is not there)."""
from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hyp

import hostlib
from hostlib import errors as ina_errors
from hostlib import fastpath, kernels, wire
from hostlib.codecs import get_codec
from hostlib.worker import Communicator
from switchsim.model import Switch
from switchsim.server import UDPServer

from .test_e2e import run_workers

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")
KERNEL_SOURCES = [os.path.join(CSRC, f) for f in ("ina_kernels.c", "ina_kernels_avx2.c", "ina_kernels_avx512.c")]


class RecordingSwitch(Switch):
    """The reference model, keeping every update it is sent ((rank, slot, packet id) -> copies), with the
    session and boot fields zeroed (each run joins a generation of its own, on a switch of its own)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.updates: dict[int, list[bytes]] = {}

    def process(self, data, src):
        data = bytes(data)
        try:
            h = wire.unpack(data)
            if h.msg_type in (wire.MSG_UPDATE, wire.MSG_SPARSE_UPDATE):
                assert h.boot == self.boot, "a worker echoes its join_ack's boot id"
                self.updates.setdefault((h.rank, h.slot, h.packet_id), []).append(_zeroed(data, "session", "boot"))
        except wire.WireError:
            pass
        return super().process(data, src)


def _zeroed(data: bytes, *fields) -> bytes:
    """data with these 4-byte header fields zeroed."""
    b = bytearray(data)
    for f in fields:
        off = wire.OFFSETS[f]
        b[off:off + 4] = bytes(4)
    return bytes(b)


@pytest.fixture
def recording_server():
    servers = []

    def start(world=1, **impairment):
        sw = RecordingSwitch({1: world}, first_packet_id=0)  # both runs: the same packet ids
        srv = UDPServer(sw, "127.0.0.1", 0, **impairment)
        th = srv.start_thread()
        servers.append((srv, th))
        return sw, "%s:%d" % srv.address

    yield start
    for srv, th in servers:
        srv.stop()
        th.join(5)
        srv.close()


def one_worker(address, x, fast, **kw):
    with hostlib.connect(address, 0, 1, job=1, fast=fast, **kw) as comm:
        out = comm.allreduce(x)
        return out, comm.stats


def unflagged(v: bytes) -> bytes:
    """An update without its FLAG_CONGESTED bit (the delay signal's echo: timing, not content)."""
    return v[:3] + bytes([v[3] & ~wire.FLAG_CONGESTED]) + v[4:]


CASES = [
    ("int32", {}, np.int32, 5000),
    ("int32", {}, np.int64, 777),
    ("fixed", {}, np.float32, 5000),
    ("fixed", {}, np.float32, 300),  # fewer blocks than the window: D < W
    ("nc", {"rounding": "stochastic"}, np.float32, 20000),
    ("nc", {"rounding": "deterministic"}, np.float32, 1500),
]


@pytest.mark.parametrize("codec,params,dtype,size", CASES,
                         ids=[f"{c}-{p.get('rounding', '')}-{np.dtype(d).name}-{s}" for c, p, d, s in CASES])
@pytest.mark.parametrize("cc", ["none", "aimd"])
def test_c_loop_sends_the_python_loops_packets(recording_server, codec, params, dtype, size, cc):
    """Bit for bit: every update packet (header and payload) and the decoded result, with SwitchML's fixed
    window and with the congestion window (whose FLAG_CONGESTED, the delay signal's echo, depends on timing:
    that bit alone is left out)."""
    rs = np.random.default_rng(size)
    if np.issubdtype(dtype, np.integer):
        x = rs.integers(-(2**30), 2**30, size).astype(dtype)
    else:
        x = (rs.standard_normal(size) * 10.0 ** rs.integers(-20, 3, size)).astype(dtype)
        x[::97] = 0
    assert fastpath.kind(get_codec(codec, **params), x) is not None
    runs = []
    for fast in (False, True):
        sw, address = recording_server()
        out, stats = one_worker(address, x, fast, codec=codec, window=16, elements_per_packet=128, seed=5,
                                cc=cc, **params)
        runs.append((out, stats, sw.updates))
    (out_py, st_py, up_py), (out_c, st_c, up_c) = runs
    assert out_c.dtype == out_py.dtype == x.dtype and np.array_equal(out_c, out_py)
    assert {q: unflagged(v[0]) for q, v in up_c.items()} == {q: unflagged(v[0]) for q, v in up_py.items()}
    # every copy of an update after its first is a counted retransmission (the stats' totals also hold the
    # joins, which a loaded machine repeats, JOIN_REPEAT, in one run and not the other)
    for up, st in ((up_c, st_c), (up_py, st_py)):
        assert sum(len(v) for v in up.values()) - len(up) <= st.retransmissions
        assert st.packets_sent - st.retransmissions >= len(up)


SPARSE_CASES = [("int32", {}, np.int32), ("int32", {}, np.int16), ("fixed", {}, np.float32),
                ("nc", {"rounding": "stochastic"}, np.float32)]


@pytest.mark.parametrize("codec,params,dtype", SPARSE_CASES,
                         ids=[f"{c}-{np.dtype(d).name}" for c, p, d in SPARSE_CASES])
def test_c_loop_sends_the_python_loops_block_sparse_packets(recording_server, codec, params, dtype):
    """allreduce(sparse=True) with three workers, each holding its own blocks: every sparse_update of every
    rank and the results are the same from both loops; then a dense call follows. (Byte counters are not
    compared: with three workers the join barrier's waits depend on timing.)"""
    n, k, size = 3, 64, 64 * 150 + 17
    rs = np.random.default_rng(11)
    xs = []
    for r in range(n):
        x = (rs.standard_normal(size) * 100).astype(dtype)
        x[~np.repeat(rs.random(150 + 1) < 0.15 * (r + 1), k)[:size]] = 0
        xs.append(x)
    runs = []
    for fast in (False, True):
        sw, address = recording_server(world=n)
        outs, errors, _ = run_workers(address, xs, codec, sparse=[True, True, False], fast=fast, window=16,
                                      elements_per_packet=k, seed=5, **params)
        assert errors == [None] * n
        runs.append((outs, sw.updates))
    (out_py, up_py), (out_c, up_c) = runs
    if fastpath.kind(get_codec(codec, **params), xs[0]) is None:
        pytest.fail(f"the C loop does not take {codec} on {np.dtype(dtype).name}")
    for a, b in zip(out_py, out_c):
        assert a.dtype == b.dtype == dtype and np.array_equal(a, b)
    assert {q: unflagged(v[0]) for q, v in up_c.items()} == {q: unflagged(v[0]) for q, v in up_py.items()}
    assert any(wire.unpack(v[0]).msg_type == wire.MSG_SPARSE_UPDATE for v in up_c.values())


def test_c_loop_rebuilds_retransmissions_bit_for_bit(recording_server):
    """Under loss the switch sees resends; each equals the first copy of its packet id."""
    sw, address = recording_server(loss=0.2, dup=0.1, reorder=0.1, seed=3)
    x = np.random.default_rng(0).standard_normal(30000).astype(np.float32)
    out, stats = one_worker(address, x, True, codec="nc", window=8, rto=0.005, timeout=20)
    assert stats.retransmissions > 0 and any(len(v) > 1 for v in sw.updates.values())
    for copies in sw.updates.values():
        assert all(c == copies[0] for c in copies)
    assert np.abs(out - x).max() <= np.abs(x).max()  # one worker: NC of x, within a factor of two


@pytest.mark.parametrize("n,loss", [(3, 0.05), (4, 0.1)])
def test_python_loop_still_exact_under_loss(switch_process, n, loss):
    """The fallback (fast=False) keeps its own exactness test now that the C loop is the default."""
    sw = switch_process("--workers", n, "--loss", loss, "--dup", loss, "--reorder", loss, "--seed", n)
    rs = np.random.default_rng(n)
    xs = [rs.integers(-(2**24), 2**24, 3000).astype(np.int32) for _ in range(n)]
    outs, errors, stats = run_workers(sw.address, xs, "int32", calls=2, elements_per_packet=64, window=16,
                                      timeout=30, fast=False)
    assert errors == [None] * n
    exact = np.sum(np.array(xs, dtype=np.int64), axis=0)
    assert all(np.array_equal(o, exact) for o in outs)
    assert sum(s.retransmissions for s in stats) > 0


@pytest.mark.parametrize("fast", [True, False])
def test_c_loop_reports_a_silent_peer_as_timeout(recording_server, fast):
    """Rank 1 joins and then never calls (its heartbeats keep it a member): rank 0's C loop gives up after
    `timeout` with the packet named, as the Python loop does; the next call re-joins, which rank 1 never does."""
    sw, address = recording_server(world=2)
    joined = threading.Event()
    errors = []

    def silent_peer():
        with hostlib.connect(address, 1, 2, job=1, codec="int32"):
            joined.wait(10)

    t = threading.Thread(target=silent_peer, daemon=True)
    t.start()
    try:
        with hostlib.connect(address, 0, 2, job=1, codec="int32", timeout=0.5, join_timeout=10, fast=fast) as comm:
            with pytest.raises(ina_errors.CallTimeout, match=r"no result for packet \d+ .*after \d+ retransmissions"):
                comm.allreduce(np.arange(1000, dtype=np.int32))
            comm._join_timeout = 0.5
            with pytest.raises(ina_errors.CallTimeout, match=r"ranks \[1\] did not join") as e:
                comm.allreduce(np.arange(10, dtype=np.int32))
            assert e.value.rank == 1
    except Exception as e:  # noqa: BLE001
        errors.append(e)
    finally:
        joined.set()
        t.join(10)
    assert not errors


def spy_errors(monkeypatch) -> list[bytes]:
    """Every datagram a loop hands to Communicator.error_from_datagram (the C loop: its raw copy)."""
    seen = []
    original = Communicator.error_from_datagram

    def spy(self, data):
        seen.append(bytes(data))
        return original(self, data)

    monkeypatch.setattr(Communicator, "error_from_datagram", spy)
    return seen


class FailingSwitch(Switch):
    """The model, failing job 1 at the `at`-th update it is sent: as its control plane does for an abort
    (fail: the error to every member, then to every packet of the generation), or by forgetting the
    generation as a switch that re-formed the job without these workers (admit of another session) or
    restarted (and a new boot id)."""

    def __init__(self, *a, at=20, how="abort", **kw):
        super().__init__(*a, **kw)
        self.at, self.how, self.updates = at, how, 0

    def process(self, data, src):
        try:
            h = wire.unpack(bytes(data))
        except wire.WireError:
            h = None
        out = []
        if h is not None and h.msg_type == wire.MSG_UPDATE:
            self.updates += 1
            if self.updates == self.at:
                job = self.jobs[1]
                if self.how == "abort":
                    out = self.fail(1, wire.ERR_ABORTED, 1, "rank 1 aborted its call: test")
                else:
                    if self.how == "restart":
                        self.set_boot(self.boot ^ 0x5A5A5A5A)
                    self.admit(1, job.generation + 1, job.session ^ 1, job.first_id, job.addresses)
        return out + super().process(data, src)


@pytest.fixture
def failing_server():
    servers = []

    def start(world, **kw):
        srv = UDPServer(FailingSwitch({1: world}, **kw), "127.0.0.1", 0)
        servers.append((srv, srv.start_thread()))
        return "%s:%d" % srv.address

    yield start
    for srv, th in servers:
        srv.stop()
        th.join(5)
        srv.close()


@pytest.mark.parametrize("fast", [True, False])
def test_c_loop_ends_a_failed_call_by_name(failing_server, monkeypatch, fast):
    """The switch fails the job mid-call (an abort naming rank 1): both ranks raise CallAborted naming rank 1
    with the switch's text, the C loop as the Python loop; what the C loop hands over is the error datagram
    of the generation; the next call re-joins and is exact."""
    seen = spy_errors(monkeypatch)
    address = failing_server(2, at=40)
    xs = [np.arange(20_000, dtype=np.int32) * (r + 1) for r in range(2)]
    outcome = [None, None]

    def call(comm, r, _):
        session = comm.session  # the generation that fails (the heartbeat thread may re-join right after)
        with pytest.raises(ina_errors.CallAborted) as e:
            comm.allreduce(xs[r])
        outcome[r] = (e.value.rank, str(e.value), session)
        return comm.allreduce(xs[r])

    outs, errs, _ = run_workers(address, xs, "int32", call=call, fast=fast, window=8, elements_per_packet=256,
                                timeout=10)
    assert errs == [None, None]
    assert all(np.array_equal(o, xs[0] + xs[1]) for o in outs)
    for rank, text, _ in outcome:
        assert rank == 1 and "rank 1 aborted its call: test" in text
    # the first rank to close at the end leaves while the other is still a member: its peer_dead is the
    # second generation's, and not this test's subject
    seen = [raw for raw in seen if wire.unpack_error(raw)[0] != wire.ERR_PEER_DEAD]
    assert len(seen) >= 2
    for raw in seen:
        h = wire.unpack(raw)
        assert h.msg_type == wire.MSG_ERROR and h.job == 1 and h.session in {o[2] for o in outcome}
        assert wire.unpack_error(raw) == (wire.ERR_ABORTED, 1, "rank 1 aborted its call: test")


@pytest.mark.parametrize("how,cls", [("re-formed", ina_errors.NotMember), ("restart", ina_errors.SwitchRestarted)])
@pytest.mark.parametrize("fast", [True, False])
def test_c_loop_stops_when_the_switch_forgot_the_generation(failing_server, monkeypatch, fast, how, cls):
    """The switch no longer has the worker's generation (re-formed without it, or restarted): the header-only
    error answering its packet ends the call at once (not after the 30 s timeout), by name."""
    seen = spy_errors(monkeypatch)
    address = failing_server(1, at=10, how=how)
    with hostlib.connect(address, 0, 1, job=1, timeout=30, fast=fast, window=8, elements_per_packet=256) as comm:
        start = time.monotonic()
        with pytest.raises(cls):
            comm.allreduce(np.arange(20_000, dtype=np.int32))
        assert time.monotonic() - start < 5
        session, boot = comm.session, comm.boot
    raw = seen[-1]
    h = wire.unpack(raw)
    assert len(raw) == wire.HEADER_SIZE and h.msg_type == wire.MSG_ERROR and h.flags & wire.FLAG_REPLY
    assert h.session == session and (h.boot != boot) == (how == "restart")


class MistakenSwitch(Switch):
    """The model, taking before the `at`-th and the next update a copy of it on a slot the job does not have,
    from the same address: as if the worker had sent that in the middle of its call (a bug of its own). The
    first copy is told (ERR_DROPPED, bad_slot) while the call runs, the second only counted (told once)."""

    def __init__(self, *a, at=10, **kw):
        super().__init__(*a, **kw)
        self.at, self.updates = at, 0

    def process(self, data, src):
        data, out = bytes(data), []
        if len(data) > 1 and data[1] == wire.MSG_UPDATE:
            self.updates += 1
            if self.updates in (self.at, self.at + 1):
                pool = wire.OFFSETS["pool"]
                bad = data[:pool] + (data[pool] & 0x80 | self.slots >> 8).to_bytes(1, "big")
                out = super().process(bad + bytes([self.slots & 0xFF]) + data[pool + 2:], src)
        return out + super().process(data, src)


@pytest.mark.parametrize("fast", [True, False])
def test_both_loops_count_a_told_drop(monkeypatch, fast):
    """A packet of this worker the switch drops for its mistake is told (ERR_DROPPED): both loops count it
    (stats.switch_drops) and keep its words (drop_notes), and the call goes on, exact; one told between calls
    (a protocol v2 packet from the communicator's socket) is counted when the next call starts."""
    calls = []
    monkeypatch.setattr(fastpath, "allreduce", lambda *a, _f=fastpath.allreduce, **kw: calls.append(1) or _f(*a, **kw))
    srv = UDPServer(MistakenSwitch({1: 1}, slots=64, first_packet_id=0), "127.0.0.1", 0)
    th = srv.start_thread()
    try:
        with hostlib.connect("%s:%d" % srv.address, 0, 1, job=1, fast=fast, window=8, elements_per_packet=256,
                             timeout=10) as comm:
            x = np.arange(20_000, dtype=np.int32)
            assert np.array_equal(comm.allreduce(x), x)
            assert comm.stats.switch_drops == 1 and bool(calls) == fast  # the C loop ran the call (fast)
            assert len(comm.drop_notes) == 1 and comm.drop_notes[0].startswith("bad_slot: ")
            mistake = wire.pack(wire.MSG_UPDATE, job=1, rank=0, count=16, codec=wire.CODEC_INT32, payload=bytes(64),
                                session=comm.session)
            comm._send(bytes([2]) + mistake[1:])  # a v2 packet, naming this rank: malformed, told
            time.sleep(0.2)
            assert np.array_equal(comm.allreduce(x), x)
            assert comm.stats.switch_drops == 2 and comm.drop_notes[-1].startswith("malformed: ")
            assert comm.stats.stale_results == 0
    finally:
        srv.stop()
        th.join(5)
        srv.close()
    dropped = srv.backend.stats()["dropped"]
    assert (dropped["bad_slot"], dropped["malformed"]) == (2, 1), dropped


@pytest.mark.parametrize("fast", [True, False])
def test_no_switch_listening_is_refused_fast(fast):
    """The switch's process is gone (its port answers ICMP port unreachable): the call raises
    SwitchUnreachable after about worker.REFUSED_AFTER, not the 30 s timeout; both loops."""
    assert kernels.lib.INA_WK_REFUSED_AFTER_MS == round(hostlib.worker.REFUSED_AFTER * 1000)
    srv = UDPServer(Switch({1: 1}), "127.0.0.1", 0)
    th = srv.start_thread()
    comm = hostlib.connect("%s:%d" % srv.address, 0, 1, job=1, timeout=30, fast=fast)
    try:
        x = np.arange(100_000, dtype=np.int32)
        assert np.array_equal(comm.allreduce(x), x)
        srv.stop()
        th.join(5)
        srv.close()
        start = time.monotonic()
        with pytest.raises(ina_errors.SwitchUnreachable, match="refused"):
            comm.allreduce(x)
        assert time.monotonic() - start < 5
    finally:
        comm.close()


def test_c_loop_raises_on_nan_and_overflow_like_the_python_loop(switch_process):
    sw = switch_process("--workers", 2)
    x = np.ones(3000, dtype=np.float32)
    y = x.copy()
    y[2500] = np.nan
    _, errors, _ = run_workers(sw.address, [x, y], "fixed", elements_per_packet=256)
    assert all(isinstance(e, ValueError) and "NaN or Inf" in str(e) for e in errors)
    big = np.full(600, 2**30, dtype=np.int32)
    _, errors, _ = run_workers(sw.address, [big, big], "int32", job=1)
    assert all(isinstance(e, OverflowError) for e in errors)


def test_block_exponents_kernel_matches_numpy(monkeypatch):
    rs = np.random.default_rng(2)
    x = (rs.uniform(-1, 1, 10000) * np.exp2(rs.integers(-149, 126, 10000))).astype(np.float32)
    x[:300] = 0
    x[1000] = np.inf
    x[2000] = np.nan
    x[3000:3003] = np.array([1e-45, 2**-126, 2**-127], dtype=np.float32)  # denormals and the smallest normal
    for k in (1, 7, 256, 10000, 20000):
        codec = get_codec("fixed")
        want = codec.flat_exponents(x.astype(np.float64), k)  # float64: the numpy path
        got, status = kernels.block_exponents(x, k)
        assert status == 0 and np.array_equal(got, want), k
    with pytest.raises(OverflowError):
        get_codec("fixed").flat_exponents(np.array([3e38], np.float32), 4)
    with pytest.raises(OverflowError, match="nc"):
        get_codec("nc").flat_exponents(np.array([2.0**64], np.float32), 4)


def test_fixed_dequantize_kernel_matches_codec_decode():
    rs = np.random.default_rng(4)
    sums = rs.integers(-(2**31), 2**31, 5000).astype(np.int32)
    exps = rs.integers(-127, 127, 5000 // 64 + 1).astype(np.int8)
    exps[3] = wire.EXP_NONE
    want = get_codec("fixed").decode(sums.astype(np.int64), exps, 3, 64).astype(np.float32)
    assert np.array_equal(kernels.fixed_dequantize(sums, exps, 3, 64), want)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")
def test_c_loop_under_address_sanitizer(tmp_path):
    """csrc/tests/worker_echo.c drives the C loop against a lossy, duplicating echo switch on a socketpair,
    built with -fsanitize=address,undefined: no report, every result right, every recovery path taken, every
    packet with the call's identity and boot id, the error rules of protocol v3 and a refused port."""
    exe = tmp_path / "worker_echo"
    subprocess.run(["gcc", "-std=gnu11", "-g", "-O1", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                    "-fno-omit-frame-pointer", "-I", CSRC, os.path.join(CSRC, "tests", "worker_echo.c"),
                    os.path.join(CSRC, "ina_worker.c"), os.path.join(CSRC, "ina_cc.c"), os.path.join(CSRC, "ina_shm.c"),
                    *KERNEL_SOURCES, "-lm",
                    "-lpthread",
                    "-o", str(exe)], check=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0"})
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-4000:]
    assert "runtime error" not in run.stderr and "ERROR" not in run.stderr, run.stderr[-4000:]
    # int32, fixed, nc, dense and block-sparse, under cc none and aimd; six error runs; a refused port
    assert run.stderr.count("-> ok") == 19 and "BAD" not in run.stderr, run.stderr[-4000:]


def test_allreduce_without_out_reuses_a_result_only_once_nobody_holds_it(recording_server):
    """allreduce(x) decodes into the last call's result array when the caller dropped it (no page faults),
    and never into one the caller still holds, directly or through a view or a tensor."""
    x = np.arange(4096, dtype=np.float32)
    _, address = recording_server()
    with hostlib.connect(address, 0, 1, codec="fixed") as comm:
        first = comm.allreduce(x)
        where = first.__array_interface__["data"][0]
        second = comm.allreduce(2 * x)
        assert second.__array_interface__["data"][0] != where  # first is held: a new array
        np.testing.assert_allclose(first, x, rtol=1e-6)
        view = second[::2]
        del second
        third = comm.allreduce(3 * x)
        np.testing.assert_allclose(view, 2 * x[::2], rtol=1e-6)  # a view keeps its memory
        del first, view
        fourth = comm.allreduce(4 * x)
        np.testing.assert_allclose(third, 3 * x, rtol=1e-6)
        np.testing.assert_allclose(fourth, 4 * x, rtol=1e-6)
        reused = fourth.__array_interface__["data"][0]
        del fourth
        fifth = comm.allreduce(5 * x)
        assert fifth.__array_interface__["data"][0] == reused  # dropped: its pages reused
        seen = set()
        for i in range(6):  # the user's loop: the last y is held during the next call, so two take turns
            fifth = comm.allreduce(i * x)
            np.testing.assert_allclose(fifth, i * x, rtol=1e-6)
            seen.add(fifth.__array_interface__["data"][0])
        assert len(seen) == 2


@settings(max_examples=300, deadline=None)
@given(window=hyp.integers(1, 300), first=hyp.integers(0, 299), total=hyp.integers(0, 2000),
       near_wrap=hyp.booleans(), seed=hyp.integers(0, 2 ** 32 - 1))
def test_a_dense_calls_slot_ids_move_on_as_its_packets_went_out(window, first, total, near_wrap, seed):
    """CallSlots.commit (slices per lane, no index arrays) against packet q going out on lane q mod W, one id
    per packet, ids wrapping mod 2^32; the next call starts on the slot after the last lane used."""
    from hostlib.streams import CallSlots

    first %= window
    rs = np.random.default_rng(seed)
    uses = (np.full(window, 2 ** 32 - 1, dtype=np.uint64) - rs.integers(0, 3, window) if near_wrap
            else rs.integers(0, 2 ** 32, window, dtype=np.uint64)).astype(np.uint32)
    expected = uses.astype(np.int64)
    for q in range(total):
        expected[(first + q) % window] += 1
    got, next_slot = CallSlots(first, uses).commit(total=total)
    assert got.dtype == np.uint32
    assert (got == (expected & wire.PACKET_ID_MASK)).all()
    assert next_slot == (first + total) % window
