"""`switchsim model`: the projection, INA against ring and tree for a cluster (inacli adds it; `switchsim
bench model`, the projection against this emulator on namespace links, is topologies.cli's)."""
from __future__ import annotations

import json
import sys


def add_parser(sub, csv):
    m = sub.add_parser("model", help="project allreduce time: INA (SwitchML semantics) against NCCL's ring and tree",
                       description="e.g. switchsim model --workers 8,16,32,64,128,256 --size-mib 100 "
                                   "--link-gbps 100 --codec nc --json")
    m.add_argument("--workers", type=csv(int), default="8,16,32,64,128,256", metavar="LIST")
    m.add_argument("--size-mib", type=float, default=100.0, help="float32 MiB per worker")
    m.add_argument("--link-gbps", type=float, default=100.0, help="every worker link's rate")
    m.add_argument("--codec", choices=("int32", "fixed", "nc"), default="int32")
    m.add_argument("--payload", type=int, default=1024, help="INA payload bytes per packet")
    m.add_argument("--window", type=int, default=128, help="INA slots per worker")
    m.add_argument("--latency-us", type=float, default=1.0, help="one-way worker-switch latency")
    m.add_argument("--switch-mpps", type=float, default=None, help="switch packet rate (default: line rate)")
    m.add_argument("--loss", type=float, default=0.0, help="per packet and direction")
    m.add_argument("--rto-ms", type=float, default=1.0, help="what a lost round costs its slot")
    m.add_argument("--density", type=float, default=1.0, help="block-sparse INA: non-zero block fraction")
    m.add_argument("--alpha-us", type=float, default=5.0, help="ring/tree per-step latency (NCCL's alpha)")
    m.add_argument("--phy-bytes", type=int, default=None,
                   help="INA: link bytes per frame beyond the frame (default: Ethernet's preamble, gap and FCS)")
    m.add_argument("--switchml", action="store_true",
                   help="SwitchML's setting (100 Gbps, 256 B and 1 KiB payloads) next to its published numbers")
    m.add_argument("--json", action="store_true")
    m.add_argument("--plot", metavar="PNG")
    m.set_defaults(func=cmd_model)


def _print(rows, as_json, title):
    from inabench.report import table

    print(json.dumps({title: rows}, indent=2) if as_json else f"\n== {title}\n{table(rows)}")


def cmd_model(args) -> int:
    from inabench import projection

    try:
        if args.switchml:
            rows = projection.switchml_shape()
        else:
            rows = projection.project(
                args.workers, args.size_mib * 2**20, args.link_gbps * 1e9, codec=args.codec, payload=args.payload,
                window=args.window, latency=args.latency_us * 1e-6, loss=args.loss, rto=args.rto_ms * 1e-3,
                switch_pps=args.switch_mpps * 1e6 if args.switch_mpps else float("inf"), density=args.density,
                alpha=args.alpha_us * 1e-6,
                phy=projection.ETHERNET_PHY if args.phy_bytes is None else args.phy_bytes)
    except ValueError as e:
        print(f"switchsim model: {e}", file=sys.stderr)
        return 2
    _print(rows, args.json, "switchml" if args.switchml else "model")
    if args.plot:
        projection.plot(rows, args.plot)
    return 0
