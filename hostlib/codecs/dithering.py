"""Natural dithering (Horvath et al., 2019, Sec. 4): levels 1, 1/2, ..., 2^(1-s) of the p-norm.

Each entry sends its sign and a level index j (0 = zero, j -> 2^(j-s)); the vector sends its norm.
|x_i|/||x|| between two neighbouring levels is rounded to one of them, unbiased.
"""
from __future__ import annotations

import numpy as np

from .. import rng


def encode(x, levels: int = 8, p: float = 2.0, seed: int = 0, offset: int = 0):
    """Natural dithering of x: unbiased rounding of |x_i| / ||x||_p to powers of two below 1, so a few
    levels (a few bits per entry) cover the vector's range.

    Args:
        x: float values.
        levels: levels s below the norm (1..127).
        p: the norm's order.
        seed, offset: the counter-based RNG stream and position of x[0], so a re-encoding is identical.

    Returns:
        (norm as float32, uint8 codes: bit 7 sign, bits 6..0 level index 0..levels).

    Raises:
        ValueError: levels out of range, or NaN/Inf in x.
    """
    if not 1 <= levels <= 127:
        raise ValueError("levels must be in 1..127")
    v = np.asarray(x, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(v)):
        raise ValueError("natural dithering: input contains NaN or Inf")
    norm = np.float32(np.linalg.norm(v, ord=p)) if v.size else np.float32(0)
    codes = np.zeros(v.size, dtype=np.uint8)
    if norm == 0:
        return norm, codes
    y = np.minimum(np.abs(v) / np.float64(norm), 1.0)
    # interval [lo, hi] around y: hi = smallest level >= y; lo = hi / 2, or 0 below the lowest level
    with np.errstate(divide="ignore"):
        j_hi = np.clip(np.ceil(np.log2(np.where(y > 0, y, 1.0))) + levels, 1, levels)
    hi = np.exp2(j_hi - levels)
    j_hi = j_hi - (hi / 2 >= y) * (j_hi > 1)  # guard against log2 rounding
    hi = np.exp2(j_hi - levels)
    lo = np.where(j_hi > 1, hi / 2, 0.0)
    u = (rng.bits64(seed, offset, v.size) >> np.uint64(11)).astype(np.float64) * 2.0**-53
    up = u < (y - lo) / (hi - lo)
    j = np.where(up, j_hi, j_hi - 1).astype(np.uint8)
    j[y == 0] = 0
    codes = j | ((v < 0).astype(np.uint8) << np.uint8(7))
    return norm, codes


def decode(norm, codes, levels: int = 8) -> np.ndarray:
    """Values of dithering codes.

    Args:
        norm: the vector's norm, as encode returned it.
        codes: uint8 codes.
        levels: as given to encode.

    Returns:
        float32 values of codes' shape.

    Raises:
        ValueError: a level index above levels (a corrupt message, or levels that differ from encode's).
    """
    c = np.asarray(codes, dtype=np.uint8)
    j = (c & 0x7F).astype(np.float64)
    if np.any(j > levels):
        raise ValueError(f"natural dithering: level index above {levels}")
    mag = np.where(j > 0, np.exp2(j - levels), 0.0) * float(norm)
    return np.where(c & 0x80, -mag, mag).astype(np.float32)
