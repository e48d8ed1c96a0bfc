"""Ways to call one allreduce, timed in turn in the same processes on the same connection (issues 36 and 37).

    python benchmarks/alternating_calls.py --size 64K [--workers 4] [--codec nc|int32|fixed] [--payload 1024]
        [--rounds 10] [--batch N] [--layers] [--json]

`switchsim bench allreduce` times each configuration in its own processes with its own switch, so two rows
can differ by +-15 % on a shared 2-core VM before any code differs. This takes the variants in turn, round
after round, in one set of rank processes of the "ina" process group, so each ratio compares calls that
shared the machine's state:

- `hostlib out=`: `comm.allreduce(x, out=y)` on the group's own hostlib connection (nccl-tests' out of place);
- `hostlib plain`: `y = comm.allreduce(x)`, as users call it;
- `hostlib in place`: `comm.allreduce(x, out=x)`;
- `hostlib persistent`: `p()` of `p = comm.allreduce_init(x, ...)` (in place; hostlib/persistent.py);
- `torch dist.all_reduce`: `dist.all_reduce(t)` in place, the path DDP and users take;
- with --layers, the torch path peeled: `torch pg.allreduce, new options` (the group's allreduce with c10d's
  options made and filled per call, as dist.all_reduce makes them, then wait()), `torch pg.allreduce` (the
  same with one options object made beforehand: without torch's Python wrapper) and `torch calls.sum` (the
  inline path's sum on the tensor's lane: without the tensor's and the options' checks).

Each call starts from the same input (copied in first, in every variant). Reported per variant, on rank 0:
the median time per call over the rounds with min and max, and its ratio to `hostlib out=`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from inabench.allreduce import init_ina_group, parse_size  # noqa: E402
from inabench.harness import SwitchProcess, run_ranks  # noqa: E402

VARIANTS = ("hostlib out=", "hostlib plain", "hostlib in place", "hostlib persistent", "torch dist.all_reduce")
LAYERS = ("torch pg.allreduce, new options", "torch pg.allreduce", "torch calls.sum")


def _elements(codec: str, payload: int) -> int:
    """Elements per packet of `payload` bytes in the codec's wire format."""
    from hostlib import wire
    from hostlib.codecs import get_codec

    return payload // wire.ELEMENT_SIZE[get_codec(codec).wire_codec]


def _rank(rank, world, port, address, codec, count, payload, rounds, batch, variants, out):
    import numpy as np
    import torch
    import torch.distributed as dist

    pg = init_ina_group(rank, world, port, address, codec, _elements(codec, payload))
    rs = np.random.default_rng(rank)
    src = (rs.integers(-1000, 1000, count, dtype=np.int32) if codec == "int32"
           else rs.standard_normal(count, dtype=np.float32))
    t = torch.from_numpy(src.copy())
    x, y = t.numpy(), np.empty_like(src)
    route_codec, k, _ = pg.calls.route(t)  # the codec and packet size dist.all_reduce uses for this tensor
    comm = pg.comm
    calls = {
        "hostlib out=": lambda: comm.allreduce(x, out=y, codec=route_codec, elements=k),
        "hostlib plain": lambda: comm.allreduce(x, codec=route_codec, elements=k),
        "hostlib in place": lambda: comm.allreduce(x, out=x, codec=route_codec, elements=k),
        "hostlib persistent": comm.allreduce_init(x, route_codec, k),
        "torch dist.all_reduce": lambda: dist.all_reduce(t),
    }
    opts = dist.AllreduceOptions()
    opts.reduceOp, opts.asyncOp = dist.ReduceOp.SUM, False  # what dist.all_reduce(t) passes
    calls["torch pg.allreduce"] = lambda: pg.allreduce([t], opts).wait()

    def new_options():  # as dist.all_reduce(t) makes its options: through pybind, on every call
        fresh = dist.AllreduceOptions()
        fresh.reduceOp = dist.ReduceOp.SUM
        fresh.asyncOp = False
        pg.allreduce([t], fresh).wait()

    calls["torch pg.allreduce, new options"] = new_options
    calls["torch calls.sum"] = lambda: pg.calls.sum(t, pg.calls.lane(t))
    times = {v: [] for v in variants}
    cpu = {v: [] for v in variants}
    for v in variants:  # warm-up: every variant's buffers and code paths once
        for _ in range(2):
            np.copyto(x, src)
            calls[v]()
    for _ in range(rounds):
        for v in variants:
            took = used = 0.0
            for _ in range(batch):
                np.copyto(x, src)
                start, start_cpu = time.perf_counter(), time.process_time()
                calls[v]()
                used += time.process_time() - start_cpu
                took += time.perf_counter() - start
            times[v].append(took / batch)
            cpu[v].append(used / batch)
    stats = pg.ina_stats()
    out.put((rank, times, stats["gloo_calls"], cpu))
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="64K", help="bytes per rank (K/M/G = 1024^n); default 64K")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--codec", default="nc", choices=("nc", "int32", "fixed"))
    ap.add_argument("--payload", type=int, default=1024, help="payload bytes per packet (default 1024)")
    ap.add_argument("--backend", default="c", help="switch backend (default c)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--batch", type=int, default=None, help="calls per variant per round (default: about 8 MiB "
                    "of calls, 2 to 100)")
    ap.add_argument("--layers", action="store_true", help="also the torch path's layers (torch pg.allreduce, torch "
                    "calls.sum)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    variants = VARIANTS + (LAYERS if args.layers else ())
    size = parse_size(args.size)
    batch = args.batch or max(2, min(100, (8 << 20) // size))
    elements = _elements(args.codec, args.payload)
    sw = SwitchProcess("--workers", args.workers, "--elements-per-packet", max(elements, 1024), backend=args.backend)
    try:
        reports = run_ranks(_rank, args.workers, (sw.address, args.codec, size // 4, args.payload, args.rounds,
                                                  batch, variants), expect=args.workers)
    finally:
        sw.stop()
    times, cpu = next((r[1], r[3]) for r in reports if r[0] == 0)
    base = statistics.median(times[variants[0]])
    rows = [{"variant": v, "us per call": statistics.median(ts) * 1e6, "min": min(ts) * 1e6, "max": max(ts) * 1e6,
             "x hostlib out=": statistics.median(ts) / base, "cpu us per call": statistics.median(cpu[v]) * 1e6}
            for v, ts in times.items()]
    fell_back = max(r[2] for r in reports)
    if args.json:
        print(json.dumps({"size": size, "workers": args.workers, "codec": args.codec, "payload": args.payload,
                          "rounds": args.rounds, "batch": batch, "gloo calls": fell_back, "rows": rows}))
    else:
        print(f"# {args.size} x {args.workers}, {args.codec}, {args.payload} B packets, {args.backend} switch: "
              f"{args.rounds} rounds of {batch} calls per variant, in turn (rank 0)")
        print(f"{'variant':32s} {'us per call':>12s} {'min':>10s} {'max':>10s} {'x hostlib out=':>15s} "
              f"{'cpu us per call':>16s}")
        for r in rows:
            print(f"{r['variant']:32s} {r['us per call']:12.1f} {r['min']:10.1f} {r['max']:10.1f} "
                  f"{r['x hostlib out=']:15.2f} {r['cpu us per call']:16.1f}")
        if fell_back:
            print(f"# {fell_back} calls fell back to gloo: the switch failed under the run")
    return 1 if fell_back else 0


if __name__ == "__main__":
    raise SystemExit(main())
