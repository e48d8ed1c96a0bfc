"""End to end over UDP on loopback: `switchsim serve` in a child process, workers as threads."""
from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

import hostlib
from hostlib.codecs import fixed, natural


def run_workers(address, xs, codec, job=1, calls=1, sparse=False, every_call=False, call=None, **kw):
    """Each rank allreduces its tensor `calls` times (or once per flag if sparse is a list of
    allreduce(sparse=...) flags), or runs call(comm, rank, flag) instead; returns (outputs of the last call,
    or with every_call each rank's list of every call's output, errors, stats)."""
    n = len(xs)
    outs, errors, stats = [[] if every_call else None for _ in range(n)], [None] * n, [None] * n
    flags = sparse if isinstance(sparse, list) else [sparse] * calls

    def work(r):
        try:
            with hostlib.connect(address, r, n, job=job, codec=codec, **kw) as comm:
                for flag in flags:
                    out = call(comm, r, flag) if call else comm.allreduce(xs[r], sparse=flag)
                    if every_call:
                        outs[r].append(out)
                    else:
                        outs[r] = out
                stats[r] = comm.stats
        except Exception as e:  # noqa: BLE001 - reported to the test
            errors[r] = e

    threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    return outs, errors, stats


LOSSY = [(n, loss) for n in (2, 3, 5, 8) for loss in (0.0, 0.01, 0.05, 0.10)]


@pytest.mark.parametrize("n,loss", LOSSY, ids=[f"{n}w-loss{int(p * 100)}" for n, p in LOSSY])
def test_int32_exact_under_loss_duplication_reordering(switch_process, n, loss):
    sw = switch_process("--workers", n, "--loss", loss, "--dup", loss, "--reorder", loss, "--seed", n)
    rs = np.random.default_rng(n)
    xs = [rs.integers(-(2**24), 2**24, 3000).astype(np.int32) for _ in range(n)]
    outs, errors, stats = run_workers(sw.address, xs, "int32", calls=2, elements_per_packet=64, window=16,
                                      timeout=30)
    assert errors == [None] * n
    exact = np.sum(np.array(xs, dtype=np.int64), axis=0)
    for o in outs:
        assert o.dtype == np.int32 and np.array_equal(o, exact)
    report = json.loads(sw.stop())
    per_slot = report["jobs"]["1"]["per_slot"]
    assert sum(per_slot["multicast"]) == report["jobs"]["1"]["multicast"] >= 2 * (3000 // 64)
    if loss:
        check_impaired(report, stats)


def check_impaired(report, stats):
    """The run met losses (and recovered by retransmission) and duplicates, counted over both directions:
    at 1 % a single direction may see no duplicate in a short run."""
    assert sum(s.retransmissions for s in stats) > 0
    imp = report["impairment"]
    assert imp["rx"]["dropped"] + imp["tx"]["dropped"] > 0
    assert imp["rx"]["duplicated"] + imp["tx"]["duplicated"] > 0


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "block-sparse"])
def test_fixed_point_within_proven_bound_under_loss(switch_process, sparse):
    """Block-sparse: each worker keeps a fifth of its blocks; the agreed exponents, hence the bound, are the
    dense path's, and blocks zero everywhere come back exactly zero."""
    n, k, size = 4, 128, 20000
    sw = switch_process("--workers", n, "--loss", 0.05, "--reorder", 0.05)
    rs = np.random.default_rng(1)
    xs = [(rs.standard_normal(size) * 10.0 ** rs.integers(-3, 3, size)).astype(np.float32) for _ in range(n)]
    if sparse:
        xs = [np.where(np.repeat(rs.random(-(-size // k)) < 0.2, k)[:size], x, 0).astype(np.float32) for x in xs]
    outs, errors, _ = run_workers(sw.address, xs, "fixed", sparse=sparse, elements_per_packet=k, window=16,
                                  timeout=30)
    assert errors == [None] * n
    exact = np.sum(np.array(xs, dtype=np.float64), axis=0)
    bound = fixed.allreduce_error_bound(xs, k, exact)
    for o in outs:
        assert o.dtype == np.float32 and np.all(np.abs(o - exact) <= bound)
        assert np.array_equal(o, outs[0])
    assert np.all(outs[0][exact == 0] == 0)


def test_nc_over_udp_is_unbiased_with_the_predicted_error(switch_process):
    n = 3
    sw = switch_process("--workers", n)
    rs = np.random.default_rng(2)
    xs = [rs.standard_normal(50000).astype(np.float32) for _ in range(n)]
    outs, errors, stats = run_workers(sw.address, xs, "nc", window=16, timeout=30)
    assert errors == [None] * n
    exact = np.sum(np.array(xs, dtype=np.float64), axis=0)
    err = outs[0].astype(np.float64) - exact
    expected = natural.allreduce_expected_sq_error(xs, exact)
    assert float(err @ err) <= 1.2 * expected
    assert abs(err.mean()) < 5 * np.sqrt(expected / exact.size / exact.size)  # unbiased
    assert all(np.array_equal(o, outs[0]) for o in outs)
    # 8-bit codes both ways: about a quarter of float32's bytes
    assert stats[0].bytes_sent < 0.3 * 4 * xs[0].size


@pytest.mark.parametrize("fast", [None, False], ids=["c-loop", "python-loop"])
def test_nc_of_values_below_the_lowest_level_completes_within_its_bound(switch_process, fast):
    """Gradients of 1e-20 (below 2^-63, NC's lowest level): each rounds to 0 or +-2^-63, and the call
    completes on every rank (their packets were dropped as bad codes, and the call timed out), next to a
    block of ordinary values, an all-zero block and a block that is tiny on one rank only."""
    n, k = 3, 1024
    sw = switch_process("--workers", n)
    rs = np.random.default_rng(5)
    xs = []
    for r in range(n):
        x = np.zeros(4 * k, np.float32)
        x[:k] = rs.standard_normal(k) * 2.0**-66
        x[2 * k:3 * k] = rs.standard_normal(k)
        x[3 * k:] = rs.standard_normal(k) * (2.0**-67 if r == 0 else 1.0)
        xs.append(x)
    outs, errors, _ = run_workers(sw.address, xs, "nc", timeout=5, fast=fast)
    assert errors == [None] * n
    assert all(np.array_equal(o, outs[0]) for o in outs)
    exact = np.sum(np.array(xs, dtype=np.float64), axis=0)
    err = np.abs(outs[0].astype(np.float64) - exact)
    assert np.all(outs[0][k:2 * k] == 0)
    # each code errs by less than its value or 2^-63, the switch's rounding of the sum by less than the sum
    assert np.all(err[:k] <= 2 * n * 2.0**-63)
    bound = 3 * np.sum(np.abs(np.array(xs, dtype=np.float64)), axis=0) + 2 * n * 2.0**-63
    assert np.all(err <= bound)
    assert np.count_nonzero(outs[0][:k]) > 0  # not all flushed to zero: unbiased rounding at the lowest level


@pytest.mark.parametrize("switch_process", ["python", "c"], indirect=True)  # DPDK's veth: 1500-byte MTU
@pytest.mark.parametrize("codec,elements,payload,window", [
    ("nc", 1024, 1024, 512),  # 993 packets of 1 KiB fit 1 MiB: the switch's 512 slots bind
    ("nc", 8192, 8192, 127),
    ("int32", 256, 1024, 512),
    ("fixed", 2048, 8192, 127),
])
def test_the_default_window_bounds_bytes_in_flight(switch_process, codec, elements, payload, window):
    """The window connect picks holds at most 1 MiB of packets, no more than half the switch's socket buffer over
    the job's workers, and no more than the switch grants (serve: 512 slots)."""
    from hostlib.window import IN_FLIGHT_BYTES, NETWORK_WINDOW, auto_window

    asked = auto_window(1024, payload, 4)
    assert asked == min(1024, IN_FLIGHT_BYTES // (hostlib.wire.HEADER_SIZE + payload))
    assert min(asked, 512) == window
    assert auto_window(1024, 1024, 64) == 4 * 1024 * 1024 // 64 // (hostlib.wire.HEADER_SIZE + 1024)
    assert auto_window(1024, 65000, 64) == 4  # never fewer than 4 packets
    assert auto_window(1024, 1024, 4, network=True) == NETWORK_WINDOW
    sw = switch_process("--workers", 1, "--elements-per-packet", max(elements, 1024))
    with hostlib.connect(sw.address, 0, 1, codec=codec, elements_per_packet=elements, timeout=20) as comm:
        assert comm.window == window
        x = np.arange(3 * window * elements // 2, dtype=np.int32 if codec == "int32" else np.float32)
        out = comm.allreduce(x)  # more packets than the window: slots are reused
        if codec == "nc":
            assert np.all(np.abs(out - x) <= np.abs(x))  # within one power of two
        else:
            assert np.allclose(out, x, rtol=1e-6, atol=1e-3)


def test_two_jobs_share_one_switch(switch_process):
    sw = switch_process("--job", "1:2", "--job", "7:3", "--loss", 0.02)
    rs = np.random.default_rng(3)
    a = [rs.integers(-1000, 1000, 5000) for _ in range(2)]
    b = [rs.integers(-1000, 1000, 7000) for _ in range(3)]
    res = {}
    ta = threading.Thread(target=lambda: res.setdefault("a", run_workers(sw.address, a, "int32", job=1, window=8)))
    tb = threading.Thread(target=lambda: res.setdefault("b", run_workers(sw.address, b, "int32", job=7, window=8)))
    ta.start(), tb.start(), ta.join(120), tb.join(120)
    assert res["a"][1] == [None] * 2 and res["b"][1] == [None] * 3
    assert all(np.array_equal(o, np.sum(a, axis=0)) for o in res["a"][0])
    assert all(np.array_equal(o, np.sum(b, axis=0)) for o in res["b"][0])


def test_control_replies_keep_their_payload_in_one_batch_with_impairment_on(switch_process):
    """Regression: with an impairment active, the C loop queued a control reply's payload by pointer into the
    core's scratch buffer, so a JOIN_WAIT for job 7 in the same receive batch overwrote job 1's JOIN_ACK.
    (Since protocol v2 the control plane answers joins, punted out of the batch.) The switch is paused
    (SIGSTOP) while the joins arrive, so they land in one batch."""
    import os
    import signal
    import socket

    from hostlib import wire

    sw = switch_process("--job", "1:2", "--job", "7:2", "--slots", 300, "--dup", 1e-9)
    host, port = sw.address.rsplit(":", 1)
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(3)]
    try:
        for s in socks:
            s.settimeout(5)
        os.kill(sw.proc.pid, signal.SIGSTOP)
        try:
            for s, (job, rank) in zip(socks, [(1, 0), (1, 1), (7, 0)]):
                s.sendto(wire.pack_join(job, rank, rank + 1, 2, 64), (host, int(port)))
            time.sleep(0.2)
        finally:
            os.kill(sw.proc.pid, signal.SIGCONT)
        for s in socks[:2]:  # confirm with the join_wait's cookie (the switch counts the join then), as workers do
            wait = s.recv(2048)
            assert wire.unpack(wait).msg_type == wire.MSG_JOIN_WAIT
            join = wire.pack_join(1, socks.index(s), socks.index(s) + 1, 2, 64)
            s.sendto(wire.confirm_join(join, wait), (host, int(port)))
        for s in socks[:2]:
            data = s.recv(2048)
            while wire.unpack(data).msg_type == wire.MSG_JOIN_WAIT:  # the waits come first
                data = s.recv(2048)
            h = wire.unpack(data)
            assert (h.msg_type, h.job) == (wire.MSG_JOIN_ACK, 1)
            _, slots, max_elements, window, _ = wire.JOIN_ACK_PAYLOAD.unpack_from(data, wire.HEADER_SIZE)
            assert (slots, max_elements, window) == (300, 1024, 64)
        h = wire.unpack(socks[2].recv(2048))
        assert (h.msg_type, h.job) == (wire.MSG_JOIN_WAIT, 7)
    finally:
        for s in socks:
            s.close()


def test_missing_peer_at_join_times_out_clearly(switch_process):
    sw = switch_process("--workers", 3)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1, 2\] did not join"):
        hostlib.connect(sw.address, 0, 3, timeout=1.0)
    assert time.monotonic() - t0 < 5


def test_a_peer_that_left_is_named_at_once(switch_process):
    """Rank 1 joins and closes its communicator (leaves) without sending data: rank 0's call raises PeerDead
    naming rank 1 at once, not a timeout; its next call re-joins, and is told at once that rank 1 left and has
    not joined again (not a join that waits for it)."""
    sw = switch_process("--workers", 2)
    box = {}

    def doomed():
        box["c1"] = hostlib.connect(sw.address, 1, 2, timeout=5)

    t = threading.Thread(target=doomed)
    t.start()
    c0 = hostlib.connect(sw.address, 0, 2, timeout=1.0)
    t.join()
    box["c1"].close()
    t0 = time.monotonic()
    with pytest.raises(hostlib.PeerDead, match="rank 1 left the job") as info:
        c0.allreduce(np.arange(1000))
    assert time.monotonic() - t0 < 1 and info.value.rank == 1
    t0 = time.monotonic()
    with pytest.raises(hostlib.PeerDead, match="rank 1 left the job .* has not joined again") as info:
        c0.allreduce(np.arange(10))
    assert time.monotonic() - t0 < 1 and info.value.rank == 1
    c0.close()


def test_unreachable_switch_and_rejected_joins(switch_process):
    t0 = time.monotonic()
    with pytest.raises(hostlib.errors.SwitchUnreachable, match="no switch at 127.0.0.1:9"):
        hostlib.connect("127.0.0.1:9", 0, 1, timeout=5)
    assert time.monotonic() - t0 < 1.5
    sw = switch_process("--workers", 2)
    with pytest.raises(hostlib.INAError, match="unknown job 5"):
        hostlib.connect(sw.address, 0, 2, job=5, timeout=2)
    with pytest.raises(hostlib.INAError, match="has 2 workers, not 3"):
        hostlib.connect(sw.address, 0, 3, timeout=2)


def test_nan_and_overflow_raise_on_every_worker(switch_process):
    sw = switch_process("--workers", 2)
    xs = [np.ones(3000, np.float32), np.ones(3000, np.float32)]
    xs[1][1234] = np.nan
    _, errors, _ = run_workers(sw.address, xs, "fixed", timeout=10)
    assert all(isinstance(e, ValueError) and "NaN" in str(e) for e in errors)
    big = [np.full(100, 2**31 - 1, np.int64)] * 2
    _, errors, _ = run_workers(sw.address, big, "int32", timeout=10)
    assert all(isinstance(e, OverflowError) for e in errors)


def test_shapes_dtypes_and_torch_tensors(switch_process):
    sw = switch_process("--workers", 2)
    xs = [np.arange(24, dtype=np.float64).reshape(2, 3, 4) * (r + 1) for r in range(2)]
    outs, errors, _ = run_workers(sw.address, xs, "fixed")
    assert errors == [None, None]
    assert outs[0].shape == (2, 3, 4) and outs[0].dtype == np.float64
    np.testing.assert_allclose(outs[0], xs[0] * 3, atol=1e-6)
    torch = pytest.importorskip("torch", reason="torch is an optional extra (pip install '.[torch]')")
    ts = [torch.arange(10, dtype=torch.int32) * (r + 1) for r in range(2)]
    outs, errors, _ = run_workers(sw.address, ts, "int32")
    assert errors == [None, None] and isinstance(outs[0], torch.Tensor) and outs[0].dtype == torch.int32
    assert torch.equal(outs[0], torch.arange(10, dtype=torch.int32) * 3)


def _with_out(address, xs, codec, mode, fast):
    """Each rank allreduces once into a fresh out (mode "out"), into its input ("in place"), into a
    non-contiguous view ("strided", copied into at the end) or a torch tensor ("torch"), or through
    a persistent call (allreduce_init: the torch backend's inline path); returns the outs."""
    torch = pytest.importorskip("torch", reason="torch is an optional extra") if mode == "torch" else None

    def call(comm, r, _):
        x = xs[r].copy()
        if mode == "in place":
            out = x
        elif mode == "strided":
            out = np.zeros(2 * x.size, x.dtype)[::2]
        elif mode == "torch":
            x, out = torch.from_numpy(x), torch.zeros(x.size, dtype=torch.from_numpy(x[:0]).dtype)
        elif mode == "allreduce_init":
            assert comm.allreduce_init(x)() is x
            return x
        else:
            out = np.full_like(x, 7)
        got = comm.allreduce(x, out=out)
        assert got is out
        return out.numpy() if mode == "torch" else np.array(out)

    outs, errors, _ = run_workers(address, xs, codec, call=call, seed=3, fast=fast, timeout=20)
    assert errors == [None] * len(xs), errors
    return outs


@pytest.mark.parametrize("fast", [None, False], ids=["c-loop", "python-loop"])
def test_allreduce_into_out_and_in_place(switch_process, fast):
    """allreduce(x, out=y) and out=x give the bytes allreduce(x) returns, for every codec and either loop
    (a strided numpy out and a torch out too); an out of another shape or dtype is refused."""
    sw = switch_process("--workers", 2, "--nc-rounding", "deterministic")  # NC sums the same in every run
    rs = np.random.default_rng(4)
    for codec in ("int32", "fixed", "nc"):
        dtype = np.int32 if codec == "int32" else np.float32
        xs = [(rs.standard_normal(5000) * 100).astype(dtype) for _ in range(2)]
        ref, errors, _ = run_workers(sw.address, xs, codec, seed=3, fast=fast, timeout=20)
        assert errors == [None, None]
        for mode in ("out", "in place", "strided", "torch", "allreduce_init"):
            got = _with_out(sw.address, xs, codec, mode, fast)
            assert got[0].tobytes() == ref[0].tobytes() and got[1].tobytes() == ref[1].tobytes(), (codec, mode)
    x = np.ones(10, np.int32)
    for bad in (np.ones(11, np.int32), np.ones(10, np.int64), np.ones(10, np.int32).reshape(2, 5)):
        with pytest.raises(ValueError, match="out must have x's shape and dtype"):
            hostlib.tensors.out_view(bad, x, x)  # what allreduce checks before its first packet


@pytest.mark.parametrize("fast", [True, False], ids=["c-loop", "python-loop"])
def test_packet_ids_wrap_past_2_32_with_any_window(switch_process, fast):
    """Every slot's 32-bit packet id (its use number) wraps during these calls, dense and block-sparse
    alike, with a window of 12 and a call starting mid-window: the ids run on mod 2^32 and the sets with
    their parity."""
    n, size = 3, 5000
    sw = switch_process("--workers", n, "--first-packet-id", 2**32 - 10)  # as after ~4 billion uses of each slot
    rs = np.random.default_rng(12)
    xs = [rs.integers(-1000, 1000, size).astype(np.int32) for _ in range(n)]
    for x in xs:
        x[1000:4000] = 0
    outs, errors = [None] * n, [None] * n

    def work(r):
        try:
            with hostlib.connect(sw.address, r, n, window=12, elements_per_packet=64, timeout=10, fast=fast) as c:
                assert np.all(c.gen.uses == 2**32 - 10)
                c.gen.next_slot = 5
                for flag in (False, True, False, True):
                    outs[r] = c.allreduce(xs[r], sparse=flag)
                assert np.all(c.gen.uses < 1000)  # every slot went past the wrap
        except Exception as e:  # noqa: BLE001 - reported to the test
            errors[r] = e

    threads = [threading.Thread(target=work, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [None] * n
    assert all(np.array_equal(o, np.sum(np.array(xs, dtype=np.int64), axis=0)) for o in outs)
