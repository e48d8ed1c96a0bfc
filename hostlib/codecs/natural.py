"""Natural compression (Horvath et al., 2019): stochastic rounding of |x| to a neighbouring power of two.

Codes are one byte: bit 7 the sign, bits 6..0 m, with m = 0 for zero and 2^(m-64) otherwise (see
wire.py / docs/protocol.md). In the float32 bit view rounding is exact: |x| = 2^a (1 + mant/2^23) rounds
up with probability mant/2^23, decided by comparing mant with 23 random bits. Values below the floor
level 2^F go to 0 or 2^F with probability |x|/2^F, so the operator stays unbiased over its whole range.

The switch side of the code table (`codes_to_int`, `int_to_codes`) lives in inaproto.nc, which both
sides import; it is re-exported here.
"""
from __future__ import annotations

import numpy as np

from inaproto.nc import codes_to_int, int_to_codes  # noqa: F401 - re-exported

from .. import kernels, rng, wire
from .base import Codec

_SIGN = np.uint8(0x80)
NONFINITE_MESSAGE = "natural compression: input contains NaN or Inf"
OVERFLOW_MESSAGE = f"natural compression: |x| >= 2^{wire.NC_LEVEL_MAX} is out of range"
BAD_CODE_MESSAGE = "natural compression: 0x80 is not a valid code"


def encode(x, seed: int = 0, offset: int = 0, deterministic: bool = False,
           floor: int = wire.NC_LEVEL_MIN) -> np.ndarray:
    """NC codes (uint8) for x (any float array, computed on its float32 value); the C kernel when built.

    Args:
        x: float values.
        seed, offset: the counter-based RNG stream and the position of x[0] in it, so a block re-encoded
            for a retransmission gets the same codes.
        deterministic: round to nearest instead of stochastically (biased, but no RNG).
        floor: the smallest level kept (2^floor); smaller values round to 0 or 2^floor, unbiased.

    Returns:
        uint8 codes, one per element (flat).

    Raises:
        ValueError: NaN or Inf in x.
        OverflowError: |x| >= 2^NC_LEVEL_MAX.
    """
    x32 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if not kernels.enabled():
        return encode_reference(x32, seed, offset, deterministic, floor)
    codes, status = kernels.nc_encode(x32, seed, offset, deterministic, floor)
    if status == kernels.NONFINITE:
        raise ValueError(NONFINITE_MESSAGE)
    if status == kernels.OVERFLOW:
        raise OverflowError(OVERFLOW_MESSAGE)
    return codes


def encode_reference(x32: np.ndarray, seed: int, offset: int, deterministic: bool, floor: int) -> np.ndarray:
    """The numpy definition of `encode` that the C kernel matches bit for bit (same arguments, returns and
    errors; x32 must already be flat float32)."""
    bits = x32.view(np.uint32)
    if np.any((bits & np.uint32(0x7F800000)) == np.uint32(0x7F800000)):
        raise ValueError(NONFINITE_MESSAGE)
    n = bits.size
    expf = ((bits >> np.uint32(23)) & np.uint32(0xFF)).astype(np.int16)
    mant = bits & np.uint32(0x7FFFFF)
    a = expf - 127  # 2^a <= |x| < 2^(a+1) for normal numbers
    if deterministic:
        up = mant >= np.uint32(1 << 22)
    else:
        r = rng.bits64(seed, offset, n)
        up = (r >> np.uint64(41)).astype(np.uint32) < mant
    level = a + up
    below = a < floor
    if np.any(below):
        # |x| < 2^floor: 0 or 2^floor, up with probability |x| / 2^floor (exact in float64)
        p = np.abs(x32[below]).astype(np.float64) * 2.0 ** (53 - floor)
        if deterministic:
            up_b = p >= 2.0**52
        else:
            up_b = (r[below] >> np.uint64(11)).astype(np.float64) < p
        level[below] = np.where(up_b, floor, wire.NC_LEVEL_MIN - 1)  # NC_LEVEL_MIN-1 marks zero
    if level.size and level.max() > wire.NC_LEVEL_MAX:
        raise OverflowError(OVERFLOW_MESSAGE)
    zero = level < wire.NC_LEVEL_MIN
    codes = (level + wire.NC_BIAS).astype(np.uint8)
    codes |= (bits >> np.uint32(31)).astype(np.uint8) << np.uint8(7)
    codes[zero] = 0
    return codes


_DECODE = np.zeros(256, dtype=np.float64)
for _m in range(1, 128):
    _DECODE[_m] = 2.0 ** (_m - wire.NC_BIAS)
    _DECODE[_m | 0x80] = -(2.0 ** (_m - wire.NC_BIAS))


def decode(codes, dtype=np.float32) -> np.ndarray:
    """Values of NC codes.

    Args:
        codes: uint8 codes, any shape.
        dtype: of the result; float32 takes the C kernel when built.

    Returns:
        Values of codes' shape.

    Raises:
        ValueError: the invalid code 0x80 (negative zero), which no encoder emits: a corrupt payload.
    """
    c = np.asarray(codes, dtype=np.uint8)
    if dtype == np.float32 and kernels.enabled():
        out, status = kernels.nc_decode(np.ascontiguousarray(c).reshape(-1))
        if status:
            raise ValueError(BAD_CODE_MESSAGE)
        return out.reshape(c.shape)
    if np.any(c == _SIGN):
        raise ValueError(BAD_CODE_MESSAGE)
    return _DECODE[c].astype(dtype, copy=False)


def allreduce_expected_sq_error(inputs, exact: np.ndarray) -> float:
    """Bound on E|allreduce - exact|^2 for NC both ways: each worker's C adds at most |x_i|^2/8, and the
    switch's C of S' = sum C(x_i) adds at most E|S'|^2/8 with E|S'|^2 <= |S|^2 + sum |x_i|^2/8.

    Args:
        inputs: each worker's input.
        exact: the true sum, flat.

    Returns:
        The bound, for tests that average the squared error over seeds.
    """
    sq = sum(float(np.dot(np.ravel(x).astype(np.float64), np.ravel(x))) for x in inputs)
    return sq / 8 + (float(np.dot(exact, exact)) + sq / 8) / 8


class NaturalCodec(Codec):
    """NC on the INA path: 8-bit codes both ways, integer sums in the switch."""

    name = "nc"

    def native_kind(self, flat):
        return "NC" if flat.dtype == np.float32 else None
    wire_codec = wire.CODEC_NC8
    negotiates_exponent = True
    default_elements = 1024  # 1 KiB of codes, the same payload as 256 int32

    def __init__(self, rounding: str = "stochastic"):
        """Args:
            rounding: "stochastic" (unbiased: errors cancel over steps and workers) or "deterministic"
                (round to nearest: no variance, but biased).

        Raises:
            ValueError: another rounding.
        """
        if rounding not in ("stochastic", "deterministic"):
            raise ValueError("rounding must be 'stochastic' or 'deterministic'")
        self.deterministic = rounding == "deterministic"

    def check_input(self, flat):
        """Raises:
            TypeError: integers (use int32, which sums them exactly).
        """
        if not np.issubdtype(flat.dtype, np.floating):
            raise TypeError(f"codec 'nc' compresses floats; got {flat.dtype}")

    def check_exponents(self, e):
        """Raises:
            OverflowError: a block with |x| >= 2^NC_LEVEL_MAX, beyond the code table.
        """
        if np.any((e != wire.EXP_NONFINITE) & (e > wire.NC_LEVEL_MAX)):
            raise OverflowError(f"codec 'nc': values of magnitude >= 2^{wire.NC_LEVEL_MAX} are out of range")
        return e

    def encode(self, block, exp, world_size, seed, offset):
        floor = wire.nc_floor(exp) if exp != wire.EXP_NONE else wire.NC_LEVEL_MIN
        return encode(block, seed, offset, self.deterministic, floor).tobytes()

    def decode(self, payloads, exps, world_size, k):
        return decode(payloads, np.float64)

    def result_dtype(self):
        return np.uint8
