"""Deflate (zlib) over the float32 bytes."""
from __future__ import annotations

import zlib

import numpy as np

from ..bits import CodecError
from .base import ValueCodec


class DeflateCodec(ValueCodec):
    name = "deflate"

    def __init__(self, level: int = 6):
        if not 0 <= level <= 9:
            raise ValueError("deflate: level must be in 0..9")
        self.level = level

    def params(self):
        return {"level": self.level}

    def encode(self, values):
        return zlib.compress(np.asarray(values, dtype="<f4").tobytes(), self.level)

    def decode(self, data, n):
        try:
            raw = zlib.decompress(data)
        except zlib.error as e:
            raise CodecError(f"deflate: {e}") from None
        if len(raw) != 4 * n:
            raise CodecError(f"deflate: {len(raw)} bytes for {n} float32 values")
        return np.frombuffer(raw, dtype="<f4").astype(np.float32)
