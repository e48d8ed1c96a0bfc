"""Persistent allreduce (Communicator.allreduce_init, hostlib/persistent.py): the same packets and sums as
allreduce(x, out=x), call after call, between other calls and across a re-join; bad arrays refused at once."""
from __future__ import annotations

import numpy as np
import pytest

import hostlib
from hostlib import errors
from hostlib.codecs import get_codec

from .test_e2e import run_workers

CODECS = ("int32", "fixed", "nc")


def _inputs(codec: str, n: int, size: int, seed: int):
    rs = np.random.default_rng(seed)
    dtype = np.int32 if codec == "int32" else np.float32
    return [(rs.standard_normal(size) * 100).astype(dtype) for _ in range(n)]


@pytest.mark.parametrize("fast", [None, False], ids=["c-loop", "python-loop"])
def test_a_persistent_call_sums_as_allreduce_does_call_after_call(switch_process, fast):
    """Each rank alternates a persistent call on one buffer (new values each time) with plain allreduces of
    the same values and of another size: every persistent sum is byte-equal to the plain one beside it, so
    the kept frame's pointers, the slots and the call numbers stay right whatever runs between (NC rounds
    to nearest here, so two calls of the same values send the same codes)."""
    sw = switch_process("--workers", 2, "--nc-rounding", "deterministic")
    for name in CODECS:
        codec = get_codec(name, rounding="deterministic") if name == "nc" else get_codec(name)
        xs, other = _inputs(name, 2, 5000, 4), _inputs(name, 2, 300, 5)

        def call(comm, r, _):
            buf = np.empty_like(xs[r])
            p = comm.allreduce_init(buf, codec)
            pairs = []
            for i in range(4):
                buf[...] = xs[r] * (i + 1)
                assert p() is buf
                plain = comm.allreduce(xs[r] * (i + 1), codec=codec)
                comm.allreduce(other[r], codec=codec)
                pairs.append((buf.copy(), plain))
            return pairs

        outs, errs, _ = run_workers(sw.address, xs, name, call=call, seed=3, fast=fast, timeout=20)
        assert errs == [None, None], (name, errs)
        for r in range(2):
            for i, (got, plain) in enumerate(outs[r]):
                assert got.tobytes() == plain.tobytes(), (name, r, i)
        assert outs[0][3][0].tobytes() == outs[1][3][0].tobytes()
        if name == "int32":
            assert np.array_equal(outs[0][2][0], (xs[0] + xs[1]) * 3)


def test_a_persistent_call_makes_its_frame_again_after_a_rejoin(switch_process):
    """A call that fails on every rank (the ranks' lengths differ: CallMismatch) ends the generation; the
    next persistent call joins a new one and is exact, on a frame made for it."""
    sw = switch_process("--workers", 2)
    xs = _inputs("int32", 2, 3000, 6)

    def call(comm, r, _):
        buf = xs[r].copy()
        p = comm.allreduce_init(buf)
        p()
        first = buf.copy()
        with pytest.raises(errors.CallMismatch):
            comm.allreduce(np.ones(10 + r, np.int32))
        gen = comm.gen
        buf[...] = xs[r]
        p()
        assert comm.gen is not gen  # the call joined again
        return first, buf.copy()

    outs, errs, _ = run_workers(sw.address, xs, "int32", call=call, timeout=20)
    assert errs == [None, None], errs
    for first, again in outs:
        assert np.array_equal(first, xs[0] + xs[1]) and np.array_equal(again, xs[0] + xs[1])


def test_allreduce_init_refuses_what_it_cannot_sum_in_place(switch_process):
    sw = switch_process("--workers", 1)
    with hostlib.connect(sw.address, 0, 1, codec="nc", timeout=10) as comm:
        x = np.zeros(8, np.float32)
        with pytest.raises(ValueError, match="contiguous 1-D"):
            comm.allreduce_init(np.zeros(16, np.float32)[::2])
        with pytest.raises(ValueError, match="contiguous 1-D"):
            comm.allreduce_init(x.reshape(2, 4))
        ro = x.copy()
        ro.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            comm.allreduce_init(ro)
        with pytest.raises(TypeError, match="sums float32 in place; got int32"):
            comm.allreduce_init(np.zeros(8, np.int32))
        with pytest.raises(TypeError, match="sums int32 in place; got float32"):
            comm.allreduce_init(x, "int32")
        x[:] = 0.25  # a power of two: NC carries it exactly
        assert comm.allreduce_init(x)() is x and np.array_equal(x, np.full(8, 0.25, np.float32))


@pytest.mark.parametrize("fast", [None, False], ids=["c-loop", "python-loop"])
@pytest.mark.parametrize("codec", ["int32", "nc"])
def test_keep_tail_keeps_the_last_successful_sums_tail(switch_process, fast, codec):
    """keep_tail: after each call that succeeds, `kept` holds (start, the sums of flat[start:]) from kept_from
    (the C loop copies them as they land, NC's blocks a window behind its exponents; the Python loop keeps the
    whole sum); a call that fails on every rank (an int32 overflow or an NC NaN, raised after the call completed
    on the wire, and a mismatch, which stops it) leaves the last success's, though the C loop wrote into its
    other buffer meanwhile."""
    sw = switch_process("--workers", 2)
    size, window = 3000, 4  # int32: 12 blocks of 256, the tail the last 4 from element 2048; nc: 3 of 1024, all
    xs = _inputs(codec, 2, size, 7)

    def call(comm, r, _):
        buf = np.empty_like(xs[r])
        p = comm.allreduce_init(buf, codec, keep_tail=True)
        assert p.kept is None
        seen = []
        for i in (1, 2):
            buf[...] = xs[r] * i
            p()
            start, tail = p.kept
            seen.append((start, tail.copy(), buf.copy()))
        start, tail = p.kept
        if codec == "int32":
            buf[...] = 2**31 - 1  # the sum overflows: OverflowError on every rank
        else:
            buf[7] = np.nan  # NaN on one rank: ValueError on every rank
        with pytest.raises(OverflowError if codec == "int32" else ValueError):
            p()
        assert p.kept[0] == start and p.kept[1] is tail
        buf[...] = xs[r] * 5
        with pytest.raises(errors.CallMismatch):
            (p if r == 0 else lambda: comm.allreduce(np.ones(7, buf.dtype), codec=codec))()
        assert p.kept[1] is tail
        return seen, tail.copy()

    outs, errs, _ = run_workers(sw.address, xs, codec, call=call, window=window, fast=fast, timeout=20)
    assert errs == [None, None], errs
    for seen, last in outs:
        for i, (start, tail, total) in enumerate(seen, 1):
            assert start == (2048 if fast is None and codec == "int32" else 0), start
            if codec == "int32":
                assert np.array_equal(total, (xs[0] + xs[1]) * i)
            assert tail.tobytes() == total[start:].tobytes()
        assert np.array_equal(last, seen[1][1])  # the failures left the second call's tail
