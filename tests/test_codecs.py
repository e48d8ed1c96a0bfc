import numpy as np
import pytest
from hypothesis import given, strategies as st

from hostlib import rng, wire
from hostlib.codecs import dithering, fixed, get_codec, natural
from hostlib.codecs.base import block_exponents
from switchsim.model import Switch

DRAWS = 4000


def test_rng_is_counter_based():
    a = rng.bits64(7, 100, 50)
    assert np.array_equal(a[10:], rng.bits64(7, 110, 40))  # element i depends only on (seed, offset + i)
    assert not np.array_equal(a, rng.bits64(8, 100, 50))
    u = (rng.bits64(1, 0, 200000) >> np.uint64(40)).astype(np.float64) / 2**24
    assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002


def test_nc_code_table():
    x = np.array([0, 1, -1, 2**-63, 2**63, -(2.0**-10)], dtype=np.float32)
    codes = natural.encode(x, seed=1)
    assert codes.tolist() == [0, 64, 0x80 | 64, 1, 127, 0x80 | 54]
    assert np.array_equal(natural.decode(codes), x)
    with pytest.raises(ValueError, match="0x80"):
        natural.decode(np.array([0x80], np.uint8))


def test_nc_rejects_nan_inf_and_overflow():
    for bad in (np.nan, np.inf, -np.inf):
        with pytest.raises(ValueError, match="NaN or Inf"):
            natural.encode(np.array([1.0, bad], np.float32))
    with pytest.raises(OverflowError):
        natural.encode(np.array([2.0**64], np.float32))


def sample_nc(x, draws=DRAWS, **kw):
    return np.stack([natural.decode(natural.encode(x, seed=s, **kw), np.float64) for s in range(draws)])


X = np.array([1.0, 1.25, 1 / 3, -0.7, 3.999, -1e-3, 5e-20, 2.0**-70, -(2.0**-64), 0.0], dtype=np.float32)


def test_nc_theorem1_unbiased_and_second_moment():
    """E C(x) = x and E C(x)^2 <= 9/8 x^2 (Theorem 1); also the exact E C(x)^2 = 4^a (1 + 3f)."""
    s = sample_nc(X)
    x = X.astype(np.float64)
    sd = np.abs(x) / np.sqrt(8 * DRAWS)  # Var C(x) <= x^2 / 8 inside the range
    inside = np.abs(x) >= 2.0**-63
    assert np.all(np.abs(s.mean(0) - x)[inside] <= 5 * sd[inside] + 1e-300)
    m2 = (s**2).mean(0)
    assert np.all(m2[inside] <= 9 / 8 * x[inside] ** 2 * 1.05)
    a = np.floor(np.log2(np.abs(x[:6])))
    f = np.abs(x[:6]) / 2**a - 1
    np.testing.assert_allclose(m2[:6], 4**a * (1 + 3 * f), rtol=0.06)
    # below the range (2^-63): rounded to 0 or 2^-63, still unbiased
    assert abs(s[:, 7].mean() - 2.0**-70) < 5 * np.sqrt(2.0**-70 * 2.0**-63 / DRAWS)


def test_nc_is_reproducible_and_deterministic_mode_rounds_to_nearest():
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    assert np.array_equal(natural.encode(x, seed=3, offset=5), natural.encode(x, seed=3, offset=5))
    assert np.array_equal(natural.encode(x[10:], seed=3, offset=15), natural.encode(x, seed=3, offset=5)[10:])
    d = natural.decode(natural.encode(x, deterministic=True), np.float64)
    a = 2.0 ** np.floor(np.log2(np.abs(x)))
    nearest = np.where(np.abs(x) - a >= a / 2, 2 * a, a) * np.sign(x)
    assert np.array_equal(d, nearest)


@given(st.lists(st.floats(-1e6, 1e6, width=32), min_size=1, max_size=50), st.integers(1, 8))
def test_fixed_point_error_bound_and_no_overflow(values, n):
    x = np.array(values, dtype=np.float32)
    e = int(block_exponents(x[None, :])[0])
    codec = fixed.FixedPointCodec()
    q = np.frombuffer(codec.encode(x, e, n, 0, 0), dtype=">i4").astype(np.int64)
    assert np.all(np.abs(q) * n <= 2**31 - 1)  # n copies of the largest value still fit in int32
    back = codec.decode(q, np.array([e]), n, x.size)
    assert np.all(np.abs(back - x) * n <= fixed.error_bound(np.array([e]), n)[0])


def test_block_exponents_rules():
    b = np.array([[0, 0], [0.5, -1.0], [np.nan, 1], [2.0**-140, 0]], dtype=np.float32)
    assert block_exponents(b).tolist() == [wire.EXP_NONE, 1, wire.EXP_NONFINITE, wire.EXP_MIN]
    with pytest.raises(OverflowError):
        block_exponents(np.array([[2.0**127]], dtype=np.float32))
    with pytest.raises(OverflowError):
        get_codec("nc").block_exponents(np.array([[2.0**64]], dtype=np.float32))


def test_switch_recompression_is_exact_in_expectation():
    """int_to_codes: |s| = 2^a + rem rounds up with probability rem / 2^a, so E[decoded] = s exactly."""
    sums = np.array([1, 3, 5, 7, 100, -12345, 2**55 + 2**54 + 1, 0], dtype=np.int64)
    exp = 20
    floor = wire.nc_floor(exp)
    vals = np.stack([natural.decode(natural.int_to_codes(sums, exp, False, 9, i * sums.size)[0], np.float64)
                     for i in range(DRAWS)])
    mean = vals.mean(0) / 2.0**floor
    sd = np.abs(sums) / np.sqrt(8 * DRAWS)
    assert np.all(np.abs(mean - sums) <= 5 * sd + 1e-9)
    det = natural.int_to_codes(sums, exp, True, 0, 0)[0]
    assert (natural.decode(det, np.float64) / 2.0**floor).tolist()[:5] == [1, 4, 4, 8, 128]


def test_nc_through_the_switch_model_bidirectional():
    """Workers encode, the reference switch sums integers and re-compresses: E out = sum x and
    E out^2 <= 9/8 ((sum x)^2 + 1/8 sum x^2), the bound for C(sum C(x_i))."""
    xs = np.array([[0.3, -1.7, 5.0, 1e-3], [0.9, 0.2, -4.5, 2e-3], [-0.1, 1.1, 0.6, 1e-3]], dtype=np.float32)
    n, k = xs.shape
    exp = int(block_exponents(xs.reshape(1, -1))[0])
    sw = Switch({1: n}, slots=1, max_elements=k, seed=5)
    sw.admit(1, 1, 77, 0, list(range(n)))  # rank r sends from address r with session 77
    outs = []
    for d in range(DRAWS // 2):
        pid = d
        res = None
        for r in range(n):
            payload = natural.encode(xs[r], seed=1000 * d + r, floor=wire.nc_floor(exp))
            res = sw.process(wire.pack(wire.MSG_UPDATE, job=1, rank=r, packet_id=pid, slot=0, set=pid & 1,
                                       count=k, codec=wire.CODEC_NC8, exp_cur=exp, payload=payload.tobytes(),
                                       session=77), r)
        assert len(res) == n
        h = wire.unpack(res[0][0])
        outs.append(natural.decode(wire.payload_view(res[0][0], h), np.float64))
    outs = np.array(outs)
    x64 = xs.astype(np.float64)
    S = x64.sum(0)
    bound = 9 / 8 * (S**2 + (x64**2).sum(0) / 8)
    sd = np.sqrt(bound / outs.shape[0])
    assert np.all(np.abs(outs.mean(0) - S) <= 5 * sd)
    assert np.all((outs**2).mean(0) <= bound * 1.08)


def test_natural_dithering_unbiased_with_levels():
    x = np.array([3.0, -1.0, 0.5, 0.01, 0.0, -2.2])
    levels = 4
    draws = np.stack([dithering.decode(*dithering.encode(x, levels=levels, seed=s), levels=levels)
                      for s in range(DRAWS)]).astype(np.float64)
    norm = np.linalg.norm(x)
    assert np.all(np.abs(draws.mean(0) - x) <= 5 * norm / np.sqrt(DRAWS))
    allowed = {0.0} | {float(np.float32(norm * 2.0 ** (j - levels))) for j in range(1, levels + 1)}
    assert set(np.unique(np.abs(draws))) <= allowed
    norm2, codes = dithering.encode(x, levels=levels, seed=0)
    assert (codes & 0x7F).max() <= levels and norm2 == np.float32(norm)


def test_codec_input_checks():
    with pytest.raises(TypeError):
        get_codec("int32").check_input(np.zeros(3, np.float32))
    with pytest.raises(OverflowError):
        get_codec("int32").check_input(np.array([2**40]))
    with pytest.raises(TypeError):
        get_codec("fixed").check_input(np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="unknown codec"):
        get_codec("zip")
