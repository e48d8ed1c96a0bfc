from __future__ import annotations

import numpy as np

from .. import kernels, wire

EXPONENT_OVERFLOW_MESSAGE = f"values of magnitude >= 2^{wire.EXP_MAX} cannot be sent"


def float_values(x) -> np.ndarray:
    """x as a flat contiguous float32 or float64 array without rounding, so a codec rounds from the caller's
    own bits: float32 and float64 stay, narrower floats (float16, torch bfloat16) widen exactly to float32,
    anything else real (integers, bool, long double) goes to float64.

    Args:
        x: a numpy array, torch tensor (any device, any float dtype), scalar or sequence.

    Returns:
        A 1-D float32 or float64 array (a view of x where no conversion is needed).

    Raises:
        TypeError: complex or non-numeric values.
    """
    if type(x).__module__.startswith("torch"):
        import torch

        t = x.detach().to("cpu")
        # numpy has no bfloat16; widening to float32 is exact (bfloat16 is float32's top half)
        x = (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t).numpy()
    a = np.asarray(x)
    if a.dtype.kind not in "fiub":
        raise TypeError(f"expected real numbers, got {a.dtype}")
    if a.dtype not in (np.float32, np.float64):
        a = a.astype(np.float32 if a.dtype.kind == "f" and a.dtype.itemsize < 4 else np.float64)
    return np.ascontiguousarray(a).reshape(-1)


def extremes(a: np.ndarray) -> tuple[int, int]:
    """(min, max) of a non-empty int array: of a small one (a small call's exponents) through a list, where
    numpy's setup of each reduction costs more than the data (~3 us a reduction, paid on every call)."""
    if a.size <= 16:
        values = a.tolist()
        return min(values), max(values)
    return int(a.min()), int(a.max())


def block_exponents(blocks: np.ndarray) -> np.ndarray:
    """Per row of a 2-D float array: the smallest e with every |x| < 2^e, as int8 (wire.EXP_* rules).

    All-zero rows give EXP_NONE; rows with NaN/Inf give EXP_NONFINITE (so every worker learns of a
    NaN through the negotiation instead of summing it); e is clipped to [EXP_MIN, EXP_MAX].

    Args:
        blocks: one row per packet's block.

    Returns:
        int8 exponents, one per row.

    Raises:
        OverflowError: a value needs e > EXP_MAX, which the header cannot carry.
    """
    a = np.abs(blocks.astype(np.float64, copy=False))
    with np.errstate(invalid="ignore"):
        amax = a.max(axis=1) if a.shape[1] else np.zeros(a.shape[0])
    finite = np.isfinite(amax)
    _, e = np.frexp(np.where(finite, amax, 0.0))  # amax = m * 2^e with 0.5 <= m < 1, so amax < 2^e
    if np.any(finite & (e > wire.EXP_MAX)):
        raise OverflowError(EXPONENT_OVERFLOW_MESSAGE)
    out = np.clip(e, wire.EXP_MIN, wire.EXP_MAX)
    out = np.where(amax == 0, wire.EXP_NONE, out)
    out = np.where(finite, out, wire.EXP_NONFINITE)
    return out.astype(np.int8)


class Codec:
    """Interface every dense codec implements, so the window loop (Python or C) never branches on a
    codec's name. A subclass sets name, wire_codec (the switch's element type), negotiates_exponent (packets
    carry block exponents one window ahead) and default_elements, and overrides what differs."""

    name = "?"
    wire_codec = wire.CODEC_INT32
    negotiates_exponent = False  # True: packets carry block exponents one window ahead
    default_elements = 256  # elements per packet: 1 KiB of int32

    def check_input(self, flat: np.ndarray) -> None:
        """Refuse an input before the first packet, so it fails on this worker rather than as a wrong sum.

        Args:
            flat: the whole (1-D) input of an allreduce.

        Raises:
            TypeError, ValueError, OverflowError: the codec cannot carry it.
        """

    def block_exponents(self, blocks: np.ndarray) -> np.ndarray:
        """This worker's exponents for the negotiation, checked against what the codec can carry.

        Args:
            blocks: 2-D, one row per packet's block.

        Returns:
            int8 exponents, one per row (module-level block_exponents).

        Raises:
            OverflowError: a block the codec cannot carry.
        """
        return self.check_exponents(block_exponents(blocks))

    def flat_exponents(self, flat: np.ndarray, k: int) -> np.ndarray:
        """block_exponents of flat cut into blocks of k (the last one zero-padded); the C kernel for float32,
        since this runs over the whole tensor before the first packet.

        Args:
            flat: the whole (1-D) input.
            k: elements per packet.

        Returns:
            int8 exponents, one per block.

        Raises:
            OverflowError: a block the codec cannot carry.
        """
        if flat.dtype == np.float32 and kernels.enabled():
            e, status = kernels.block_exponents(flat, k)
            if status:
                raise OverflowError(EXPONENT_OVERFLOW_MESSAGE)
            return self.check_exponents(e)
        nb = -(-flat.size // k)
        padded = np.zeros(nb * k, dtype=flat.dtype)
        padded[:flat.size] = flat
        return self.block_exponents(padded.reshape(nb, k))

    def check_exponents(self, e: np.ndarray) -> np.ndarray:
        """A codec narrower than the header's exponent range (nc) refuses here, before anything is sent.

        Args:
            e: int8 block exponents.

        Returns:
            e unchanged.

        Raises:
            OverflowError: an exponent the codec cannot carry.
        """
        return e

    def encode(self, block: np.ndarray, exp: int, world_size: int, seed: int, offset: int) -> bytes:
        """One update packet's payload. Deterministic in its arguments, so a retransmission is rebuilt
        bit for bit instead of being kept in memory.

        Args:
            block: this packet's elements.
            exp: the block's agreed exponent (max over workers; EXP_NONE: all zero), for codecs that negotiate.
            world_size: workers summing (fixed point leaves headroom for that many terms).
            seed, offset: the counter-based RNG stream and position of block[0] (stochastic rounding).

        Returns:
            The payload bytes in the codec's wire element type.
        """
        raise NotImplementedError

    def decode(self, payloads: np.ndarray, exps: np.ndarray, world_size: int, k: int) -> np.ndarray:
        """Decode result payloads for all blocks at once (one vectorised pass after the last result).

        Args:
            payloads: flat array of the result elements (int64 for int32 codecs, uint8 codes for NC).
            exps: per-block agreed exponent.
            world_size: workers summed (fixed point's scale depends on it).
            k: elements per block.

        Returns:
            float64 or int64 values, one per element.
        """
        raise NotImplementedError

    def result_dtype(self):
        """Returns:
            The dtype the loops collect result elements in (int64 sums, or uint8 codes for nc).
        """
        return np.int64

    def native_kind(self, flat: np.ndarray) -> str | None:
        """Which C worker loop carries this input, declared by the codec so fastpath never matches names.

        Args:
            flat: the whole (1-D) input.

        Returns:
            The kind (INA_WK_<kind> in csrc/ina_worker.h), or None where only the Python loop carries it.
        """
        return None
