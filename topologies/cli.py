"""`switchsim topo run|up|down|status|exec`: the topologies' command line (inacli adds it)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

STATE_DIR = os.environ.get("INA_TOPO_STATE", "/run/ina-topo")  # one NAME.json (and NAME/ logs) per `topo up`


def add_parser(sub):
    t = sub.add_parser("topo", help="hosts as network namespaces on links with rate, delay and loss, around "
                                    "switches of any backend (a star, or leaves under a root)")
    t.add_argument("action", choices=("run", "up", "down", "status", "exec"),
                   help="run: build, allreduce from every worker host, report, tear down; up: build and start "
                        "the switches, keep them (NAME); down: remove NAME; status: what is up; exec: run a "
                        "command in one host of NAME (switch, root, l0.., w0..)")
    t.add_argument("name", nargs="?", help="up/down/status/exec: the topology's name")
    t.add_argument("argv", nargs="*", help="exec: HOST -- COMMAND...")
    t.add_argument("--file", help="a TOML topology (topologies/examples/); flags given here override it")
    t.add_argument("--workers", type=int)
    t.add_argument("--leaves", type=int, help="two-level aggregation: this many leaf switches under a root")
    t.add_argument("--jobs", type=int, help="jobs sharing the switch, workers split evenly (a star)")
    t.add_argument("--backend", choices=("python", "c", "dpdk", "bmv2"), help="the switch (a tree's root)")
    t.add_argument("--bw", type=float, metavar="MBIT", help="every link's rate in Mbit/s (tc tbf on both ends)")
    t.add_argument("--delay", type=_ms, metavar="D", help="every link's delay each way (e.g. 1ms, 500us; a "
                                                          "user-space stage: this kernel has no netem)")
    t.add_argument("--loss", type=float, help="drop probability per packet and direction on every link")
    t.add_argument("--ecn", action="store_true", default=None,
                   help="every link's queue marks CE (counted) above a threshold instead of dropping (needs --bw)")
    t.add_argument("--codec", choices=("int32", "fixed", "nc"), default="int32")
    t.add_argument("--size", type=int, default=1 << 16, help="elements per worker")
    t.add_argument("--window", type=int, default=32, help="the workers' window (the switch may grant fewer)")
    t.add_argument("--timeout", type=float, default=60.0)
    t.add_argument("--mininet", action="store_true",
                   help="run: the star as a mininet topology instead (Debian's mininet, under /usr/bin/python3)")
    t.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    t.set_defaults(func=cmd_topo)


def _ms(text: str) -> float:
    """A delay as milliseconds: 1ms, 250us, 0.5 (ms), 1s."""
    for unit, scale in (("ms", 1.0), ("us", 1e-3), ("s", 1e3)):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale
    return float(text)


def spec_from_args(args):
    from topologies.run import Spec

    flags = dict(workers=args.workers, backend=args.backend, bw_mbit=args.bw, delay_ms=args.delay,
                 loss=args.loss, leaves=args.leaves, jobs=args.jobs, ecn=args.ecn)
    if args.file:
        return Spec.load(args.file, **flags)
    return Spec(**{k: v for k, v in flags.items() if v is not None})


def cmd_topo(args) -> int:
    """0 on success, 1 if an int32 result was wrong, 2 if the topology or the run failed."""
    try:
        return {"run": _run, "up": _up, "down": _down, "status": _status, "exec": _exec}[args.action](args)
    except (RuntimeError, ValueError, OSError) as e:
        print(f"switchsim topo {args.action}: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    from topologies.run import run, run_mininet

    report = (run_mininet if args.mininet else run)(spec_from_args(args), args.codec, args.size, args.window,
                                                    args.timeout)
    _print(report, args.json)
    return 1 if report["exact"] is False else 0


def _print(obj: dict, as_json: bool):
    if as_json:
        print(json.dumps(obj))
    else:
        for key, value in obj.items():
            print(f"{key:>16}: {value}")


def _named(args) -> str:
    if not args.name or "/" in args.name or args.name.startswith("."):
        raise ValueError("give the topology a NAME (letters, digits, - and _)")
    return os.path.join(STATE_DIR, args.name)


def _up(args) -> int:
    """Build and start; the namespaces and switches stay until `topo down NAME` (the state file says what)."""
    from topologies.run import Deployment

    path = _named(args)
    if os.path.exists(path + ".json"):
        raise ValueError(f"{args.name} is up already (switchsim topo down {args.name})")
    os.makedirs(path, exist_ok=True)
    dep = Deployment(spec_from_args(args), path)
    state = {"name": args.name, "spec": vars(dep.spec), "namespaces": dep.topo.made,
             "hosts": _hosts(dep.topo), "switches": {n: {"pid": p.pid, "log": log, "address": a}
                                                     for n, (p, log, a) in dep.switches.items()},
             "members": [vars(m) for m in dep.members]}
    with open(path + ".json", "w") as f:
        json.dump(state, f, indent=2)
    _print({k: state[k] for k in ("name", "switches", "members")}, args.json)
    return 0


def _hosts(topo) -> dict:
    """Short host names for `topo exec`: switch or root, l0.., w0.. -> namespace."""
    hosts = {f"w{w}": ns for w, ns in enumerate(topo.worker_ns)}
    if hasattr(topo, "switch_ns"):
        hosts["switch"] = topo.switch_ns
    else:
        hosts["root"] = topo.root_ns
        hosts.update({f"l{j}": ns for j, ns in enumerate(topo.leaf_ns)})
    return hosts


def _load(args) -> dict:
    path = _named(args) + ".json"
    if not os.path.exists(path):
        raise ValueError(f"no topology {args.name} is up (switchsim topo status lists them)")
    with open(path) as f:
        return json.load(f)


def _down(args) -> int:
    from switchsim.netns import remove_namespaces

    state = _load(args)
    remove_namespaces(state["namespaces"])  # ends the switches and delay stages inside too
    os.remove(_named(args) + ".json")
    shutil.rmtree(_named(args), ignore_errors=True)
    print(f"{args.name}: removed {len(state['namespaces'])} hosts")
    return 0


def _status(args) -> int:
    names = [args.name] if args.name else sorted(f[:-5] for f in os.listdir(STATE_DIR) if f.endswith(".json")) \
        if os.path.isdir(STATE_DIR) else []
    have = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    out = {}
    for name in names:
        args.name = name
        state = _load(args)
        out[name] = {"spec": state["spec"], "hosts_up": sum(ns in have for ns in state["namespaces"]),
                     "hosts": len(state["namespaces"]),
                     "switches": {n: {**s, "running": _alive(s["pid"])} for n, s in state["switches"].items()}}
    if not out:
        print("no topology is up")
    else:
        _print(out, args.json)
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _exec(args) -> int:
    """`topo exec NAME HOST -- CMD...`: CMD inside host HOST (its exit status), e.g. a worker or `switchsim stats`."""
    state = _load(args)
    if len(args.argv) < 2 or args.argv[0] not in state["hosts"]:
        raise ValueError(f"usage: topo exec NAME HOST -- COMMAND... (hosts: {', '.join(state['hosts'])})")
    return subprocess.call(["ip", "netns", "exec", state["hosts"][args.argv[0]], *args.argv[1:]])


def add_bench(sp, csv):
    """`switchsim bench topo`'s flags (sp: its sub-parser, made by inabench/cli.py's bench_parser)."""
    sp.add_argument("--workers", type=int, default=4)
    sp.add_argument("--size", type=int, default=1 << 18, help="float32 elements per worker (default %(default)s)")
    sp.add_argument("--rates", type=csv(float), default="10,100,1000,10000", metavar="LIST",
                    help="link rates in Mbit/s, no loss (comma list; default %(default)s)")
    sp.add_argument("--losses", type=csv(float), default="0,0.01,0.05,0.1", metavar="LIST",
                    help="losses per packet and direction at --loss-rate (comma list; default %(default)s)")
    sp.add_argument("--loss-rate", type=float, default=100, help="the link rate of the loss runs (Mbit/s)")
    sp.add_argument("--codecs", type=csv(str), default="int32,fixed,nc", metavar="LIST")
    sp.add_argument("--backend", choices=("python", "c"), default="c")
    sp.add_argument("--delay", type=_ms, default=0.0, metavar="D", help="every link's delay each way")
    sp.add_argument("--ecn", action="store_true", help="the links' queues mark CE above a threshold")
    sp.set_defaults(func=cmd_bench_topo)


def cmd_bench_topo(args) -> int:
    from inabench.extras import require
    from inabench.report import table
    from topologies.bench import bench_topo, plot

    if not require("bench topo", "torch", why="gloo's ring over the same links"):
        return 2
    as_json = getattr(args, "json", False)
    rows = _measure("topo", args, lambda progress: bench_topo(args.workers, args.size, args.rates, args.losses,
                                                              args.loss_rate, args.codecs, args.backend, args.delay,
                                                              progress=progress, ecn=args.ecn))
    if rows is None:
        return 2
    print(json.dumps({"topo": rows}, indent=2) if as_json else f"\n== topo\n{table(rows)}")
    if getattr(args, "plot", None):
        plot(rows, args.plot)
    return 0


def add_net_bench(sp, csv):
    """`switchsim bench net`'s flags (sp: its sub-parser, made by inabench/cli.py's bench_parser)."""
    from hostlib.cc import POLICIES

    sp.add_argument("--hosts", type=int, default=4, help="worker hosts of the star (at least 2; default %(default)s)")
    sp.add_argument("--bw", type=float, default=100.0, help="every link's rate, Mbit/s (default %(default)s)")
    sp.add_argument("--delay", type=_ms, default=1.0, metavar="D", help="every link's delay each way (default 1ms)")
    sp.add_argument("--seconds", type=float, default=20.0, help="each phase's length (default %(default)s)")
    sp.add_argument("--ecn", action="store_true", help="the links' queues mark CE above a threshold (counted)")
    sp.add_argument("--cc", dest="ccs", type=csv(str), default="none,aimd", metavar="LIST",
                    help="INA congestion policies, a row pair each (default %(default)s; of " + ", ".join(POLICIES)
                         + "; none: SwitchML's fixed window, --window or 10 ms of the link's rate)")
    sp.add_argument("--loss", type=float, default=0.0, help="every link's loss, per packet and direction")
    sp.add_argument("--tcp-cc", default="cubic",
                    help="the TCP bulk flow's congestion control (default %(default)s, Linux's; bbr ignores ECN)")
    sp.add_argument("--codec", choices=("int32", "fixed", "nc"), default="int32")
    sp.add_argument("--elements", type=int, default=1 << 20, help="elements per allreduce call (default %(default)s)")
    sp.add_argument("--window", type=int, default=None,
                    help="INA slots per worker (default: hostlib's, its congestion window finding the path's share; "
                         "under --cc none: 10 ms of the link's rate in 1 KiB packets)")
    sp.add_argument("--short-rate", type=float, default=50.0, help="short flows per second (default %(default)s)")
    sp.add_argument("--short-kb", type=float, default=16.0, help="each short flow's response, KB (default %(default)s)")
    sp.add_argument("--second-job", action="store_true",
                    help="one more phase per policy: INA beside a second INA job (2 ranks on workers 0 and 1)")
    sp.set_defaults(func=cmd_bench_net)


def _measure(name: str, args, run):
    """run(progress) of `switchsim bench NAME`: its rows, or None when it failed (the error named once);
    progress lines go to a terminal's stderr only, never with --json or into a pipe."""
    as_json = getattr(args, "json", False)
    progress = None if as_json or not sys.stderr.isatty() else (lambda s: print(f"... {s}", file=sys.stderr))
    try:
        return run(progress)
    except (RuntimeError, ValueError, OSError) as e:
        print(f"switchsim bench {name}: {e}", file=sys.stderr)
        return None


def cmd_bench_net(args) -> int:
    from hostlib.cc import policy_of
    from inabench.report import table
    from topologies.net import bench_net, plot, table_rows

    for cc in args.ccs:
        policy_of(cc)
    fixed = args.window or topo_window(args.bw)  # "none": SwitchML's window, set for the link
    rows = _measure("net", args, lambda progress: bench_net(
        args.hosts, args.bw, args.delay, args.seconds, args.ecn, args.ccs, args.codec, args.elements,
        args.window, args.short_rate, args.short_kb, progress=progress, job2=args.second_job, loss=args.loss,
        fixed_window=fixed, tcp_cc=args.tcp_cc))
    if rows is None:
        return 2
    print(json.dumps({"net": rows}, indent=2) if getattr(args, "json", False) else
          f"\n== net\n{table(table_rows(rows))}")
    if getattr(args, "plot", None):
        plot(rows, args.plot)
    return 0


def add_model_bench(sp, csv):
    """`switchsim bench model`'s flags (sp: its sub-parser, made by inabench/cli.py's bench_parser)."""
    sp.add_argument("--workers", type=csv(int), default="2,3,4,6,8", metavar="LIST")
    sp.add_argument("--codecs", type=csv(str), default="int32,fixed,nc", metavar="LIST")
    sp.add_argument("--losses", type=csv(float), default="0,0.05", metavar="LIST")
    sp.add_argument("--size", type=int, default=1 << 18, help="float32 elements per worker")
    sp.add_argument("--bw", type=float, default=100.0, help="link rate, Mbit/s")
    sp.set_defaults(func=cmd_bench_model)


def cmd_bench_model(args) -> int:
    from . import validate

    from inabench.report import table

    as_json = getattr(args, "json", False)
    rows = _measure("model", args, lambda progress: validate.validate(args.workers, args.codecs, args.losses,
                                                                      args.size, args.bw, progress=progress))
    if rows is None:
        return 2
    worst = max(rows, key=lambda r: abs(r["error"]))
    print(json.dumps({"model vs emulator": rows}, indent=2) if as_json else
          f"\n== model vs emulator\n{table(rows)}")
    if not as_json:
        print(f"worst: {worst['error']:+.1%} ({worst['codec']}, loss {worst['loss']}, {worst['workers']} workers)")
    if getattr(args, "plot", None):
        validate.plot(rows, args.plot)
    return 0


def add_ddp_bench(sp, csv):
    from hostlib.cc import DEFAULT as DEFAULT_CC
    from hostlib.cc import POLICIES

    """`switchsim bench ddp`'s flags (sp: its sub-parser, made by inabench/cli.py's bench_parser)."""
    sp.add_argument("--workers", type=csv(int), default="2,4", metavar="LIST", help="world sizes (default %(default)s)")
    sp.add_argument("--paths", type=csv(str), default="gloo,ina:fixed,ina:nc,hook:fixed,hook:nc", metavar="LIST",
                    help="gradient paths: gloo, ina:CODEC (init_process_group('ina')), hook:CODEC (the DDP comm "
                         "hook on gloo); CODEC fixed or nc (default %(default)s)")
    sp.add_argument("--model", choices=("wide", "cnn", "mlp"), default="wide",
                    help="wide: an MLP with 8.4 MB of gradients; cnn: 4.3 MB; mlp: the digits MLP (default %(default)s)")
    sp.add_argument("--batch", type=int, default=32, help="examples per rank and step")
    sp.add_argument("--iters", type=int, default=20, help="timed steps per run")
    sp.add_argument("--warmup", type=int, default=5, help="steps before the timed ones")
    sp.add_argument("--repeat", type=int, default=3, help="runs of every configuration, alternating; medians")
    sp.add_argument("--bucket-mb", type=float, default=2.0, help="DDP's bucket_cap_mb (several buckets per step)")
    sp.add_argument("--straggler", metavar="R:MS", type=lambda t: [int(t.split(":")[0]), float(t.split(":")[1])],
                    help="rank R sleeps MS ms in every step (a slow host)")
    sp.add_argument("--backend", choices=("python", "c"), default="c",
                    help="the INA switch (with --topo: python or c, whose stars bridge the workers' links: DDP's "
                         "rendezvous store and gloo need worker to worker paths, which the bmv2 and dpdk stars "
                         "do not have)")
    sp.add_argument("--window", type=int, default=None,
                    help="INA slots per worker (default: hostlib's; its congestion window finds the path's share. "
                         "With --cc none and --topo: 10 ms of the link's rate in 1 KiB packets, as SwitchML's "
                         "fixed window would be set for the link)")
    sp.add_argument("--cc", choices=tuple(POLICIES), default=None,
                    help="the INA congestion policy of every rank (default: hostlib's, %s)" % DEFAULT_CC)
    sp.add_argument("--jobs", type=int, default=1,
                    help="also run every path as this many DDP jobs at once (job ids 1..N, each of --workers ranks) "
                         "on one shared switch, on loopback: rows with 'jobs' and 'x solo' (p50 over the same path "
                         "alone on that switch)")
    sp.add_argument("--topo", action="store_true",
                    help="ranks on namespace hosts of a star (root): --bw, --delay, --loss on every link; gloo's "
                         "ring over the same links; the projection model beside each row")
    sp.add_argument("--bw", type=float, default=100.0, help="--topo: link rate, Mbit/s (default %(default)s)")
    sp.add_argument("--delay", type=_ms, default=1.0, metavar="D", help="--topo: every link's delay each way (ms)")
    sp.add_argument("--loss", type=float, default=0.0, help="--topo: per packet and direction")
    sp.add_argument("--ecn", action="store_true", help="--topo: the links' queues mark CE above a threshold")
    sp.add_argument("--tcp-cc", default="cubic",
                    help="--topo: the worker hosts' TCP congestion control, gloo's (default %(default)s, Linux's; "
                         "the host's own may be bbr, which ignores loss)")
    sp.add_argument("--tta", action="store_true",
                    help="time to accuracy instead: the digits MLP for --epochs, epochs and seconds to --target")
    sp.add_argument("--target", type=float, default=0.95, help="--tta: test accuracy (default %(default)s)")
    sp.add_argument("--epochs", type=int, default=30, help="--tta: epochs (default %(default)s)")
    sp.add_argument("--diff", nargs=2, metavar=("A.json", "B.json"),
                    help="compare two `bench ddp --json` outputs (p50 and p95, B / A) instead of running")
    sp.set_defaults(func=cmd_bench_ddp)


def cmd_bench_ddp(args) -> int:
    from inabench import ddp
    from inabench.extras import require
    from inabench.report import table

    if not args.diff and not require("bench ddp", "torch", why="DDP training on every path"):
        return 2
    if args.cc:  # every rank's Communicator reads it (the ina group, the hook)
        os.environ["INA_CC"] = args.cc
    if args.jobs < 1 or args.jobs > 1 and (args.topo or args.tta):
        print("switchsim bench ddp: --jobs N (N >= 1) runs on loopback, without --topo or --tta", file=sys.stderr)
        return 2
    if args.topo and args.window is None and args.cc == "none":  # SwitchML's fixed window, set for the link
        args.window = topo_window(args.bw)

    as_json = getattr(args, "json", False)
    progress = None if as_json or not sys.stderr.isatty() else (lambda s: print(f"... {s}", file=sys.stderr))
    try:
        if args.diff:
            a, b = (json.load(open(p)) for p in args.diff)
            out = {"diff": ddp.diff(a, b)}
        elif args.tta:
            place = _ddp_hosts(args)(args.workers[-1]) if args.topo else None
            res = ddp.bench_tta(args.workers[-1], args.paths, args.epochs, args.target, args.batch, args.backend,
                                place=place, progress=progress, window=args.window)
            out = {"tta": res["rows"], "curves": res["curves"]}
        else:
            rows = ddp.bench_ddp(args.workers, args.paths, args.model, args.batch, args.iters, args.warmup,
                                 args.repeat, args.straggler, args.bucket_mb, args.backend,
                                 place_for=_ddp_hosts(args) if args.topo else None, progress=progress,
                                 window=args.window, jobs=args.jobs)
            if args.topo:
                from .ddp import with_projection

                rows = with_projection(rows, args.bw, args.delay, args.loss)
            out = {"ddp": rows}
    except (RuntimeError, ValueError, OSError) as e:
        print(f"switchsim bench ddp: {e}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(out, indent=2))
    else:
        for key, rows in out.items():
            if key != "curves":
                print(f"\n== ddp {key}\n{table(rows)}")
    if getattr(args, "plot", None) and not args.diff:
        (ddp.plot_tta({"rows": out["tta"], "curves": out["curves"]}, args.plot) if args.tta
         else ddp.plot_steps(out["ddp"], args.plot))
    return 0


def topo_window(bw_mbit: float, seconds: float = 0.01) -> int:
    """INA slots for a link of bw_mbit: `seconds` of its rate in packets of 1 KiB payload (1068 bytes on the
    link), 16..1024. 100 Mbit/s: 117 (measured: 64 slots 1.06 s a step, 128 0.97 s, 256 1.35 s with
    retransmissions, the default 512 1.68 s; 8.4 MB of fixed-point gradients, 4 hosts, 1 ms links)."""
    return max(16, min(1024, int(bw_mbit * 1e6 / 8 * seconds / 1068)))


def _ddp_hosts(args):
    from .ddp import Hosts

    return lambda world: Hosts(world, args.backend, args.bw, args.delay, args.loss, args.ecn, args.tcp_cc)
