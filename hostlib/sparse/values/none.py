"""No value compression: float32, little-endian."""
from __future__ import annotations

import numpy as np

from ..bits import CodecError
from .base import ValueCodec


class NoneCodec(ValueCodec):
    name = "none"

    def encode(self, values):
        return np.asarray(values, dtype="<f4").tobytes()

    def decode(self, data, n):
        if len(data) != 4 * n:
            raise CodecError(f"none: {len(data)} bytes for {n} float32 values")
        return np.frombuffer(data, dtype="<f4").astype(np.float32)
