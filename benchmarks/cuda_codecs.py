"""The CUDA codec kernels (hostlib.cuda) at memory speed: encode and decode GB/s on a 256 MiB float32 tensor
against the device's copy bandwidth measured in the same run (torch clone: read + write) and against a
naive torch implementation that computes the same NC codes with torch ops (Philox in int64 tensors).
Bandwidth counts the bytes a kernel must move (encode: 4 in + 1 out per float32 element; decode: 1 + 4);
the goal is >= 70 % of the copy's. The naive encode's codes are checked equal to the kernel's.

    python benchmarks/cuda_codecs.py [--mib 256] [--repeat 20] [--json]

Without a GPU (or without the built library) it prints why and exits 0.
"""
from __future__ import annotations

import argparse
import json
import sys

from hostlib import cuda, wire

PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)
MASK32 = 0xFFFFFFFF


def _mulhilo(a, m: int):
    """(hi, lo) 32-bit halves of a * m for int64 tensors a < 2^32: the product wraps in int64 and both halves
    survive the wrap (two's complement), so they are exact."""
    p = a * m
    return (p >> 32) & MASK32, p & MASK32


def torch_philox(seed: int, q, substream: int):
    """Random123's philox4x32_10 with counter (q, q >> 32, substream, 0) as torch int64 ops: 4 tensors of words."""
    import torch

    x0, x1 = q & MASK32, (q >> 32) & MASK32
    x2, x3 = torch.full_like(q, substream), torch.zeros_like(q)
    k0, k1 = seed & MASK32, (seed >> 32) & MASK32
    for _ in range(10):
        hi0, lo0 = _mulhilo(x0, PHILOX_M[0])
        hi1, lo1 = _mulhilo(x2, PHILOX_M[1])
        x0, x1, x2, x3 = hi1 ^ x1 ^ k0, lo1, hi0 ^ x3 ^ k1, lo0
        k0, k1 = (k0 + PHILOX_W[0]) & MASK32, (k1 + PHILOX_W[1]) & MASK32
    return x0, x1, x2, x3


def _words(seed: int, n: int, substream: int, device):
    """Element i's word of the sub-stream (offset 0), flat int64."""
    import torch

    q = torch.arange((n + 3) // 4, dtype=torch.int64, device=device)
    return torch.stack(torch_philox(seed, q, substream), dim=1).reshape(-1)[:n]


def naive_encode(x, seed: int = 0, floor: int = wire.NC_LEVEL_MIN):
    """NC codes of a float32 tensor with plain torch ops (natural.encode's codes; the stochastic rounding of
    docs/protocol.md): the baseline the fused kernel is measured against. No error checks."""
    import torch

    floor = max(floor, wire.NC_LEVEL_MIN)
    bits = x.reshape(-1).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    mag = bits & 0x7FFFFFFF
    n = mag.numel()
    i = torch.arange(n, dtype=torch.int64, device=x.device)
    h = (_words(seed, (n + 3) // 4, 0, x.device).repeat_interleave(4)[:n] >> (8 * (i & 3))) & 0xFF  # a byte each
    w1 = _words(seed, n, 1, x.device)
    level = ((mag + ((h << 15) | (w1 >> 17))) >> 23) - 127  # the 23-bit uniform: byte, then word1's top 15 bits
    below = ((mag >> 23) - 127) < floor
    t = x.reshape(-1).abs().double() * 2.0 ** (32 - floor)
    up = w1.double() < t
    level = torch.where(below, torch.where(up, floor, wire.NC_LEVEL_MIN - 1), level)
    codes = torch.where(level < wire.NC_LEVEL_MIN, 0, (level + wire.NC_BIAS) | ((bits >> 31) << 7))
    return codes.to(torch.uint8)


def naive_decode(codes):
    """Values of NC codes by a 256-entry table lookup."""
    import torch

    m = torch.arange(256, device=codes.device)
    table = torch.where((m & 0x7F) == 0, 0.0, torch.ldexp(torch.ones(256, device=codes.device), (m & 0x7F) - 64))
    table = torch.where(m >= 128, -table, table).float()
    return table[codes.long()]


def timed(fn, repeat: int) -> float:
    """Median seconds of fn() on the GPU (CUDA events), after one warm-up call."""
    import torch

    fn()
    times = []
    for _ in range(repeat):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return sorted(times)[len(times) // 2]


def measure(mib: int = 256, repeat: int = 20) -> list[dict]:
    """One row per operation: seconds, bytes moved, GB/s, fraction of the copy's GB/s."""
    import torch

    n = mib * 2**20 // 4
    x = torch.randn(n, device="cuda") * 2.0 ** torch.randint(-30, 30, (n,), device="cuda")
    codes = cuda.nc_encode(x, 1)
    if not torch.equal(naive_encode(x[:1 << 22], 1), codes[:1 << 22]):
        raise AssertionError("the naive torch encode's codes differ from the kernel's")
    xb = x.to(torch.bfloat16)
    values = torch.empty_like(x)
    cases = [("copy (torch clone)", lambda: x.clone(), 8),
             ("nc encode float32, stochastic", lambda: cuda.nc_encode(x, 1, out=codes, check=False), 5),
             ("nc encode float32, deterministic", lambda: cuda.nc_encode(x, 1, deterministic=True, out=codes,
                                                                          check=False), 5),
             ("nc encode bfloat16, stochastic", lambda: cuda.nc_encode(xb, 1, out=codes, check=False), 3),
             ("dither encode (floor -20)", lambda: cuda.nc_encode(x, 1, floor=-20, out=codes, check=False), 5),
             ("nc decode float32", lambda: cuda.nc_decode(codes, out=values, check=False), 5),
             ("naive torch encode", lambda: naive_encode(x, 1), 5),
             ("naive torch decode", lambda: naive_decode(codes), 5)]
    rows = []
    for name, fn, per_element in cases:
        s = timed(fn, repeat)
        rows.append({"op": name, "seconds": s, "bytes": n * per_element, "gbps": n * per_element / s / 1e9})
    copy = rows[0]["gbps"]
    for r in rows:
        r["of_copy"] = r["gbps"] / copy
    return rows


def print_table(rows, mib: int, device: str) -> None:
    print(f"{device}: {mib} MiB of float32 ({mib * 2**20 // 4} elements); GB/s of bytes moved, median of runs")
    print(f"{'operation':34} {'ms':>9} {'GB/s':>8} {'of copy':>8}")
    for r in rows:
        print(f"{r['op']:34} {r['seconds'] * 1e3:9.3f} {r['gbps']:8.1f} {r['of_copy']:8.1%}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="float32 input size in MiB (default 256)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json", action="store_true", help="rows as JSON instead of a table")
    args = ap.parse_args(argv)
    ok, why = cuda.available()
    if not ok:
        print(f"cuda_codecs: no GPU run: {why}")
        return 0
    import torch

    rows = measure(args.mib, args.repeat)
    if args.json:
        print(json.dumps({"device": torch.cuda.get_device_name(), "mib": args.mib, "rows": rows}, indent=1))
    else:
        print_table(rows, args.mib, torch.cuda.get_device_name())
    return 0


if __name__ == "__main__":
    sys.exit(main())
