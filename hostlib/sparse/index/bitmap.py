"""Bitmap: one bit per tensor element, 1 where the element is sent (DeepReduce, Fig. 1.c), packed MSB
first and zero-padded to a whole byte. ceil(size / 8) bytes whatever the density, so it beats the
(key, value) form once more than 1 element in 32 is sent."""
from __future__ import annotations

import numpy as np

from ..bits import CodecError
from .base import IndexCodec


class BitmapCodec(IndexCodec):
    name = "bitmap"

    def encode(self, indices, size):
        idx = np.asarray(indices, dtype=np.int64)
        bits = np.zeros(size, dtype=np.uint8)
        bits[idx] = 1
        return np.packbits(bits).tobytes(), idx

    def decode(self, data, size, count):
        if len(data) != -(-size // 8):
            raise CodecError(f"bitmap: {len(data)} bytes for {size} elements (need {-(-size // 8)})")
        bits = np.unpackbits(np.frombuffer(bytes(data), dtype=np.uint8))
        if bits[size:].any():
            raise CodecError("bitmap: padding bits past the tensor's end are set")
        idx = np.flatnonzero(bits[:size])
        if idx.size != count:
            raise CodecError(f"bitmap: {idx.size} bits set, the container says {count}")
        return idx.astype(np.int64)
