"""`switchsim` command line: serve a switch, run the demo, read a running switch's counters."""
from __future__ import annotations

import argparse
import signal
import sys

from inaproto import auth, wire

from .config import DEFAULT_MAX_ELEMENTS, DEFAULT_SLOTS, SwitchConfig


def parse_jobs(workers: int | None, jobs: list[str] | None) -> dict[int, int]:
    """The jobs to serve from --workers and --job, so `serve --workers 4` stays the one-job shorthand.

    Args:
        workers: --workers, the size of job 1 (None: not given).
        jobs: --job ID:WORKERS specs.

    Returns:
        job id -> world size (job 1 with 2 workers when neither is given).

    Raises:
        SystemExit: a spec that is not ID:WORKERS.
    """
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
    """--key-file [JOB:]FILE: the key of one job, or of every job served.

    Args:
        specs: the --key-file values.
        jobs: the jobs served (a key without JOB: applies to each).

    Returns:
        job id -> key.

    Raises:
        ValueError: a key too short, or for a job not served.
        OSError: an unreadable key file.
    """
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
    """(switch, server) for --backend: the reference model under the Python UDP loop, the C core under the
    C UDP loop, or a server that is its own data plane (dpdk, bmv2).

    Args:
        args: serve's parsed flags.

    Returns:
        (the data plane, whose jobs are reported; the server to run).

    Raises:
        ValueError, OSError, RuntimeError: a bad configuration, an unreadable key file, an address in use,
            or a backend that cannot start (cmd_serve reports them as exit status 2).
    """
    config = config_from_args(args)
    net = dict(loss=args.loss, dup=args.dup, reorder=args.reorder, seed=args.seed)
    if args.uplink:
        if args.backend != "python":
            raise ValueError("a leaf switch (--uplink) runs the reference model: --backend python")
        from .leaf import make_leaf
        from .server import UDPServer

        return make_leaf(config, UDPServer, args.host, args.port, args.uplink, args.uplink_rank,
                         args.uplink_leaves, args.uplink_timeout, **net)
    if args.backend == "dpdk":
        from .dpdk import DPDKServer

        server = DPDKServer(config, args.host, args.port, loss=args.loss, dup=args.dup, reorder=args.reorder,
                            eal=args.eal, vdev=args.vdev, iface=args.iface, dpdk_port=args.dpdk_port)
        return server, server
    if args.backend == "bmv2":
        from .bmv2 import BMv2Server

        if args.loss or args.dup or args.reorder:
            raise ValueError("the BMv2 backend has no impairment stage: impair its links (switchsim topo) instead")
        server = BMv2Server(config, args.host, args.port, ifaces=args.iface.split(",") if args.iface else None,
                            grpc_addr=args.grpc, pcap=(args.pcap, args.pcap_max_mb) if args.pcap else None,
                            p4runtime=args.p4runtime)
        return server, server
    if args.shm and args.backend != "c":
        raise ValueError("--shm (the shared-memory transport) runs the C core: --backend c")
    if args.backend == "c":
        from .native import CoreSwitch, CShmServer, CUDPServer

        switch = CoreSwitch(config)
        if args.shm:
            return switch, CShmServer(switch, args.shm, **net)
        return switch, CUDPServer(switch, args.host, args.port, **net)
    from .model import Switch
    from .server import UDPServer

    switch = Switch(config)
    return switch, UDPServer(switch, args.host, args.port, **net)


def config_from_args(args) -> SwitchConfig:
    """serve's flags as a SwitchConfig, validated once here for every backend.

    Args:
        args: serve's parsed flags (elements_per_packet is filled in when not given: bmv2 has its own default).

    Returns:
        The configuration.

    Raises:
        ValueError: an invalid configuration or key.
        OSError: an unreadable key file.
    """
    jobs = parse_jobs(args.workers, args.job)
    if args.elements_per_packet is None:
        args.elements_per_packet = 64 if args.backend == "bmv2" else DEFAULT_MAX_ELEMENTS
    return SwitchConfig(jobs, args.slots, args.elements_per_packet, args.nc_rounding, args.seed,
                        keys=parse_keys(args.key_file, jobs), control_hosts=tuple(args.control or ()),
                        first_packet_id=args.first_packet_id)


def cmd_serve(args) -> int:
    """`switchsim serve`: run until SIGINT/SIGTERM, then print the counters, so a test or script that
    stops the switch still gets them.

    Args:
        args: serve's parsed flags.

    Returns:
        0, or 2 for a configuration the switch cannot start with (the message on stderr).
    """
    from .server import print_json

    try:
        switch, server = make_server(args)
        if args.pcap and args.backend != "bmv2":  # bmv2 captures with BMv2's own --pcap
            server.start_capture(args.pcap, args.pcap_max_mb)
        if args.metrics_port is not None:
            from .metrics import serve_metrics

            metrics = serve_metrics(server.stats, args.metrics_host, args.metrics_port)
    except (ValueError, OSError, RuntimeError) as e:  # OSError: a missing key file too
        print(f"switchsim: {e}", file=sys.stderr)
        return 2
    host, port = server.address
    where = getattr(server, "url", None) or f"{host}:{port}"  # shm://NAME for the shared-memory transport
    jobs = ", ".join(f"job {j}: {job.world_size} workers" for j, job in switch.jobs.items())
    print(f"switchsim listening on {where} ({jobs}; {args.slots} slots, "
          f"<= {args.elements_per_packet} elements/packet, backend {args.backend})", flush=True)
    if getattr(server, "p4runtime", None):  # bmv2: where p4runtime-shell attaches
        from .bmv2 import CONTROLLER_ELECTION_ID, DEVICE_ID

        print(f"switchsim P4Runtime on {server.p4runtime} (device {DEVICE_ID}; the controller is the primary, "
              f"election id {','.join(map(str, CONTROLLER_ELECTION_ID))})", flush=True)
    if args.metrics_port is not None:
        print(f"switchsim metrics on http://{args.metrics_host}:{metrics}/metrics", flush=True)
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


def cmd_p4(args) -> int:
    """`switchsim p4 build|check|info`."""
    from inaproto import gen_p4

    if args.action == "info":
        from . import p4rt

        info = p4rt.P4Info(gen_p4.P4INFO).message
        print(f"p4/ina.p4: {gen_p4.LANES} lanes, {gen_p4.SLOT_CAPACITY} slots, {gen_p4.MEMBER_CAPACITY} ranks, "
              f"{gen_p4.JOB_CAPACITY} jobs; UDP ports {wire.DEFAULT_PORT}..{wire.DEFAULT_PORT + 15}")
        for t in info.tables:
            print(f"table   {t.preamble.name} ({', '.join(m.name for m in t.match_fields)}) size {t.size}")
        for c in info.counters:
            print(f"counter {c.preamble.name} size {c.size}")
        return 0
    try:
        return gen_p4.main(["--check"] if args.action == "check" else ["--compile"])
    except RuntimeError as e:
        print(f"switchsim: {e}", file=sys.stderr)
        return 2


def dissector_path() -> str:
    """The Wireshark dissector the package ships (inaproto/ina.lua, generated from wire.py)."""
    from importlib import resources

    return str(resources.files("inaproto").joinpath("ina.lua"))


def cmd_dissector(args) -> int:
    """`switchsim dissector [--path]`: the Lua dissector's text, or where it is (for tshark -X lua_script:)."""
    path = dissector_path()
    if args.path:
        print(path)
        return 0
    with open(path) as f:
        sys.stdout.write(f.read())
    return 0


def cmd_stats(args) -> int:
    """`switchsim stats`: print a running switch's counters as JSON, or watch them (--watch).

    Args:
        args: the switch address, --timeout and the --watch flags.

    Returns:
        0, or 1 when the switch does not answer (not running, or this host is not a control host).
    """
    from .server import print_json, query_stats
    from inaproto.net import parse_address, shm_name

    address = args.switch if shm_name(args.switch) is not None else parse_address(args.switch)
    if args.watch:
        from .metrics import watch

        return watch(address, args.interval, args.count, args.timeout)
    try:
        print_json(query_stats(address, timeout=args.timeout))
    except (OSError, TimeoutError) as e:
        print(f"switchsim: no answer from {args.switch}: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_demo(args) -> int:
    """`switchsim demo`: delegates to inabench.demo.run_demo (the switch package does not own the demo).

    Args:
        args: demo's parsed flags.

    Returns:
        run_demo's exit status.
    """
    from inabench.demo import run_demo

    return run_demo(args)


BENCH_COMMON = ("command", "func", "benchmark", "json", "plot")  # bench's own keys, not a benchmark's arguments


def cmd_bench(args) -> int:
    """`switchsim bench [BENCHMARK]`: turn the parsed flags into the benchmark's keyword arguments and hand
    them to inabench, which runs and prints.

    Args:
        args: the namespace of a `bench` parser; each benchmark's flags are named after its function's
            parameters, so they pass through unchanged.

    Returns:
        The exit status.
    """
    from inabench.bench import BENCHMARKS, run_benchmarks

    def kwargs(ns):
        return {k: v for k, v in vars(ns).items() if k not in BENCH_COMMON}

    if args.benchmark in (None, "all"):  # what `switchsim bench` always ran: every benchmark with its defaults
        runs = {name: kwargs(build_parser().parse_args(["bench", name])) for name in BENCHMARKS}
    else:
        runs = {args.benchmark: kwargs(args)}
    return run_benchmarks(runs, as_json=args.json, plot_path=args.plot)


def convergence_modes():
    """Returns:
        The training benchmark's default gradient paths, for `bench train --modes`' default.
    """
    from inabench.convergence import MODES  # numpy only: cheap

    return MODES


def build_parser() -> argparse.ArgumentParser:
    """Returns:
        The `switchsim` parser; each sub-command sets func, which main() calls with the parsed flags.
    """
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
    s.add_argument("--shm", metavar="NAME", help="serve workers on this host through shared-memory rings "
                   "(/dev/shm/ina-NAME) instead of UDP; they connect to shm://NAME (--backend c)")
    s.add_argument("--iface", help="dpdk: drive this kernel interface with net_af_packet (e.g. a veth); "
                                    "bmv2: its ports, comma-separated (default: a namespace and veth of its own)")
    s.add_argument("--grpc", metavar="ADDR",
                   help="bmv2: control a simple_switch_grpc that is already running (started with --cpu-port 255; "
                        "HOST:PORT or unix:PATH) instead of starting one; --host is the switch's IP")
    s.add_argument("--p4runtime", metavar="SOCKET",
                   help="bmv2: the unix socket the started simple_switch_grpc serves P4Runtime on (default: one in a "
                        "temporary directory), for p4runtime-shell beside the controller: python -m p4runtime_sh "
                        "--grpc-addr unix:SOCKET --device-id 0 (its default election id 1,0 is a backup that reads)")
    s.add_argument("--vdev", action="append", help="dpdk: an EAL virtual device, e.g. net_memif0,role=server")
    s.add_argument("--eal", help=f"dpdk: EAL arguments replacing the defaults ({'--no-huge ...'}), e.g. for a NIC")
    s.add_argument("--dpdk-port", type=int, default=0, help="dpdk: port id to serve on")
    s.add_argument("--json-stats", action="store_true", help="print the counters (with per-slot arrays) as JSON on exit")
    s.add_argument("--pcap", metavar="FILE", help="write every packet in and out to this pcapng file, the "
                                                   "impairment's decision in each packet's comment")
    s.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve the counters in Prometheus' text format at http://HOST:PORT/metrics (0: any port)")
    s.add_argument("--metrics-host", default="127.0.0.1", help="where --metrics-port listens (default loopback)")
    s.add_argument("--pcap-max-mb", type=float, default=100.0, metavar="MB",
                   help="stop writing the capture at this size (later packets are counted as capture_skipped)")
    s.add_argument("--key-file", action="append", metavar="[JOB:]FILE",
                   help="a job key (>= 16 bytes): joins must carry its MAC (hostlib.connect(key=...) or "
                        "$INA_JOB_KEY); JOB: for one job, else for every job served (repeatable)")
    s.add_argument("--first-packet-id", type=int, metavar="N",
                   help="every slot's first packet id (even; default: random per generation). For tests that "
                        "cross the 32-bit wrap")
    s.add_argument("--control", action="append", metavar="HOST",
                   help="a host besides loopback that may read the counters (switchsim stats) (repeatable)")
    s.add_argument("--uplink", metavar="HOST:PORT",
                   help="two-level aggregation: be a leaf of the root switch there, as rank --uplink-rank of "
                        "--uplink-leaves (switchsim/leaf.py; python backend, one job)")
    s.add_argument("--uplink-rank", type=int, default=0, help="this leaf's rank at the root")
    s.add_argument("--uplink-leaves", type=int, default=2, help="leaves the root's job has")
    s.add_argument("--uplink-timeout", type=float, default=60.0, help="seconds to wait for every leaf to join the root")
    network(s)
    s.set_defaults(func=cmd_serve)

    from topologies.cli import add_parser as add_topo

    add_topo(sub)

    p4 = sub.add_parser("p4", help="the P4 program (p4/ina.p4): regenerate and compile it, or describe it")
    p4.add_argument("action", choices=("build", "check", "info"),
                    help="build: regenerate p4/ina.p4 from wire.py and compile it with p4c-bm2-ss into p4/build/; "
                         "check: exit 1 if p4/ina.p4 is out of date; info: its tables, counters and limits")
    p4.set_defaults(func=cmd_p4)

    ds = sub.add_parser("dissector", help="the Wireshark/tshark dissector of the INA protocol (Lua)",
                        description="Print the Lua dissector (generated from inaproto/wire.py), e.g. into "
                                    "~/.local/lib/wireshark/plugins/ina.lua; or with --path where it is: "
                                    "tshark -X lua_script:$(switchsim dissector --path) -r FILE -Y ina")
    ds.add_argument("--path", action="store_true", help="print the installed file's absolute path instead")
    ds.set_defaults(func=cmd_dissector)

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
    network(d)
    d.set_defaults(func=cmd_demo)

    b = sub.add_parser("bench", help="benchmarks (`switchsim bench BENCHMARK -h` for each one's flags)",
                       description="Without BENCHMARK (or with `all`): every benchmark with its defaults.")
    b.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    b.add_argument("--plot", metavar="PNG", help="write a plot (needs matplotlib)")
    b.set_defaults(func=cmd_bench)
    bench = b.add_subparsers(dest="benchmark", metavar="BENCHMARK")

    def csv(cast):
        return lambda text: [cast(v) for v in text.split(",") if v]

    def bench_parser(name, help, plot="write a plot (needs matplotlib)"):
        """A benchmark's sub-parser; --json/--plot here too (SUPPRESS: `bench --json NAME` keeps working)."""
        sp = bench.add_parser(name, help=help, description=help)
        sp.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print one JSON object instead of a table")
        if plot:
            sp.add_argument("--plot", metavar="PNG", default=argparse.SUPPRESS, help=plot)
        return sp

    def size_list(text):
        """bench allreduce's --sizes: "1K,64M" -> bytes (inabench imported only when parsed)."""
        from inabench.bench import parse_size

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
                    help="timed calls per size (nccl-tests' -n; default: about 32 MiB per size, 1 to 20)")
    sp.add_argument("--repeat", type=int, default=1, metavar="R",
                    help="run every configuration and gloo R times, alternating, and report each row's median, "
                         "min and max, and its ratio to gloo's median (default %(default)s)")
    sp.add_argument("--windows", type=csv(int), default=None, metavar="LIST",
                    help="worker windows in packets to sweep (comma list; default: connect's own, "
                         "hostlib.worker.auto_window)")
    sp.add_argument("--payloads", type=csv(int), default="1024", metavar="LIST",
                    help="payload bytes per packet (comma list, default %(default)s; 1024 = 256 int32 or 1024 NC codes, SwitchML's "
                         "large packets; loopback carries up to 64 KiB)")
    sp = bench_parser("blocksparse", "block-sparse INA against dense INA of the same tensors and gloo")
    ina_runs(sp)
    sp.add_argument("--densities", type=csv(float), default="0.001,0.01,0.1", metavar="LIST",
                    help="fractions of each worker's blocks that are non-zero (comma list; default %(default)s)")
    sp.add_argument("--payload", type=int, default=1024, metavar="BYTES",
                    help="payload bytes per packet, one block (default %(default)s)")
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

    from topologies.cli import add_bench as add_topo_bench

    add_topo_bench(bench_parser("topo", "allreduce time on emulated links (namespaces, root): INA against gloo's "
                                        "ring over the same links, vs link rate and loss (not in `all`)"), csv)

    from inabench.model_cli import add_bench as add_model_bench, add_parser as add_model

    add_model_bench(bench_parser("model", "the projection model (switchsim model) against this emulator on "
                                          "rate-limited namespace links: predicted vs measured (not in `all`)"), csv)
    add_model(sub, csv)

    t = sub.add_parser("stats", help="print a running switch's counters")
    t.add_argument("switch", nargs="?", default=f"127.0.0.1:{wire.DEFAULT_PORT}")
    t.add_argument("--timeout", type=float, default=2.0)
    t.add_argument("--watch", action="store_true",
                   help="poll: a live per-job and per-slot view on a terminal, one JSON object per line otherwise")
    t.add_argument("--interval", type=float, default=1.0, help="--watch: seconds between looks")
    t.add_argument("--count", type=int, help="--watch: stop after this many looks (default: until Ctrl-C)")
    t.set_defaults(func=cmd_stats)
    return p


def main(argv=None) -> int:
    """The `switchsim` entry point (also `python -m switchsim`, and the benchmarks/ scripts).

    Args:
        argv: the arguments without the program name (None: sys.argv[1:]).

    Returns:
        The sub-command's exit status.

    Raises:
        SystemExit: from argparse, for bad flags or --help.
    """
    args = build_parser().parse_args(argv)
    return args.func(args)
