"""`switchsim demo`: a switch process and N worker processes on loopback, checked against numpy."""
from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import sys
import time

import numpy as np

from hostlib import wire
from switchsim.config import DEFAULT_MAX_ELEMENTS

from .harness import SwitchProcess


def make_input(codec: str, size: int, rank: int, seed: int = 1234, density: float = 1.0,
               block: int = 256) -> np.ndarray:
    """Rank's tensor; with density < 1, only that fraction of its blocks of `block` elements is non-zero
    (each rank draws its own blocks), the input block-sparse INA is for."""
    rs = np.random.default_rng(seed * 1000 + rank)
    if codec == "int32":
        x = rs.integers(-(1 << 20), 1 << 20, size, dtype=np.int64).astype(np.int32)
    else:
        x = rs.standard_normal(size, dtype=np.float32)
    if density < 1.0:
        keep = rs.random(-(-size // block)) < density
        x[~np.repeat(keep, block)[:size]] = 0
    return x


def block_elements(args) -> int:
    """Elements per packet the workers ask for (the block of block-sparse INA)."""
    from hostlib.codecs import get_codec

    return min(args.elements or get_codec(args.codec, **codec_options(args)).default_elements,
               args.elements_per_packet)


def inputs(args, rank: int) -> np.ndarray:
    return make_input(args.codec, args.size, rank, density=args.density, block=block_elements(args))


def codec_options(args) -> dict:
    """The codec's own options among the demo's flags (connect passes them to get_codec)."""
    return {"levels": args.levels} if args.codec == "dither" else {}


def _worker(rank, args, address, progress, results):
    import hostlib

    try:
        x = inputs(args, rank)
        with hostlib.connect(address, rank, args.workers, job=1, codec=args.codec, window=args.window,
                             elements_per_packet=args.elements, timeout=args.timeout, **codec_options(args)) as comm:
            t0 = time.perf_counter()
            out = comm.allreduce(x, progress=lambda done: setattr(progress, "value", done), sparse=args.sparse)
            seconds = time.perf_counter() - t0
            rep = {"rank": rank, "seconds": seconds, "stats": comm.stats.as_dict(),
                   "digest": hashlib.sha256(out.tobytes()).hexdigest()}
        if rank == 0:
            rep["check"] = check_result(args, out)
        results.put(rep)
    except Exception as e:  # reported by the parent, which exits non-zero
        results.put({"rank": rank, "error": f"{type(e).__name__}: {e}"})


def check_result(args, out) -> dict:
    """Compare with the exact sum computed by numpy in float64 (or int64)."""
    from hostlib.codecs import ditherswitch, fixed, natural

    xs = [inputs(args, r) for r in range(args.workers)]
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    err = out.astype(np.float64) - exact
    norm = float(np.linalg.norm(exact)) or 1.0
    res = {"max_abs_error": float(np.abs(err).max()), "rel_l2_error": float(np.linalg.norm(err)) / norm}
    if args.codec == "int32":
        res["bound"] = 0.0
        res["ok"] = bool(np.array_equal(out.astype(np.int64), exact.astype(np.int64)))
    elif args.codec == "fixed":
        bound = fixed.allreduce_error_bound(xs, block_elements(args), exact)
        res["bound"] = float(bound.max())
        res["ok"] = bool(np.all(np.abs(err) <= bound))
    else:
        expected = (ditherswitch.allreduce_expected_sq_error(xs, exact, block_elements(args), args.levels)
                    if args.codec == "dither" else natural.allreduce_expected_sq_error(xs, exact))
        res["bound"] = float(np.sqrt(expected)) / norm
        res["ok"] = bool(float(np.dot(err, err)) <= 1.5 * expected)
    return res


def start_switch(args, ns=None, extra=()) -> SwitchProcess:
    """`switchsim serve` for args.backend (plus extra arguments): on loopback, or for dpdk in namespace ns
    (a VethNamespace)."""
    cmd = ns.serve_command(wire.DEFAULT_PORT) if args.backend == "dpdk" else None
    return SwitchProcess("--workers", args.workers, "--loss", args.loss, "--dup", args.dup, "--reorder", args.reorder,
                         *(("--slots", args.slots) if args.slots else ()), "--elements-per-packet", args.elements_per_packet,
                         "--nc-rounding", args.nc_rounding, "--seed", args.seed, *extra, backend=args.backend, cmd=cmd)


def run_demo(args) -> int:
    if args.workers < 1 or args.size < 1:
        print("switchsim demo: --workers and --size must be >= 1", file=sys.stderr)
        return 2
    if not 0.0 <= args.density <= 1.0:
        print("switchsim demo: --density must be in [0, 1]", file=sys.stderr)
        return 2
    if args.elements_per_packet is None:
        args.elements_per_packet = 64 if args.backend == "bmv2" else DEFAULT_MAX_ELEMENTS
    ns = None
    if args.backend == "dpdk":
        from switchsim.netns import VethNamespace

        ns = VethNamespace()
        if ns.error:
            print(f"switchsim demo: {ns.error}", file=sys.stderr)
            return 2
    try:
        return _run(args, ns)
    finally:
        if ns is not None:
            ns.close()


def progress_bar(args):
    """A tqdm bar on stderr only when stderr is a terminal: in a pipe or a log its redraws are noise."""
    if args.json or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=args.size * args.workers, unit="el", unit_scale=True,
                desc=f"allreduce {args.codec} x{args.workers}", file=sys.stderr)


def _run(args, ns) -> int:
    sw = start_switch(args, ns)
    address = sw.address
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    progress = [ctx.Value("q", 0, lock=False) for _ in range(args.workers)]
    t0 = time.perf_counter()
    procs = [ctx.Process(target=_worker, args=(r, args, address, progress[r], results), daemon=True)
             for r in range(args.workers)]
    for p in procs:
        p.start()
    reports = []
    try:
        bar = progress_bar(args)
        deadline = time.monotonic() + args.timeout * 4 + 120
        while len(reports) < args.workers and time.monotonic() < deadline:
            try:
                reports.append(results.get(timeout=0.1))
            except Exception:
                pass
            if bar is not None:
                bar.n = min(sum(v.value for v in progress), bar.total)
                bar.refresh()
                if bar.n >= bar.total:  # done: stop redrawing while the ranks report
                    bar.close()
                    bar = None
        if bar is not None:
            bar.close()
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        switch_stats = sw.stop_stats()
    wall = time.perf_counter() - t0
    return report(args, reports, switch_stats, wall)


def report(args, reports, switch_stats, wall) -> int:
    errors = [r for r in reports if "error" in r]
    missing = args.workers - len(reports)
    ok = not errors and not missing
    summary = {"workers": args.workers, "size": args.size, "codec": args.codec, "backend": args.backend,
               "loss": args.loss, "sparse": args.sparse, "density": args.density,
               "wall_seconds": round(wall, 3), "errors": [f"rank {r['rank']}: {r['error']}" for r in errors]}
    if missing:
        summary["errors"].append(f"{missing} workers did not report")
    if ok:
        reports.sort(key=lambda r: r["rank"])
        stats = [r["stats"] for r in reports]
        secs = max(r["seconds"] for r in reports)
        f32 = 4 * args.size
        summary.update({
            "allreduce_seconds": round(secs, 4),
            "goodput_gbit_s": round(f32 * 8 / secs / 1e9, 4),
            "bytes_sent_per_worker": int(np.mean([s["bytes_sent"] for s in stats])),
            "wire_bytes_sent_per_worker": int(np.mean([s["wire_bytes_sent"] for s in stats])),
            "float32_bytes": f32,
            "packets_sent_per_worker": int(np.mean([s["packets_sent"] for s in stats])),
            "retransmissions": int(sum(s["retransmissions"] for s in stats)),
            "check": reports[0]["check"],
            "identical_on_all_workers": len({r["digest"] for r in reports}) == 1,
            "switch": {k: switch_stats.get(k) for k in ("packets_in", "packets_out", "dropped", "jobs")},
        })
        summary["bytes_ratio_vs_float32"] = round(summary["bytes_sent_per_worker"] / f32, 4)
        ok = summary["check"]["ok"] and summary["identical_on_all_workers"]
    summary["ok"] = ok
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_table(summary)
    return 0 if ok else 1


def print_table(s):
    what = f"{s['codec']}, loss {s['loss']:.0%}"
    if s["density"] < 1 or s["sparse"]:
        what += f", {s['density']:.2%} of blocks non-zero, {'block-sparse' if s['sparse'] else 'dense'} INA"
    rows = [("workers x elements", f"{s['workers']} x {s['size']:,} ({what})")]
    if "allreduce_seconds" in s:
        c = s["check"]
        sw = s["switch"]
        rows += [
            ("allreduce time", f"{s['allreduce_seconds']:.3f} s ({s['goodput_gbit_s']:.3f} Gbit/s of float32)"),
            ("bytes sent per worker", f"{s['bytes_sent_per_worker']:,} B = {s['bytes_ratio_vs_float32']:.3f} x float32 "
                                      f"({s['wire_bytes_sent_per_worker']:,} B with Eth/IP/UDP headers)"),
            ("packets sent per worker", f"{s['packets_sent_per_worker']:,}"),
            ("retransmissions (all workers)", f"{s['retransmissions']:,}"),
            ("max |error| vs numpy", f"{c['max_abs_error']:.3g}"),
            ("relative L2 error", f"{c['rel_l2_error']:.3g} (bound {c['bound']:.3g})"),
            ("switch packets in / out", f"{sw.get('packets_in')} / {sw.get('packets_out')}"),
            ("switch drops", ", ".join(f"{k} {v}" for k, v in (sw.get("dropped") or {}).items() if v) or "none"),
        ]
    rows.append(("result", "OK" if s["ok"] else "FAILED " + "; ".join(s["errors"])))
    width = max(len(r[0]) for r in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
