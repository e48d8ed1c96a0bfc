"""allreduce sweeps as nccl-tests reports them: INA configurations (hostlib, the torch backend) against gloo
on the same tensors, block-sparse against dense; repeated runs alternate and report medians."""
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

from .harness import SwitchProcess, run_ranks
from .micro import copyto_seconds


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


RENEW_BITS = 32  # torch rows: the growth in place (bits) after which the input is copied in again
WARMUP = 2  # calls before the timed ones at least (nccl-tests' -w): by the second, a plain call's result
# buffers exist (hostlib keeps two per size, so `y = allreduce(x)` takes turns); and at least as many as are
# timed: in a freshly spawned set of torch ranks the first 80-150 calls of 1 KiB took 500-600 us, the next
# 300-400 (ten-call chunks, three process sets), while the ranks' start-up still shared the cores


TIMED_BYTES = 256 << 20  # timed calls per size without --iters: about this many bytes per rank,
TIMED_CALLS = (4, 100)  # at least 4 and at most 100 calls. 20 calls of 1 KiB were ~10 ms of timing, and one
# call of 64 MiB a row of its own: rows the scheduler of a shared 2-core VM moved by 10-40 % between rounds


def _iterations(size: int, iters: int | None = None) -> tuple[int, int]:
    """(warm-up, timed) calls per size: `iters` timed calls (nccl-tests' -n), else about TIMED_BYTES per size
    within TIMED_CALLS."""
    lo, hi = TIMED_CALLS
    timed = iters or max(lo, min(hi, TIMED_BYTES // size))
    return max(WARMUP, timed), timed


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


def _ina_sizes_rank(rank, n, _port, address, codec, elements, counts, window, n_iters, plain, out):
    """One INA rank: per count, warm-up then timed allreduces on one connection, out of place into one
    preallocated buffer (nccl-tests' recvbuff: no fresh pages per call); with plain, as users call it,
    `y = allreduce(x)`, paired with `out=` (_paired_batches). Rank 0 checks the last result of each size after
    the loop (checking in between would delay the next size's first call)."""
    import hostlib

    from .demo import make_input

    times, last, pairs = [], [], []
    with hostlib.connect(address, rank, n, job=1, codec=codec, elements_per_packet=elements, timeout=60,
                         window=window) as comm:
        for count in counts:
            x = make_input(codec, count, rank)
            res = np.empty_like(x)
            warm, iters = _iterations(4 * count, n_iters)
            for _ in range(warm):
                comm.allreduce(x, out=res)
            if plain:
                took, res = _paired_batches(comm, x, res, warm, iters)
                pairs.append(took)
                times.append(float(np.mean([p for p, _ in took])))
            else:
                t0 = time.perf_counter()
                for _ in range(iters):
                    comm.allreduce(x, out=res)
                times.append((time.perf_counter() - t0) / iters)
            last.append(res if rank == 0 else None)
    wrong = [count_wrong(codec, [make_input(codec, c, r) for r in range(n)], res, elements) if rank == 0 else None
             for c, res in zip(counts, last)]
    out.put((rank, times, wrong, pairs))


PAIRS = 8  # plain rows: batches of `y = allreduce(x)` and of `out=` per size, in turn


def _paired_batches(comm, x, res, warm, iters):
    """`y = allreduce(x)` against `allreduce(x, out=res)` in the same processes, on the same connection: PAIRS
    pairs of batches of `iters` calls, the order swapped every other pair, after `warm` plain calls (by the
    second, hostlib's two kept result buffers exist and the steady state is timed). Returns ([(seconds per plain
    call, seconds per out= call)] per pair, the last plain result). Rows of separate process sets, seconds
    apart, differ by ±10 % on a shared VM; a pair's batches run within a second of each other."""
    y = res
    for _ in range(warm):
        y = comm.allreduce(x)

    def batch(is_plain):
        nonlocal y
        t0 = time.perf_counter()
        for _ in range(iters):
            if is_plain:
                y = comm.allreduce(x)  # the last result is held during the call, as in a user's loop
            else:
                comm.allreduce(x, out=res)
        return (time.perf_counter() - t0) / iters

    return _in_turn(lambda: batch(True), lambda: batch(False)), y


def _in_turn(a, b) -> list[tuple[float, float]]:
    """PAIRS pairs (a(), b()) of timed batches, b's first in every other pair."""
    took = []
    for k in range(PAIRS):
        if k % 2 == 0:
            first = a()
            took.append((first, b()))
        else:
            first = b()
            took.append((a(), first))
    return took


def _renew_every(dist) -> int:
    """Calls after which a torch row's in-place input is copied in again (RENEW_BITS of growth)."""
    return max(1, RENEW_BITS // max(1, (dist.get_world_size() - 1).bit_length()))


def _torch_batch(dist, t, src, iters: int, every: int) -> float:
    """Seconds per in-place dist.all_reduce(t) over iters calls, t copied in from src first and again every
    `every` calls, untimed."""
    took = 0.0
    for k in range(iters):
        if k % every == 0 and src is not None:
            t.copy_(src)
        t0 = time.perf_counter()
        dist.all_reduce(t)
        took += time.perf_counter() - t0
    return took / iters


def _paired_with_hostlib(dist, pg, t, src, x: np.ndarray, iters: int):
    """dist.all_reduce(t) against hostlib's `allreduce(x, out=y)` on the group's own connection with the codec
    and packet size the group takes for t: PAIRS pairs of batches of iters calls in the same processes, the
    order swapped every other pair. [(seconds per torch call, per hostlib call)] per pair. The rows of separate
    process sets moved the ratio by 0.3 between invocations (each set's processes, imports and the machine's
    moment differ); in turn, the calls share them."""
    codec, k, _ = pg.calls.route(t)
    y, every, comm = np.empty_like(x), _renew_every(dist), pg.comm

    def hostlib_batch():
        t0 = time.perf_counter()
        for _ in range(iters):
            comm.allreduce(x, out=y, codec=codec, elements=k)
        return (time.perf_counter() - t0) / iters

    hostlib_batch()  # warm: y's pages, this shape's C-loop frame
    return _in_turn(lambda: _torch_batch(dist, t, src, iters, every), hostlib_batch)


def _timed_all_reduce(dist, x: np.ndarray, n_iters) -> float:
    """Seconds per in-place dist.all_reduce(t) of the current process group, t starting as input x: warm-up
    calls, a barrier, one more call, then the timed calls (nccl-tests' -w and -n). The call after the barrier
    starts the timed calls as hostlib's rows start theirs, right after a call of their own ended on every
    rank: the ranks leave a gloo barrier up to a message apart, and a rank that left it first would count the
    wait for the last in its first timed call. Summed in place again and again, floats grow by the world
    size per call: x is copied in again every RENEW_BITS bits of growth (a copy before each call would cost
    every call: untimed on this rank, its CPU still delays the others on a machine the ranks share); int32
    runs on zeros (its codec's cost does not depend on the values), the check's call on x."""
    t, src = _torch_input(x)
    warm, iters = _iterations(4 * x.size, n_iters)
    every = _renew_every(dist)
    _torch_batch(dist, t, src, warm, every)  # renewed as the timed calls are: 100 calls would grow by 2^200
    dist.barrier()
    dist.all_reduce(t)  # the call after the barrier, untimed
    return _torch_batch(dist, t, src, iters, every)


def _torch_input(x: np.ndarray):
    """(t, src): the tensor a torch row sums in place, and what it is copied in from (None: int32 on zeros)."""
    import torch

    src = torch.from_numpy(x)
    return (torch.zeros_like(src), None) if x.dtype == np.int32 else (src.clone(), src)


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
        times.append(_timed_all_reduce(dist, x, n_iters))
        t = torch.from_numpy(x.copy())
        dist.all_reduce(t)
        wrong.append(count_wrong("float32", [make_input("float32", count, r) for r in range(n)], t.numpy(), count)
                     if rank == 0 else None)
    out.put((rank, times, wrong))
    dist.destroy_process_group()


def init_ina_group(rank, n, port, address, codec, elements):
    """This process as one rank of an "ina" process group on the switch at address (rendezvous on a loopback
    port), with the codec for floats and the elements per packet; one torch thread per rank. Returns the
    group."""
    import torch
    import torch.distributed as dist

    import hostlib  # noqa: F401 - registers "ina"

    torch.set_num_threads(1)
    os.environ["INA_SWITCH"] = address
    options = {"elements_per_packet": elements, "timeout": 60}
    if codec != "int32":
        options["codec"] = codec
    dist.init_process_group("ina", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                            pg_options=options)
    return dist.group.WORLD


def _torch_ina_sizes_rank(rank, n, port, address, codec, elements, counts, n_iters, out):
    """One rank of the "ina" process group (hostlib.integrations.torch_backend), timed as gloo's rows are:
    per count, warm-up then timed in-place dist.all_reduce, then one on a fresh copy for the check. Also
    reports the group's recoveries (store work after a switch fault; 0 on a healthy run, where a call does no
    store operation) and the calls that fell back to gloo."""
    import torch
    import torch.distributed as dist

    from .demo import make_input

    pg = init_ina_group(rank, n, port, address, codec, elements)
    dtype = "int32" if codec == "int32" else "float32"
    times, wrong, pairs = [], [], []
    for count in counts:
        x = make_input(dtype, count, rank)
        times.append(_timed_all_reduce(dist, x, n_iters))
        t, src = _torch_input(x)
        pairs.append(_paired_with_hostlib(dist, pg, t, src, x, _iterations(4 * count, n_iters)[1]))
        t = torch.from_numpy(x.copy())
        dist.all_reduce(t)
        wrong.append(count_wrong(codec, [make_input(dtype, count, r) for r in range(n)], t.numpy(), elements)
                     if rank == 0 else None)
    stats = pg.ina_stats()
    fell_back = stats["gloo_calls"]
    out.put((rank, times, wrong, stats["recoveries"], fell_back, pairs))
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
    rows = _rows(config, sizes, [r[:3] for r in reports], workers, "int32" if codec == "int32" else "float",
                 in_place=True)
    for i, row in enumerate(rows):  # the layer's cost: in turn with hostlib's calls in the same processes
        row["x hostlib"] = paired_ratio([r[5][i] for r in reports])
        row["hostlib here us"] = float(np.median([np.mean([r[5][i][k][1] for r in reports])
                                                  for k in range(len(reports[0][5][i]))])) * 1e6
    return rows


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


def _ina_config(backend, codec, workers, payload, sizes, window=None, iters=None, plain=False) -> list[dict]:
    """One INA configuration over every size: one switch, one connection per rank (window None: the
    connection's default, hostlib.worker.auto_window); plain: `y = allreduce(x)` instead of out=."""
    elements = payload // wire.ELEMENT_SIZE[get_codec(codec).wire_codec]
    config = {"config": f"{backend}/{codec} x{workers} {payload} B" + (f" W={window}" if window else "")
              + (" plain" if plain else ""),
              "backend": backend, "codec": codec, "workers": workers, "payload B": payload, "window": window}
    sw = None
    try:  # a switch that does not start (dpdk without root) or ranks that die: error rows, the run goes on
        sw = SwitchProcess("--workers", workers, "--elements-per-packet", max(elements, 1024), backend=backend)
        reports = run_ranks(_ina_sizes_rank, workers, (sw.address, codec, elements, [s // 4 for s in sizes], window,
                                                       iters, plain), expect=workers)
    except RuntimeError as e:
        return [{**config, "size": s, "error": " ".join(str(e).split())[:200]} for s in sizes]
    finally:
        if sw is not None:
            sw.stop()
    rows = _rows(config, sizes, [r[:3] for r in reports], workers, "int32" if codec == "int32" else "float",
                 in_place=False)
    for i, row in enumerate(rows if plain else ()):
        row["x out"] = paired_ratio([r[3][i] for r in reports])
    return rows


def paired_ratio(ranks: list[list[tuple[float, float]]]) -> float:
    """A paired ratio ("x out" of a plain row, "x hostlib" of a torch row) from every rank's pairs (the row's,
    the baseline's) of batches: per pair, the ranks' mean time over their mean baseline time; the median over
    the pairs."""
    return float(np.median([np.mean([r[k][0] for r in ranks]) / np.mean([r[k][1] for r in ranks])
                            for k in range(len(ranks[0]))]))


def _gloo_config(workers, sizes, iters=None) -> list[dict]:
    config = {"config": f"gloo x{workers}", "backend": "gloo", "codec": "float32", "workers": workers}
    reports = run_ranks(_gloo_sizes_rank, workers, ([s // 4 for s in sizes], iters), expect=workers)
    return _rows(config, sizes, reports, workers, "float", in_place=True)


def _runs(workers, backends, codecs, payloads, sizes, gloo, windows, iters, torch_ina, plain=False):
    """Every configuration of one worker count as (progress label, a function that measures it once)."""
    runs = [(f"gloo x{workers}", functools.partial(_gloo_config, workers, sizes, iters))] if gloo else []
    for backend, codec, payload in itertools.product(backends, codecs, payloads) if gloo and torch_ina else ():
        runs.append((f"torch ina {backend}/{codec} x{workers} {payload} B/packet",
                     functools.partial(_torch_ina_config, backend, codec, workers, payload, sizes, iters)))
    for backend, codec, payload, window in itertools.product(backends, codecs, payloads, windows or (None,)):
        runs.append((f"{backend}/{codec} x{workers} {payload} B/packet" + (f", window {window}" if window else ""),
                     functools.partial(_ina_config, backend, codec, workers, payload, sizes, window, iters)))
        if plain:
            runs.append((f"{backend}/{codec} x{workers} {payload} B/packet, y = allreduce(x)" +
                         (f", window {window}" if window else ""),
                         functools.partial(_ina_config, backend, codec, workers, payload, sizes, window, iters, True)))
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
        for name in ("x out", "x hostlib", "hostlib here us"):  # plain and torch rows: the rounds' median
            if name in row:
                out[-1][name] = float(np.median([r[name] for r in same]))
    return out


def bench_allreduce(sizes, workers_list, backends, codecs, payloads=(1024,), gloo=True, progress=None,
                    windows=(None,), iters=None, torch_ina=True, repeat: int = 1, plain: bool = False) -> list[dict]:
    """nccl-tests-style rows (see NCCL_COLUMNS) per configuration (backend x codec x workers x payload x
    window, and gloo x workers) and size, plus np.copyto of each size (backend "memory") as the memory-bound line.
    With gloo and torch_ina, the "ina" torch.distributed backend per backend x codec x workers x payload too
    ("torch ina", in place as gloo: the two torch rows). With repeat R, every configuration of a worker count
    runs R times, the order reversed every other round (so no configuration always runs first or after the
    same one), and a row is the median of its R runs with their min and max; each run warms up apart (its
    warm-up calls never land in a row). "x gloo" is the time over gloo's (median) at the same size and
    worker count. plain: each INA configuration also as users call it, `y = allreduce(x)` (" plain")."""
    rows = [{"config": "np.copyto", "backend": "memory", "codec": "float32", "workers": 1, "size": s,
             "count": s // 4, "type": "float", "time": t * 1e6, "algbw": s / t / 1e9}
            for s, t in ((s, copyto_seconds(s)) for s in sizes)]
    for workers in workers_list:
        runs = _runs(workers, backends, codecs, payloads, sizes, gloo, windows, iters, torch_ina, plain)
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
