"""`switchsim` command line: serve a switch, run the demo, read a running switch's counters."""
from __future__ import annotations

import argparse
import os
import signal
import sys

from inaproto import auth, wire

from .config import DEFAULT_MAX_ELEMENTS, DEFAULT_SLOTS, SwitchConfig


def parse_jobs(workers: int | None, jobs: list[str] | None) -> dict[int, int]:
    out = {}
    for spec in jobs or []:
        try:
            job, n = spec.split(":")
            out[int(job)] = int(n)
        except ValueError:
            raise SystemExit(f"switchsim: --job wants ID:WORKERS, got {spec!r}") from None
    if workers is not None or not out:
        out.setdefault(1, workers or 2)
    return out


BACKENDS = ("python", "c", "dpdk", "bmv2")


def parse_keys(specs: list[str] | None, jobs: dict[int, int]) -> dict[int, bytes]:
    """--key-file [JOB:]FILE: the key of one job, or of every job served."""
    keys = {}
    for spec in specs or []:
        job, sep, path = spec.partition(":")
        if sep and job.isdigit():
            keys[int(job)] = auth.load_key(path)
        else:
            keys.update(dict.fromkeys(jobs, auth.load_key(spec)))
    unknown = sorted(set(keys) - set(jobs))
    if unknown:
        raise ValueError(f"--key-file for jobs {unknown} that are not served")
    return keys


def make_server(args):
    """(switch, server) for --backend: the reference model under the Python UDP loop, or the C core under
    the C UDP loop."""
    config = config_from_args(args)
    net = dict(loss=args.loss, dup=args.dup, reorder=args.reorder, seed=args.seed)
    if args.backend == "dpdk":
        from .dpdk import DPDKServer

        server = DPDKServer(config, args.host, args.port, loss=args.loss, dup=args.dup, reorder=args.reorder,
                            eal=args.eal, vdev=args.vdev, iface=args.iface, dpdk_port=args.dpdk_port)
        return server, server
    if args.backend == "bmv2":
        from .bmv2 import BMv2Server

        if args.loss or args.dup or args.reorder:
            raise ValueError("the BMv2 backend has no impairment stage: impair its links (switchsim topo) instead")
        server = BMv2Server(config, args.host, args.port, ifaces=args.iface.split(",") if args.iface else None)
        return server, server
    if args.backend == "c":
        from .native import CoreSwitch, CUDPServer

        switch = CoreSwitch(config)
        return switch, CUDPServer(switch, args.host, args.port, **net)
    from .model import Switch
    from .server import UDPServer

    switch = Switch(config)
    return switch, UDPServer(switch, args.host, args.port, **net)


def config_from_args(args) -> SwitchConfig:
    """serve's flags as a SwitchConfig (ValueError for a bad one, OSError for an unreadable key file)."""
    jobs = parse_jobs(args.workers, args.job)
    if args.elements_per_packet is None:
        args.elements_per_packet = 64 if args.backend == "bmv2" else DEFAULT_MAX_ELEMENTS
    return SwitchConfig(jobs, args.slots, args.elements_per_packet, args.nc_rounding, args.seed,
                        keys=parse_keys(args.key_file, jobs), control_hosts=tuple(args.control or ()),
                        first_packet_id=args.first_packet_id)


def cmd_serve(args) -> int:
    from .server import print_json

    try:
        switch, server = make_server(args)
    except (ValueError, OSError, RuntimeError) as e:  # OSError: a missing key file too
        print(f"switchsim: {e}", file=sys.stderr)
        return 2
    host, port = server.address
    jobs = ", ".join(f"job {j}: {job.world_size} workers" for j, job in switch.jobs.items())
    print(f"switchsim listening on {host}:{port} ({jobs}; {args.slots} slots, "
          f"<= {args.elements_per_packet} elements/packet, backend {args.backend})", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    stats = server.stats(per_slot=args.json_stats)
    if args.json_stats:
        print_json(stats)
    else:
        drops = sum(stats["dropped"].values())
        print(f"switchsim: {stats['packets_in']} packets in, {stats['packets_out']} out, {drops} dropped "
              f"({', '.join(f'{k} {v}' for k, v in stats['dropped'].items() if v) or 'none'})", flush=True)
    return 0


def cmd_stats(args) -> int:
    from .server import print_json, query_stats
    from inaproto.net import parse_address

    try:
        print_json(query_stats(parse_address(args.switch), timeout=args.timeout))
    except (OSError, TimeoutError) as e:
        print(f"switchsim: no answer from {args.switch}: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_demo(args) -> int:
    from inabench.demo import run_demo

    return run_demo(args)


def cmd_bench(args) -> int:
    import json as _json

    from inabench import bench

    def csv(text, cast):
        return [cast(v) for v in text.split(",") if v]

    what = (("codecs", "switch", "allreduce", "train", "sparse", "sparcml", "blocksparse") if args.what == "all"
            else (args.what,))
    results = {}
    if "codecs" in what:
        results["codecs"] = bench.bench_codecs(args.mib)
    if "switch" in what:
        results["switch"] = bench.bench_switch(args.packets)
    if "allreduce" in what:
        results["allreduce"] = bench.bench_allreduce(
            csv(args.sizes, float), csv(args.workers, int), csv(args.backends, str), csv(args.codecs, str),
            payloads=csv(args.payloads, int), gloo=not args.no_gloo, progress=None if args.json else lambda s: print(f"... {s}", file=sys.stderr))
    if "blocksparse" in what:
        results["blocksparse"] = bench.bench_block_sparse(
            csv(args.sizes, float), csv(args.workers, int), csv(args.backends, str), csv(args.codecs, str),
            csv(args.densities, float), payload=csv(args.payloads, int)[0], gloo=not args.no_gloo,
            progress=None if args.json else lambda s: print(f"... {s}", file=sys.stderr))
    if "sparse" in what:
        from inabench.bench_sparse import bench_sparse

        results["sparse"] = bench_sparse(args.sparse_d)
    if "sparcml" in what:
        from inabench.bench_sparse import bench_sparcml

        results["sparcml"] = bench_sparcml(csv(args.workers, int), csv(args.densities, float))
    train = None
    if "train" in what:
        from inabench import convergence

        train = convergence.run(max(csv(args.workers, int)), csv(args.modes, str), epochs=args.epochs)
        results["train"] = convergence.main_rows(train)
    if args.json:
        print(_json.dumps({**results, **({"exponent_histogram": train["exponents"]} if train else {})}, indent=2))
    else:
        for key, rows in results.items():
            print(f"\n== {key}\n{bench.table(rows)}")
    if args.plot:
        if set(results) & {"codecs", "switch", "allreduce", "blocksparse"}:
            bench.plot(results, args.plot)
        if train:
            base, ext = os.path.splitext(args.plot)
            convergence.plot(train, f"{base}-train{ext or '.png'}")
    return 0


def convergence_modes():
    from inabench.convergence import MODES  # numpy only: cheap

    return MODES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="switchsim", description="In-network aggregation emulator (switch side)")
    sub = p.add_subparsers(dest="command", required=True)

    def network(sp):
        sp.add_argument("--loss", type=float, default=0.0, help="drop probability per packet and direction")
        sp.add_argument("--dup", type=float, default=0.0, help="duplication probability per packet and direction")
        sp.add_argument("--reorder", type=float, default=0.0, help="probability to hold a packet behind the next")
        sp.add_argument("--slots", type=int, default=DEFAULT_SLOTS, help="slots per job (each has 2 sets)")
        sp.add_argument("--elements-per-packet", type=int, default=None,
                        help=f"largest packet the switch accepts (default {DEFAULT_MAX_ELEMENTS}; bmv2: 64)")
        sp.add_argument("--nc-rounding", choices=("stochastic", "deterministic"), default="stochastic",
                        help="how the switch re-compresses NC sums")
        sp.add_argument("--seed", type=int, default=0)
        sp.add_argument("--backend", choices=BACKENDS, default="python",
                        help="python: reference model; c: C core and C UDP loop; dpdk: C core on a DPDK port; "
                             "bmv2: p4/ina.p4 on simple_switch_grpc in a namespace of its own")

    s = sub.add_parser("serve", help="run a switch on UDP")
    s.add_argument("--workers", type=int, help="workers of job 1 (default 2)")
    s.add_argument("--job", action="append", metavar="ID:WORKERS", help="serve this job (repeatable)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=wire.DEFAULT_PORT, help="UDP port (0 = any free port)")
    s.add_argument("--iface", help="dpdk: drive this kernel interface with net_af_packet (e.g. a veth); "
                                    "bmv2: its ports, comma-separated (default: a namespace and veth of its own)")
    s.add_argument("--vdev", action="append", help="dpdk: an EAL virtual device, e.g. net_memif0,role=server")
    s.add_argument("--eal", help=f"dpdk: EAL arguments replacing the defaults ({'--no-huge ...'}), e.g. for a NIC")
    s.add_argument("--dpdk-port", type=int, default=0, help="dpdk: port id to serve on")
    s.add_argument("--json-stats", action="store_true", help="print the counters (with per-slot arrays) as JSON on exit")
    s.add_argument("--key-file", action="append", metavar="[JOB:]FILE",
                   help="a job key (>= 16 bytes): joins must carry its MAC (hostlib.connect(key=...) or "
                        "$INA_JOB_KEY); JOB: for one job, else for every job served (repeatable)")
    s.add_argument("--first-packet-id", type=int, metavar="N",
                   help="every slot's first packet id (even; default: random per generation). For tests that "
                        "cross the 32-bit wrap")
    s.add_argument("--control", action="append", metavar="HOST",
                   help="a host besides loopback that may read the counters (switchsim stats) (repeatable)")
    network(s)
    s.set_defaults(func=cmd_serve)

    d = sub.add_parser("demo", help="switch + N worker processes on loopback, checked against numpy")
    d.add_argument("--workers", type=int, default=4)
    d.add_argument("--size", type=int, default=1 << 20, help="float32 elements per worker")
    d.add_argument("--codec", choices=("nc", "fixed", "int32"), default="nc")
    d.add_argument("--window", type=int, default=128)
    d.add_argument("--elements", type=int, default=None, help="elements per packet (codec default)")
    d.add_argument("--timeout", type=float, default=60.0)
    d.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    d.add_argument("--density", type=float, default=1.0,
                   help="fraction of each worker's blocks (of --elements) that are non-zero (default 1: dense)")
    d.add_argument("--sparse", action="store_true", help="block-sparse INA: send only non-zero blocks")
    network(d)
    d.set_defaults(func=cmd_demo)

    b = sub.add_parser("bench", help="benchmarks: codec kernels, aggregator packets/s, allreduce vs gloo")
    b.add_argument("what", nargs="?", choices=("all", "codecs", "switch", "allreduce", "train", "sparse", "sparcml", "blocksparse"),
                   default="all")
    b.add_argument("--mib", type=int, default=64, help="codecs: buffer size")
    b.add_argument("--packets", type=int, default=200_000, help="switch: packets per measurement")
    b.add_argument("--sizes", default="1,16,64", help="allreduce: MiB of float32 per worker (comma list)")
    b.add_argument("--workers", default="2,4", help="allreduce: worker counts (comma list)")
    b.add_argument("--backends", default="python,c", help="allreduce: python,c,dpdk (dpdk needs root)")
    b.add_argument("--codecs", default="int32,fixed,nc", help="allreduce: codecs (comma list)")
    b.add_argument("--payloads", default="1024",
                   help="allreduce: payload bytes per packet (comma list; 1024 = 256 int32 or 1024 NC codes, "
                        "SwitchML's large packets; loopback carries up to 64 KiB)")
    b.add_argument("--no-gloo", action="store_true", help="allreduce: skip the torch gloo baseline")
    b.add_argument("--modes", default=",".join(convergence_modes()),
                   help="train: gradient paths: gloo, fixed, nc, nc-deterministic, topk:INDEX:VALUE (top-1 %% "
                        "with DeepReduce codecs, e.g. topk:bloom-p0:qsgd), blocktopk:CODEC:RATIO (top blocks by "
                        "block-sparse INA, e.g. blocktopk:nc:0.1)")
    b.add_argument("--epochs", type=int, default=30, help="train: epochs over the digits training split")
    b.add_argument("--densities", default="0.001,0.01,0.1",
                   help="sparcml: non-zero fractions; blocksparse: fractions of non-zero blocks (comma lists)")
    b.add_argument("--sparse-d", type=int, default=25_500_000, help="sparse: size of the synthetic tensor")
    b.add_argument("--json", action="store_true")
    b.add_argument("--plot", metavar="PNG", help="write a plot (needs matplotlib)")
    b.set_defaults(func=cmd_bench)

    t = sub.add_parser("stats", help="print a running switch's counters")
    t.add_argument("switch", nargs="?", default=f"127.0.0.1:{wire.DEFAULT_PORT}")
    t.add_argument("--timeout", type=float, default=2.0)
    t.set_defaults(func=cmd_stats)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
