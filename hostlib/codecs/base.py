from __future__ import annotations

import numpy as np

from .. import kernels, wire

EXPONENT_OVERFLOW_MESSAGE = f"values of magnitude >= 2^{wire.EXP_MAX} cannot be sent"


def block_exponents(blocks: np.ndarray) -> np.ndarray:
    """Per row of a 2-D float array: the smallest e with every |x| < 2^e, as int8 (wire.EXP_* rules).

    All-zero rows give EXP_NONE; rows with NaN/Inf give EXP_NONFINITE; e is clipped to
    [EXP_MIN, EXP_MAX] and a value needing e > EXP_MAX raises OverflowError.
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
    """Interface every dense codec implements."""

    name = "?"
    wire_codec = wire.CODEC_INT32
    negotiates_exponent = False  # True: packets carry block exponents one window ahead
    default_elements = 256  # elements per packet: 1 KiB of int32

    def check_input(self, flat: np.ndarray) -> None:
        """Raise TypeError/ValueError for inputs the codec cannot carry."""

    def block_exponents(self, blocks: np.ndarray) -> np.ndarray:
        return self.check_exponents(block_exponents(blocks))

    def flat_exponents(self, flat: np.ndarray, k: int) -> np.ndarray:
        """block_exponents of flat cut into blocks of k (the last one zero-padded); the C kernel for float32."""
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
        """Raise OverflowError for exponents the codec cannot carry."""
        return e

    def encode(self, block: np.ndarray, exp: int, world_size: int, seed: int, offset: int) -> bytes:
        raise NotImplementedError

    def decode(self, payloads: np.ndarray, exps: np.ndarray, world_size: int, k: int) -> np.ndarray:
        """Decode result payloads for all blocks at once.

        payloads: flat array of the result elements (int64 for int32 codecs, uint8 codes for NC);
        exps: per-block agreed exponent; k: elements per block. Returns float64 or int64.
        """
        raise NotImplementedError

    def result_dtype(self):
        return np.int64

    def native_kind(self, flat: np.ndarray) -> str | None:
        """The C worker loop's kind for this input (INA_WK_<kind> in csrc/ina_worker.h), or None where only
        the Python loop carries it."""
        return None
