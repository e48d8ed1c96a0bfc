"""What a stranger's flood costs a running job (protocol v2): the time of an int32 allreduce while another
process floods the switch with stats requests, joins, forged updates or malformed datagrams, as a ratio to
the same allreduce without a flood, measured in the same run.

    python benchmarks/flood.py --backend c --size 1048576 --workers 2 [--json]

Every flood is a loop bounded in count and time that sends only to the switch on loopback.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import socket
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from inaproto import wire  # noqa: E402
from inaproto.net import parse_address  # noqa: E402

FLOODS = ("none", "stats", "join", "forged_update", "malformed")


def flood_packets(kind: str) -> list[bytes]:
    rs = np.random.default_rng(1)
    if kind == "stats":
        return [wire.pack(wire.MSG_STATS_REQ)]
    if kind == "join":
        return [wire.pack_join(1, r, int(rs.integers(1, 2**60)), 2, 64) for r in (0, 1)]
    if kind == "forged_update":
        return [wire.pack(wire.MSG_UPDATE, 1, r, p, p % 64, p & 1, 256, wire.CODEC_INT32, 0, 0, 0, bytes(1024),
                          int(rs.integers(1, 2**32))) for r in (0, 1) for p in range(8)]
    return [rs.bytes(int(n)) for n in rs.integers(0, 60, 16)]


def flooder(address, kind, seconds, counter):
    pkts = flood_packets(kind)
    end, n = time.monotonic() + seconds, 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        while time.monotonic() < end and n < 50_000_000:
            for p in pkts:
                try:
                    s.sendto(p, address)
                except OSError:
                    pass
            n += len(pkts)
            if n % 4096 < len(pkts):
                counter.value = n  # the parent terminates this process: keep the count current


def worker(address, rank, world, size, calls, out):
    import hostlib

    x = np.full(size, rank + 1, np.int32)
    with hostlib.connect(address, rank, world, window=64, timeout=120) as c:
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            y = c.allreduce(x)
            times.append(time.perf_counter() - t0)
        assert np.all(y == world * (world + 1) // 2)
    out.put((rank, float(np.median(times))))


def run(backend: str, size: int, world: int, calls: int, kind: str) -> dict:
    ctx = mp.get_context("spawn")
    sw = subprocess.Popen([sys.executable, "-m", "switchsim", "serve", "--backend", backend, "--port", "0",
                           "--workers", str(world)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        m = re.search(r"listening on ([\d.]+):(\d+)", sw.stdout.readline())
        address = parse_address(f"{m.group(1)}:{m.group(2)}")
        counter = ctx.Value("q", 0)
        fl = ctx.Process(target=flooder, args=(address, kind, 60, counter)) if kind != "none" else None
        if fl:
            fl.start()
            time.sleep(0.5)
        out = ctx.Queue()
        procs = [ctx.Process(target=worker, args=(address, r, world, size, calls, out)) for r in range(world)]
        t0 = time.monotonic()
        for p in procs:
            p.start()
        times = dict(out.get(timeout=600) for _ in procs)
        wall = time.monotonic() - t0
        for p in procs:
            p.join(10)
        if fl:
            fl.terminate()
            fl.join(5)
        sent = counter.value
        return {"flood": kind, "allreduce_s": max(times.values()), "wall_s": wall,
                "flood_pps": sent / (wall + 0.5) if fl else 0.0}
    finally:
        sw.terminate()
        sw.wait(10)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="c", choices=("python", "c"))
    p.add_argument("--size", type=int, default=1 << 20)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--floods", default=",".join(FLOODS))
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    rows = [run(a.backend, a.size, a.workers, a.calls, k) for k in a.floods.split(",")]
    base = next((r["allreduce_s"] for r in rows if r["flood"] == "none"), rows[0]["allreduce_s"])
    for r in rows:
        r["x_no_flood"] = r["allreduce_s"] / base
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'flood':>14} {'allreduce s':>12} {'x no flood':>11} {'flood pkt/s':>12}")
    for r in rows:
        print(f"{r['flood']:>14} {r['allreduce_s']:12.4f} {r['x_no_flood']:11.2f} {r['flood_pps']:12.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
