"""The worker codec kernels on every instruction set (issue 15): each path (scalar C, AVX2, AVX-512) equals the
numpy reference bit for bit for the same seed and offset, on random inputs and on the edge cases; Philox
against Random123's known answers; INA_SIMD forcing a path."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from hostlib import kernels, wire
from hostlib.codecs import dithering, fixed, natural
from inaproto import rng

pytestmark = pytest.mark.skipif(kernels.lib is None, reason="the C kernels are not built")

# Random123 tests/kat_vectors, the three "philox4x32 10" lines: counter, key, expected output
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]
# offsets: aligned, each misalignment, a crossing of counter word 1 (position 2^34), near the top of the stream
OFFSETS = [0, 1, 2, 3, 6, 2**34 - 37, 2**64 - 5000]
SEED = 0x0123456789ABCDEF


@pytest.fixture(params=kernels.SIMD_PATHS)
def path(request, monkeypatch):
    """Run a test on one path (skipped where the CPU lacks it), with the C kernels on."""
    if request.param not in kernels.simd_supported():
        pytest.skip(f"this CPU cannot run {request.param}")
    monkeypatch.delenv("INA_KERNELS", raising=False)
    before = kernels.SIMD_PATHS[kernels.lib.ina_simd_get()]
    kernels.set_simd(request.param)
    yield request.param
    kernels.set_simd(before)


def edge_values() -> np.ndarray:
    """float32 edge cases for NC: zeros, subnormals, every power of two in the code table, the smallest and
    largest levels and their neighbours, tiny negatives, and random values over the whole range."""
    f32 = np.float32
    tiny = np.array([0.0, -0.0, 1e-45, -1e-45, 1.1754942e-38, 2.0**-126, -(2.0**-100), -1e-30, 2.0**-64,
                     2.0**-63, -(2.0**-63), 2.0**-63 * 1.5, 2.0**62, -(2.0**62), 2.0**62 * 1.999, 2.0**63 * (1 - 2.0**-24)],
                    dtype=f32)
    powers = np.exp2(np.arange(wire.NC_LEVEL_MIN, wire.NC_LEVEL_MAX)).astype(f32)
    rs = np.random.default_rng(1)
    rand = (rs.standard_normal(3000) * np.exp2(rs.integers(-90, 62, 3000))).astype(f32)
    rand = np.clip(rand, -(2.0**62), 2.0**62).astype(f32)
    return np.concatenate([tiny, powers, -powers, rand, tiny[::-1]])


def test_philox_known_answers():
    """Random123's known-answer vectors, in numpy and in C; and the stream's counter layout."""
    for ctr, key, want in KAT:
        assert rng.philox4x32_10(ctr, key)[:, 0].tolist() == list(want)
        assert kernels.philox_raw(ctr, key) == list(want)
    # position i of sub-stream s: word i & 3 of counter (i >> 2, i >> 34, s, 0), key (seed low, seed high)
    i, s = 2**36 + 4 * 5 + 2, 1
    want = rng.philox4x32_10((i >> 2, i >> 34, s, 0), (SEED & 0xFFFFFFFF, SEED >> 32))[2, 0]
    assert rng.philox(SEED, i, 1, s)[0] == want == rng.philox_at(SEED, [i], s)[0]


def test_nc_byte_stream_layout():
    """NC's first 8 random bits of position i: byte i & 3 (little-endian) of the word at position i >> 2, so
    one draw feeds 16 positions; any slice of the byte stream is the stream at its own offset."""
    for i in (0, 1, 2, 3, 4, 17, 2**34 - 37, 2**36 + 4 * 5 + 2, 2**64 - 5):
        want = (int(rng.philox(SEED, i >> 2, 1)[0]) >> (8 * (i & 3))) & 0xFF
        assert rng.philox_bytes(SEED, i, 1)[0] == want, i
    b = rng.philox_bytes(SEED, 3, 100)
    for k in (1, 4, 13, 16, 99):
        assert np.array_equal(b[k:], rng.philox_bytes(SEED, 3 + k, 100 - k))
    assert not np.array_equal(b, rng.philox_bytes(SEED, 3, 100, rng.SUB_EXTRA))


@pytest.mark.parametrize("offset", [0, 5, 2**34 - 37])
def test_nc_ties_read_word1_on_every_path(path, offset):
    """The byte decides the carry unless the mantissa's top 8 bits plus the byte are 0xFF; then word1's top
    15 bits do. Every element here is such a tie (its low 15 mantissa bits 0x2AAA), mixed in each vector with
    zeros, values below the floor and plain values: each path equals the model, the lanes at or above the
    floor equal the eager definition (the 23-bit uniform byte << 15 | word1 >> 17 added to every element),
    and the ties go up at the rate of their low bits (0x2AAA / 2^15)."""
    n = 20000
    rs = np.random.default_rng(4)
    h = rng.philox_bytes(SEED, offset, n).astype(np.uint32)
    e = rs.integers(127 - 40, 127 + 40, n).astype(np.uint32)
    bits = (rs.integers(0, 2, n).astype(np.uint32) << 31) | (e << 23) | ((0xFF - h) << 15) | np.uint32(0x2AAA)
    x = bits.view(np.float32).copy()
    x[::7], x[3::11], x[5::13] = 0.0, np.float32(-1e-30), np.float32(1.3)
    w1 = rng.philox(SEED, offset, n, rng.SUB_EXTRA).astype(np.uint64)
    mag = x.view(np.uint32).astype(np.uint64) & np.uint64(0x7FFFFFFF)
    eager = ((((mag + ((h.astype(np.uint64) << np.uint64(15)) | (w1 >> np.uint64(17)))) >> np.uint64(23))
              - np.uint64(127 - wire.NC_BIAS)).astype(np.uint8)) | ((x.view(np.uint32) >> 31) << 7).astype(np.uint8)
    tie = np.ones(n, bool)
    tie[::7] = tie[3::11] = tie[5::13] = False
    for floor in (wire.NC_LEVEL_MIN, -20, 62, 63):
        codes, status = kernels.nc_encode(x, SEED, offset, False, floor)
        assert status == 0 and np.array_equal(codes, natural.encode_reference(x, SEED, offset, False, floor)), floor
        above = (mag >> np.uint64(23)).astype(np.int64) - 127 >= floor
        assert np.array_equal(codes[above], eager[above]), floor
    codes = kernels.nc_encode(x, SEED, offset, False, wire.NC_LEVEL_MIN)[0]
    up = (codes[tie] & 0x7F).astype(np.int64) - wire.NC_BIAS > e[tie].astype(np.int64) - 127
    p = 0x2AAA / 2**15
    assert abs(up.mean() - p) <= 5 * np.sqrt(p * (1 - p) / tie.sum())
    assert np.array_equal(up, (np.uint64(0x2AAA) + (w1[tie] >> np.uint64(17))) >= np.uint64(2**15))


@pytest.mark.parametrize("offset", OFFSETS)
def test_stream_words_every_path(path, offset):
    for n in (0, 1, 5, 64, 200, 1027):
        for s in (0, 1, 2, 0xFFFFFFFF):
            assert np.array_equal(kernels.philox(SEED, offset, n, s), rng.philox(SEED, offset, n, s)), (n, s)


@pytest.mark.parametrize("deterministic", [False, True])
def test_nc_encode_every_path_equals_numpy(path, deterministic):
    x = edge_values()
    for floor in (wire.NC_LEVEL_MIN, -70, -20, 0, 30):
        for offset in OFFSETS:
            ref = natural.encode_reference(x, SEED, offset, deterministic, floor)
            codes, status = kernels.nc_encode(x, SEED, offset, deterministic, floor)
            assert status == 0 and np.array_equal(codes, ref), (floor, offset)
            # and on a slice: head and tail lengths differ
            codes, status = kernels.nc_encode(x[3:-5], SEED, offset + 3, deterministic, floor)
            assert np.array_equal(codes, ref[3:-5])


def test_nc_powers_of_two_and_tiny_negatives(path):
    """Exact powers of two come back unchanged whatever the draw (no doubling, as GRACE's NC did); a tiny
    negative goes to 0 or -2^floor (never to a positive code)."""
    p = np.exp2(np.arange(wire.NC_LEVEL_MIN, wire.NC_LEVEL_MAX)).astype(np.float32)
    x = np.concatenate([p, -p] * 3)
    for seed in range(5):
        assert np.array_equal(natural.decode(natural.encode(x, seed=seed, offset=seed)), x)
    neg = np.full(1000, -1e-30, np.float32)
    for floor in (-63, -90, -20):
        codes = natural.encode(neg, seed=3, floor=floor)
        f = max(floor, wire.NC_LEVEL_MIN)
        assert set(np.unique(codes).tolist()) <= {0, 0x80 | (f + wire.NC_BIAS)}


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nc_nonfinite_is_an_error_on_every_path(path, bad):
    for at in (0, 1, 100, 4999):
        x = np.linspace(-3, 3, 5000).astype(np.float32)
        x[at] = bad
        x[7] = 2.0**64  # NaN/Inf outranks overflow
        for offset in (0, 3):
            assert kernels.nc_encode(x, SEED, offset, False, -63)[1] == kernels.NONFINITE
        with pytest.raises(ValueError, match="NaN or Inf"):
            natural.encode(x)


def test_nc_at_or_above_the_top_level_is_an_error_whatever_the_draw(path):
    for big in (2.0**63, -(2.0**63), 1.5 * 2.0**63, 3.4e38):
        for at in (0, 2, 130, 4999):
            x = np.full(5000, 0.5, np.float32)
            x[at] = big
            for seed in range(20):
                for det in (False, True):
                    assert kernels.nc_encode(x, seed, seed, det, -63)[1] == kernels.OVERFLOW
    # just below the top level rounds (to 2^62 or 2^63) and is no error
    x = np.full(5000, 2.0**63 * (1 - 2.0**-24), np.float32)
    codes, status = kernels.nc_encode(x, 1, 0, False, -63)
    assert status == 0 and set(np.unique(codes).tolist()) <= {126, 127}


def test_nc_floor_above_the_top_level(path):
    """A floor above 2^63 sends everything finite to 0 (2^70 is out of the table, but up with probability
    |x| / 2^70, which no 300 draws reach) or to an overflow, the same on every path as in numpy."""
    x = np.concatenate([np.zeros(100), np.full(100, 1e-30), np.ones(100)]).astype(np.float32)
    codes, status = kernels.nc_encode(x, 1, 0, False, 70)
    assert status == 0 and np.array_equal(codes, natural.encode_reference(x, 1, 0, False, 70))
    x[150] = 2.0**64
    assert kernels.nc_encode(x, 1, 0, False, 70)[1] == kernels.OVERFLOW


def test_nc_decode_every_path(path):
    every = np.arange(256, dtype=np.uint8)
    values, status = kernels.nc_decode(every)
    assert status == kernels.BAD_CODE  # 0x80
    valid = every != 0x80
    assert np.array_equal(values[valid], natural._DECODE[every[valid]].astype(np.float32))
    codes = np.random.default_rng(2).integers(0, 256, 10007).astype(np.uint8)
    codes[codes == 0x80] = 1
    values, status = kernels.nc_decode(codes)
    assert status == 0 and np.array_equal(values, natural._DECODE[codes].astype(np.float32))
    codes[9999] = 0x80
    assert kernels.nc_decode(codes)[1] == kernels.BAD_CODE


@pytest.mark.parametrize("shift", [0, 1, 3, 16])
def test_nc_decode_streaming_stores_equal_plain(path, shift):
    """The worker loop's decode for large outputs (non-temporal stores from out's first 64-byte line) writes
    what the plain decode writes, wherever out starts, and finds a bad code in the head, body or tail."""
    codes = np.random.default_rng(5).integers(0, 256, 5003).astype(np.uint8)
    codes[codes == 0x80] = 3
    buf = np.full(5003 + 32, -1.0, dtype=np.float32)
    out = buf[shift:shift + 5003]
    values, status = kernels.nc_decode(codes, out=out, nt=True)
    assert status == 0 and np.array_equal(out, natural._DECODE[codes].astype(np.float32))
    assert (buf[:shift] == -1).all() and (buf[shift + 5003:] == -1).all()
    for bad in (0, 2000, 5002):
        c = codes.copy()
        c[bad] = 0x80
        assert kernels.nc_decode(c, out=out, nt=True)[1] == kernels.BAD_CODE


@pytest.mark.parametrize("shift", [0, 1, 3, 16])
@pytest.mark.parametrize("n", [0, 5, 16, 17, 256, 5003])
def test_int32_unwire_streaming_stores_equal_plain(path, shift, n):
    """The int32 worker loop's store of a large output (a result's big-endian sums, by streaming stores from
    out's first whole line) writes each sum in native order, and nothing before or after out."""
    be = np.random.default_rng(n).integers(-2**31, 2**31, n, dtype=np.int64).astype(">i4")
    buf = np.full(n + 32, -7, dtype=np.int32)
    out = buf[shift:shift + n]
    kernels.int32_unwire_nt(be, out=out)
    assert np.array_equal(out, be.astype(np.int32))
    assert (buf[:shift] == -7).all() and (buf[shift + n:] == -7).all()


def fixed_inputs() -> np.ndarray:
    rs = np.random.default_rng(3)
    x = rs.standard_normal(4099).astype(np.float32)
    x[:8] = [0.5, 1.5, 2.5, -0.5, -2.5, -0.0, 3.0, -3.0]  # ties to even after scale 1
    x[8:16] = [1e9, -1e9, 2.0**31, -(2.0**31), 1e-45, -1e-45, 7.0, -7.0]  # beyond the clip
    return x


def test_fixed_quantize_every_path_equals_numpy(path):
    x = fixed_inputs()
    for scale, limit in ((1.0, 2**31 - 1), (1000.0, 5), (float(fixed.scale_for(3, 4)), (2**31 - 1) // 4)):
        ref = fixed.quantize_reference(x, scale, limit)
        assert np.array_equal(kernels.fixed_quantize(x, scale, limit), ref)
        for offset in OFFSETS:
            ref = fixed.quantize_reference(x, scale, limit, SEED, offset)
            assert np.array_equal(kernels.fixed_quantize_sr(x, scale, limit, SEED, offset), ref), (scale, offset)


def test_fixed_dequantize_every_path(path):
    rs = np.random.default_rng(4)
    sums = rs.integers(-(2**31), 2**31, 10007).astype(np.int32)
    k = 300
    exps = rs.integers(-30, 30, -(-sums.size // k)).astype(np.int8)
    exps[1] = wire.EXP_NONE
    scales = np.repeat(fixed.scale_for(exps, 4), k)[:sums.size]
    ref = (sums.astype(np.float64) / scales).astype(np.float32)
    assert np.array_equal(kernels.fixed_dequantize(sums, exps, 4, k), ref)


@pytest.mark.parametrize("partition, levels", [("natural", 1), ("natural", 3), ("natural", 8), ("natural", 127),
                                               ("standard", 1), ("standard", 3), ("standard", 10),
                                               ("standard", 32767)])
def test_dithering_every_path_equals_numpy(path, partition, levels):
    rs = np.random.default_rng(5)
    norm = np.float32(4.0)
    x = (rs.standard_normal(3001) * np.exp2(rs.integers(-40, 1, 3001))).astype(np.float32)
    x = np.clip(x, -4, 4).astype(np.float32)
    table = dithering.level_table(levels, partition)
    x[:levels + 1 if levels < 200 else 200] = (table * 4.0)[:200].astype(np.float32)  # exactly on the levels
    x[300:310] = [0.0, -0.0, 4.0, -4.0, 1e-45, -1e-45, 2.0, -2.0, 4.0 * 2**-126, 3.9999998]
    dtype, sign = (np.uint8, 0x80) if partition == "natural" else (np.uint16, 0x8000)
    for offset in (0, 1, 3, 2**34 - 37):
        ref = dithering.encode_reference(x.astype(np.float64), norm, table, SEED, offset, dtype, sign)
        got = kernels.dither_encode(x, float(norm), levels, partition == "standard", SEED, offset)
        assert got.dtype == dtype and np.array_equal(got, ref), offset


def test_dithering_codec_uses_the_kernel(path, monkeypatch):
    x = np.random.default_rng(6).standard_normal(2000).astype(np.float32)
    for partition in dithering.PARTITIONS:
        norm, codes = dithering.encode(x, 5, seed=9, offset=2, partition=partition)
        monkeypatch.setenv("INA_KERNELS", "numpy")
        assert dithering.encode(x, 5, seed=9, offset=2, partition=partition)[1].tolist() == codes.tolist()
        monkeypatch.delenv("INA_KERNELS")


def test_out_buffers_are_reused_and_checked(path):
    x = np.linspace(-1, 1, 1000).astype(np.float32)
    codes = np.empty(1000, np.uint8)
    assert natural.encode(x, seed=1, out=codes) is codes
    assert np.array_equal(codes, natural.encode(x, seed=1))
    values = np.empty(1000, np.float32)
    assert natural.decode(codes, out=values) is values
    assert np.array_equal(values, natural.decode(codes))
    with pytest.raises(ValueError, match="out must be"):
        natural.encode(x, out=np.empty(999, np.uint8))
    with pytest.raises(ValueError, match="out must be"):
        natural.decode(codes, out=np.empty(1000, np.float64))


def _path_in_subprocess(value: str):
    env = {**os.environ, "INA_SIMD": value}
    env.pop("INA_KERNELS", None)
    return subprocess.run([sys.executable, "-c", "from hostlib import kernels; print(kernels.simd_path())"],
                          capture_output=True, text=True, env=env, timeout=60)


def test_ina_simd_forces_a_path():
    for p in kernels.simd_supported():
        run = _path_in_subprocess(p)
        assert run.returncode == 0 and run.stdout.strip() == p, run.stderr
    run = _path_in_subprocess("sse9")
    assert run.returncode != 0 and "INA_SIMD: unknown path 'sse9'" in run.stderr
    if "avx512" not in kernels.simd_supported():
        run = _path_in_subprocess("avx512")
        assert run.returncode != 0 and "this CPU cannot run it" in run.stderr
