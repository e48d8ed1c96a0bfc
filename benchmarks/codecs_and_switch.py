"""Throughput of the numpy codecs (vs np.copyto of the same buffer) and of the Python reference switch.

    python benchmarks/codecs_and_switch.py [--mib 64] [--packets 20000] [--json]

Prints a table; ratios are to baselines measured in the same run. Not a test: numbers vary by machine.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from hostlib import wire
from hostlib.codecs import fixed, natural
from switchsim.model import Switch


def best_of(fn, repeat=3):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def codec_rows(mib):
    n = mib * (1 << 20) // 4
    x = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    dst = np.empty_like(x)
    base = best_of(lambda: np.copyto(dst, x))
    codes = natural.encode(x, seed=1)
    e = int(np.frexp(np.abs(x).max())[1])
    fx = fixed.FixedPointCodec()
    q = np.frombuffer(fx.encode(x, e, 4, 0, 0), dtype=">i4").astype(np.int64)
    rows = [("np.copyto (baseline)", base),
            ("NC encode (stochastic)", best_of(lambda: natural.encode(x, seed=1))),
            ("NC encode (deterministic)", best_of(lambda: natural.encode(x, deterministic=True))),
            ("NC decode", best_of(lambda: natural.decode(codes))),
            ("fixed quantize", best_of(lambda: fx.encode(x, e, 4, 0, 0))),
            ("fixed dequantize", best_of(lambda: fx.decode(q, np.array([e]), 4, n)))]
    return [{"what": name, "seconds": t, "gib_s": mib / 1024 / t, "vs_copy": base / t} for name, t in rows]


def switch_rows(packets, workers=4):
    out = []
    for codec, k in (("int32", 256), ("nc", 1024)):
        sw = Switch({1: workers}, slots=512, max_elements=1024, seed=1)
        rs = np.random.default_rng(0)
        if codec == "int32":
            payload = rs.integers(-1000, 1000, k).astype(">i4").tobytes()
            wc, exp = wire.CODEC_INT32, 0
        else:
            payload = natural.encode(rs.standard_normal(k).astype(np.float32), floor=wire.nc_floor(4)).tobytes()
            wc, exp = wire.CODEC_NC8, 4
        rounds = packets // workers
        pkts = [wire.pack(wire.MSG_UPDATE, 1, r, p, p % 512, (p // 512) & 1, k, wc, exp, exp, 0, payload)
                for p in range(rounds) for r in range(workers)]
        t0 = time.perf_counter()
        emitted = sum(len(sw.process(d, i % workers)) for i, d in enumerate(pkts))
        t = time.perf_counter() - t0
        assert emitted == rounds * workers, "every round must complete"
        out.append({"what": f"reference switch, {codec} x {k} elements, {workers} workers", "seconds": t,
                    "packets_per_s": len(pkts) / t, "elements_per_s": len(pkts) * k / t})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--packets", type=int, default=20000)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    res = {"codecs": codec_rows(a.mib), "switch": switch_rows(a.packets)}
    if a.json:
        print(json.dumps(res, indent=2))
        return
    print(f"{'codec on ' + str(a.mib) + ' MiB float32':<40} {'s':>8} {'GiB/s':>8} {'x copyto':>9}")
    for r in res["codecs"]:
        print(f"{r['what']:<40} {r['seconds']:>8.4f} {r['gib_s']:>8.2f} {r['vs_copy']:>9.3f}")
    print()
    print(f"{'switch (Python reference model, in-process)':<52} {'packets/s':>10} {'Melem/s':>8}")
    for r in res["switch"]:
        print(f"{r['what']:<52} {r['packets_per_s']:>10,.0f} {r['elements_per_s'] / 1e6:>8.2f}")


if __name__ == "__main__":
    main()
