"""Natural compression of the values: one byte each (hostlib.codecs.natural), unbiased."""
from __future__ import annotations

import numpy as np

from ...codecs import natural
from ..bits import CodecError
from .base import ValueCodec


class NCValueCodec(ValueCodec):
    name = "nc"
    lossless = False

    def __init__(self, seed: int = 0, rounding: str = "stochastic"):
        if rounding not in ("stochastic", "deterministic"):
            raise ValueError("nc: rounding must be 'stochastic' or 'deterministic'")
        self.seed, self.rounding = int(seed), rounding

    def params(self):
        return {"seed": self.seed, "rounding": self.rounding}

    def encode(self, values):
        return natural.encode(np.asarray(values, np.float32), seed=self.seed,
                              deterministic=self.rounding == "deterministic").tobytes()

    def decode(self, data, n):
        if len(data) != n:
            raise CodecError(f"nc: {len(data)} codes for {n} values")
        try:
            return natural.decode(np.frombuffer(data, dtype=np.uint8))
        except ValueError as e:
            raise CodecError(str(e)) from None
