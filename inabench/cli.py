"""The benchmarks' and the demo's verbs of the `switchsim` command line (demo, bench, model); inacli puts
every package's verbs together. Each benchmark's flags are named after its function's parameters, so they
pass through unchanged."""
from __future__ import annotations

import argparse

from switchsim.cli import add_network_flags, csv

BENCH_COMMON = ("command", "func", "benchmark", "json", "plot")  # bench's own keys, not a benchmark's arguments


def cmd_demo(args) -> int:
    """`switchsim demo`: inabench.demo.run_demo's exit status."""
    from .demo import run_demo

    return run_demo(args)


def cmd_bench(args) -> int:
    """`switchsim bench [BENCHMARK]`: the parsed flags as the benchmark's keyword arguments, handed to
    run_benchmarks, which runs and prints; its exit status."""
    from .bench import BENCHMARKS, run_benchmarks

    def kwargs(ns):
        return {k: v for k, v in vars(ns).items() if k not in BENCH_COMMON}

    if args.benchmark in (None, "all"):  # what `switchsim bench` always ran: every benchmark with its defaults
        defaults = argparse.ArgumentParser()
        add_parser(defaults.add_subparsers())
        runs = {name: kwargs(defaults.parse_args(["bench", name])) for name in BENCHMARKS}
    else:
        runs = {args.benchmark: kwargs(args)}
    from .extras import require

    gloo = [n for n, kw in runs.items() if n in GLOO_BASELINE and kw.get("gloo", True)]
    if gloo and not require("bench " + (args.benchmark or "all"), "torch",
                            why=f"the gloo baseline of {', '.join(gloo)}; `--no-gloo` skips it where there is one"):
        return 2
    return run_benchmarks(runs, as_json=args.json, plot_path=args.plot)


GLOO_BASELINE = ("allreduce", "blocksparse", "sparcml", "train")  # benchmarks that run torch's gloo beside INA


def convergence_modes():
    """The training benchmark's default gradient paths, for `bench train --modes`' default."""
    from .convergence import MODES  # numpy only: cheap

    return MODES


def add_parser(sub):
    """`demo` and `bench` with the benchmarks of this package on the command line's sub-parsers; returns
    bench_parser(name, help, plot=...), which makes a sub-parser of `bench` for another package's benchmark
    (topologies' `topo`, the model's `model`)."""
    d = sub.add_parser("demo", help="switch + N worker processes on loopback, checked against numpy")
    d.add_argument("--workers", type=int, default=4)
    d.add_argument("--size", type=int, default=1 << 20, help="float32 elements per worker")
    d.add_argument("--codec", choices=("nc", "fixed", "int32", "dither"), default="nc")
    d.add_argument("--levels", type=int, default=8,
                   help="dither: levels s per block, 2^e ... 2^(e-s+1) for the block's agreed exponent e")
    d.add_argument("--window", type=int, default=128)
    d.add_argument("--elements", type=int, default=None, help="elements per packet (codec default)")
    d.add_argument("--timeout", type=float, default=60.0)
    d.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    d.add_argument("--density", type=float, default=1.0,
                   help="fraction of each worker's blocks (of --elements) that are non-zero (default 1: dense)")
    d.add_argument("--sparse", action="store_true", help="block-sparse INA: send only non-zero blocks")
    add_network_flags(d)
    d.set_defaults(func=cmd_demo)

    b = sub.add_parser("bench", help="benchmarks (`switchsim bench BENCHMARK -h` for each one's flags)",
                       description="Without BENCHMARK (or with `all`): every benchmark with its defaults.")
    b.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    b.add_argument("--plot", metavar="PNG", help="write a plot (needs matplotlib)")
    b.set_defaults(func=cmd_bench)
    bench = b.add_subparsers(dest="benchmark", metavar="BENCHMARK")

    def bench_parser(name, help, plot="write a plot (needs matplotlib)"):
        """A benchmark's sub-parser; --json/--plot here too (SUPPRESS: `bench --json NAME` keeps working)."""
        sp = bench.add_parser(name, help=help, description=help)
        sp.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print one JSON object instead of a table")
        if plot:
            sp.add_argument("--plot", metavar="PNG", default=argparse.SUPPRESS, help=plot)
        return sp

    _add_benchmarks(bench_parser)
    return bench_parser


def size_list(text):
    """bench allreduce's --sizes: "1K,64M" -> bytes (inabench imported only when parsed)."""
    from inabench.allreduce import parse_size

    return [parse_size(v) for v in text.split(",") if v]


def ina_runs(sp, sizes=True):
    """allreduce and blocksparse: INA against gloo on the same tensors (blocksparse: sizes in MiB)."""
    if sizes:
        sp.add_argument("--sizes", dest="sizes_mib", type=csv(float), default="1,16,64", metavar="LIST",
                        help="MiB of float32 per worker (comma list; default %(default)s)")
    sp.add_argument("--workers", dest="workers_list", type=csv(int), default="2,4", metavar="LIST",
                    help="worker counts (comma list; default %(default)s)")
    sp.add_argument("--backends", type=csv(str), default="python,c", metavar="LIST",
                    help="switch backends: python,c,dpdk,shm (comma list; dpdk needs root; shm: the C core "
                         "on shared-memory rings, serve --shm; default %(default)s)")
    sp.add_argument("--codecs", type=csv(str), default="int32,fixed,nc", metavar="LIST",
                    help="codecs (comma list; default %(default)s)")
    sp.add_argument("--no-gloo", dest="gloo", action="store_false", help="skip the torch gloo baseline")


def _add_benchmarks(bench_parser):
    """Every benchmark of `bench all` (BENCHMARKS), each with its flags."""
    bench_parser("all", "every benchmark below with its defaults (what `switchsim bench` runs)")
    sp = bench_parser("codecs", "NC/fixed kernels (C and numpy) as a ratio to np.copyto of the same buffer")
    sp.add_argument("--mib", type=int, default=64, help="buffer size in MiB (default %(default)s)")
    sp = bench_parser("switch", "aggregator packets/s: C core against the Python reference model; with "
                                "--backend bmv2, the P4 program on BMv2 against a forwarding and a bare-add program")
    sp.add_argument("--packets", type=int, default=200_000, metavar="N",
                    help="packets per measurement (default %(default)s)")
    sp.add_argument("--backend", choices=("core", "bmv2"), default="core",
                    help="core: the C core and the Python model in this process; bmv2: p4/ina.p4 on "
                         "simple_switch_grpc (root, p4c-bm2-ss and simple_switch_grpc on PATH)")
    sp.add_argument("--rates", type=csv(int), default="", metavar="LIST",
                    help="bmv2: then each program at these offered packets/s, paced, with its loss (comma list; "
                         "default none)")
    sp.add_argument("--seconds", type=float, default=1.0,
                    help="bmv2: seconds of traffic per measurement (default %(default)s)")
    sp.add_argument("--repeats", type=int, default=3,
                    help="bmv2: measurements of each program, alternating (default %(default)s)")
    sp.add_argument("--window", type=int, default=24,
                    help="bmv2: packets in flight, sent and not answered (default %(default)s)")
    _add_sweeps(bench_parser)
    _add_sparse_and_training(bench_parser)


def _add_sweeps(bench_parser):
    """allreduce and blocksparse: INA configurations against gloo."""
    sp = bench_parser("allreduce", "allreduce as nccl-tests reports it (size, count, type, redop, time, algbw, busbw, "
                                   "#wrong) per backend, codec, workers and payload, with torch gloo and np.copyto "
                                   "in the same run",
                      plot="write algbw vs size, log-log, with gloo and np.copyto as references (needs matplotlib)")
    ina_runs(sp, sizes=False)
    sp.add_argument("--sizes", type=size_list, default="1K,4K,16K,64K,256K,1M,4M,16M,64M", metavar="LIST",
                    help="bytes of float32 per worker, K/M/G = 1024^n (comma list; default %(default)s; "
                         "nccl-tests' top is 256M)")
    sp.set_defaults(backends="c")  # the python reference switch: `--backends python,c`; shared memory: shm
    sp.add_argument("--iters", type=int, default=None, metavar="N",
                    help="timed calls per size (nccl-tests' -n; default: about 256 MiB per size, 4 to 100)")
    sp.add_argument("--repeat", type=int, default=1, metavar="R",
                    help="run every configuration and gloo R times, alternating, and report each row's median, "
                         "min and max, and its ratio to gloo's median (default %(default)s)")
    sp.add_argument("--windows", type=csv(int), default=None, metavar="LIST",
                    help="worker windows in packets to sweep (comma list; default: connect's own, "
                         "hostlib.worker.auto_window)")
    sp.add_argument("--plain", action="store_true",
                    help="each INA configuration also as users call it, y = allreduce(x) (rows \"plain\"), next to "
                         "allreduce(x, out=y)")
    sp.add_argument("--payloads", type=csv(int), default="1024", metavar="LIST",
                    help="payload bytes per packet (comma list, default %(default)s; 1024 = 256 int32 or 1024 NC codes, SwitchML's "
                         "large packets; loopback carries up to 64 KiB)")
    sp = bench_parser("blocksparse", "block-sparse INA against dense INA of the same tensors and gloo")
    ina_runs(sp)
    sp.add_argument("--densities", type=csv(float), default="0.001,0.01,0.1", metavar="LIST",
                    help="fractions of each worker's blocks that are non-zero (comma list; default %(default)s)")
    sp.add_argument("--payload", type=int, default=1024, metavar="BYTES",
                    help="payload bytes per packet, one block (default %(default)s)")


def _add_sparse_and_training(bench_parser):
    sp = bench_parser("sparse", "DeepReduce index/value codecs on a real gradient and a synthetic top-1 %%",
                      plot=None)
    sp.add_argument("--size", "--sparse-d", dest="d", type=int, default=25_500_000, metavar="N",
                    help="elements of the synthetic tensor (default %(default)s)")
    sp = bench_parser("sparcml", "SparCML's sparse allreduces against gloo's dense one", plot=None)
    sp.add_argument("--workers", dest="ranks", type=csv(int), default="2,4", metavar="LIST",
                    help="rank counts (comma list; default %(default)s)")
    sp.add_argument("--densities", type=csv(float), default="0.001,0.01,0.1", metavar="LIST",
                    help="fractions of non-zero elements (comma list; default %(default)s)")
    sp = bench_parser("train", "DDP training on scikit-learn's digits: gloo against the INA hook per gradient path",
                      plot="write the training plots to PNG's name + -train (needs matplotlib)")
    sp.add_argument("--workers", type=int, default=4, help="DDP ranks (default %(default)s)")
    sp.add_argument("--modes", type=csv(str), default=",".join(convergence_modes()), metavar="LIST",
                    help="gradient paths (comma list): gloo, fixed, nc, nc-deterministic, topk:INDEX:VALUE (top-1 "
                         "%% with DeepReduce codecs, e.g. topk:bloom-p0:qsgd), blocktopk:CODEC:RATIO (top blocks "
                         "by block-sparse INA, e.g. blocktopk:nc:0.1)")
    sp.add_argument("--epochs", type=int, default=30,
                    help="epochs over the digits training split (default %(default)s)")
