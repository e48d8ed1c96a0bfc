"""The CUDA codec kernels (csrc/cuda, hostlib.cuda) and the GPU path of allreduce.

Where nvcc is (no GPU needed): every .cu compiles for sm_80 and sm_90 with warnings as errors, the library
builds and loads, and an emulation build of the same source runs the kernels' thread bodies on the CPU
(`kernels` fixture, "emulated"), checked bit for bit against the CPU codecs, through hostlib.cuda's
wrappers and Communicator.allreduce's GPU path. Everywhere: raise_floor_host's law. On a machine with a GPU
the same tests run on the real kernels ("gpu"), with the allreduce of CUDA tensors and the DDP hook; here they
skip with the reason hostlib.cuda.available() gives.
"""
from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[torch]')")

import hostlib  # noqa: E402
from hostlib import cuda as hc, wire  # noqa: E402
from hostlib.codecs import base, fixed, natural  # noqa: E402
from hostlib.codecs.ditherswitch import DitherCodec, dither_floor  # noqa: E402
from inabench.harness import ROOT, SwitchProcess  # noqa: E402

from .test_e2e import run_workers  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "csrc", "cuda"))
import build_cuda  # noqa: E402

NVCC = build_cuda.find_nvcc()
NO_NVCC = "nvcc not found (PATH, $NVCC, $CUDA_HOME/bin, /usr/local/cuda/bin): the CUDA sources cannot be compiled here"
GPU_OK, GPU_WHY = hc.available()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason=NO_NVCC)
needs_gpu = pytest.mark.skipif(not GPU_OK, reason=f"needs a GPU: {GPU_WHY}")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# ---------------------------------------------------------------- the build

@needs_nvcc
def test_the_flags_turn_a_device_warning_into_an_error(tmp_path):
    src = tmp_path / "w.cu"
    src.write_text("__global__ void k(float *x) { int unused; x[0] = 1; }\n")
    run = subprocess.run([NVCC, *build_cuda.NVCC_FLAGS, "--generate-code", "arch=compute_80,code=sm_80", "-c", "-o",
                          str(tmp_path / "w.o"), str(src)], capture_output=True, text=True)
    assert run.returncode != 0 and "unused" in run.stdout + run.stderr


@needs_nvcc
def test_library_builds_without_warnings_loads_and_exports_every_launcher(tmp_path):
    """One nvcc run compiles every .cu for sm_80 and sm_90 with every warning an error (nvcc's, cicc's,
    ptxas's and the host compiler's: test_the_flags_turn_a_device_warning_into_an_error shows they bite), and
    says nothing: every source compiles without a warning on both architectures."""
    command = build_cuda.compile_command(NVCC, build_cuda.sources(), "lib.so")
    assert set(build_cuda.sources()) <= set(command) and len(build_cuda.sources()) >= 1
    for arch in ("sm_80", "sm_90"):
        assert any(arch in part for part in command), arch
    for flag in build_cuda.WARNINGS:
        assert flag in command, flag
    log: list = []
    out = build_cuda.build(str(tmp_path / "_ina_cuda.so"), NVCC, log)
    assert "warning" not in log[0].lower(), log[0]
    lib = ctypes.CDLL(out)
    assert set(hc.declare(lib)) == set(hc._SIGNATURES)
    lib.ina_cuda_error_name.restype = ctypes.c_char_p
    count = ctypes.c_int(-1)
    rc = lib.ina_cuda_device_count(ctypes.byref(count))  # without a driver: an error code, not a crash
    assert lib.ina_cuda_error_name(rc).startswith(b"cuda") and (rc != 0 or count.value >= 0)


def test_available_gives_the_precise_reason():
    known = [r"hostlib/_ina_cuda\.so not built \((nvcc not found at install|nvcc is at .+: run `make cuda` or reinstall)\)",
             r"hostlib/_ina_cuda\.so does not load: .+",
             r"no CUDA device: cudaGetDeviceCount returned \d+ \(cudaError\w+: [^;]+(; [^;]+)?\)",
             r"no CUDA device: cudaGetDeviceCount found 0 devices",
             r"torch is not installed", r"torch has no CUDA \(CPU build: torch .+\)",
             r"torch sees no CUDA device \(torch\.cuda\.is_available\(\) is False\)"]
    ok, why = hc.available()
    if ok:
        assert why == ""
        return
    parts = re.split(r"; (?=no CUDA|torch|hostlib)", why)
    for part in parts:
        assert any(re.fullmatch(k, part) for k in known), part
    if torch.version.cuda is None:
        assert f"torch has no CUDA (CPU build: torch {torch.__version__})" in why
    if os.path.exists(hc.LIB_PATH) and "does not load" not in why:
        assert hc._load()[0] is not None  # the library itself loads here, driver or not


def test_cpu_tensors_and_other_codecs_keep_the_host_path():
    assert not hc.allreduce_applies(natural.NaturalCodec(), torch.ones(4))
    assert not hc.allreduce_applies(fixed.FixedPointCodec(), torch.ones(4))
    if not GPU_OK:
        with pytest.raises(RuntimeError, match="CUDA codecs unavailable: " + re.escape(GPU_WHY)):
            hc._launchers()


# ---------------------------------------------------------------- where the kernels run

@pytest.fixture(scope="module")
def emulation(tmp_path_factory):
    """The launchers of an emulation build (-DINA_CUDA_EMULATE): the kernels' bodies on the CPU."""
    if NVCC is None:
        pytest.skip(NO_NVCC)
    out = str(tmp_path_factory.mktemp("emu") / "emu.so")
    cmd = build_cuda.compile_command(NVCC, build_cuda.sources(), out, ["--generate-code", "arch=compute_80,code=sm_80"])
    run = subprocess.run([*cmd[:1], "-DINA_CUDA_EMULATE", *cmd[1:]], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    return hc.declare(ctypes.CDLL(out), "ina_emu_")


@pytest.fixture(params=["emulated", "gpu"])
def device(request, monkeypatch):
    """Where the tensors live: "gpu" runs the real kernels on CUDA tensors; "emulated" the same thread bodies
    on CPU tensors (hostlib.cuda's wrappers unchanged but for the launch)."""
    if request.param == "gpu":
        if not GPU_OK:
            pytest.skip(f"needs a GPU: {GPU_WHY}")
        return torch.device("cuda")
    fns = request.getfixturevalue("emulation")

    def launch(name, t, *args):
        rc = fns[name](*args, 0)
        if rc:
            raise hc.CudaError(f"{name}: cudaError_t {rc}")

    monkeypatch.setattr(hc, "_launch", launch)
    monkeypatch.setattr(hc, "_on_device", lambda t: True)
    return torch.device("cpu")


def edge_values() -> np.ndarray:
    """Zeros, subnormals, exact powers of two, the smallest and largest levels and their neighbours, tiny
    negatives, halfway mantissas."""
    f32 = np.float32
    bits = np.array([0x00000001, 0x007FFFFF, 0x00800000, 0x5EFFFFFF, 0x1F800000, 0x1F7FFFFF, 0x20000000], np.uint32)
    vals = [0.0, -0.0, 1.0, -1.0, 1.5, -1.75, 0.75, 2.0**-63, 2.0**-64, 2.0**-63 * 1.5, 2.0**62, -(2.0**62) * 1.999,
            -1e-30, -(2.0**-70), -1e-45, 1e-45, 3.0 * 2**-66, 2.0**-126, -(2.0**-149)]
    v = np.concatenate([np.array(vals, f32), bits.view(f32), -bits.view(f32)])
    return np.tile(v, 3)  # each value at several offsets mod 4


def random_values(rs, n: int, dtype) -> np.ndarray:
    """Normal values spread over many binades, within the dtype's finite range."""
    lo, hi = (-40, 10) if dtype == torch.float16 else (-80, 40)
    return (rs.standard_normal(n) * 2.0 ** rs.integers(lo, hi, n)).astype(np.float32)


def as_input(values: np.ndarray, dtype, device, finite: bool = False):
    """values in dtype on device, and the float32 the CPU codecs see (widened exactly); finite: without the
    values the conversion took to Inf or to 2^63 and beyond (float16's range ends at 65504)."""
    t = torch.from_numpy(values).to(dtype)
    if finite:
        t = t[t.float().abs() < 2.0**63]
    return t.to(device), t.float().numpy()


# ---------------------------------------------------------------- bit for bit against the CPU codecs

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("det", [False, True], ids=["stochastic", "deterministic"])
def test_encode_is_bit_identical_to_the_cpu(device, dtype, det):
    rs = np.random.default_rng(7)
    values = np.concatenate([random_values(rs, 20011, dtype), edge_values()])
    x, ref = as_input(values, dtype, device, finite=True)
    # vectorised (aligned data, offset % 4 == 0) and one-element paths; offsets past 2^34 (counter word 1)
    for seed, offset, floor, start in [(1, 0, wire.NC_LEVEL_MIN, 0), (2**40 + 5, 2**34 + 4, -20, 0), (9, 6, 0, 0),
                                       (9, 3, 0, 1), (2**63 + 1, 2**34 - 2, -90, 3)]:
        got = hc.nc_encode(x[start:], seed, offset, floor, det).cpu().numpy()
        want = natural.encode(ref[start:], seed, offset, det, floor)
        assert np.array_equal(got, want), (seed, offset, floor, start, np.flatnonzero(got != want)[:8])


@pytest.mark.parametrize("span", [wire.NC_SPAN, 4], ids=["nc", "dither4"])
@pytest.mark.parametrize("k", [1024, 1000])
def test_encode_with_floors_per_block_is_the_cpu_encode_of_each_block(device, span, k):
    rs = np.random.default_rng(k + span)
    values = random_values(rs, 5 * k + 77, torch.float32)
    values[3 * k:4 * k] = 0
    x, ref = as_input(values, torch.float32, device)
    exps = base.block_exponents(np.pad(ref, (0, -ref.size % k)).reshape(-1, k))
    floors = [hc.floor_of_exp(int(e), span) for e in exps]
    exps_t = torch.from_numpy(exps).to(device)
    got = hc.nc_encode(x, 11, 0, exps_t, False, k=k, span=span).cpu().numpy()
    by_floor = hc.nc_encode(x, 11, 0, torch.tensor(floors, dtype=torch.int8, device=device), False, k=k).cpu().numpy()
    want = np.concatenate([natural.encode(ref[b * k:(b + 1) * k], 11, b * k, False, f) for b, f in enumerate(floors)])
    assert np.array_equal(got, want) and np.array_equal(by_floor, want)
    if span == 4:
        assert floors[0] == dither_floor(int(exps[0]), 4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_encode_raises_what_the_cpu_raises(device, dtype):
    big = np.float32(2.0**63) if dtype != torch.float16 else None
    cases = [(np.float32("nan"), ValueError), (np.float32("inf"), ValueError), (-np.float32("inf"), ValueError)]
    if big is not None:
        cases += [(big, OverflowError), (-big * 4, OverflowError)]
    for bad, error in cases:
        values = np.ones(37, np.float32)
        values[21] = bad
        x, ref = as_input(values, dtype, device)
        for det in (False, True):
            with pytest.raises(error) as cpu:
                natural.encode(ref, 3, 0, det)
            with pytest.raises(error) as gpu:
                hc.nc_encode(x, 3, 0, deterministic=det)
            assert str(gpu.value) == str(cpu.value)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_of_every_code_is_the_cpus(device, dtype):
    codes = np.array([c for c in range(256) if c != 0x80] * 3, np.uint8)
    for divisor in (1.0, 3.0):
        got = hc.nc_decode(torch.from_numpy(codes).to(device), dtype, divisor).cpu()
        want = (torch.from_numpy(natural.decode(codes)) / torch.tensor(divisor, dtype=torch.float32)).to(dtype)
        assert got.dtype == dtype and torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                                                  want.view(torch.int16 if dtype != torch.float32 else torch.int32))
    with pytest.raises(ValueError, match="0x80"):
        hc.nc_decode(torch.tensor([1, 0x80, 2], dtype=torch.uint8, device=device))


def test_raise_floor_kernel_is_raise_floor_host(device):
    rs = np.random.default_rng(5)
    codes = rs.integers(0, 256, 40000).astype(np.uint8)
    codes[codes == 0x80] = 0
    codes[::7] = rs.integers(1, 60, codes[::7].size) | (rs.integers(0, 2, codes[::7].size) << 7)  # far below
    for floor, det, offset, start in [(-20, False, 0, 0), (5, False, 9, 1), (63, False, 4, 0), (-5, True, 0, 2)]:
        c = torch.from_numpy(codes[start:].copy()).to(device)
        got = hc.raise_floor(c, floor, 77, offset, det).cpu().numpy()
        want = hc.raise_floor_host(codes[start:], floor, 77, offset, det)
        assert np.array_equal(got, want), (floor, det, offset, np.flatnonzero(got != want)[:8])
    k = 1000
    exps = rs.integers(-60, 60, -(-codes.size // k)).astype(np.int8)
    got = hc.raise_floor(torch.from_numpy(codes.copy()).to(device), torch.from_numpy(exps).to(device), 1, 0, k=k,
                         span=8).cpu().numpy()
    want = np.concatenate([hc.raise_floor_host(codes[b * k:(b + 1) * k], hc.floor_of_exp(int(e), 8), 1, b * k)
                           for b, e in enumerate(exps)])
    assert np.array_equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", [1024, 1000, 7])
def test_block_exponents_are_the_cpus(device, dtype, k):
    rs = np.random.default_rng(k)
    values = random_values(rs, 9 * k + 3, dtype)
    values[k:2 * k] = 0
    values[2 * k + 5] = np.float32("nan")
    values[3 * k:4 * k] = np.float32(1e-45) if dtype == torch.float32 else 0
    x, ref = as_input(values, dtype, device)
    got = hc.block_exponents(x, k, check=False).cpu().numpy()
    want = base.block_exponents(np.pad(ref, (0, -ref.size % k)).reshape(-1, k))
    assert np.array_equal(got, want)
    if dtype == torch.float32:
        with pytest.raises(OverflowError):
            hc.block_exponents(torch.full((10,), 3e38).to(device), 4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_fixed_point_is_the_cpus(device, dtype, stochastic):
    rs = np.random.default_rng(3)
    edges = edge_values()
    values = np.concatenate([rs.standard_normal(4099).astype(np.float32) * 100, edges[np.abs(edges) < 1e4]])
    x, ref = as_input(values, dtype, device, finite=True)
    world, exp, seed, offset = 3, 8, 12345, 4
    scale, limit = float(fixed.scale_for(exp, world)), fixed.INT32_MAX // world
    for big_endian in (True, False):
        got = hc.fixed_quantize(x, exp, world, stochastic=stochastic, seed=seed, offset=offset,
                                big_endian=big_endian).cpu().numpy()
        want = fixed.quantize_reference(ref, scale, limit, seed if stochastic else None, offset)
        assert np.array_equal(got.view(">i4") if big_endian else got, want if big_endian else want.astype(np.int32))
    k = 1000
    exps = rs.integers(-10, 20, -(-values.size // k)).astype(np.int8)
    sums = rs.integers(-(2**31) + 1, 2**31 - 1, values.size).astype(np.int32)
    got = hc.fixed_dequantize(torch.from_numpy(sums).to(device), torch.from_numpy(exps).to(device), world, k=k,
                              dtype=dtype).cpu()
    want = torch.from_numpy(fixed.FixedPointCodec().decode(sums.astype(np.int64), exps, world, k).astype(np.float32))
    assert torch.equal(got, want.to(dtype))


# ---------------------------------------------------------------- the law of the codes

def test_encode_is_unbiased_within_the_nine_eighths_bound(device):
    rs = np.random.default_rng(11)
    values = (rs.standard_normal(2000) * 2.0 ** rs.integers(-50, 40, 2000)).astype(np.float32)  # above the floor
    values = np.concatenate([values, np.float32([4 / 3, -4 / 3 * 2**-20])])
    x, ref = as_input(values, torch.float32, device)
    draws = np.stack([natural.decode(hc.nc_encode(x, seed).cpu().numpy(), np.float64) for seed in range(400)])
    a = np.abs(ref.astype(np.float64))
    lo = np.ldexp(0.5, np.frexp(a)[1])
    var = (2 * lo - a) * (a - lo)  # exact variance of C(x): <= x^2 / 8
    assert np.all(var <= a * a / 8 * (1 + 1e-12))
    assert np.all(np.abs(draws.mean(0) - ref) <= 5 * np.sqrt(var / 400) + 1e-300)
    second = (draws**2).mean(0)
    # E C^2 = a^2 + var; C^2 is lo^2 or 4 lo^2 (up with p = a / lo - 1): the sum of the 400-draw means within
    # 5 of its standard deviations (a few elements of the 90 binades carry most of it: about 0.6 %)
    p = a / lo - 1
    sd = np.sqrt((p * (1 - p) * (3 * lo * lo) ** 2).sum() / 400)
    assert abs(second.sum() - (a * a + var).sum()) <= 5 * sd
    assert np.all(second[-2:] / (a[-2:] ** 2) < 9 / 8 * 1.05)  # 4/3: the worst case, E C^2 = 9/8 x^2


def test_raised_codes_have_the_law_of_encoding_with_the_higher_floor():
    """Encoding at a low floor then raising the floor to f gives {0, 2^f} with mean |x|: the law of encoding
    with floor f directly, so E C^2 = 2^f |x| either way."""
    n, f = 200_000, -10
    for x in (0.3 * 2.0**f, 2.0 ** (f - 5) * 1.7, -(2.0 ** (f - 30)) * 1.1, 0.9 * 2.0**f):
        xs = np.full(n, x, np.float32)
        direct = natural.decode(natural.encode(xs, 5, 0, floor=f), np.float64)
        raised = natural.decode(hc.raise_floor_host(natural.encode(xs, 6, 0), f, 7, 0), np.float64)
        p = abs(float(np.float32(x))) / 2.0**f
        for c in (direct, raised):
            assert set(np.unique(np.abs(c))) <= {0.0, 2.0**f}
            assert abs(c.mean() - np.float32(x)) <= 5 * 2.0**f * np.sqrt(p * (1 - p) / n)
            assert abs((c**2).mean() - 2.0**f * abs(np.float32(x))) <= 5 * 4.0**f * np.sqrt(p * (1 - p) / n)


def test_raise_floor_probability_per_distance():
    n = 1 << 18
    for d in (1, 2, 5, 9):
        codes = np.full(n, (0 - d) + wire.NC_BIAS, np.uint8)  # level -d, floor 0
        up = hc.raise_floor_host(codes, 0, 3, 0) != 0
        assert abs(up.mean() - 2.0**-d) <= 5 * np.sqrt(2.0**-d / n)


def test_raise_floor_reads_as_many_32_bit_pieces_as_the_distance_needs(monkeypatch):
    """P = 2^-d from the top d bits of a 128-bit uniform, pieces 0..3 of sub-stream 2: with fake pieces
    0, 0, 1, ... the draw is up exactly when d <= 63."""
    real = hc.rng.philox4x32_10

    def fake(ctr, key):
        words = real(ctr, key)
        piece = int(np.asarray(ctr[3]).reshape(-1)[0])
        words[:] = 0 if piece == 0 else 1 if piece == 1 else 0xFFFFFFFF
        return words

    monkeypatch.setattr(hc.rng, "philox4x32_10", fake)
    d = np.arange(1, 127)
    up = hc._raise_draws(1, np.arange(d.size, dtype=np.uint64), d)
    assert np.array_equal(up, d <= 63)


def test_raise_floor_keeps_codes_at_or_above_the_floor_and_rounds_deterministically():
    codes = np.array([0, 0x80 | 70, 66, 64 + 5, 0x80 | (64 + 4), 64 + 3, 1], np.uint8)
    out = hc.raise_floor_host(codes, 5, 1, 0, deterministic=True)  # 2^4 (halfway to 2^5) up, lower to 0
    assert out.tolist() == [0, 0x80 | 70, 0, 64 + 5, 0x80 | (64 + 5), 0, 0]
    same = np.array([0, 64 + 9, 0x80 | (64 + 20)], np.uint8)
    assert np.array_equal(hc.raise_floor_host(same, 9, 1, 0), same)


@pytest.mark.parametrize("codec", [natural.NaturalCodec(), DitherCodec(6)], ids=["nc", "dither"])
def test_precoded_packets_are_the_cpu_packets_when_the_exponent_is_this_workers(codec):
    """The GPU path encodes every block with its own exponent's floor; a packet whose agreed exponent is the
    worker's own is then exactly the CPU path's packet (the codes are the same stream)."""
    rs = np.random.default_rng(2)
    k, seed = 256, 99
    x = random_values(rs, 4 * k, torch.float32)
    exps = codec.flat_exponents(x, k)
    span = hc.span_of(codec)
    codes = np.concatenate([natural.encode(x[b * k:(b + 1) * k], seed, b * k, False, hc.floor_of_exp(int(e), span))
                            for b, e in enumerate(exps)])
    pre = hc.PrecodedNC(codec)
    for b, e in enumerate(exps):
        lo = b * k
        assert pre.encode(codes[lo:lo + k], e, 2, seed, lo) == codec.encode(x[lo:lo + k], e, 2, seed, lo)
    f = hc.floor_of_exp(int(exps[0]) + 9, span)  # an agreed exponent above this worker's
    higher = np.frombuffer(pre.encode(codes[:k], exps[0] + 9, 2, seed, 0), np.uint8)
    kept = (codes[:k] & 0x7F) >= f + wire.NC_BIAS
    assert np.array_equal(higher[kept], codes[:k][kept])
    assert np.all((higher[~kept] & 0x7F == 0) | (higher[~kept] & 0x7F == f + wire.NC_BIAS))


# ---------------------------------------------------------------- allreduce and the DDP hook

def allreduce_all(address, xs, codec, **kw):
    kw.setdefault("timeout", 30)
    outs, errors, _ = run_workers(address, xs, codec, **kw)
    assert errors == [None] * len(xs)
    return outs


def run_switch(xs, codec, **kw):
    sw = SwitchProcess("--workers", len(xs), "--seed", 4, backend="python")
    try:
        return allreduce_all(sw.address, xs, codec, **kw)
    finally:
        sw.stop()


@pytest.mark.parametrize("codec,levels", [("nc", None), ("dither", 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_allreduce_on_the_gpu_path_equals_the_host_path(device, monkeypatch, codec, levels, dtype):
    """Block maxima equal on both workers (every agreed exponent is each worker's own): the GPU path's
    packets are the host path's, so the sums are equal bit for bit, in x's dtype, shape and device."""
    rs = np.random.default_rng(8)
    k = 1024
    xs = [(rs.standard_normal((61, 52)) * 2.0 ** rs.integers(-30, 3, (61, 52))).astype(np.float32) for _ in range(2)]
    for x in xs:
        x.reshape(-1)[::k] = 24.5  # the same max in every block
    kw = {"levels": levels} if levels else {}
    tensors = [torch.from_numpy(x).to(dtype) for x in xs]
    host = run_switch(tensors, codec, **kw)
    calls = []
    if device.type == "cpu":  # the emulation: CPU tensors take the GPU path
        monkeypatch.setattr(hostlib.tensors, "on_gpu_path", lambda c, x: calls.append(1) or True)
    gpu = run_switch([t.to(device) for t in tensors], codec, **kw)
    assert device.type != "cpu" or len(calls) == 2
    for h, g in zip(host, gpu):
        assert g.device.type == device.type and g.dtype == dtype and g.shape == tensors[0].shape
        assert torch.equal(h.to(device), g)


def test_allreduce_on_the_gpu_path_raises_the_floor_of_lower_blocks(device, monkeypatch):
    """Worker 1's blocks are 2^20 smaller: its codes are encoded at its own floor and raised to the agreed
    one; the sum stays within NC's bound of the exact sum (and equals the host path's where no code was
    below the agreed floor)."""
    rs = np.random.default_rng(9)
    xs = [rs.standard_normal(5000).astype(np.float32), rs.standard_normal(5000).astype(np.float32) * 2.0**-20]
    xs[1][::50] = 2.0**-62  # below the agreed floor: raised
    if device.type == "cpu":
        monkeypatch.setattr(hostlib.tensors, "on_gpu_path", lambda c, x: True)
    outs = run_switch([torch.from_numpy(x).to(device) for x in xs], "nc")
    exact = xs[0].astype(np.float64) + xs[1]
    err = np.sum((outs[0].cpu().numpy().astype(np.float64) - exact) ** 2)
    assert err <= 4 * natural.allreduce_expected_sq_error(xs, exact)
    assert torch.equal(outs[0], outs[1])


def test_allreduce_on_the_gpu_path_of_blocks_below_the_lowest_level_is_the_host_path(device, monkeypatch):
    """Blocks below 2^-63 (NC's lowest level) go out with the exponent -63 on both paths (their own exponent
    left the switch no valid code, and the call timed out): the GPU encodes them at the floor of its own
    exponent, -63 as the host's, so the sums are the host path's bit for bit."""
    rs = np.random.default_rng(10)
    k = 1024
    xs = [rs.standard_normal(3 * k).astype(np.float32) for _ in range(2)]
    for x in xs:  # the same max per block on both workers: every agreed exponent is each worker's own
        x[:k] *= 2.0**-68
        x[0] = 2.0**-66
        x[k] = 24.5
        x[2 * k:] *= 2.0**-70
        x[2 * k] = -2.0**-64
    tensors = [torch.from_numpy(x) for x in xs]
    host = run_switch(tensors, "nc", timeout=10)
    if device.type == "cpu":
        monkeypatch.setattr(hostlib.tensors, "on_gpu_path", lambda c, x: True)
    gpu = run_switch([t.to(device) for t in tensors], "nc", timeout=10)
    for h, g in zip(host, gpu):
        assert g.device.type == device.type and torch.equal(h.to(device), g)
    assert torch.count_nonzero(host[0][:k]) > 0 and torch.count_nonzero(host[0][2 * k:]) > 0


@pytest.mark.parametrize("bad,error", [(float("nan"), ValueError), (2.0**64, OverflowError)], ids=["nan", "2^64"])
def test_allreduce_on_the_gpu_path_raises_as_the_host_path(device, monkeypatch, bad, error):
    """NaN on one worker: every worker learns it through the exponents and raises ValueError at the end; a
    value beyond NC's range: OverflowError on its worker before anything is sent (as on the host path)."""
    if device.type == "cpu":
        monkeypatch.setattr(hostlib.tensors, "on_gpu_path", lambda c, x: True)
    sw = SwitchProcess("--workers", 2, backend="python")
    xs = [torch.ones(3000, device=device), torch.ones(3000, device=device)]
    xs[1][2100] = bad
    outs, errors = [None] * 2, [None] * 2

    def work(r):
        try:
            with hostlib.connect(sw.address, r, 2, codec="nc", timeout=5, join_timeout=30) as comm:
                outs[r] = comm.allreduce(xs[r])
        except Exception as e:  # noqa: BLE001 - reported to the test
            errors[r] = e

    try:
        threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        sw.stop()
    assert isinstance(errors[1], error)
    if error is ValueError:
        assert isinstance(errors[0], ValueError)


@needs_gpu
def test_int32_and_fixed_cuda_tensors_return_cuda_tensors_equal_to_the_host_path():
    rs = np.random.default_rng(1)
    ints = [torch.from_numpy(rs.integers(-(2**20), 2**20, 3000).astype(np.int32)) for _ in range(2)]
    outs = run_switch([t.cuda() for t in ints], "int32")
    assert all(o.is_cuda and torch.equal(o.cpu(), ints[0] + ints[1]) for o in outs)
    floats = [torch.randn(3000) for _ in range(2)]
    host, gpu = run_switch(floats, "fixed"), run_switch([f.cuda() for f in floats], "fixed")
    assert all(g.is_cuda and torch.equal(h, g.cpu()) for h, g in zip(host, gpu))


@needs_gpu
def test_ddp_hook_averages_cuda_buckets_on_the_gpu_as_the_host_path(tmp_path, monkeypatch):
    """One rank, codec nc: the hook's GPU path (codes made on the GPU) gives the host path's gradients."""
    import torch.distributed as dist

    from hostlib.integrations.torch import INAHookState, ina_hook

    def grads(env_cuda):
        monkeypatch.setenv("INA_CUDA", env_cuda)
        sw = SwitchProcess("--workers", 1, "--seed", 4, backend="python")
        try:
            torch.manual_seed(0)
            model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 8).cuda())
            state = INAHookState(switch=sw.address, codec="nc", seed=5)
            model.register_comm_hook(state, ina_hook)
            model(torch.randn(16, 64, device="cuda")).pow(2).sum().backward()
            state.close()
            return [p.grad.clone() for p in model.parameters()]
        finally:
            sw.stop()

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        on_gpu, on_host = grads("1"), grads("0")
    finally:
        dist.destroy_process_group()
    assert all(a.is_cuda and torch.equal(a, b) for a, b in zip(on_gpu, on_host))


# ---------------------------------------------------------------- the benchmark

def load_benchmark():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import cuda_codecs

    return cuda_codecs


def test_the_benchmarks_naive_torch_baseline_computes_the_same_codes():
    """The baseline the kernels are measured against is the same computation (checked here on CPU tensors)."""
    bench = load_benchmark()
    rs = np.random.default_rng(4)
    x, ref = as_input(np.concatenate([random_values(rs, 5001, torch.float32), edge_values()]), torch.float32, "cpu",
                      finite=True)
    for seed, floor in ((5, wire.NC_LEVEL_MIN), (2**33 + 7, -20)):
        assert np.array_equal(bench.naive_encode(x, seed, floor).numpy(), natural.encode(ref, seed, 0, False, floor))
    codes = np.array([c for c in range(256) if c != 0x80], np.uint8)
    assert torch.equal(bench.naive_decode(torch.from_numpy(codes)), torch.from_numpy(natural.decode(codes)))


def test_the_benchmark_without_a_gpu_says_why_and_exits_0(capsys):
    if GPU_OK:
        pytest.skip("a GPU is here: the benchmark runs instead (python benchmarks/cuda_codecs.py)")
    assert load_benchmark().main([]) == 0
    assert GPU_WHY in capsys.readouterr().out
