"""Natural compression (Horvath et al., 2019): stochastic rounding of |x| to a neighbouring power of two.

Codes are one byte: bit 7 the sign, bits 6..0 m, with m = 0 for zero and 2^(m-64) otherwise (see
wire.py / docs/protocol.md). In the float bit view rounding is exact: |x| = 2^a (1 + mant/2^M) rounds
up with probability mant/2^M: a uniform M-bit integer (23 for float32, 52 for float64, from the Philox
stream of inaproto.rng) added to the bits carries into the exponent exactly that often. Its first 8 bits come
a byte per element (one Philox draw per 16 elements) and decide the carry alone except with probability
2^-8; only then are the next bits drawn (`_uniform`), so the rounding stays exact at a quarter of the draws. Values below the
floor level 2^F go to 0 or 2^F with probability |x|/2^F (to 2^-32 of 2^F), so the operator stays unbiased
over its whole range.

The switch side of the code table (`codes_to_int`, `int_to_codes`) lives in inaproto.nc, which both
sides import; it is re-exported here.
"""
from __future__ import annotations

import numpy as np

from inaproto.nc import codes_to_int, int_to_codes  # noqa: F401 - re-exported

from .. import kernels, rng, wire
from .base import Codec, extremes, float_values

_SIGN = np.uint8(0x80)
NONFINITE_MESSAGE = "natural compression: input contains NaN or Inf"
OVERFLOW_MESSAGE = f"natural compression: |x| >= 2^{wire.NC_LEVEL_MAX} is out of range"
BAD_CODE_MESSAGE = "natural compression: 0x80 is not a valid code"


def encode(x, seed: int = 0, offset: int = 0, deterministic: bool = False,
           floor: int = wire.NC_LEVEL_MIN, out: np.ndarray | None = None) -> np.ndarray:
    """NC codes (uint8) for x, rounded from x's own bits (float64 from its 52-bit mantissa, never through
    float32, whose rounding would bias it); the C kernel when built.

    Args:
        x: float values: numpy array or torch tensor (bfloat16/float16 widen to float32 exactly).
        seed, offset: the counter-based RNG stream and the position of x[0] in it, so a block re-encoded
            for a retransmission gets the same codes (a float64 holding a float32 value gets its codes).
        deterministic: round to nearest instead of stochastically (biased, but no RNG).
        floor: the smallest level kept (2^floor); smaller values round to 0 or 2^floor, unbiased.
        out: a contiguous uint8 array of x's size to write the codes into (reused across calls, so a
            training loop allocates nothing per step).

    Returns:
        uint8 codes, one per element (flat): out where given.

    Raises:
        ValueError: NaN or Inf in x.
        OverflowError: |x| >= 2^NC_LEVEL_MAX (always, whatever the random draw: the exponent negotiation
            refuses the same inputs).
        TypeError: x is not real numbers.
    """
    v = float_values(x)
    if not kernels.enabled():
        codes = encode_reference(v, seed, offset, deterministic, floor)
        if out is None:
            return codes
        out.reshape(-1)[...] = codes
        return out
    codes, status = kernels.nc_encode(v, seed, offset, deterministic, floor, out)
    if status == kernels.NONFINITE:
        raise ValueError(NONFINITE_MESSAGE)
    if status == kernels.OVERFLOW:
        raise OverflowError(OVERFLOW_MESSAGE)
    return codes


# per float format: (unsigned view, mantissa bits, exponent mask, exponent bias)
_FORMATS = {np.dtype(np.float32): (np.uint32, 23, 0xFF, 127), np.dtype(np.float64): (np.uint64, 52, 0x7FF, 1023)}


def _uniform(mag: np.ndarray, dtype, seed: int, offset: int, deterministic: bool) -> np.ndarray:
    """The integer added to each element's mantissa bits (mag: |x|'s bits as uint64): its carry into the
    exponent is the round-up. The element's uniform is its byte h (`rng.philox_bytes`: one Philox draw per 16
    elements), then its word1 (sub-stream 1), then its word3 (sub-stream 3), read as one binary fraction.
    float32: h << 15 | word1 >> 17 (23 bits), word1 drawn only where h leaves the carry open (the mantissa's
    top 8 bits plus h are 0xFF, probability 2^-8: elsewhere the low 15 bits cannot change the carry, so they
    are left 0); float64: h << 44 | word1 << 12 | word3 >> 20 (52 bits, whose top 23 are the float32's, so a
    double holding a float32 value carries exactly when the float does); deterministic: half the mantissa's
    range (round half up)."""
    if dtype == np.float32:
        if deterministic:
            return np.uint64(1 << 22)
        u = rng.philox_bytes(seed, offset, mag.size).astype(np.uint64) << np.uint64(15)
        tie = np.flatnonzero(((mag + u) & np.uint64(0x7F8000)) == np.uint64(0x7F8000))
        if tie.size:
            w1 = rng.philox_at(seed, np.uint64(offset & rng.MASK64) + tie.astype(np.uint64), rng.SUB_EXTRA)
            u[tie] |= w1.astype(np.uint64) >> np.uint64(17)
        return u
    if deterministic:
        return np.uint64(1 << 51)
    h = rng.philox_bytes(seed, offset, mag.size).astype(np.uint64)
    w1 = rng.philox(seed, offset, mag.size, rng.SUB_EXTRA).astype(np.uint64)
    w3 = rng.philox(seed, offset, mag.size, rng.SUB_LOW).astype(np.uint64)
    return (h << np.uint64(44)) | (w1 << np.uint64(12)) | (w3 >> np.uint64(20))


def encode_reference(x: np.ndarray, seed: int, offset: int, deterministic: bool, floor: int) -> np.ndarray:
    """The numpy definition of `encode` that the C kernels (scalar, AVX2, AVX-512) and CUDA match bit for
    bit (same arguments, returns and errors; x must already be flat float32 or float64). At or above the
    floor, a uniform integer added to |x|'s bits rounds up when it carries into the exponent (probability
    mantissa / 2^M; `_uniform`); below it, 2^floor iff word1 of sub-stream 1 < |x| 2^(32 - floor)
    (docs/protocol.md, "Random stream")."""
    uint, m, emask, ebias = _FORMATS[x.dtype]
    floor = max(floor, wire.NC_LEVEL_MIN)  # no code below 2^NC_LEVEL_MIN
    bits = x.view(uint).astype(np.uint64)
    mag = bits & np.uint64((1 << (8 * x.itemsize - 1)) - 1)
    a = (mag >> np.uint64(m)).astype(np.int64) - ebias  # 2^a <= |x| < 2^(a+1) for normal numbers
    if np.any(a == emask - ebias):
        raise ValueError(NONFINITE_MESSAGE)
    level = ((mag + _uniform(mag, x.dtype, seed, offset, deterministic)) >> np.uint64(m)).astype(np.int64) - ebias
    below = np.flatnonzero(a < floor)
    if below.size:
        # |x| < 2^floor: 0 or 2^floor, up with probability |x| / 2^floor (to 2^-32; the product is exact)
        t = np.abs(x[below]).astype(np.float64) * 2.0 ** (32 - floor)
        if deterministic:
            up_b = t >= 2.0**31
        else:
            up_b = rng.philox_at(seed, np.uint64(offset & rng.MASK64) + below.astype(np.uint64), rng.SUB_EXTRA).astype(np.float64) < t
        level[below] = np.where(up_b, floor, wire.NC_LEVEL_MIN - 1)  # NC_LEVEL_MIN-1 marks zero
    if np.any(a >= wire.NC_LEVEL_MAX) or (level.size and level.max() > wire.NC_LEVEL_MAX):
        raise OverflowError(OVERFLOW_MESSAGE)
    zero = level < wire.NC_LEVEL_MIN
    codes = (np.where(zero, 0, level + wire.NC_BIAS)).astype(np.uint8)
    codes |= (bits >> np.uint64(8 * x.itemsize - 1)).astype(np.uint8) << np.uint8(7)
    codes[zero] = 0
    return codes


_DECODE = np.zeros(256, dtype=np.float64)
for _m in range(1, 128):
    _DECODE[_m] = 2.0 ** (_m - wire.NC_BIAS)
    _DECODE[_m | 0x80] = -(2.0 ** (_m - wire.NC_BIAS))


def decode(codes, dtype=np.float32, out: np.ndarray | None = None) -> np.ndarray:
    """Values of NC codes.

    Args:
        codes: uint8 codes, any shape.
        dtype: of the result; float32 takes the C kernel when built.
        out: a contiguous array of dtype and codes' size to write into (reused across calls).

    Returns:
        Values of codes' shape.

    Raises:
        ValueError: the invalid code 0x80 (negative zero), which no encoder emits: a corrupt payload.
    """
    c = np.asarray(codes, dtype=np.uint8)
    if dtype == np.float32 and kernels.enabled():
        values, status = kernels.nc_decode(np.ascontiguousarray(c).reshape(-1), out)
        if status:
            raise ValueError(BAD_CODE_MESSAGE)
        return values.reshape(c.shape) if out is None else out
    if np.any(c == _SIGN):
        raise ValueError(BAD_CODE_MESSAGE)
    if out is None:
        return _DECODE[c].astype(dtype, copy=False)
    out.reshape(c.shape)[...] = _DECODE[c]
    return out


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
        """The block exponents as they go on the wire: a block with data below 2^NC_LEVEL_MIN gets the exponent
        NC_LEVEL_MIN. The switch takes a block's codes in [nc_floor(e), e], empty for e < NC_LEVEL_MIN, while
        the encoder rounds such values (a gradient of 1e-20) to 0 or +-2^NC_LEVEL_MIN, unbiased: with the
        block's own exponent every packet holding such a code was dropped (bad_codes) and the call timed out.

        Raises:
            OverflowError: a block with |x| >= 2^NC_LEVEL_MAX, beyond the code table.
        """
        if not e.size:
            return e
        lo, hi = extremes(e)
        if hi > wire.NC_LEVEL_MAX and ((e != wire.EXP_NONFINITE) & (e > wire.NC_LEVEL_MAX)).any():
            raise OverflowError(f"codec 'nc': values of magnitude >= 2^{wire.NC_LEVEL_MAX} are out of range")
        if lo < wire.NC_LEVEL_MIN:
            tiny = (e < wire.NC_LEVEL_MIN) & (e != wire.EXP_NONE)
            if tiny.any():
                e = np.where(tiny, np.int8(wire.NC_LEVEL_MIN), e).astype(np.int8, copy=False)
        return e

    def encode(self, block, exp, world_size, seed, offset):
        floor = wire.nc_floor(exp) if exp != wire.EXP_NONE else wire.NC_LEVEL_MIN
        return encode(block, seed, offset, self.deterministic, floor).tobytes()

    def decode(self, payloads, exps, world_size, k):
        return decode(payloads, np.float64)

    def result_dtype(self):
        return np.uint8
