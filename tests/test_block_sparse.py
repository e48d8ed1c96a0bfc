"""Block-sparse INA (OmniReduce-style): the switch's round semantics on every backend, and
allreduce(x, sparse=True) end to end (exact for int32 under loss, duplication and reordering)."""
from __future__ import annotations

import dataclasses
import json
import threading

import numpy as np
import pytest
from hypothesis import given, strategies as st

import hostlib
from hostlib import wire
from hostlib.codecs import natural

from .test_e2e import check_impaired, run_workers

NONE = wire.BLOCK_NONE
K = 16


def V(k):
    return np.arange(K, dtype=np.int64) * k


def sup(rank, pid, block=NONE, nxt=NONE, k=None, exp_next=wire.EXP_NONE, exp_cur=0, slot=0, set_=None,
        codec=wire.CODEC_INT32, payload=None, count=None):
    """A sparse update; with k given, it carries V(k) for `block`."""
    if payload is None:
        payload = b"" if k is None else V(k).astype(">i4").tobytes()
    if count is None:
        count = len(payload) // wire.ELEMENT_SIZE[codec]
    return wire.pack_sparse(wire.MSG_SPARSE_UPDATE, 1, rank, pid, slot, pid & 1 if set_ is None else set_, count,
                            codec, exp_cur, exp_next, 0, block, nxt, payload)


def results(out):
    return [(port, wire.unpack(d), d) for port, d in out]


def check_multicast(out, n, block, nxt, k=None, exp_next=wire.EXP_NONE, pid=0):
    got = results(out)
    assert sorted(p for p, _, _ in got) == list(range(n))
    for port, h, data in got:
        assert (h.msg_type, h.rank, h.packet_id, h.block, h.next_block, h.exp_next) == (
            wire.MSG_SPARSE_RESULT, port, pid, block, nxt, exp_next)
        if k is None:
            assert h.count == 0
        else:
            np.testing.assert_array_equal(wire.payload_view(data, h), V(k))
    return got


# ---------------------------------------------------------------- the wire
@given(block=st.integers(0, NONE - 1), gap=st.integers(1, 2**32), count=st.integers(0, 64),
       codec=st.sampled_from([wire.CODEC_INT32, wire.CODEC_NC8]), msg=st.sampled_from(wire.SPARSE_MESSAGES))
def test_block_extension_roundtrip(block, gap, count, codec, msg):
    block = block if count else NONE
    nxt = NONE if block == NONE or block + gap >= NONE else block + gap
    payload = bytes(count * wire.ELEMENT_SIZE[codec])
    data = wire.pack_sparse(msg, 3, 2, 77, 5, 1, count, codec, 4, 9, 0, block, nxt, payload)
    h = wire.unpack(data)
    assert (h.msg_type, h.block, h.next_block, h.count) == (msg, block, nxt, count)
    assert len(data) == wire.HEADER_SIZE + wire.BLOCK_EXT_SIZE + len(payload)
    assert h.pack(payload) == data and wire.payload_view(data, h).size == count


@pytest.mark.parametrize("data,reason", [
    (sup(0, 0, block=NONE, nxt=3, count=0, payload=bytes(4)), "payload"),  # elements without a count
    (sup(0, 0, block=5, nxt=9, payload=b"", count=0), "block extension"),  # a block but no elements
    (sup(0, 0, block=NONE, nxt=3, k=1), "block extension"),  # elements of no block
    (sup(0, 0, block=5, nxt=5, k=1), "not after"),  # next block must lie after the block
    (sup(0, 0, block=5, nxt=2, k=1), "not after"),
    (sup(0, 0, block=5, nxt=9, k=1)[:wire.HEADER_SIZE + 4], "payload"),  # truncated extension
])
def test_malformed_block_extension_is_rejected(data, reason):
    with pytest.raises(wire.WireError, match=reason):
        wire.unpack(data)


# ---------------------------------------------------------------- the switch, on every backend
def test_announce_round_names_the_smallest_first_block_and_its_exponent(switch_backend):
    sw = switch_backend({1: 3}, slots=2, max_elements=K)
    assert sw.send(0, sup(0, 0, nxt=4, exp_next=5)) == []
    assert sw.send(1, sup(1, 0, nxt=2, exp_next=-3)) == []
    out = sw.send(2, sup(2, 0, nxt=2, exp_next=9))
    check_multicast(out, 3, NONE, 2, exp_next=9)  # the max only over workers whose next block it is


@pytest.mark.parametrize("n", [2, 3])
def test_round_sums_the_holders_and_moves_to_the_next_block(switch_backend, n):
    sw = switch_backend({1: n}, slots=2, max_elements=K)
    # round about block 2: W0 holds it (next 8), W1 holds it (next 6), W2 (if any) only has block 4
    assert sw.send(0, sup(0, 0, block=2, nxt=8, k=1, exp_next=11)) == []
    last = sup(1, 0, block=2, nxt=6, k=3, exp_next=7)
    if n == 3:
        assert sw.send(1, last) == []
        last = sup(2, 0, nxt=4, exp_next=1)
    got = check_multicast(sw.send(n - 1, last), n, 2, 4 if n == 3 else 6, k=4, exp_next=1 if n == 3 else 7, pid=0)
    # a retransmission after completion gets the same bytes back, unicast
    again = sw.send(0, sup(0, 0, block=2, nxt=8, k=1, exp_next=11))
    assert again == [(0, next(d for p, _, d in got if p == 0))]  # the copies of a multicast come in any order
    s = sw.stats()["jobs"]["1"]
    assert (s["multicast"], s["resent"]) == (1, 1)


def test_rounds_alternate_sets_and_a_stream_ends_with_no_next_block(switch_backend):
    sw = switch_backend({1: 2}, slots=1, max_elements=K)
    sw.send(0, sup(0, 0, nxt=0))
    check_multicast(sw.send(1, sup(1, 0, nxt=1)), 2, NONE, 0)
    sw.send(0, sup(0, 1, block=0, nxt=1, k=2))
    check_multicast(sw.send(1, sup(1, 1, nxt=1)), 2, 0, 1, k=2, pid=1)
    sw.send(1, sup(1, 2, block=1, nxt=NONE, k=5))
    check_multicast(sw.send(0, sup(0, 2, block=1, nxt=NONE, k=1)), 2, 1, NONE, k=6, pid=2)
    sw.send(0, sup(0, 3))  # padding round: no elements, no next block
    check_multicast(sw.send(1, sup(1, 3)), 2, NONE, NONE, pid=3)
    # the stale packet of round 1 (set 1 has moved on to round 3) is dropped, not summed
    assert sw.send(0, sup(0, 1, block=0, nxt=1, k=2)) == []
    assert sw.stats()["dropped"]["stale"] == 1


def test_duplicate_before_completion_is_dropped(switch_backend):
    sw = switch_backend({1: 2}, slots=1, max_elements=K)
    assert sw.send(0, sup(0, 0, block=3, nxt=NONE, k=1)) == []
    assert sw.send(0, sup(0, 0, block=3, nxt=NONE, k=1)) == []
    check_multicast(sw.send(1, sup(1, 0, block=3, nxt=NONE, k=2)), 2, 3, NONE, k=3)
    assert sw.stats()["dropped"]["duplicate"] == 1


@pytest.mark.parametrize("first,second", [
    (sup(0, 0, block=3, nxt=9, k=1), sup(1, 0, block=4, nxt=9, k=1)),  # elements of another block
    (sup(0, 0, block=3, nxt=9, k=1), sup(1, 0, nxt=3)),  # claims block 3 without sending it
    (sup(0, 0, nxt=2), sup(1, 0, block=3, nxt=9, k=1)),  # W0 said it holds block 2, before 3
    (sup(0, 0, block=3, nxt=9, k=1), sup(1, 0, block=3, nxt=9, k=1, exp_cur=4)),  # another agreed exponent
    (sup(0, 0, block=3, nxt=9, k=1), sup(1, 0, block=3, nxt=9, codec=wire.CODEC_NC8, payload=bytes(K))),
    (sup(0, 0, block=3, nxt=9, k=1), wire.pack(wire.MSG_UPDATE, 1, 1, 0, 0, 0, K, wire.CODEC_INT32,
                                              payload=V(1).astype(">i4").tobytes())),  # a dense packet
    (wire.pack(wire.MSG_UPDATE, 1, 0, 0, 0, 0, K, wire.CODEC_INT32, payload=V(1).astype(">i4").tobytes()),
     sup(1, 0, block=3, nxt=9, k=1)),  # a sparse packet in a dense round
])
def test_inconsistent_sparse_packets_are_dropped_as_mismatch(switch_backend, first, second):
    sw = switch_backend({1: 2}, slots=1, max_elements=K)
    assert sw.send(0, first) == []
    assert sw.send(1, second) == []
    assert sw.stats()["dropped"]["mismatch"] == 1
    assert sw.stats()["jobs"]["1"]["multicast"] == 0


def test_nc_round_is_summed_in_integers_and_recompressed(switch_backend):
    sw = switch_backend({1: 2}, slots=1, max_elements=K, nc_rounding="deterministic")
    e = 3  # every |x| < 2^3
    codes = natural.encode(np.full(K, 2.0, np.float32), deterministic=True, floor=wire.nc_floor(e))
    sw.send(0, sup(0, 0, block=7, nxt=NONE, codec=wire.CODEC_NC8, exp_cur=e, payload=codes.tobytes()))
    out = sw.send(1, sup(1, 0, block=7, nxt=NONE, codec=wire.CODEC_NC8, exp_cur=e, payload=codes.tobytes()))
    assert len(out) == 2
    for _, data in out:
        h = wire.unpack(data)
        assert (h.block, h.exp_cur) == (7, e)
        np.testing.assert_array_equal(natural.decode(wire.payload_view(data, h)), np.full(K, 4.0, np.float32))


# ---------------------------------------------------------------- allreduce(x, sparse=True) end to end
def block_sparse(rs, n, size, k, density, dtype=np.int32, overlap=True):
    """n tensors whose non-zero blocks of k cover about `density` of the blocks each."""
    nb = -(-size // k)
    xs = []
    for r in range(n):
        mask = rs.random(nb) < density
        if not overlap:
            mask &= np.arange(nb) % n == r
        if np.issubdtype(dtype, np.integer):
            vals = rs.integers(-(2**24), 2**24, size)
        else:
            vals = rs.standard_normal(size) * 10.0 ** rs.integers(-3, 3, size)
        xs.append(np.where(np.repeat(mask, k)[:size], vals, 0).astype(dtype))
    return xs


SPARSE_LOSSY = [(n, loss) for n in (2, 3, 5) for loss in (0.0, 0.05, 0.10)]


@pytest.mark.parametrize("n,loss", SPARSE_LOSSY, ids=[f"{n}w-loss{int(p * 100)}" for n, p in SPARSE_LOSSY])
def test_block_sparse_int32_exact_under_loss_duplication_reordering(switch_process, n, loss):
    sw = switch_process("--workers", n, "--loss", loss, "--dup", loss, "--reorder", loss, "--seed", n)
    rs = np.random.default_rng(n)
    k, size = 64, 20000
    xs = block_sparse(rs, n, size, k, 0.1)
    # sparse twice, then dense: each slot's sets keep alternating across calls of either kind
    outs, errors, stats = run_workers(sw.address, xs, "int32", sparse=[True, True, False, True],
                                      elements_per_packet=k, window=16, timeout=30)
    assert errors == [None] * n
    exact = np.sum(np.array(xs, dtype=np.int64), axis=0)
    for o in outs:
        assert o.dtype == np.int32 and np.array_equal(o, exact)
    report = json.loads(sw.stop())
    assert report["dropped"]["mismatch"] == 0
    if loss:
        check_impaired(report, stats)


def test_block_sparse_sends_only_nonzero_blocks(switch_process):
    n, k, size, window = 4, 256, 256 * 400, 32
    sw = switch_process("--workers", n)
    rs = np.random.default_rng(7)
    xs = block_sparse(rs, n, size, k, 0.02, overlap=False)
    sent = [None] * n

    def work(r):
        with hostlib.connect(sw.address, r, n, elements_per_packet=k, window=window) as comm:
            before = dataclasses.replace(comm.stats)  # after the join
            out = comm.allreduce(xs[r], sparse=True)
            sent[r] = (out, comm.stats.packets_sent - before.packets_sent, comm.stats.bytes_sent - before.bytes_sent)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    exact = np.sum(np.array(xs, dtype=np.int64), axis=0)
    union = int(np.any(exact.reshape(-1, k) != 0, axis=1).sum())
    for r in range(n):
        out, packets, nbytes = sent[r]
        assert np.array_equal(out, exact)
        # rounds: an announce round per stream, one per block of the union, at most one padding round per stream
        assert union + window <= packets <= union + 2 * window
        # the elements of this worker's non-zero blocks and nothing else, plus headers
        own = int(np.any(xs[r].reshape(-1, k) != 0, axis=1).sum())
        assert nbytes == packets * (wire.HEADER_SIZE + wire.BLOCK_EXT_SIZE) + own * k * 4
        assert nbytes < 0.05 * 4 * size  # dense int32 would send 4 bytes per element


def test_block_sparse_nc_is_unbiased_with_the_predicted_error(switch_process):
    n = 3
    sw = switch_process("--workers", n)
    rs = np.random.default_rng(2)
    xs = block_sparse(rs, n, 60 * 1024, 1024, 0.3, dtype=np.float32)
    xs = [np.where(x != 0, rs.standard_normal(x.size), 0).astype(np.float32) for x in xs]
    outs, errors, stats = run_workers(sw.address, xs, "nc", sparse=True, window=16, timeout=30)
    assert errors == [None] * n
    exact = np.sum(np.array(xs, dtype=np.float64), axis=0)
    err = outs[0].astype(np.float64) - exact
    expected = natural.allreduce_expected_sq_error(xs, exact)
    assert float(err @ err) <= 1.2 * expected
    assert all(np.array_equal(o, outs[0]) for o in outs)
    assert np.all(outs[0][exact == 0] == 0)
    nonzero = sum(int(np.any(x.reshape(-1, 1024) != 0, axis=1).sum()) for x in xs[:1])
    header = wire.HEADER_SIZE + wire.BLOCK_EXT_SIZE  # the join (sent twice: confirmed) is padded to JOIN_SIZE
    assert stats[0].bytes_sent <= 2 * wire.JOIN_SIZE + (stats[0].packets_sent - 2) * header + nonzero * 1024


@pytest.mark.parametrize("pattern", ["all-zero", "one-rank-only", "one-short-block", "fewer-blocks-than-window",
                                     "dense"])
def test_block_sparse_edge_patterns(switch_process, pattern):
    n, k = 3, 32
    sw = switch_process("--workers", n)
    rs = np.random.default_rng(5)
    size = {"one-short-block": 7, "fewer-blocks-than-window": 3 * k + 5}.get(pattern, 40 * k)
    xs = [rs.integers(-100, 100, size).astype(np.int32) for _ in range(n)]
    if pattern == "all-zero":
        xs = [np.zeros(size, np.int32) for _ in range(n)]
    if pattern == "one-rank-only":
        xs = [xs[0]] + [np.zeros(size, np.int32)] * (n - 1)
    outs, errors, _ = run_workers(sw.address, xs, "int32", sparse=[True, False, True], elements_per_packet=k,
                                  window=8)
    assert errors == [None] * n
    exact = np.sum(np.array(xs, dtype=np.int64), axis=0)
    assert all(np.array_equal(o, exact) for o in outs)


def test_block_sparse_nan_and_overflow_raise_on_every_worker(switch_process):
    sw = switch_process("--workers", 2)
    xs = [np.zeros(3000, np.float32), np.zeros(3000, np.float32)]
    xs[0][:100] = 1.0
    xs[1][1234] = np.nan
    _, errors, _ = run_workers(sw.address, xs, "fixed", sparse=True, timeout=10)
    assert all(isinstance(e, ValueError) and "NaN" in str(e) for e in errors)
    big = [np.full(100, 2**31 - 1, np.int64)] * 2
    _, errors, _ = run_workers(sw.address, big, "int32", sparse=True, timeout=10)
    assert all(isinstance(e, OverflowError) for e in errors)


def test_block_sparse_torch_tensors(switch_process):
    torch = pytest.importorskip("torch", reason="torch is an optional extra (pip install '.[torch]')")
    sw = switch_process("--workers", 2)
    ts = [torch.zeros(3000, dtype=torch.int64) for _ in range(2)]
    ts[0][10:20] = 5
    ts[1][2000:2100] = -3
    outs, errors, _ = run_workers(sw.address, ts, "int32", sparse=True)
    assert errors == [None, None] and isinstance(outs[0], torch.Tensor) and outs[0].dtype == torch.int64
    assert torch.equal(outs[0], ts[0] + ts[1])


def test_python_sparse_loop_exact_under_loss(switch_process):
    """The fallback loop (fast=False, the definition the C loop is checked against) recovers on its own."""
    n, k = 3, 64
    sw = switch_process("--workers", n, "--loss", 0.1, "--dup", 0.1, "--reorder", 0.1, "--seed", 9)
    xs = block_sparse(np.random.default_rng(9), n, 12000, k, 0.2)
    outs, errors, stats = run_workers(sw.address, xs, "int32", sparse=[True, False, True], fast=False,
                                      elements_per_packet=k, window=16, timeout=30)
    assert errors == [None] * n
    exact = np.sum(np.array(xs, dtype=np.int64), axis=0)
    assert all(np.array_equal(o, exact) for o in outs)
    check_impaired(json.loads(sw.stop()), stats)


def test_ranks_that_disagree_on_sparse_fail_by_name(switch_process):
    """One rank sparse, the other dense: the call identities differ (call_kind's sparse bit), the switch
    fails the call, and both ranks raise CallMismatch naming it at once, instead of a wrong sum."""
    sw = switch_process("--workers", 2)
    xs = [np.arange(3000, dtype=np.int32)] * 2
    box = [None, None]

    def work(r):
        try:
            with hostlib.connect(sw.address, r, 2, timeout=1.0) as comm:
                comm.allreduce(xs[r], sparse=(r == 0))
        except Exception as e:  # noqa: BLE001 - checked below
            box[r] = e

    threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(isinstance(e, hostlib.CallMismatch) and "codec int32 sparse" in str(e) for e in box), box
    assert json.loads(sw.stop())["dropped"]["call_mismatch"] == 1
