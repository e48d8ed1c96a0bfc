"""What `serve --pcap` costs, and that the C loop without it costs what it did: the time of an int32
allreduce through the C switch without a capture, with one, and (--against TREE) without one on another
build of the project (e.g. the commit before the capture: `git worktree add /tmp/old COMMIT && (cd /tmp/old
&& python setup.py build_ext --inplace)`), as ratios to this build without a capture, in one run.

    python benchmarks/capture.py --mib 16 --workers 2 --repeat 5 [--against /tmp/old] [--json]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from inabench.report import table  # noqa: E402
from inabench.harness import SwitchProcess  # noqa: E402


def _rank(rank, world, address, numel, repeat, out):
    import hostlib

    x = np.ones(numel, dtype=np.int32)
    with hostlib.connect(address, rank, world, codec="int32", timeout=60) as comm:
        comm.allreduce(x[:4096])  # warm: joins, buffers
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            y = comm.allreduce(x)
            times.append(time.perf_counter() - t)
        out.put((rank, times, bool(np.all(y == world))))


def run(cmd_root: str, numel: int, workers: int, repeat: int, pcap: str | None) -> dict:
    """Median seconds over `repeat` allreduces (slowest rank each time) through a C switch started from
    cmd_root's tree."""
    cmd = [sys.executable, "-m", "switchsim", "serve", "--port", "0", "--backend", "c"]
    env_root = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = cmd_root
    try:
        sw = SwitchProcess("--workers", workers, *(("--pcap", pcap, "--pcap-max-mb", 100000) if pcap else ()),
                           cmd=cmd)
    finally:
        os.environ.pop("PYTHONPATH") if env_root is None else os.environ.update(PYTHONPATH=env_root)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, workers, sw.address, numel, repeat, out)) for r in range(workers)]
    for p in procs:
        p.start()
    try:
        reports = [out.get(timeout=300) for _ in procs]
    finally:
        for p in procs:
            p.join(10)
        stats = sw.stop_stats()
    slowest = [max(r[1][i] for r in reports) for i in range(repeat)]
    return {"seconds": statistics.median(slowest), "exact": all(r[2] for r in reports),
            "captured": stats.get("captured", 0), "capture_MB": os.path.getsize(pcap) / 2**20 if pcap else 0.0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=16.0, help="int32 MiB per worker")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--against", metavar="TREE", help="another built tree of the project (no capture)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    numel = int(args.mib * 2**20 / 4)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        configs = [("this build, no capture", ROOT, None), ("this build, --pcap", ROOT, os.path.join(d, "x.pcapng"))]
        if args.against:
            configs.append((f"{args.against}, no capture", os.path.abspath(args.against), None))
        for name, tree, pcap in configs:
            r = run(tree, numel, args.workers, args.repeat, pcap)
            rows.append({"switch": name, **r})
    base = rows[0]["seconds"]
    for r in rows:
        r["x no capture"] = round(r["seconds"] / base, 3)
        r["seconds"] = round(r["seconds"], 4)
        r["capture_MB"] = round(r["capture_MB"], 1)
    print(json.dumps({"capture": rows}, indent=2) if args.json else table(rows))
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
