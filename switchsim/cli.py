"""The switch's verbs of the `switchsim` command line (serve, p4, dissector, stats); inacli puts every package's
verbs together."""
from __future__ import annotations

import signal
import sys

from inaproto import auth, wire
from inaproto.timers import PEER_SILENT

from .config import ADMISSION_RULES, DEFAULT_MAX_ELEMENTS, DEFAULT_MAX_JOBS, DEFAULT_SLOTS, SwitchConfig


def parse_jobs(workers: int | None, jobs: list[str] | None) -> dict[int, int]:
    """The jobs to serve from --workers and --job, so `serve --workers 4` stays the one-job shorthand.

    Args:
        workers: --workers, the size of job 1 (None: not given).
        jobs: --job ID:WORKERS specs.

    Returns:
        job id -> world size; empty when neither is given (a shared switch: jobs admitted as they join).

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
    if workers is not None:
        out.setdefault(1, workers)
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
    if args.uplink and not jobs:
        jobs = {1: 2}  # a leaf serves one job (job 1 of 2 workers unless said)
    shared = not jobs
    pool, max_jobs = getattr(args, "pool", None), getattr(args, "max_jobs", None) or DEFAULT_MAX_JOBS
    if not shared and (pool or getattr(args, "max_jobs", None) or getattr(args, "min_slots", None)
                       or getattr(args, "admit", "open") != "open" or getattr(args, "key_dir", None)):
        raise ValueError("--pool, --max-jobs, --min-slots, --admit and --key-dir are a shared switch's: serve "
                         "without --job / --workers")
    slots = args.slots or (pool // max_jobs if shared and pool else DEFAULT_SLOTS)
    shares = dict(shared=True, pool=pool or slots * max_jobs, min_slots=args.min_slots, admit=args.admit,
                  key_dir=args.key_dir) if shared else {}
    return SwitchConfig(jobs, slots, args.elements_per_packet, args.nc_rounding, args.seed,
                        keys=parse_keys(args.key_file, jobs), control_hosts=tuple(args.control or ()),
                        first_packet_id=args.first_packet_id, peer_silent=args.peer_silent, **shares)


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
    c = switch.config
    jobs = (f"shared: jobs admitted as they join ({c.admit}), a pool of {c.pool} slots, {c.slots} a job"
            if c.shared else ", ".join(f"job {j}: {n} workers" for j, n in c.jobs.items()) + f"; {c.slots} slots")
    print(f"switchsim listening on {where} ({jobs}, <= {args.elements_per_packet} elements/packet, "
          f"backend {args.backend})", flush=True)
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


def cmd_key(args) -> int:
    """`switchsim key issue|revoke --key-dir DIR --job N`: a keyed shared switch admits only the jobs whose key
    is in its --key-dir (read at each new job's first join, so issuing and revoking need no restart). issue
    writes a fresh key (owner-only) and prints its path: the job's workers take it as $INA_JOB_KEY."""
    import os
    import secrets

    path = os.path.join(args.key_dir, f"{args.job}.key")
    if args.action == "revoke":
        try:
            os.remove(path)
        except FileNotFoundError:
            print(f"switchsim: no key issued for job {args.job} in {args.key_dir}", file=sys.stderr)
            return 1
        print(f"revoked {path} (a running job keeps its generation; its next join is refused)")
        return 0
    if not 0 <= args.job <= 0xFFFF:
        print(f"switchsim: job id {args.job} out of range 0..65535", file=sys.stderr)
        return 2
    os.makedirs(args.key_dir, mode=0o700, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if args.force else os.O_EXCL), 0o600)
    except FileExistsError:
        print(f"switchsim: job {args.job} has a key already ({path}); --force replaces it", file=sys.stderr)
        return 1
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    print(path)
    return 0


def csv(cast):
    """An argparse type for comma lists: "1,2" -> [cast("1"), cast("2")]."""
    return lambda text: [cast(v) for v in text.split(",") if v]


def add_network_flags(sp):
    """The impairment and switch flags `serve` and `demo` share."""
    sp.add_argument("--loss", type=float, default=0.0, help="drop probability per packet and direction")
    sp.add_argument("--dup", type=float, default=0.0, help="duplication probability per packet and direction")
    sp.add_argument("--reorder", type=float, default=0.0, help="probability to hold a packet behind the next")
    sp.add_argument("--slots", "--job-slots", type=int, default=None,
                    help=f"slots per job, each with 2 sets (default {DEFAULT_SLOTS}; a shared switch: each job's "
                         f"quota of its pool, default --pool / --max-jobs)")
    sp.add_argument("--elements-per-packet", type=int, default=None,
                    help=f"largest packet the switch accepts (default {DEFAULT_MAX_ELEMENTS}; bmv2: 64)")
    sp.add_argument("--nc-rounding", choices=("stochastic", "deterministic"), default="stochastic",
                    help="how the switch re-compresses NC sums")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--backend", choices=BACKENDS, default="python",
                    help="python: reference model; c: C core and C UDP loop; dpdk: C core on a DPDK port; "
                         "bmv2: p4/ina.p4 on simple_switch_grpc in a namespace of its own")


def add_parser(sub):
    """The switch's verbs (serve, p4, dissector, stats) on the command line's sub-parsers (inacli)."""
    add_serve(sub)
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

    k = sub.add_parser("key", help="issue or revoke a job's key for a keyed shared switch (serve --admit keyed)")
    k.add_argument("action", choices=("issue", "revoke"))
    k.add_argument("--key-dir", required=True, help="the switch's --key-dir")
    k.add_argument("--job", type=int, required=True, help="the job id")
    k.add_argument("--force", action="store_true", help="issue: replace a key issued before")
    k.set_defaults(func=cmd_key)

    t = sub.add_parser("stats", help="print a running switch's counters")
    t.add_argument("switch", nargs="?", default=f"127.0.0.1:{wire.DEFAULT_PORT}")
    t.add_argument("--timeout", type=float, default=2.0)
    t.add_argument("--watch", action="store_true",
                   help="poll: a live per-job and per-slot view on a terminal, one JSON object per line otherwise")
    t.add_argument("--interval", type=float, default=1.0, help="--watch: seconds between looks")
    t.add_argument("--count", type=int, help="--watch: stop after this many looks (default: until Ctrl-C)")
    t.set_defaults(func=cmd_stats)


def add_serve(sub):
    """`switchsim serve`."""
    s = sub.add_parser("serve", help="run a switch on UDP")
    s.add_argument("--workers", type=int, help="serve job 1 with this many workers (the one-job shorthand)")
    s.add_argument("--job", action="append", metavar="ID:WORKERS",
                   help="serve this job (repeatable); without --job and --workers the switch is shared: jobs are "
                        "admitted at their first join and end when their members leave or fall silent")
    s.add_argument("--pool", type=int, help=f"a shared switch's slots over all jobs (default --slots x "
                                            f"--max-jobs, {DEFAULT_SLOTS * DEFAULT_MAX_JOBS})")
    s.add_argument("--max-jobs", type=int, help=f"a shared switch's equal shares: each job's quota is the pool "
                                                f"divided by this (default {DEFAULT_MAX_JOBS})")
    s.add_argument("--min-slots", type=int, help="a shared switch admits a job with no fewer slots than this "
                                                 "(default: its quota); a job it cannot give them is refused at "
                                                 "once (PoolFull)")
    s.add_argument("--admit", choices=ADMISSION_RULES, default="open",
                   help="a shared switch's admission: open (any job id; loopback, trusted labs) or keyed (only jobs "
                        "whose key was issued into --key-dir: switchsim key issue)")
    s.add_argument("--key-dir", help="--admit keyed: the directory of issued keys (JOB.key)")
    s.add_argument("--peer-silent", type=float, default=PEER_SILENT, metavar="SECONDS",
                   help=f"a member silent this long (no packet, no heartbeat) is dead: its generation fails, and a "
                        f"shared switch's job whose members are all silent ends (default {PEER_SILENT:g})")
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
    add_network_flags(s)
    s.set_defaults(func=cmd_serve)
