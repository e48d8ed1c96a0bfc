"""Natural dithering on the INA path (`codec="dither"`, option `levels`): natural dithering whose norm is
the block's agreed exponent, so its codes are NC codes and the switch sums and re-compresses them as NC.

Natural dithering (Sec. 4) scales by a norm and rounds |x| / norm to the levels 1, 1/2, ..., 2^(1-s). Here
the scale is 2^e, e the block's agreed exponent (max over workers, every |x| < 2^e): a power of two every
worker and the switch already know, so no norm is sent, and the s levels 2^e, 2^(e-1), ..., 2^(e-s+1) are NC
levels: the encoder is NC with its floor raised to f = e - s + 1 (values below 2^f go to 0 or 2^f,
unbiased). The switch checks codes against [nc_floor(e), e], which contains [f, e], and re-compresses the
sum with NC's full range: the result direction is NC, as in the paper's Algorithm 1 (bi-directional).

Variance. Per worker and element (exact, `worker_variance`): v(x) = (2^(a+1) - |x|)(|x| - 2^a) <= x^2/8 for
|x| >= 2^f (Theorem 1), and |x| (2^f - |x|) <= min(|x| 2^f, 4^f / 4) below 2^f; so per worker and block of d
elements, E||D(x) - x||^2 <= ||x||^2 / 8 + min(2^f ||x||_1, d 4^f / 4): Theorem 4's shape with the scale 2^e
for the norm (2^f = 2^e 2^(1-s)). The allreduce (`allreduce_expected_sq_error`): workers round
independently, so S' = sum D(x_i) has E S' = S and E|S'|^2 = |S|^2 + V with V the sum of the workers'
variances; the switch's NC adds at most E|S'|^2 / 8 (Theorem 1; S' is a multiple of the floor unit, so it
never falls below NC's range). In all E|out - S|^2 <= V + (|S|^2 + V) / 8.
"""
from __future__ import annotations

import numpy as np

from .. import wire
from . import natural
from .base import Codec

MAX_LEVELS = wire.NC_SPAN  # at s = NC_SPAN the floor is nc_floor(e): plain NC


def dither_floor(exp: int, levels: int) -> int:
    """The lowest level 2^f of a block with agreed exponent exp: f = exp - levels + 1, never below the
    switch's floor for the block."""
    if exp == wire.EXP_NONE:
        return wire.NC_LEVEL_MIN
    return max(exp - levels + 1, wire.nc_floor(exp))


def worker_variance(x, exps, k: int, levels: int) -> np.ndarray:
    """Per element, E(D(x) - x)^2 of one worker's dithering (exact; the module doc's v).

    Args:
        x: one worker's flat input.
        exps: agreed block exponents (blocks of k elements).
        k: elements per packet.
        levels: s.

    Returns:
        float64 variances, one per element.
    """
    a = np.abs(np.ravel(x).astype(np.float64))
    f = np.repeat([dither_floor(int(e), levels) for e in exps], k)[:a.size].astype(np.float64)
    unit = np.exp2(f)
    lo = np.ldexp(0.5, np.frexp(a)[1])  # a = m 2^e, 0.5 <= m < 1: lo = 2^(e-1) <= a < 2 lo
    return np.where(a >= unit, (2 * lo - a) * (a - lo), a * (unit - a))


def allreduce_expected_sq_error(inputs, exact: np.ndarray, k: int, levels: int) -> float:
    """Bound on E|allreduce - exact|^2 for dithering up and NC down: V + (|S|^2 + V) / 8 (module doc).

    Args:
        inputs: each worker's input.
        exact: the true sum, flat.
        k: elements per packet (the blocks exponents are agreed on).
        levels: s.

    Returns:
        The bound, for tests that average the squared error over seeds.
    """
    codec = DitherCodec(levels)
    exps = np.max([codec.flat_exponents(np.ravel(x), k) for x in inputs], axis=0)
    v = sum(float(worker_variance(x, exps, k, levels).sum()) for x in inputs)
    return v + (float(np.dot(exact, exact)) + v) / 8


class DitherCodec(natural.NaturalCodec):
    """Natural dithering with s levels at and below the agreed exponent, as NC codes (wire element type
    NC8), so the switch needs nothing new. An element carries a sign and one of s + 1 levels, 1 + log2(s + 1)
    bits of information, though the wire still spends a byte per code (no tighter packing here). The C
    worker loop carries NC only, so this takes the Python loop."""

    name = "dither"

    def __init__(self, levels: int = 8):
        """Args:
            levels: s, the non-zero levels per block, 1..MAX_LEVELS (s = MAX_LEVELS is plain NC).

        Raises:
            ValueError: levels out of range.
        """
        super().__init__("stochastic")
        if not isinstance(levels, (int, np.integer)) or not 1 <= levels <= MAX_LEVELS:
            raise ValueError(f"codec 'dither': levels must be an integer in 1..{MAX_LEVELS}, not {levels!r}")
        self.levels = int(levels)

    def native_kind(self, flat):
        return None

    def check_input(self, flat):
        """Raises:
            TypeError: integers (use int32, which sums them exactly).
        """
        if not np.issubdtype(flat.dtype, np.floating):
            raise TypeError(f"codec 'dither' rounds floats; got {flat.dtype}")

    def encode(self, block, exp, world_size, seed, offset):
        return natural.encode(block, seed, offset, False, dither_floor(exp, self.levels)).tobytes()
