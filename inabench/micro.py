"""Micro-benchmarks: codec kernels against np.copyto of the same buffer, the switch core's packets/s against
the Python reference model (each a ratio to a baseline measured in the same run)."""
from __future__ import annotations

import os
import time

import numpy as np

from hostlib import wire


def best(fn, repeat=3) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


KERNELS = ("NC encode", "NC decode", "fixed quantize", "fixed quantize SR", "fixed dequantize",
           "dithering natural s=8", "Philox words alone")


def _codec_calls(x: np.ndarray, impl: str) -> dict:
    """Per kernel: a call that writes into buffers made here once (as a training loop would reuse them).
    impl "numpy" runs the references; otherwise the C kernels on the path now selected."""
    from hostlib import kernels
    from hostlib.codecs import dithering, fixed, natural
    from inaproto import rng

    n = x.size
    scale, limit, k = float(fixed.scale_for(4, 4)), fixed.INT32_MAX // 4, 1024
    exps = np.full(-(-n // k), 4, np.int8)
    codes, values, q = np.empty(n, np.uint8), np.empty(n, np.float32), np.empty(n, ">i4")
    sums = np.empty(n, np.int32)
    natural.encode(x, seed=1, out=codes)
    sums[:] = fixed.quantize_reference(x, scale, limit)
    norm = dithering._norm32(x.astype(np.float64), 2.0)
    dcodes, words = np.empty(n, np.uint8), np.empty(n, np.uint32)
    if impl == "numpy":
        table, scales = dithering.level_table(8), np.repeat(fixed.scale_for(exps, 4), k)[:n]
        return {"NC encode": lambda: natural.encode(x, seed=1, out=codes),
                "NC decode": lambda: natural.decode(codes, out=values),
                "fixed quantize": lambda: fixed.quantize_reference(x, scale, limit),
                "fixed quantize SR": lambda: fixed.quantize_reference(x, scale, limit, 1, 0),
                "fixed dequantize": lambda: np.divide(sums, scales, out=values, casting="unsafe"),
                "dithering natural s=8": lambda: dithering.encode_reference(x.astype(np.float64), norm, table, 1, 0,
                                                                            np.uint8, 0x80),
                "Philox words alone": lambda: rng.philox(1, 0, n)}
    return {"NC encode": lambda: kernels.nc_encode(x, 1, 0, False, wire.NC_LEVEL_MIN, codes),
            "NC decode": lambda: kernels.nc_decode(codes, values),
            "fixed quantize": lambda: kernels.fixed_quantize(x, scale, limit, q),
            "fixed quantize SR": lambda: kernels.fixed_quantize_sr(x, scale, limit, 1, 0, q),
            "fixed dequantize": lambda: kernels.fixed_dequantize(sums, exps, 4, k, values),
            "dithering natural s=8": lambda: kernels.dither_encode(x, float(norm), 8, False, 1, 0, dcodes),
            "Philox words alone": lambda: kernels.philox(1, 0, n, 0, words)}


def _cuda_calls(x: np.ndarray):
    """The GPU kernels (hostlib.cuda) on the same values, each followed by a device sync; None where they do
    not run here (no module, no device, no torch)."""
    try:
        from hostlib import cuda
    except ImportError:
        return None
    if not cuda.available()[0]:
        return None
    import torch

    def synced(fn):
        return lambda: (fn(), torch.cuda.synchronize())

    xd = torch.from_numpy(x).cuda()
    codes, values = torch.empty(x.size, dtype=torch.uint8, device="cuda"), torch.empty_like(xd)
    q, copy = torch.empty(x.size, dtype=torch.int32, device="cuda"), torch.empty_like(xd)
    cuda.nc_encode(xd, seed=1, out=codes)
    cuda.fixed_quantize(xd, 4, 4, out=q)
    return {"torch copy_ (device)": synced(lambda: copy.copy_(xd)),
            "NC encode": synced(lambda: cuda.nc_encode(xd, seed=1, out=codes)),
            "NC decode": synced(lambda: cuda.nc_decode(codes, out=values)),
            "fixed quantize": synced(lambda: cuda.fixed_quantize(xd, 4, 4, out=q)),
            "fixed quantize SR": synced(lambda: cuda.fixed_quantize(xd, 4, 4, stochastic=True, seed=1, out=q)),
            "fixed dequantize": synced(lambda: cuda.fixed_dequantize(q, 4, 4, out=values))}


def bench_codecs(mib: int = 64, repeat: int = 5) -> list[dict]:
    """Each codec kernel on every path this machine runs (scalar C, AVX2, AVX-512, numpy; the GPU's where
    hostlib.cuda runs) over one float32 buffer of mib MiB, against np.copyto of the same buffer in the same
    run: GiB/s of float32 input (decode and dequantize: of float32 output) and the ratio to the copy."""
    from hostlib import kernels

    n = mib * (1 << 20) // 4
    x = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    dst = np.empty_like(x)
    np.copyto(dst, x)  # touch the pages first: the baseline times the copy, not page faults
    t_copy = best(lambda: np.copyto(dst, x), repeat)
    rows = [{"what": f"np.copyto {mib} MiB (baseline)", "seconds": t_copy}]
    paths = kernels.simd_supported() if kernels.lib is not None else []
    before = kernels.simd_path() if paths else None
    try:
        for impl in [*paths, "numpy"]:
            if impl != "numpy":
                kernels.set_simd(impl)
            os.environ["INA_KERNELS"] = "numpy" if impl == "numpy" else "native"
            for name, fn in _codec_calls(x, impl).items():
                fn()  # warm: buffers touched, code paged in
                rows.append({"what": f"{name} ({impl})", "seconds": best(fn, repeat if impl != "numpy" else 1)})
    finally:
        os.environ.pop("INA_KERNELS", None)
        if paths:
            kernels.set_simd(None if before == "numpy" else before)
    for name, fn in (_cuda_calls(x) or {}).items():
        fn()
        rows.append({"what": f"{name} (cuda)", "seconds": best(fn, repeat)})
    for r in rows:
        r["GiB/s"] = mib / 1024 / r["seconds"]
        r["x copyto"] = t_copy / r["seconds"]
    return rows


BENCH_SESSION = 0x5E55  # the generation the benchmark's switches admit (worker r sends from address r)


def _rounds(codec: int, workers: int, k: int, rounds: int, slots: int) -> list[tuple[bytes, int]]:
    """A lossless stream of update packets: every worker's packet for each round, round after round
    (round q on slot q mod slots, whose use number q div slots is the packet id)."""
    rs = np.random.default_rng(0)
    pkts = []
    for q in range(rounds):
        use = q // slots
        for r in range(workers):
            if codec == wire.CODEC_INT32:
                payload, exp = rs.integers(-1000, 1000, k).astype(">i4").tobytes(), 0
            else:
                payload, exp = (rs.integers(60, 64, k).astype(np.uint8)).tobytes(), 0
            pkts.append((wire.pack(wire.MSG_UPDATE, 1, r, use, q % slots, use & 1, k, codec, exp,
                                   exp, 0, payload, BENCH_SESSION), r))
    return pkts


def bench_core(packets: int = 100_000, workers: int = 4) -> list[dict]:
    """Packets/s of the Python model and the C core in this process (per packet through cffi, and the C
    core alone replaying a stream on one core, per SIMD path this CPU runs), as ratios to the model."""
    from switchsim import native
    from switchsim.config import SwitchConfig
    from switchsim.model import Switch

    rows = []
    for name, codec, k in (("int32 x 256", wire.CODEC_INT32, 256), ("NC x 1024", wire.CODEC_NC8, 1024)):
        stream = _rounds(codec, workers, k, packets // workers, 512)
        config = SwitchConfig({1: workers})
        model = Switch(config)
        model.admit(1, 1, BENCH_SESSION, 0, list(range(workers)))
        sub = stream[: max(workers, len(stream) // 10)]  # the model is slow: a tenth of the stream
        t = best(lambda: [model.process(d, s) for d, s in sub], 1)
        base = len(sub) / t
        rows.append({"what": f"python reference, {name}", "packets/s": base, "x python": 1.0})
        if not native.available():
            continue
        core = native.CoreSwitch(config)
        core.admit(1, 1, BENCH_SESSION, 0, list(range(workers)))
        t = best(lambda: [core.process(d, s) for d, s in sub], 1)
        rows.append({"what": f"C core via cffi per packet, {name}", "packets/s": len(sub) / t,
                     "x python": len(sub) / t / base})
        blob = b"".join(d for d, _ in stream)
        lens = native.ffi.new("uint32_t[]", [len(d) for d, _ in stream])
        srcs = native.ffi.new("uint64_t[]", [s for _, s in stream])
        addrs = native.ffi.new("uint64_t[]", list(range(workers)))
        for path in _SIMD_PATHS:  # the lane arithmetic each forced path runs (INA_SWITCH_SIMD, read at creation)
            times = []
            for _ in range(3):  # a fresh core each time: a replayed stream's ids are stale the second time
                replay_core, took = _core_with_lanes(native, config, path)
                native.lib.ina_switch_admit(replay_core, 1, 1, BENCH_SESSION, 0, addrs, k, 0)  # a join's layout
                times.append(best(lambda: native.lib.ina_switch_replay(replay_core, blob, lens, srcs, len(stream)), 1))
            if took != path:
                continue  # this CPU lacks it
            t = min(times)
            rows.append({"what": f"C core, one core, {path}, {name}", "packets/s": len(stream) / t,
                         "G elements/s": len(stream) * k / t / 1e9, "x python": len(stream) / t / base})
    return rows


_SIMD_PATHS = ("scalar", "avx2", "avx512")


def _core_with_lanes(native, config, path):
    """A replay core made with INA_SWITCH_SIMD=path, and the lane path it took."""
    before = os.environ.get("INA_SWITCH_SIMD")
    os.environ["INA_SWITCH_SIMD"] = path
    try:
        core = native.new_core(config)
    finally:
        if before is None:
            del os.environ["INA_SWITCH_SIMD"]
        else:
            os.environ["INA_SWITCH_SIMD"] = before
    return core, native.ffi.string(native.lib.ina_switch_lanes(core)).decode()


def copyto_seconds(size: int) -> float:
    """Seconds of np.copyto of a size-byte float32 buffer (best of 3 batches): the memory-bound reference."""
    src = np.ones(size // 4, np.float32)
    dst = np.empty_like(src)
    reps = max(1, min(1000, (64 << 20) // size))
    np.copyto(dst, src)
    return best(lambda: [np.copyto(dst, src) for _ in range(reps)]) / reps
