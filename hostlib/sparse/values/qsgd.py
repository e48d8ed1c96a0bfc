"""QSGD (Alistarh et al.): per bucket of `bucket` values, the L2 norm (float32) and for each value its sign
and a level l in 0..levels with |v| / norm * levels rounded stochastically to l (unbiased).

The random draws are counter-based: value i of an encode(values, offset) uses counter offset + i of the
seed's stream, so a caller that quantizes slices of one vector (SparCML's ranges) draws independent bits
per slice; unbiasedness over time needs a fresh seed per round (the caller's job)."""
from __future__ import annotations

import numpy as np

from ... import rng
from ..bits import CodecError, pack_fixed, unpack_fixed, width_for
from .base import ValueCodec


class QSGDCodec(ValueCodec):
    name = "qsgd"
    lossless = False

    def __init__(self, levels: int = 127, bucket: int = 512, seed: int = 0):
        if not 1 <= levels <= 2**15 or bucket < 1:
            raise ValueError("qsgd: levels must be in 1..32768 and bucket >= 1")
        self.levels, self.bucket, self.seed = int(levels), int(bucket), int(seed)

    def params(self):
        return {"levels": self.levels, "bucket": self.bucket, "seed": self.seed}

    def encode(self, values, offset: int = 0):
        v = np.asarray(values, dtype=np.float64)
        if not np.all(np.isfinite(v)):
            raise ValueError("qsgd: values contain NaN or Inf")
        if offset < 0:
            raise ValueError("qsgd: offset must be >= 0")
        n, b = v.size, self.bucket
        pad = np.zeros(-(-n // b) * b)
        pad[:n] = v
        norms = np.sqrt((pad.reshape(-1, b) ** 2).sum(axis=1)).astype(np.float32)
        scale = np.repeat(norms.astype(np.float64), b)[:n]
        y = np.divide(np.abs(v), scale, out=np.zeros(n), where=scale > 0) * self.levels
        u = (rng.bits64(self.seed, int(offset), n) >> np.uint64(11)).astype(np.float64) * 2.0**-53
        lvl = np.minimum(np.floor(y) + (u < y - np.floor(y)), self.levels).astype(np.uint64)
        code = (lvl << np.uint64(1)) | (v < 0).astype(np.uint64)
        return norms.astype("<f4").tobytes() + pack_fixed(code, width_for(self.levels + 1) + 1)

    def decode(self, data, n):
        nb = -(-n // self.bucket)
        if len(data) < 4 * nb:
            raise CodecError("qsgd: truncated norms")
        norms = np.frombuffer(data[:4 * nb], dtype="<f4").astype(np.float64)
        width = width_for(self.levels + 1) + 1
        if len(data) != 4 * nb + -(-width * n // 8):
            raise CodecError("qsgd: wrong length")
        code = unpack_fixed(data[4 * nb:], width, n)
        lvl = (code >> np.uint64(1)).astype(np.float64)
        if np.any(lvl > self.levels):
            raise CodecError("qsgd: level out of range")
        mag = lvl / self.levels * np.repeat(norms, self.bucket)[:n]
        return np.where(code & np.uint64(1), -mag, mag).astype(np.float32)
