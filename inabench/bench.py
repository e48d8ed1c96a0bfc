"""`switchsim bench`: codec kernels vs memcpy, aggregator packets/s, allreduce as nccl-tests reports it.

Every figure is a ratio to a baseline measured in the same run on the same machine (np.copyto of the same
buffer, the Python reference switch, gloo's allreduce of the same tensors).
"""
from __future__ import annotations

import functools
import itertools
import json
import os
import subprocess
import sys
import time

import numpy as np

from hostlib import wire
from hostlib.codecs import get_codec

from .harness import SwitchProcess, free_port, run_ranks  # noqa: F401 - free_port: part of this module's interface


def best(fn, repeat=3) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


# ---------------------------------------------------------------- codecs
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


# ---------------------------------------------------------------- aggregator
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


def bench_switch(packets: int = 100_000, workers: int = 4, backend: str = "core", rates=(), seconds: float = 1.0,
                 repeats: int = 3, window: int = 24) -> list[dict]:
    """Packets/s of the switch backends. core: the Python model and the C core in this process; bmv2: the P4
    program next to reference programs, measured alternately (inabench/bench_bmv2.py)."""
    if backend == "bmv2":
        from .bench_bmv2 import bench_bmv2

        return bench_bmv2(rates, seconds, repeats, window)
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
                native.lib.ina_switch_admit(replay_core, 1, 1, BENCH_SESSION, 0, addrs, 0)
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


def _gloo_rank(rank, n, port, numel, reps, out):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    t = torch.randn(numel)
    dist.all_reduce(t)  # warm-up: connections, buffers
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - t0)
    out.put((rank, min(times)))
    dist.destroy_process_group()


def gloo_allreduce_seconds(numel: int, workers: int, reps: int = 3) -> float:
    """Best-of-reps time of torch.distributed gloo allreduce of numel float32, slowest rank."""
    return max(t for _, t in run_ranks(_gloo_rank, workers, (numel, reps), expect=workers))


def demo_run(backend: str, codec: str, numel: int, workers: int, timeout: float = 120, payload: int = 1024,
             extra: tuple = ()) -> dict:
    elements = payload // wire.ELEMENT_SIZE[get_codec(codec).wire_codec]
    cmd = [sys.executable, "-m", "switchsim", "demo", "--json", "--backend", backend, "--codec", codec,
           "--size", str(numel), "--workers", str(workers), "--timeout", str(timeout),
           "--elements", str(elements), "--elements-per-packet", str(max(elements, 1024)), *extra]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout * 6 + 120)
    try:
        return json.loads(run.stdout)
    except json.JSONDecodeError:
        return {"errors": [run.stderr.strip()[-300:] or f"exit {run.returncode}"]}


def _with_gloo(workers_list, sizes_mib, gloo: bool, rows: list):
    """(workers, MiB, elements, gloo seconds or None) per configuration; appends gloo's row to rows."""
    for workers in workers_list:
        for mib in sizes_mib:
            numel = int(mib * (1 << 20)) // 4
            base = gloo_allreduce_seconds(numel, workers) if gloo else None
            if base is not None:
                rows.append({"workers": workers, "MiB": mib, "backend": "gloo", "codec": "float32", "seconds": base,
                             "x gloo": 1.0})
            yield workers, mib, numel, base


def bench_block_sparse(sizes_mib, workers_list, backends, codecs, densities, payload: int = 1024, gloo=True,
                       progress=None) -> list[dict]:
    """Block-sparse INA against dense INA of the same block-sparse tensors (same switch, same codec) and
    gloo's dense allreduce, by the fraction of non-zero blocks per worker (each worker draws its own)."""
    rows = []
    for workers, mib, numel, base in _with_gloo(workers_list, sizes_mib, gloo, rows):
        for density, backend, codec in itertools.product(densities, backends, codecs):
            dense_secs = None
            for mode in ("dense", "block-sparse"):
                if progress:
                    progress(f"{workers} workers, {mib} MiB, density {density}, {backend}, {codec}, {mode}")
                extra = ("--density", str(density)) + (("--sparse",) if mode == "block-sparse" else ())
                r = demo_run(backend, codec, numel, workers, payload=payload, extra=extra)
                row = {"workers": workers, "MiB": mib, "density": density, "backend": backend, "codec": codec,
                       "mode": mode}
                if r.get("errors") or not r.get("ok"):
                    row["error"] = "; ".join(r.get("errors") or ["result check failed"])[:200]
                else:
                    secs = r["allreduce_seconds"]
                    dense_secs = secs if mode == "dense" else dense_secs
                    row.update({"seconds": secs, "x gloo": secs / base if base else None,
                                "x dense INA": secs / dense_secs if dense_secs else None,
                                "bytes/worker x float32": r["bytes_ratio_vs_float32"],
                                "packets/worker": r["packets_sent_per_worker"],
                                "retransmissions": r["retransmissions"]})
                rows.append(row)
    return rows


# ---------------------------------------------------------------- allreduce, as nccl-tests reports it
NCCL_COLUMNS = ("size", "count", "type", "redop", "time", "algbw", "busbw", "#wrong")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes of a size written like nccl-tests' -b/-e ("64K", "1M"; K/M/G are powers of 1024, KiB/KB the
    same); a whole number of float32 elements, so every configuration gets the same count."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in _UNITS else ""
    size = int(float(t[:len(t) - len(unit)]) * _UNITS[unit])
    if size < 4 or size % 4:
        raise ValueError(f"size {text!r} is not a positive multiple of 4 bytes")
    return size


def bandwidths(size: int, seconds: float, ranks: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 B/s) with nccl-tests' allreduce definitions: algbw = size / time;
    busbw = algbw * 2(n-1)/n, what each rank's link carries in a ring, so it compares with link speed."""
    algbw = size / seconds / 1e9
    return algbw, algbw * 2 * (ranks - 1) / ranks


def _iterations(size: int, iters: int | None = None) -> tuple[int, int]:
    """(warm-up, timed) calls per size: `iters` timed calls (nccl-tests' -n), else about 32 MiB per size,
    1 to 20 calls."""
    return 1, iters or max(1, min(20, (32 << 20) // size))


def _nc_grid_round(v: np.ndarray, unit: np.ndarray, up: bool) -> np.ndarray:
    """|v| (v >= 0) rounded down or up to NC's levels {0} + {2^m: 2^m >= unit} (frexp: exact, unlike log2)."""
    m, e = np.frexp(v)
    if up:
        lv = np.ldexp(1.0, np.where(m == 0.5, e - 1, e))
        return np.where(v > 0, np.maximum(lv, unit), 0.0)
    return np.where(v < unit, 0.0, np.ldexp(1.0, e - 1))


def nc_interval(inputs, exact: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per element, the interval an NC allreduce result must lie in.

    Each worker rounds x to a neighbouring level (2^a <= |x| < 2^(a+1) goes to 2^a or 2^(a+1); below the
    block's floor 2^F, to 0 or 2^F), so it errs by at most max(|x|, 2^F); the switch's integer sum S' is thus
    within E = sum_i max(|x_i|, 2^F) of the exact S, and the switch rounds S' to a neighbouring level too.
    Rounding is monotone, so the result lies in [down(S - E), up(S + E)] on the signed level grid."""
    e = np.full(-(-exact.size // k), wire.EXP_NONE, dtype=np.int64)
    for x in inputs:
        e = np.maximum(e, get_codec("nc").flat_exponents(np.ravel(x).astype(np.float32), k))
    unit = np.repeat(np.ldexp(1.0, np.maximum(e - wire.NC_SPAN + 1, wire.NC_LEVEL_MIN)), k)[:exact.size]
    err = np.sum([np.maximum(np.abs(np.ravel(x).astype(np.float64)), unit) for x in inputs], axis=0)
    a, b = exact - err, exact + err
    lo = np.where(a >= 0, _nc_grid_round(np.abs(a), unit, False), -_nc_grid_round(np.abs(a), unit, True))
    hi = np.where(b >= 0, _nc_grid_round(np.abs(b), unit, True), -_nc_grid_round(np.abs(b), unit, False))
    return lo, hi


def count_wrong(codec: str, inputs, out, k: int) -> int | None:
    """nccl-tests' #wrong: elements of out outside the codec's proven bound around the exact sum.

    int32: exact (int64 sum). fixed: fixed.allreduce_error_bound. nc: nc_interval, and |out| a power of two
    or 0. float32 (gloo): a float32 sum of n terms is within gamma_(n-1) * sum|x_i| (u = 2^-24). Other
    codecs have no element-wise bound: None."""
    got = np.ravel(np.asarray(out))
    if codec == "int32":
        return int(np.count_nonzero(got.astype(np.int64) != np.sum([np.ravel(x).astype(np.int64) for x in inputs], 0)))
    exact = np.sum([np.ravel(x).astype(np.float64) for x in inputs], axis=0)
    got = got.astype(np.float64)
    if codec == "fixed":
        from hostlib.codecs import fixed

        return int(np.count_nonzero(np.abs(got - exact) > fixed.allreduce_error_bound(inputs, k, exact)))
    if codec == "nc":
        lo, hi = nc_interval(inputs, exact, k)
        off_grid = ~np.isin(np.frexp(got)[0], (0.0, 0.5, -0.5))
        return int(np.count_nonzero((got < lo) | (got > hi) | off_grid))
    if codec == "float32":
        n, u = len(inputs), 2.0 ** -24
        gamma = (n - 1) * u / (1 - (n - 1) * u)
        return int(np.count_nonzero(np.abs(got - exact) > gamma * np.sum([np.abs(np.ravel(x)) for x in inputs], 0)))
    return None


def _ina_sizes_rank(rank, n, _port, address, codec, elements, counts, window, n_iters, out):
    """One INA rank: per count, warm-up then timed allreduces on one connection, out of place into one
    preallocated buffer (nccl-tests' recvbuff: no fresh pages per call); rank 0 checks the last result of
    each size after the loop (checking in between would delay the next size's first call)."""
    import hostlib

    from .demo import make_input

    times, last = [], []
    with hostlib.connect(address, rank, n, job=1, codec=codec, elements_per_packet=elements, timeout=60,
                         window=window) as comm:
        for count in counts:
            x = make_input(codec, count, rank)
            res = np.empty_like(x)
            warm, iters = _iterations(4 * count, n_iters)
            for _ in range(warm):
                comm.allreduce(x, out=res)
            t0 = time.perf_counter()
            for _ in range(iters):
                comm.allreduce(x, out=res)
            times.append((time.perf_counter() - t0) / iters)
            last.append(res if rank == 0 else None)
    wrong = [count_wrong(codec, [make_input(codec, c, r) for r in range(n)], res, elements) if rank == 0 else None
             for c, res in zip(counts, last)]
    out.put((rank, times, wrong))


def _timed_all_reduce(dist, t, count: int, n_iters) -> float:
    """Seconds per in-place dist.all_reduce(t) of the current process group: warm-up calls, a barrier, then
    the timed calls (nccl-tests' -w and -n)."""
    warm, iters = _iterations(4 * count, n_iters)
    for _ in range(warm):
        dist.all_reduce(t)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t)
    return (time.perf_counter() - t0) / iters


def _gloo_sizes_rank(rank, n, port, counts, n_iters, out):
    """One gloo rank: per count, warm-up then timed in-place all_reduce (as nccl-tests' in-place run), then
    one on a fresh copy of the input for the check."""
    import torch
    import torch.distributed as dist

    from .demo import make_input

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    times, wrong = [], []
    for count in counts:
        x = make_input("float32", count, rank)
        times.append(_timed_all_reduce(dist, torch.from_numpy(x.copy()), count, n_iters))
        t = torch.from_numpy(x.copy())
        dist.all_reduce(t)
        wrong.append(count_wrong("float32", [make_input("float32", count, r) for r in range(n)], t.numpy(), count)
                     if rank == 0 else None)
    out.put((rank, times, wrong))
    dist.destroy_process_group()


def _torch_ina_sizes_rank(rank, n, port, address, codec, elements, counts, n_iters, out):
    """One rank of the "ina" process group (hostlib.integrations.torch_backend), timed as gloo's rows are:
    per count, warm-up then timed in-place dist.all_reduce, then one on a fresh copy for the check. Also
    reports the group's recoveries (store work after a switch fault; 0 on a healthy run, where a call does no
    store operation) and the calls that fell back to gloo."""
    import torch
    import torch.distributed as dist

    import hostlib  # noqa: F401 - registers "ina"

    from .demo import make_input

    torch.set_num_threads(1)
    os.environ["INA_SWITCH"] = address
    dtype = "int32" if codec == "int32" else "float32"
    options = {"elements_per_packet": elements, "timeout": 60}
    if codec != "int32":
        options["codec"] = codec
    dist.init_process_group("ina", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                            pg_options=options)
    pg = dist.group.WORLD
    times, wrong = [], []
    for count in counts:
        x = make_input(dtype, count, rank)
        # in place, each call sums the last one's sums: int32 would overflow within the timed calls, so they
        # run on zeros (the switch adds int32 lanes whatever they hold); the check below uses the input
        t = torch.zeros(count, dtype=torch.int32) if codec == "int32" else torch.from_numpy(x.copy())
        times.append(_timed_all_reduce(dist, t, count, n_iters))
        t = torch.from_numpy(x.copy())
        dist.all_reduce(t)
        wrong.append(count_wrong(codec, [make_input(dtype, count, r) for r in range(n)], t.numpy(), elements)
                     if rank == 0 else None)
    stats = pg.ina_stats()
    fell_back = stats["gloo_calls"]
    out.put((rank, times, wrong, stats["recoveries"], fell_back))
    dist.destroy_process_group()


def _torch_ina_config(backend, codec, workers, payload, sizes, iters=None) -> list[dict]:
    """The "ina" torch.distributed backend over every size, on its own switch: what a training job sees
    (dist.all_reduce in place, the call queue, the result buffer) next to hostlib's own rows."""
    elements = payload // wire.ELEMENT_SIZE[get_codec(codec).wire_codec]
    config = {"config": f"torch ina {backend}/{codec} x{workers} {payload} B", "backend": f"torch ina {backend}",
              "codec": codec, "workers": workers, "payload B": payload}
    sw = None
    try:
        sw = SwitchProcess("--workers", workers, "--elements-per-packet", max(elements, 1024), backend=backend)
        reports = run_ranks(_torch_ina_sizes_rank, workers, (sw.address, codec, elements, [s // 4 for s in sizes],
                                                             iters), expect=workers)
    except RuntimeError as e:
        return [{**config, "size": s, "error": " ".join(str(e).split())[:200]} for s in sizes]
    finally:
        if sw is not None:
            sw.stop()
    config["recoveries"] = max(r[3] for r in reports)
    config["gloo calls"] = max(r[4] for r in reports)  # > 0: some calls fell back (a switch fault)
    return _rows(config, sizes, [r[:3] for r in reports], workers, "int32" if codec == "int32" else "float",
                 in_place=True)


def copyto_seconds(size: int) -> float:
    """Seconds of np.copyto of a size-byte float32 buffer (best of 3 batches): the memory-bound reference."""
    src = np.ones(size // 4, np.float32)
    dst = np.empty_like(src)
    reps = max(1, min(1000, (64 << 20) // size))
    np.copyto(dst, src)
    return best(lambda: [np.copyto(dst, src) for _ in range(reps)]) / reps


def _rows(config: dict, sizes, reports, n: int, dtype: str, in_place: bool) -> list[dict]:
    """nccl-tests' columns per size from every rank's (rank, times, wrong): time is the mean over ranks
    (nccl-tests' default -a 1) of each rank's mean per call, in microseconds."""
    rows = []
    for i, size in enumerate(sizes):
        secs = float(np.mean([r[1][i] for r in reports]))
        algbw, busbw = bandwidths(size, secs, n)
        wrong = next(r[2][i] for r in reports if r[0] == 0)
        rows.append({**config, "size": size, "count": size // 4, "type": dtype, "redop": "sum", "time": secs * 1e6,
                     "algbw": algbw, "busbw": busbw, "#wrong": wrong, "in place": in_place})
    return rows


def _ina_config(backend, codec, workers, payload, sizes, window=None, iters=None) -> list[dict]:
    """One INA configuration over every size: one switch, one connection per rank (window None: the
    connection's default, hostlib.worker.auto_window)."""
    elements = payload // wire.ELEMENT_SIZE[get_codec(codec).wire_codec]
    config = {"config": f"{backend}/{codec} x{workers} {payload} B" + (f" W={window}" if window else ""),
              "backend": backend, "codec": codec, "workers": workers, "payload B": payload, "window": window}
    sw = None
    try:  # a switch that does not start (dpdk without root) or ranks that die: error rows, the run goes on
        sw = SwitchProcess("--workers", workers, "--elements-per-packet", max(elements, 1024), backend=backend)
        reports = run_ranks(_ina_sizes_rank, workers, (sw.address, codec, elements, [s // 4 for s in sizes], window,
                                                             iters),
                            expect=workers)
    except RuntimeError as e:
        return [{**config, "size": s, "error": " ".join(str(e).split())[:200]} for s in sizes]
    finally:
        if sw is not None:
            sw.stop()
    return _rows(config, sizes, reports, workers, "int32" if codec == "int32" else "float", in_place=False)


def _gloo_config(workers, sizes, iters=None) -> list[dict]:
    config = {"config": f"gloo x{workers}", "backend": "gloo", "codec": "float32", "workers": workers}
    reports = run_ranks(_gloo_sizes_rank, workers, ([s // 4 for s in sizes], iters), expect=workers)
    return _rows(config, sizes, reports, workers, "float", in_place=True)


def _runs(workers, backends, codecs, payloads, sizes, gloo, windows, iters, torch_ina):
    """Every configuration of one worker count as (progress label, a function that measures it once)."""
    runs = [(f"gloo x{workers}", functools.partial(_gloo_config, workers, sizes, iters))] if gloo else []
    for backend, codec, payload in itertools.product(backends, codecs, payloads) if gloo and torch_ina else ():
        runs.append((f"torch ina {backend}/{codec} x{workers} {payload} B/packet",
                     functools.partial(_torch_ina_config, backend, codec, workers, payload, sizes, iters)))
    for backend, codec, payload, window in itertools.product(backends, codecs, payloads, windows or (None,)):
        runs.append((f"{backend}/{codec} x{workers} {payload} B/packet" + (f", window {window}" if window else ""),
                     functools.partial(_ina_config, backend, codec, workers, payload, sizes, window, iters)))
    return runs


def _median_rows(rounds: list[list[dict]], n: int) -> list[dict]:
    """One row per configuration and size from R rounds of it: time the median over rounds (algbw and busbw
    from it), "min us" and "max us" the spread, #wrong the largest; an error in any round is the row."""
    out = []
    for i, row in enumerate(rounds[0]):
        same = [r[i] for r in rounds]
        if any("error" in r for r in same):
            out.append(next(r for r in same if "error" in r))
            continue
        times = sorted(r["time"] for r in same)
        med = float(np.median(times))
        algbw, busbw = bandwidths(row["size"], med / 1e6, n)
        wrong = [r["#wrong"] for r in same if r.get("#wrong") is not None]
        out.append({**row, "time": med, "algbw": algbw, "busbw": busbw, "#wrong": max(wrong) if wrong else None,
                    "min us": times[0], "max us": times[-1], "repeat": len(same)})
    return out


def bench_allreduce(sizes, workers_list, backends, codecs, payloads=(1024,), gloo=True, progress=None,
                    windows=(None,), iters=None, torch_ina=True, repeat: int = 1) -> list[dict]:
    """nccl-tests-style rows (see NCCL_COLUMNS) per configuration (backend x codec x workers x payload x
    window, and gloo x workers) and size, plus np.copyto of each size (backend "memory") as the memory-bound line.
    With gloo and torch_ina, the "ina" torch.distributed backend per backend x codec x workers x payload too
    ("torch ina", in place as gloo: the two torch rows). With repeat R, every configuration of a worker count
    runs R times, the order reversed every other round (so no configuration always runs first or after the
    same one), and a row is the median of its R runs with their min and max; each run warms up apart (its
    warm-up calls never land in a row). "x gloo" is the time over gloo's (median) at the same size and
    worker count."""
    rows = [{"config": "np.copyto", "backend": "memory", "codec": "float32", "workers": 1, "size": s,
             "count": s // 4, "type": "float", "time": t * 1e6, "algbw": s / t / 1e9}
            for s, t in ((s, copyto_seconds(s)) for s in sizes)]
    for workers in workers_list:
        runs = _runs(workers, backends, codecs, payloads, sizes, gloo, windows, iters, torch_ina)
        measured: dict[str, list] = {label: [] for label, _ in runs}
        for r in range(max(1, repeat)):
            for label, run in runs if r % 2 == 0 else runs[::-1]:
                if progress:
                    progress(label + (f" (round {r + 1}/{repeat})" if repeat > 1 else ""))
                measured[label].append(run())
        merged = [_median_rows(measured[label], workers) if repeat > 1 else measured[label][0] for label, _ in runs]
        base = {r["size"]: r["time"] for r in merged[0]} if gloo else {}
        for block in merged[1:] if gloo else merged:
            for row in block:
                row["x gloo"] = row["time"] / base[row["size"]] if "time" in row and base else None
        rows += [row for block in merged for row in block]
    return rows


def _fmt_size_row(r: dict, spread: bool = False) -> str:
    """One nccl-tests-like line: right-aligned, time in us to 1 decimal, GB/s to 2; with spread (--repeat),
    the min and max of the runs and the ratio to gloo's median after nccl-tests' columns."""
    if "error" in r:
        return f"{r['size']:>12}  {r['size'] // 4:>12}  error: {r['error']}"
    busbw = "-" if r.get("busbw") is None else f"{r['busbw']:.2f}"
    wrong = "N/A" if r.get("#wrong") is None else str(r["#wrong"])
    line = (f"{r['size']:>12}  {r['count']:>12}  {r['type']:>6}  {r.get('redop', '-'):>5}  {r['time']:>10.1f}  "
            f"{r['algbw']:>7.2f}  {busbw:>7}  {wrong:>6}")
    if spread:
        ratio = "-" if r.get("x gloo") is None else f"{r['x gloo']:.2f}"
        lo, hi = (f"{r[k]:.1f}" if r.get(k) is not None else "-" for k in ("min us", "max us"))
        line += f"  {lo:>10}  {hi:>10}  {ratio:>6}"
    return line


def nccl_table(rows: list[dict]) -> str:
    """The allreduce rows as nccl-tests prints them: one block per configuration, a header line each."""
    head = (f"#{'size':>11}  {'count':>12}  {'type':>6}  {'redop':>5}  {'time':>10}  {'algbw':>7}  {'busbw':>7}  "
            f"{'#wrong':>6}\n#{'(B)':>11}  {'(elements)':>12}  {'':>6}  {'':>5}  {'(us)':>10}  {'(GB/s)':>7}  "
            f"{'(GB/s)':>7}  {'':>6}")
    repeat = max((r.get("repeat", 1) for r in rows), default=1)
    if repeat > 1:
        head = "\n".join(h + tail for h, tail in zip(head.split("\n"), (f"  {'min':>10}  {'max':>10}  {'x gloo':>6}",
                                                                          f"  {'(us)':>10}  {'(us)':>10}  {'':>6}")))
    lines = ["# busbw = algbw * 2(n-1)/n (nccl-tests' allreduce); #wrong: elements outside the codec's bound",
             "# INA: out of place into a preallocated buffer (allreduce(x, out=y), nccl-tests' recvbuff); "
             "gloo and torch ina (init_process_group(\"ina\")): in place (all_reduce(t))"]
    if repeat > 1:
        lines.append(f"# time: the median of {repeat} runs of each configuration, alternating (every other round in "
                     f"reverse order); min, max: of those runs; x gloo: time / gloo's median time")
    for config in dict.fromkeys(r["config"] for r in rows):
        block = [r for r in rows if r["config"] == config]
        note = ("memory bound: np.copyto of the same buffer, one core (algbw = size / copy time)"
                if block[0]["backend"] == "memory" else
                f"{config}: {'in place' if block[0].get('in place') else 'out of place'}")
        if block[0].get("recoveries") is not None:
            note += f"; no store operation per call ({block[0]['recoveries']} recoveries)"
            if block[0].get("gloo calls"):
                note += f"; {block[0]['gloo calls']} calls fell back to gloo"
        lines += ["", f"# {note}", head, *(_fmt_size_row(r, repeat > 1) for r in block)]
    return "\n".join(line.rstrip() for line in lines)


# ---------------------------------------------------------------- output
def table(rows: list[dict]) -> str:
    cols = list(dict.fromkeys(k for r in rows for k in r))

    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:,.4g}" if abs(v) < 1e5 else f"{v:,.0f}"
        return str(v)

    cells = [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def pyplot():
    """matplotlib's pyplot without a display, or a clear exit naming the extra that brings it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("switchsim bench --plot needs matplotlib: pip install -e '.[bench]'") from None
    return plt


def _allreduce_panel(ax, rows: list[dict], plt) -> None:
    """algbw against size, log-log: one colour per INA configuration, gloo dashed greys, np.copyto dotted black
    (the references a reader compares against)."""
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    configs = list(dict.fromkeys(r["config"] for r in rows))
    ina = [c for c in configs if not c.startswith(("gloo", "np.copyto"))]
    for config in configs:
        pts = sorted((r["size"], r["algbw"]) for r in rows if r["config"] == config and "algbw" in r)
        if not pts:
            continue
        if config == "np.copyto":
            style = {"color": "black", "linestyle": ":", "label": "memory bound: np.copyto, same buffer"}
        elif config.startswith("gloo"):
            shade = ("dimgray", "darkgray", "silver")[[c for c in configs if c.startswith("gloo")].index(config) % 3]
            style = {"color": shade, "linestyle": "--", "label": f"{config} (torch gloo, float32)"}
        else:
            style = {"color": colors[ina.index(config) % len(colors)], "linestyle": "-", "label": config}
        ax.plot(*zip(*pts), marker="o", markersize=3, **style)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: next(
        f"{v / m:g}{u}" for m, u in ((1 << 30, "G"), (1 << 20, "M"), (1 << 10, "K"), (1, "")) if v >= m or m == 1)))
    ax.set_yscale("log")
    ax.set_xlabel("size: bytes of float32 per worker")
    ax.set_ylabel("algbw (GB/s) = size / time")
    ax.legend(fontsize=7)


def plot(results: dict, path: str) -> None:
    plt = pyplot()
    panels = [k for k in ("codecs", "switch", "allreduce", "blocksparse") if results.get(k)]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, key in zip(axes[0], panels):
        rows = results.get(key)
        if key == "codecs":
            ax.barh([r["what"] for r in rows], [r["x copyto"] for r in rows])
            ax.set_xlabel("throughput / np.copyto (same buffer)")
        elif key == "switch":
            ax.barh([r["what"] for r in rows], [r["packets/s"] for r in rows])
            ax.set_xscale("log")
            ax.set_xlabel("packets/s")
        elif key == "blocksparse":  # time against density, at the largest size measured
            mib = max(r["MiB"] for r in rows)
            timed = [r for r in rows if r["MiB"] == mib and "seconds" in r]
            timed_ina = [r for r in timed if r.get("density")]
            configs = sorted({(r["backend"], r["codec"], r["workers"]) for r in timed_ina})
            colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
            for i, cfg in enumerate(configs):  # one colour per configuration: dashed dense, solid block-sparse
                for mode in ("dense", "block-sparse"):
                    pts = sorted((r["density"], r["seconds"]) for r in timed_ina
                                 if (r["backend"], r["codec"], r["workers"]) == cfg and r["mode"] == mode)
                    if pts:
                        ax.plot(*zip(*pts), marker="o", color=colors[i % len(colors)],
                                linestyle="-" if mode == "block-sparse" else "--",
                                label=f"{cfg[0]}/{cfg[1]} x{cfg[2]} {mode}")
            for r in timed:
                if r["backend"] == "gloo":
                    ax.axhline(r["seconds"], color="grey", linewidth=0.8, linestyle=":" if r["workers"] > 2 else "-",
                               label=f"gloo x{r['workers']} (dense float32)")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel(f"fraction of non-zero blocks per worker ({mib} MiB)")
            ax.set_ylabel("allreduce seconds")
            ax.legend(fontsize=7)
        elif key == "allreduce":
            _allreduce_panel(ax, rows, plt)
        ax.set_title(key)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------- running (switchsim bench delegates here)
BENCHMARKS = ("codecs", "switch", "allreduce", "blocksparse", "sparse", "sparcml", "train")  # `bench all`, in order


def run_benchmarks(runs: dict[str, dict], as_json: bool = False, plot_path: str | None = None) -> int:
    """Run benchmarks and print their rows (a table each, or one JSON object).

    Args:
        runs: benchmark name (one of BENCHMARKS) -> keyword arguments of its function (bench_codecs,
            bench_switch, bench_allreduce, bench_block_sparse, bench_sparse.bench_sparse,
            bench_sparse.bench_sparcml, convergence.run), run in BENCHMARKS order so `bench all` reads
            the same whatever order the caller built the dict in.
        as_json: print one JSON object keyed by benchmark (train adds "exponent_histogram") and no
            progress lines, so a script can parse the output (progress lines go only to a terminal anyway).
        plot_path: a PNG for codecs/switch/allreduce/blocksparse; train writes `<base>-train<ext>` next to
            it, since its panels do not fit the others' figure.

    Returns:
        The process exit status (0).

    Raises:
        ValueError: a name that is not a benchmark (before anything runs, not after an hour of them).
    """
    unknown = set(runs) - set(BENCHMARKS)
    if unknown:
        raise ValueError(f"unknown benchmarks {sorted(unknown)}")
    progress = None if as_json or not sys.stderr.isatty() else (lambda s: print(f"... {s}", file=sys.stderr))
    results, train = {}, None
    for name in (n for n in BENCHMARKS if n in runs):
        kwargs = runs[name]
        if name == "codecs":
            results[name] = bench_codecs(**kwargs)
        elif name == "switch":
            results[name] = bench_switch(**kwargs)
        elif name == "allreduce":
            results[name] = bench_allreduce(**kwargs, progress=progress)
        elif name == "blocksparse":
            results[name] = bench_block_sparse(**kwargs, progress=progress)
        elif name in ("sparse", "sparcml"):
            from . import bench_sparse

            results[name] = (bench_sparse.bench_sparse if name == "sparse" else bench_sparse.bench_sparcml)(**kwargs)
        elif name == "train":
            from . import convergence

            train = convergence.run(**kwargs)
            results[name] = convergence.main_rows(train)
    if as_json:
        print(json.dumps({**results, **({"exponent_histogram": train["exponents"]} if train else {})}, indent=2))
    else:
        for key, rows in results.items():
            print(f"\n== {key}\n{nccl_table(rows) if key == 'allreduce' else table(rows)}")
    if plot_path:
        if set(results) & {"codecs", "switch", "allreduce", "blocksparse"}:
            plot(results, plot_path)
        if train:
            from . import convergence

            base, ext = os.path.splitext(plot_path)
            convergence.plot(train, f"{base}-train{ext or '.png'}")
    return 0
