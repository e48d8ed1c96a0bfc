import numpy as np
import pytest
from hypothesis import given, strategies as st

from hostlib import kernels, rng, wire
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
    # the worker codecs' Philox stream: the same properties, per sub-stream
    w = rng.philox(7, 101, 50)
    assert np.array_equal(w[9:], rng.philox(7, 110, 41)) and w.dtype == np.uint32
    assert not np.array_equal(w, rng.philox(8, 101, 50)) and not np.array_equal(w, rng.philox(7, 101, 50, 1))
    u = rng.philox(1, 0, 200000).astype(np.float64) / 2**32
    assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002


def test_nc_code_table():
    x = np.array([0, 1, -1, 2**-63, 2**62, -(2.0**-10)], dtype=np.float32)
    codes = natural.encode(x, seed=1)
    assert codes.tolist() == [0, 64, 0x80 | 64, 1, 126, 0x80 | 54]
    assert np.array_equal(natural.decode(codes), x)
    # the top level 2^63 is a code (a sum's, or [2^62, 2^63) rounded up) but no input: |x| >= 2^63 overflows
    assert natural.decode(np.array([127, 255], np.uint8)).tolist() == [2.0**63, -(2.0**63)]
    assert natural.encode(np.float32(1.5 * 2.0**62), deterministic=True).tolist() == [127]
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
    norm2, codes = dithering.encode(x, levels=levels, seed=0)
    allowed = {0.0} | {float(np.float32(float(norm2) * 2.0 ** (j - levels))) for j in range(1, levels + 1)}
    assert set(np.unique(np.abs(draws))) <= allowed
    # the float32 norm is rounded up, so no |x_i| / norm exceeds 1 (no clipping, no bias)
    assert (codes & 0x7F).max() <= levels and norm <= float(norm2) <= norm * (1 + 2.0**-23)


def test_codec_input_checks():
    with pytest.raises(TypeError):
        get_codec("int32").check_input(np.zeros(3, np.float32))
    with pytest.raises(OverflowError):
        get_codec("int32").check_input(np.array([2**40]))
    with pytest.raises(TypeError):
        get_codec("fixed").check_input(np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="unknown codec"):
        get_codec("zip")


# ---------------------------------------------------------------- issue 18: NC range, float64, torch dtypes
TOP = 2.0**wire.NC_LEVEL_MAX


@pytest.fixture(params=["native", "numpy"])
def kernel_path(request, monkeypatch):
    """Run a test on the C kernels and again on the numpy reference (the install builds the kernels, so a
    missing build is a failure)."""
    if request.param == "numpy":
        monkeypatch.setenv("INA_KERNELS", "numpy")
    else:
        assert kernels.enabled(), "the C kernels are not built"
    return request.param


@pytest.mark.parametrize("deterministic", [False, True])
def test_nc_at_or_above_the_top_level_always_overflows(kernel_path, deterministic):
    """|x| >= 2^63 raised only where the draw rounded it up: 1.5 * 2^63 raised in 205 of 400 seeds and came
    back as 2^63 in the others (deterministic: 1.2 * 2^63 came back as 2^63). Now every seed raises, as the
    exponent negotiation does, on float32 and float64."""
    for v in (TOP, 1.5 * TOP, -1.2 * TOP, 2 * TOP - 2.0**40):
        for dtype in (np.float32, np.float64):
            x = np.array([0.5, v, -3.0], dtype)
            raised = 0
            for seed in range(400):
                try:
                    natural.encode(x, seed=seed, deterministic=deterministic)
                except OverflowError as e:
                    raised += str(e) == natural.OVERFLOW_MESSAGE
            assert raised == 400, (v, np.dtype(dtype).name)
    with pytest.raises(OverflowError):
        get_codec("nc").check_exponents(block_exponents(np.array([[TOP]])))  # the negotiation's rule


def test_nc_below_the_top_level_rounds_instead_of_raising(kernel_path):
    """[2^62, 2^63) rounds to 2^62 or 2^63; a float64 just below 2^63 must not become float32's 2^63 and
    raise (the negotiation accepts it: its exponent is 63)."""
    assert {int(natural.encode(np.float32(1.5 * 2.0**62), seed=s)[0]) for s in range(400)} == {126, 127}
    near = TOP * (1 - 2.0**-40)
    assert {int(natural.encode(np.float64(near), seed=s)[0]) for s in range(400)} <= {126, 127}
    assert block_exponents(np.array([[near]])).tolist() == [63]
    get_codec("nc").check_exponents(block_exponents(np.array([[near]])))


def test_nc_blocks_below_the_lowest_level_go_out_with_the_lowest_level_as_exponent():
    """A block whose |x| < 2^-63 (exponent below NC_LEVEL_MIN) encodes to 0 or +-2^-63: its exponent goes out
    as NC_LEVEL_MIN, so the switch's range [nc_floor(e), e] holds the codes; no-data and NaN bytes stay."""
    low = wire.NC_LEVEL_MIN
    e = block_exponents(np.array([[0.0], [2.0**-66], [-2.0**-64], [2.0**-63], [1.0], [np.nan]]))
    assert e.tolist() == [wire.EXP_NONE, -65, -63, -62, 1, wire.EXP_NONFINITE]
    assert get_codec("nc").check_exponents(e).tolist() == [wire.EXP_NONE, low, low, -62, 1, wire.EXP_NONFINITE]
    assert get_codec("nc").check_exponents(e).dtype == np.int8
    codes = {int(c) for s in range(200) for c in natural.encode(np.float32([2.0**-66]), seed=s, floor=low)}
    assert codes == {0, int(natural.encode(np.float32([2.0**low]), seed=0, floor=low)[0])}


def test_nc_float64_beyond_float32_is_above_the_top_level_not_nan(kernel_path):
    """1e300 became float32 inf and was reported as NaN/Inf; it is finite, and above the top level."""
    for v in (1e300, -1e300, 3.5e38, 1e39):
        with pytest.raises(OverflowError) as e:
            natural.encode(np.array([1.0, v]))
        assert str(e.value) == natural.OVERFLOW_MESSAGE
    with pytest.raises(ValueError, match="NaN or Inf"):
        natural.encode(np.array([1.0, np.inf]))


@pytest.mark.parametrize("frac", [0.3, 0.7])
def test_nc_float64_up_rate_is_the_float64_probability(kernel_path, frac):
    """float64 went through float32, so the probability came from a mantissa rounded to 23 bits: a relative
    bias up to 2^-24, which ~2^48 plain draws could not resolve. So zoom in: element i's mantissa has the top
    23 bits of its own 52-bit uniform (its byte, word1, word3: natural._uniform) as its top 23 bits, and frac * 2^29 below. Rounded from float64 it goes up
    exactly when the word's next 29 bits are below that: rate frac; through float32 the mantissa rounds to
    top or top + 1 and the rate is 0 or 1."""
    n, seed, offset = 20000, 11, 5
    h = rng.philox_bytes(seed, offset, n).astype(np.uint64)
    w1 = rng.philox(seed, offset, n, rng.SUB_EXTRA).astype(np.uint64)
    w3 = rng.philox(seed, offset, n, rng.SUB_LOW).astype(np.uint64)
    u = (h << np.uint64(44)) | (w1 << np.uint64(12)) | (w3 >> np.uint64(20))  # the 52-bit uniform added to the mantissa
    low = np.uint64(int(frac * 2**29))
    top = np.uint64(2**23 - 1) - (u >> np.uint64(29))  # top 23 bits sum to 2^23 - 1: the low 29 decide
    mant = (top << np.uint64(29)) | low
    x = ((np.uint64(1023) << np.uint64(52)) | mant).view(np.float64)  # 1 + mant / 2^52
    codes = natural.encode(x, seed=seed, offset=offset)
    assert set(codes.tolist()) <= {64, 65}
    p = int(low) / 2**29
    assert abs((codes == 65).mean() - p) <= 5 * np.sqrt(p * (1 - p) / n)
    # unconditionally: up exactly when the 52-bit uniform plus the 52-bit mantissa carries
    y = 1 + np.random.default_rng(1).random(n)
    up = natural.encode(y, seed=seed, offset=offset) == 65
    assert np.array_equal(up, u + (y.view(np.uint64) & np.uint64(2**52 - 1)) >= np.uint64(2**52))
    # a float64 holding a float32 value gets the float32's codes (same stream, same decision)
    x32 = (np.random.default_rng(2).standard_normal(5000) * np.exp2(np.arange(5000) % 120 - 70)).astype(np.float32)
    same = natural.encode(x32, seed=3, offset=9)
    assert np.array_equal(natural.encode(x32.astype(np.float64), seed=3, offset=9), same)
    # deterministic: 1.5 - 2^-40 is nearer 1 in float64; float32 rounds it to 1.5, which went up to 2
    assert natural.encode(np.float64(1.5 - 2.0**-40), deterministic=True).tolist() == [64]


def test_nc_and_dithering_accept_torch_float_tensors(kernel_path):
    """natural.encode raised TypeError on bfloat16 (numpy has no bfloat16); allreduce converted, the codec
    API did not. bfloat16/float16 widen to float32 exactly, float64 keeps its bits."""
    torch = pytest.importorskip("torch")
    vals = [1.5, -3.25, 0.1, 1e-30, 0.0, 6.0e4, -2.0**-20]
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        t = torch.tensor(vals, dtype=dt)
        assert np.array_equal(natural.encode(t, seed=4), natural.encode(t.float().numpy(), seed=4)), dt
    t64 = torch.tensor(vals, dtype=torch.float64)
    assert np.array_equal(natural.encode(t64, seed=4), natural.encode(np.array(vals), seed=4))
    tb = torch.tensor(vals, dtype=torch.bfloat16)
    (n1, c1), (n2, c2) = dithering.encode(tb, 4, seed=2), dithering.encode(tb.float().numpy(), 4, seed=2)
    assert n1 == n2 and np.array_equal(c1, c2)
    with pytest.raises(TypeError, match="real numbers"):
        natural.encode(np.array([1 + 2j]))


def test_nc_float64_and_stochastic_fixed_kernels_are_bit_identical_to_numpy():
    assert kernels.enabled(), "the C kernels are not built"
    rs = np.random.default_rng(18)
    n = 20011
    x = rs.standard_normal(n) * np.exp2(rs.integers(-1100, 61, n))
    x[rs.random(n) < 0.05] = 0.0
    x[rs.random(n) < 0.02] = -0.0
    x[rs.random(n) < 0.02] = 5e-324  # denormal
    x[:4] = [1.5, 1.5 * 2.0**62, -(2.0**-63), 2.0**-64]
    for floor in (-100, wire.NC_LEVEL_MIN, -30, 0, 20):  # below NC_LEVEL_MIN: clamped, the same on both
        for det in (False, True):
            for seed, offset in ((0, 0), (7, 123456789), (2**64 - 1, 2**40)):
                codes, status = kernels.nc_encode(x, seed, offset, det, floor)
                assert status == 0
                assert np.array_equal(codes, natural.encode_reference(x, seed, offset, det, floor)), (floor, det)
    for bad, status in ((np.nan, kernels.NONFINITE), (1e300, kernels.OVERFLOW), (-TOP, kernels.OVERFLOW)):
        y = np.ones(100)
        y[37] = bad
        assert kernels.nc_encode(y, 0, 0, False, wire.NC_LEVEL_MIN)[1] == status
        with pytest.raises(ValueError if status == kernels.NONFINITE else OverflowError):
            natural.encode_reference(y, 0, 0, False, wire.NC_LEVEL_MIN)
    x32 = (rs.standard_normal(4099) * 3).astype(np.float32)
    x32[:4] = [0.5, -0.5, 1.5, 2.5]
    for exp, world in ((2, 2), (4, 3), (wire.EXP_NONE, 5), (-3, 64)):
        scale, limit = float(fixed.scale_for(exp, world)), fixed.INT32_MAX // world
        for seed, offset in ((0, 0), (9, 2**33)):
            native = kernels.fixed_quantize_sr(x32, scale, limit, seed, offset)
            assert np.array_equal(native, fixed.quantize_reference(x32, scale, limit, seed, offset))


# ---------------------------------------------------------------- issue 18: stochastic fixed point
def test_fixed_stochastic_rounding_is_unbiased(kernel_path):
    """Rounding to nearest sends 0 for every value below half a step, every time (a bias the sum of many
    workers and steps keeps); stochastic rounding is unbiased, with variance frac (1 - frac) steps^2 and an
    error below one step, and a retransmission rebuilds the same packet."""
    codec = get_codec("fixed", rounding="stochastic")
    assert codec.native_kind(np.zeros(1, np.float32)) is None  # the C worker loop rounds to nearest only
    n, exp, reps = 4, 3, 4000
    scale = float(fixed.scale_for(exp, n))
    x = (np.array([0.3, 0.5, 2.75, -7.1, 1e3 + 0.2, 0.0, -0.01]) / scale).astype(np.float32)
    t = x.astype(np.float64) * scale  # in steps, as the codec computes it
    block = np.tile(x, reps)  # one stream: element i draws word offset + i
    payload = codec.encode(block, exp, n, 9, 0)
    q = np.frombuffer(payload, ">i4").astype(np.float64).reshape(reps, -1)
    frac = t - np.floor(t)
    assert np.all(np.abs(q - t) < 1)
    assert np.all(np.abs(q.mean(0) - t) <= 5 * np.sqrt(frac * (1 - frac) / reps))
    np.testing.assert_allclose(q.var(0), frac * (1 - frac), rtol=0.15, atol=1e-12)
    nearest = np.frombuffer(get_codec("fixed").encode(x, exp, n, 9, 0), ">i4")
    assert nearest[0] == 0 and nearest[-1] == 0
    assert codec.encode(block, exp, n, 9, 0) == payload
    assert codec.encode(block[7:], exp, n, 9, 7) == payload[28:]
    with pytest.raises(ValueError, match="rounding"):
        get_codec("fixed", rounding="up")


def test_fixed_stochastic_second_moment_ratio_is_one_over_t(kernel_path):
    """Theorem 2 (natural-compression.txt): unbiased rounding to integers, C_int, is in no B(omega): for
    0 < t < 1, C(t) is 1 with probability t, so E C(t)^2 / t^2 = 1/t, unbounded as t -> 0. Stochastic fixed
    point is C_int on t = x * scale: its relative second moment follows 1/t (measured within binomial
    bounds, up to 512 at t = 2^-9), while NC's stays <= 9/8 on the same values (Theorem 1)."""
    codec = get_codec("fixed", rounding="stochastic")
    exp, n, reps = 0, 2, 200000
    scale = float(fixed.scale_for(exp, n))
    for k in (1, 3, 5, 7, 9):
        x = np.float32(2.0**-k / scale)
        t = float(np.float64(x) * scale)
        q = np.frombuffer(codec.encode(np.full(reps, x), exp, n, k, 0), ">i4").astype(np.float64)
        assert set(np.unique(q)) <= {0.0, 1.0}
        ratio = float((q**2).mean()) / t**2
        assert abs(ratio - 1 / t) <= 5 * np.sqrt(t * (1 - t) / reps) / t**2, (k, ratio, 1 / t)
        y = np.float32(x * 4 / 3)  # NC's worst case: 4/3 of a power of two, E C(y)^2 = 9/8 y^2
        c = natural.decode(natural.encode(np.full(reps // 10, y), seed=k), np.float64)
        assert float((c**2).mean()) / float(y) ** 2 <= 9 / 8 * 1.03


# ---------------------------------------------------------------- issue 18: standard vs natural dithering
def paper_omega(d, s, p, partition):
    """The papers' bounds: Theorem 4 for natural dithering (as the arXiv version states it), and for standard
    dithering QSGD's min(d / s^2, sqrt(d) / s) at p = 2."""
    r = min(p, 2.0)
    if partition == "natural":
        return 1 / 8 + d ** (1 / r) * 2.0 ** (1 - s) * min(1.0, d ** (1 / r) * 2.0 ** (1 - s))
    return min(d / s**2, np.sqrt(d) / s) if p == 2 else np.inf


@pytest.mark.parametrize("partition", ["natural", "standard"])
def test_dithering_unbiased_with_the_exact_variance_within_its_bounds(partition):
    """Per vector: the mean over draws is x, the mean squared error is the exact variance sum (hi - y)(y - lo)
    norm^2, and that is below omega ||x||^2, ours (variance_bound) and the paper's; on x = ones (each y_i =
    1/sqrt(d)) with s = 1 the bound is nearly reached, so it is not vacuous."""
    rs = np.random.default_rng(7)
    draws = 2000
    for d, s, p in ((16, 2, 2.0), (64, 4, 2.0), (64, 3, 1.0), (200, 6, np.inf), (50, 1, 2.0)):
        x = rs.standard_normal(d) * np.exp2(rs.integers(-4, 4, d))
        out = np.stack([dithering.decode(*dithering.encode(x, s, p, seed=t, partition=partition), s, partition,
                                         np.float64) for t in range(draws)])
        err = out - x
        v = dithering.variance(x, s, p, partition)
        assert np.all(np.abs(err.mean(0)) <= 5 * np.sqrt(v / draws)), (d, s, p)
        mse = float((err**2).sum(1).mean())
        assert abs(mse - v) <= 0.1 * v, (d, s, p, mse, v)
        x2 = float(x @ x)
        assert v <= dithering.variance_bound(d, s, p, partition) * x2 <= paper_omega(d, s, p, partition) * x2
    d = 256
    ones = np.ones(d)
    tight = dithering.variance(ones, 1, 2.0, partition) / d
    omega = dithering.variance_bound(d, 1, 2.0, partition)
    assert 0.9 * omega <= tight <= omega


def test_natural_dithering_needs_exponentially_fewer_levels():
    """Theorem 5 / App. B.2 (Fig. 9, 10) on a Gaussian vector: with s levels each, natural dithering's
    variance is several times standard's; standard needs 2^(s-1) levels (s + 1 bits an entry instead of
    1 + log2(s + 1)) to match it."""
    x = np.random.default_rng(3).standard_normal(4096)
    for s in (5, 6, 7):
        nat = dithering.variance(x, s)
        assert nat < dithering.variance(x, s, partition="standard") / 3
        assert 0.8 < nat / dithering.variance(x, 2 ** (s - 1), partition="standard") < 1.25
        assert dithering.bits_per_entry(s) < dithering.bits_per_entry(2 ** (s - 1))


def test_dithering_rejects_bad_options():
    for kw in ({"levels": 0}, {"levels": 128}, {"partition": "uniform"}, {"p": 0.5}):
        with pytest.raises(ValueError):
            dithering.encode(np.ones(3), **kw)
    assert dithering.encode(np.ones(3), levels=32767, partition="standard")[1].dtype == np.uint16
    with pytest.raises(ValueError, match="NaN or Inf"):
        dithering.encode(np.array([1.0, np.nan]))
    with pytest.raises(OverflowError, match="float32"):
        dithering.encode(np.array([1e300]))
    with pytest.raises(ValueError, match="level index"):
        dithering.decode(np.float32(1), np.array([5], np.uint8), levels=4)
