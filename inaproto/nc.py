"""The switch side of the natural-compression code table (docs/protocol.md): codes to integers in units of
the block's floor level, and integer sums back to codes. The worker's encoder (hostlib.codecs.natural)
and every switch backend follow this definition.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from . import rng, wire


@lru_cache(maxsize=512)
def _int_table(floor: int, top: int):
    """Per code: its integer value 2^(level - floor) with sign, and whether it is valid for [floor, top]."""
    value = np.zeros(256, dtype=np.int64)
    valid = np.zeros(256, dtype=bool)
    valid[0] = True
    for lvl in range(floor, top + 1):
        m = lvl + wire.NC_BIAS
        value[m], value[m | 0x80] = 1 << (lvl - floor), -(1 << (lvl - floor))
        valid[m] = valid[m | 0x80] = True
    return value, valid


def codes_to_int(codes: np.ndarray, exp: int):
    """Switch side: codes of a block with agreed exponent exp -> int64 values, or None if any is invalid."""
    if exp == wire.EXP_NONE:
        return np.zeros(codes.size, np.int64) if not np.any(codes) else None
    floor = wire.nc_floor(exp)
    value, valid = _int_table(floor, min(exp, wire.NC_LEVEL_MAX))
    if not valid[codes].all():
        return None
    return value[codes]


def int_to_codes(sums: np.ndarray, exp: int, deterministic: bool, seed: int, offset: int):
    """Switch side: compress integer sums (units of 2^floor) back to NC codes.

    Exact in integers: |s| = 2^a + rem rounds up with probability rem / 2^a. Returns (codes, overflow).
    """
    floor = wire.nc_floor(exp) if exp != wire.EXP_NONE else wire.NC_LEVEL_MIN
    s = np.asarray(sums, dtype=np.int64)
    mag = np.abs(s).astype(np.uint64)
    nz = mag > 0
    _, e = np.frexp(mag.astype(np.float64))
    a = np.maximum(e - 1, 0).astype(np.int64)
    one = np.uint64(1)
    # float64 may round mag up past a power of two: correct a so that 2^a <= mag < 2^(a+1)
    a -= (np.left_shift(one, a.astype(np.uint64)) > mag) & nz
    rem = mag - np.left_shift(one, a.astype(np.uint64))
    if deterministic:
        half = np.where(a > 0, np.left_shift(one, np.maximum(a - 1, 0).astype(np.uint64)), one)
        up = (rem >= half) & (a > 0)
    else:
        r = rng.bits64_pairs(seed, offset, s.size)
        shift = np.clip(64 - a, 1, 63).astype(np.uint64)
        up = ((r >> shift) < rem) & (a > 0)
    level = floor + a + up
    overflow = bool(np.any(nz & (level > wire.NC_LEVEL_MAX)))
    level = np.minimum(level, wire.NC_LEVEL_MAX)
    codes = np.where(nz, level + wire.NC_BIAS, 0).astype(np.uint8)
    codes |= (s < 0).astype(np.uint8) << np.uint8(7)
    return codes, overflow
