"""Natural dithering through the switch (`codec="dither"`, issue 18): the codec on its own, then allreduce
end to end over UDP through a real switch process, then the CLI demo."""
from __future__ import annotations

import json

import numpy as np
import pytest

from hostlib import fastpath, wire
from hostlib.codecs import ditherswitch, fixed, get_codec, natural
from hostlib.codecs.base import block_exponents

from .test_cli import switchsim
from .test_e2e import run_workers


def test_dither_codec_levels_unbiased_and_the_worker_variance_bound():
    """Codes lie on the s levels 2^e ... 2^(e-s+1) (and 0) that the switch accepts for e; the mean is x; the
    mean squared error is the exact variance, below ||x||^2/8 + min(2^f ||x||_1, d 4^f/4) (Theorem 4's
    shape with the scale 2^e for the norm, f = e - s + 1)."""
    s, draws = 3, 2000
    codec = get_codec("dither", levels=s)
    assert codec.wire_codec == wire.CODEC_NC8 and codec.negotiates_exponent
    x = (np.random.default_rng(4).standard_normal(256) * np.exp2(np.arange(256) % 9 - 7)).astype(np.float32)
    e = int(block_exponents(x[None])[0])
    f = e - s + 1
    codes = np.frombuffer(codec.encode(np.tile(x, draws), e, 4, 5, 0), np.uint8)
    assert natural.codes_to_int(codes, e) is not None  # every code is one the switch sums
    out = natural.decode(codes, np.float64).reshape(draws, -1)
    assert set(np.unique(np.abs(out))) == {0.0} | {2.0**j for j in range(f, e + 1)}
    v = ditherswitch.worker_variance(x, [e], x.size, s)
    err = out - x
    # 5 sd, plus one floor unit per run of draws: an element far below 2^f goes up ~draws |x| / 2^f < 1 times,
    # where one hit more or less is a lattice step the normal bound does not see
    assert np.all(np.abs(err.mean(0)) <= 5 * np.sqrt(v / draws) + 2.0**f / draws)
    mse, var = float((err**2).sum(1).mean()), float(v.sum())
    assert abs(mse - var) <= 0.05 * var
    x64 = x.astype(np.float64)
    assert var <= x64 @ x64 / 8 + min(2.0**f * np.abs(x64).sum(), x.size * 4.0**f / 4)
    # s = NC_SPAN is plain NC: the floor is the switch's own
    nc = get_codec("nc").encode(x, e, 4, 5, 0)
    assert get_codec("dither", levels=ditherswitch.MAX_LEVELS).encode(x, e, 4, 5, 0) == nc
    for bad in (0, ditherswitch.MAX_LEVELS + 1, 2.5):
        with pytest.raises(ValueError, match="levels"):
            get_codec("dither", levels=bad)


def allreduce_calls(address, xs, calls, codec, **kw):
    """Each rank allreduces its tensor `calls` times on one connection; returns outputs[rank][call]."""
    outs, errors, _ = run_workers(address, xs, codec, calls=calls, every_call=True, **kw)
    assert errors == [None] * len(xs)
    return np.array(outs, dtype=np.float64)


@pytest.mark.parametrize("switch_process", ["python", "c"], indirect=True)
def test_dither_allreduce_through_the_switch_is_unbiased_within_its_bound(switch_process):
    """4 workers, 300 calls (each call draws new seeds): the mean over calls is the exact sum; the mean squared
    error lies between V (the workers' dithering variance, exact) and V + (|S|^2 + V)/8 (the switch's NC on
    top, Theorem 1)."""
    n, size, k, s, calls = 4, 96, 32, 3, 300
    sw = switch_process("--workers", n)
    rs = np.random.default_rng(5)
    xs = [(rs.standard_normal(size) * np.exp2(rs.integers(-6, 3, size))).astype(np.float32) for _ in range(n)]
    outs = allreduce_calls(sw.address, xs, calls, codec="dither", levels=s, elements_per_packet=k, window=8,
                           timeout=30)
    assert all(np.array_equal(o, outs[0]) for o in outs)
    exact = np.sum(np.array(xs, dtype=np.float64), axis=0)
    err = outs[0] - exact
    exps = np.max([get_codec("dither", levels=s).flat_exponents(x, k) for x in xs], axis=0)
    v = sum(ditherswitch.worker_variance(x, exps, k, s) for x in xs)
    per_element = v + (exact**2 + v) / 8
    assert np.all(np.abs(err.mean(0)) <= 5 * np.sqrt(per_element / calls))
    mse = float((err**2).sum(1).mean())
    bound = ditherswitch.allreduce_expected_sq_error(xs, exact, k, s)
    assert np.isclose(bound, per_element.sum())
    assert 0.9 * v.sum() <= mse <= 1.1 * bound, (mse, v.sum(), bound)
    mags = np.abs(outs[0][outs[0] != 0])
    assert np.all(np.exp2(np.round(np.log2(mags))) == mags)  # NC codes came back


def test_fixed_stochastic_allreduce_is_unbiased_where_nearest_is_not(switch_process):
    """Two workers each hold 0.3 of a fixed-point step in most elements: rounding to nearest sums to 0 every
    time; stochastic rounding's mean over calls is the true 0.6 steps, and each call stays within the
    fixed-point bound."""
    n, k, calls = 2, 64, 100
    sw = switch_process("--workers", n)
    exp = 1  # block max 1.0 -> every |x| < 2^1
    step = 1 / float(fixed.scale_for(exp, n))
    x = np.full(k, 0.3 * step, np.float32)
    x[0] = 1.0
    assert fastpath.kind(get_codec("fixed", rounding="stochastic"), x) is None
    exact = 2 * x.astype(np.float64)
    sto = allreduce_calls(sw.address, [x, x], calls, codec="fixed", rounding="stochastic", elements_per_packet=k,
                          timeout=30)[0]
    near = allreduce_calls(sw.address, [x, x], 1, codec="fixed", elements_per_packet=k, timeout=30)[0]
    assert np.all(near[0, 1:] == 0)
    bound = fixed.allreduce_error_bound([x, x], k, exact)
    assert np.all(np.abs(sto - exact) <= bound)
    mean_steps = sto[:, 1:].mean() / step  # 63 elements x 100 calls, each sum 0, 1 or 2 steps
    assert abs(mean_steps - 0.6) <= 5 * np.sqrt(2 * 0.3 * 0.7 / (63 * calls))


def test_demo_runs_the_dither_codec():
    r = switchsim("demo", "--workers", 2, "--size", 5000, "--codec", "dither", "--levels", 4, "--json",
                  "--timeout", 30)
    assert r.returncode == 0, r.stdout + r.stderr
    s = json.loads(r.stdout)
    assert s["ok"] and s["check"]["ok"] and s["identical_on_all_workers"] and s["codec"] == "dither"
    assert s["bytes_ratio_vs_float32"] < 0.5  # one-byte NC codes on the wire
