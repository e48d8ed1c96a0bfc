"""Natural vs standard dithering, the paper's App. B.2 (Fig. 9 and 10, Theorem 5): the normalised empirical
variance ||D(x) - x||^2 / ||x||^2 of Gaussian vectors, for natural dithering with s levels, standard
dithering with the same s levels (Fig. 9: natural's variance is far smaller) and standard dithering with
2^(s-1) levels (Fig. 10: about the same variance, for s + 1 bits per entry instead of 1 + log2(s + 1)),
beside each one's bound omega (hostlib/codecs/dithering.py). The norm is sent as float32, uncompressed.

    python benchmarks/dithering.py [--dim 10000] [--levels 1,2,...,8] [--vectors 20] [--draws 5] [--p 2]
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from hostlib.codecs import dithering


def empirical_variance(xs, levels: int, p: float, partition: str, draws: int) -> float:
    """Mean over vectors and draws of ||D(x) - x||^2 / ||x||^2."""
    ratios = []
    for i, x in enumerate(xs):
        for t in range(draws):
            norm, codes = dithering.encode(x, levels, p, seed=i * draws + t, partition=partition)
            err = dithering.decode(norm, codes, levels, partition, np.float64) - x
            ratios.append(float(err @ err) / float(x @ x))
    return float(np.mean(ratios))


def compare(dim: int = 10000, levels=range(1, 9), vectors: int = 20, draws: int = 5, p: float = 2.0,
            seed: int = 0) -> list[dict]:
    """One row per s: bits per entry, empirical variance and bound of natural (s levels), standard (s
    levels) and standard (2^(s-1) levels)."""
    rs = np.random.default_rng(seed)
    xs = [rs.standard_normal(dim) for _ in range(vectors)]
    rows = []
    for s in levels:
        row = {"s": s}
        for tag, part, lv in (("nat", "natural", s), ("sta", "standard", s), ("sta_exp", "standard", 2 ** (s - 1))):
            row[f"{tag}_levels"] = lv
            row[f"{tag}_bits"] = dithering.bits_per_entry(lv)
            row[f"{tag}_var"] = empirical_variance(xs, lv, p, part, draws)
            row[f"{tag}_bound"] = dithering.variance_bound(dim, lv, p, part)
        rows.append(row)
    return rows


def print_table(rows, dim: int, p: float) -> None:
    print(f"normalised variance ||D(x) - x||^2 / ||x||^2, x ~ N(0, I_{dim}), p = {p}; bits per entry in ()")
    print(f"{'s':>2} | {'natural, s levels':>26} | {'standard, s levels':>26} | {'standard, 2^(s-1) levels':>34}")
    for r in rows:
        cells = [f"({r[f'{t}_bits']:2d}b) {r[f'{t}_var']:9.3g} <= {r[f'{t}_bound']:8.3g}" for t in ("nat", "sta")]
        cells.append(f"{r['sta_exp_levels']:5d} ({r['sta_exp_bits']:2d}b) {r['sta_exp_var']:9.3g} <= "
                     f"{r['sta_exp_bound']:8.3g}")
        print(f"{r['s']:2d} | " + " | ".join(cells))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=10000)
    ap.add_argument("--levels", default="1,2,3,4,5,6,7,8", help="values of s (comma list)")
    ap.add_argument("--vectors", type=int, default=20)
    ap.add_argument("--draws", type=int, default=5, help="encodings per vector")
    ap.add_argument("--p", type=float, default=2.0, help="the norm's order")
    args = ap.parse_args(argv)
    levels = [int(v) for v in args.levels.split(",")]
    print_table(compare(args.dim, levels, args.vectors, args.draws, args.p), args.dim, args.p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
