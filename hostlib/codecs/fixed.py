"""SwitchML fixed point: floats -> int32 with a per-block scale agreed by all workers.

scale = floor(INT32_MAX / n) / 2^e, with e the max exponent over workers (every |x| < 2^e), and each
quantized value clipped to +-floor(INT32_MAX / n): an n-way sum can never overflow int32. Per element
and worker the error is at most 1/scale (0.5 from rounding to nearest, the rest only where |x| rounds up
to the clip; stochastic rounding: < 1), so the sum is within n / scale = n * 2^e / floor(INT32_MAX / n)
of the exact sum.

Stochastic rounding is the paper's C_int (natural-compression.txt, Theorem 2) on t = x * scale: unbiased,
but E C(t)^2 / t^2 = 1/t for 0 < t < 1, unbounded as t -> 0 (no omega with C_int in B(omega)), while NC's
ratio stays <= 9/8: fixed point's error is bounded in absolute terms (steps of 1/scale), not relative.
"""
from __future__ import annotations

import numpy as np

from .. import kernels, rng, wire
from .base import Codec

INT32_MAX = 2**31 - 1


def scale_for(exps, world_size: int) -> np.ndarray:
    """The fixed-point scale per block, the same on every worker since it depends only on agreed values.

    Args:
        exps: agreed block exponents (EXP_NONE counts as 0).
        world_size: workers summing; each gets 1/world_size of int32's range, so the sum cannot overflow.

    Returns:
        float64 scales, one per exponent.
    """
    e = np.where(np.asarray(exps) == wire.EXP_NONE, 0, exps).astype(np.float64)
    return (INT32_MAX // world_size) / np.exp2(e)


def error_bound(exps, world_size: int) -> np.ndarray:
    """Max |allreduce - exact sum| per block for the given agreed exponents (what tests check against).

    Args:
        exps: agreed block exponents.
        world_size: workers summed.

    Returns:
        float64 bounds, one per block.
    """
    return world_size / scale_for(exps, world_size)


def allreduce_error_bound(inputs, k: int, exact: np.ndarray) -> np.ndarray:
    """Per element: the most a fixed-point allreduce of `inputs` (one float array per worker, k elements
    per packet) may differ from `exact`, the true sum: the quantization bound of each block's agreed
    exponent, plus half a float32 ulp for rounding the result to float32.

    Args:
        inputs: each worker's input.
        k: elements per packet (the blocks the exponents are agreed on).
        exact: the true sum, flat.

    Returns:
        float64 bounds, one per element of exact.
    """
    n = len(inputs)
    size = exact.size
    nb = -(-size // k)
    e = np.full(nb, wire.EXP_NONE, dtype=np.int64)
    for x in inputs:
        e = np.maximum(e, FixedPointCodec().flat_exponents(np.ravel(x).astype(np.float32), k))
    bound = np.repeat(error_bound(e, n), k)[:size]
    return bound + np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64) / 2


def quantize_reference(block: np.ndarray, scale: float, limit: int, seed: int | None = None,
                       offset: int = 0) -> np.ndarray:
    """The numpy definition the C kernels match: clip(round(x * scale)) as big-endian int32, rounded to
    nearest (seed None) or stochastically from the stream (seed, offset).

    Args:
        block: float values.
        scale: scale_for the block's agreed exponent.
        limit: the clip, INT32_MAX // world_size.
        seed, offset: stochastic rounding's counter-based stream (Philox, inaproto.rng.philox) and the
            position of block[0] in it: t = x * scale goes to floor(t) + 1 iff word 2^-32 < t - floor(t),
            i.e. with probability frac(t) rounded up to a multiple of 2^-32 (bias below 2^-32 of a step).

    Returns:
        Big-endian int32 values, the packet's payload elements.
    """
    t = block.astype(np.float64) * scale
    if seed is None:
        q = np.rint(t)
    else:
        q = np.floor(t)
        u = rng.philox(seed, offset, t.size).astype(np.float64)
        q += u < (t - q) * 2.0**32  # t - floor(t) and the scaling are exact
    np.clip(q, -limit, limit, out=q)
    return q.astype(">i4")


class FixedPointCodec(Codec):
    """SwitchML's fixed point: floats as int32 with a per-block scale from the negotiated exponent, so a
    switch without floating point sums them; error bounded by error_bound (methods as in Codec)."""

    name = "fixed"
    wire_codec = wire.CODEC_INT32
    negotiates_exponent = True

    def __init__(self, rounding: str = "nearest"):
        """Args:
            rounding: "nearest" (SwitchML's: error <= 1/2 step, but biased: a value below half a step
                always sends 0) or "stochastic" (unbiased, error < 1 step: the variance is frac (1 - frac)
                steps^2; the C worker loop carries only "nearest", so this takes the Python loop).

        Raises:
            ValueError: another rounding.
        """
        if rounding not in ("nearest", "stochastic"):
            raise ValueError(f"codec 'fixed': rounding must be 'nearest' or 'stochastic', not {rounding!r}")
        self.stochastic = rounding == "stochastic"

    def native_kind(self, flat):
        return "FIXED" if flat.dtype == np.float32 and not self.stochastic else None

    def check_input(self, flat):
        """Raises:
            TypeError: integers (use int32, which sums them exactly).
        """
        if not np.issubdtype(flat.dtype, np.floating):
            raise TypeError(f"codec 'fixed' quantizes floats; got {flat.dtype} (use 'int32' for integers)")

    def encode(self, block, exp, world_size, seed, offset):
        limit = INT32_MAX // world_size
        scale = float(scale_for(exp, world_size))
        native = block.dtype == np.float32 and kernels.enabled()
        if self.stochastic:
            if native:
                return kernels.fixed_quantize_sr(np.ascontiguousarray(block), scale, limit, seed, offset).tobytes()
            return quantize_reference(block, scale, limit, seed, offset).tobytes()
        if native:
            return kernels.fixed_quantize(np.ascontiguousarray(block), scale, limit).tobytes()
        return quantize_reference(block, scale, limit).tobytes()

    def decode(self, payloads, exps, world_size, k):
        scales = np.repeat(scale_for(exps, world_size), k)[: payloads.size]
        return payloads / scales

    def result_dtype(self):
        return np.int64
