"""General dithering (Horvath et al., 2019, Sec. 4, Definition 3) with its two partitions of [0, 1]:
natural, levels 0, 2^(1-s), ..., 1/2, 1 (powers of two, the paper's), and standard, levels 0, 1/s, 2/s,
..., 1 (random dithering as in QSGD), so the paper's comparison (App. B.2, Theorem 5) can be run on the
same vectors: benchmarks/dithering.py prints it.

Each entry sends its sign and a level index j (0 = zero); the vector sends its p-norm as float32, rounded
up so every |x_i| / norm <= 1. The norm is not compressed (the paper's App. B.2 setup: only the levels'
variance is compared). |x_i| / norm between two neighbouring levels is rounded to one of them, unbiased.

Variance, exactly, per entry: (hi - y)(y - lo) norm^2 with y = |x_i| / norm in [lo, hi] (`variance`).
Bounds over all x in R^d, as omega in E||D(x) - x||^2 <= omega ||x||_2^2 (`variance_bound`), r = min(p, 2):
  natural:  1/8 + min(d^(1/r) 2^(1-s), d^(2/r) 4^(-s)): (hi - y)(y - lo) <= y^2/8 between powers of two
            (as for NC, Theorem 1), and <= min(y 2^(1-s), 4^-s) below the lowest level 2^(1-s); then
            norm ||x||_1 <= d^(1/r) ||x||_2^2 and d norm^2 <= d^(2/r) ||x||_2^2. This is below Theorem 4's
            omega = 1/8 + d^(1/r) 2^(1-s) min(1, d^(1/r) 2^(1-s)) (the arXiv version's formula; the local
            text lost its math).
  standard: min(d^(2/r) / (4 s^2), d^(1/r) / s), from (hi - y)(y - lo) <= min(1 / (4 s^2), y / s); for
            p = 2 it is below QSGD's min(d / s^2, sqrt(d) / s).
"""
from __future__ import annotations

import numpy as np

from .. import kernels, rng
from .base import float_values

PARTITIONS = ("natural", "standard")
# a level index must fit beside the sign: 7 bits (uint8 codes) for natural, 15 bits (uint16) for standard
MAX_LEVELS = {"natural": 127, "standard": 32767}
_SIGN = {"natural": 0x80, "standard": 0x8000}


def level_table(levels: int, partition: str = "natural") -> np.ndarray:
    """The levels 0 = l_0 < l_1 < ... < l_s = 1 of [0, 1] that code j stands for.

    Args:
        levels: s, the number of non-zero levels.
        partition: "natural" (l_j = 2^(j-s)) or "standard" (l_j = j/s).

    Returns:
        float64 array of s + 1 levels.

    Raises:
        ValueError: an unknown partition, or levels outside 1..MAX_LEVELS[partition].
    """
    if partition not in PARTITIONS:
        raise ValueError(f"dithering: partition must be one of {PARTITIONS}, not {partition!r}")
    if not 1 <= levels <= MAX_LEVELS[partition]:
        raise ValueError(f"dithering: {partition} levels must be in 1..{MAX_LEVELS[partition]}, not {levels}")
    j = np.arange(levels + 1, dtype=np.float64)
    if partition == "standard":
        return j / levels
    table = np.ldexp(1.0, (j - levels).astype(np.int64))  # exact powers of two, as the C kernels take them
    table[0] = 0.0
    return table


def _norm32(v: np.ndarray, p: float) -> np.float32:
    """||v||_p as float32, rounded up so that no |v_i| / norm exceeds 1."""
    with np.errstate(over="ignore"):
        norm = float(np.linalg.norm(v, ord=p)) if v.size else 0.0
    n32 = np.float32(norm)
    if np.isinf(n32):
        raise OverflowError(f"dithering: the {p}-norm {norm:.3g} does not fit in float32")
    return np.nextafter(n32, np.float32(np.inf)) if float(n32) < norm else n32


def _neighbours(v: np.ndarray, norm: np.float32, table: np.ndarray):
    """y = |v| / norm and the indices (lo, hi) of the levels around it: table[lo] <= y <= table[hi]."""
    y = np.minimum(np.abs(v) / np.float64(norm), 1.0)
    hi = np.maximum(np.searchsorted(table, y, side="left"), 1)  # smallest level >= y (1 for y = 0)
    return y, hi - 1, hi


def encode(x, levels: int = 8, p: float = 2.0, seed: int = 0, offset: int = 0, partition: str = "natural"):
    """Dithering of x: unbiased rounding of |x_i| / ||x||_p to the partition's levels, so each entry costs
    a sign and log2(s + 1) bits.

    Args:
        x: float values (numpy array or torch tensor, any float dtype).
        levels: s, the non-zero levels (natural: 1..127, standard: 1..32767).
        p: the norm's order (>= 1).
        seed, offset: the counter-based RNG stream and position of x[0], so a re-encoding is identical.
        partition: "natural" or "standard".

    Returns:
        (norm as float32, codes: uint8 for natural (bit 7 sign), uint16 for standard (bit 15 sign), the
        low bits the level index 0..levels).

    Raises:
        ValueError: bad levels, partition or p, or NaN/Inf in x.
        OverflowError: the norm does not fit in float32.
    """
    table = level_table(levels, partition)
    if not p >= 1:
        raise ValueError(f"dithering: p must be >= 1 (a norm), not {p}")
    flat = float_values(x)
    v = flat.astype(np.float64, copy=False)
    if not np.all(np.isfinite(v)):
        raise ValueError(f"{partition} dithering: input contains NaN or Inf")
    dtype = np.uint8 if partition == "natural" else np.uint16
    norm = _norm32(v, p)
    if norm == 0:
        return norm, np.zeros(v.size, dtype=dtype)
    if flat.dtype == np.float32 and kernels.enabled():
        return norm, kernels.dither_encode(flat, float(norm), levels, partition == "standard", seed, offset)
    return norm, encode_reference(v, norm, table, seed, offset, dtype, _SIGN[partition])


def encode_reference(v: np.ndarray, norm: np.float32, table: np.ndarray, seed: int, offset: int, dtype,
                     sign: int) -> np.ndarray:
    """The numpy definition of encode's codes that the C kernels match bit for bit: y = |v| / norm rounds
    to its upper level iff word 2^-32 < (y - lo) / (hi - lo), word from the Philox stream (seed, offset)."""
    y, lo, hi = _neighbours(v, norm, table)
    u = rng.philox(seed, offset, v.size).astype(np.float64) * 2.0**-32
    up = u < (y - table[lo]) / (table[hi] - table[lo])
    codes = np.where(up, hi, lo).astype(dtype)
    codes[v < 0] |= dtype(sign)
    return codes


def decode(norm, codes, levels: int = 8, partition: str = "natural", dtype=np.float32) -> np.ndarray:
    """Values of dithering codes.

    Args:
        norm: the vector's norm, as encode returned it.
        codes: the codes, as encode returned them.
        levels, partition: as given to encode.
        dtype: of the result.

    Returns:
        Values of codes' shape.

    Raises:
        ValueError: a level index above levels (a corrupt message, or levels that differ from encode's).
    """
    table = level_table(levels, partition)
    sign = _SIGN[partition]
    c = np.asarray(codes).astype(np.int64)
    j = c & (sign - 1)
    if np.any(j > levels):
        raise ValueError(f"{partition} dithering: level index above {levels}")
    mag = table[j] * float(norm)
    return np.where(c & sign, -mag, mag).astype(dtype)


def variance(x, levels: int = 8, p: float = 2.0, partition: str = "natural") -> float:
    """E||decode(encode(x)) - x||^2, exactly (given the float32 norm encode sends): the sum over entries of
    (hi - y)(y - lo) norm^2, for the benchmark and the tests to hold the empirical variance against."""
    table = level_table(levels, partition)
    v = float_values(x).astype(np.float64, copy=False)
    norm = _norm32(v, p)
    if norm == 0:
        return 0.0
    y, lo, hi = _neighbours(v, norm, table)
    return float(np.sum((table[hi] - y) * (y - table[lo]))) * float(norm) ** 2


def variance_bound(d: int, levels: int, p: float = 2.0, partition: str = "natural") -> float:
    """omega with E||D(x) - x||^2 <= omega ||x||_2^2 for every x in R^d (derivation in the module doc).

    Args:
        d: the vector's length.
        levels, p, partition: as for encode.

    Returns:
        omega (natural's includes the 1/8 of its power-of-two levels).
    """
    level_table(levels, partition)  # validates
    r = min(p, 2.0)
    s = levels
    if partition == "natural":
        return 1 / 8 + min(d ** (1 / r) * 2.0 ** (1 - s), d ** (2 / r) * 4.0**-s)
    return min(d ** (2 / r) / (4 * s * s), d ** (1 / r) / s)


def bits_per_entry(levels: int) -> int:
    """Bits one entry costs with a fixed-width code: a sign and the level index 0..levels."""
    return 1 + int(np.ceil(np.log2(levels + 1)))
