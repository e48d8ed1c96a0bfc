"""`switchsim`: every package's verbs on one parser. A package owns its verbs (add_parser) and their
commands; this module only orders them, so nothing below the command line imports upward to reach it."""
from __future__ import annotations

import argparse

from inabench import cli as bench_cli, model_cli
from switchsim import cli as switch_cli
from switchsim.cli import csv
from topologies import cli as topo_cli


def build_parser() -> argparse.ArgumentParser:
    """The `switchsim` parser; each sub-command sets func, which main() calls with the parsed flags."""
    p = argparse.ArgumentParser(prog="switchsim", description="In-network aggregation emulator")
    sub = p.add_subparsers(dest="command", required=True)
    switch_cli.add_parser(sub)
    topo_cli.add_parser(sub)
    bench_parser = bench_cli.add_parser(sub)
    topo_cli.add_bench(bench_parser("topo", "allreduce time on emulated links (namespaces, root): INA against "
                                            "gloo's ring over the same links, vs link rate and loss (not in `all`)"),
                       csv)
    topo_cli.add_model_bench(bench_parser("model", "the projection model (switchsim model) against this emulator on "
                                                    "rate-limited namespace links: predicted vs measured (not in "
                                                    "`all`)"), csv)
    topo_cli.add_ddp_bench(bench_parser("ddp", "DDP training steps (sec/iter p50-p95, examples/s) per world size "
                                               "and gradient path, on loopback or --topo links; --tta: time to "
                                               "accuracy; --diff A B (not in `all`)"), csv)
    topo_cli.add_net_bench(bench_parser("net", "INA beside TCP on one bottleneck (namespaces, root): goodput, "
                                               "share and Jain's index, short flows' completion times, queueing "
                                               "delay and ECN marks, per INA congestion policy (not in `all`)",
                                        plot="goodput of INA and TCP over time, per policy"), csv)
    model_cli.add_parser(sub, csv)
    return p


def main(argv=None) -> int:
    """The `switchsim` entry point (also `python -m inacli`, `python -m switchsim` and benchmarks/ scripts).

    Args:
        argv: the arguments without the program name (None: sys.argv[1:]).

    Returns:
        The sub-command's exit status.

    Raises:
        SystemExit: from argparse, for bad flags or --help.
    """
    args = build_parser().parse_args(argv)
    return args.func(args)
