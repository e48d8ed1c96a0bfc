"""Golomb-Rice coded gaps (SBC, Sattler et al. 2019): gap - 1 = q * 2^b + r as q ones, a zero, b bits of r.
With b* = 1 + floor(log2(log(phi - 1) / log(1 - p))) for density p (phi the golden ratio) the mean cost is
b* + 1 / (1 - (1 - p)^(2^b*)) bits per position; b is chosen from the tensor's density unless given."""
from __future__ import annotations

import math

import numpy as np

from ..bits import CodecError, next_zero, windows
from .base import IndexCodec, from_gaps, gaps

PHI = (1 + math.sqrt(5)) / 2


def optimal_b(p: float) -> int:
    if not 0 < p < 1:
        return 0
    return max(0, 1 + math.floor(math.log2(math.log(PHI - 1) / math.log(1 - p))))


def expected_bits(p: float, b: int) -> float:
    """Mean bits per position for density p and parameter b (the SBC paper's formula)."""
    return b + 1 / (1 - (1 - p) ** (2**b))


class GolombCodec(IndexCodec):
    name = "golomb"

    def __init__(self, b: int | None = None):
        if b is not None and not 0 <= b <= 40:
            raise ValueError("golomb: b must be in 0..40")
        self.b = b

    def params(self):
        return {} if self.b is None else {"b": self.b}

    def encode(self, indices, size):
        b = self.b if self.b is not None else optimal_b(len(indices) / size if size else 0)
        v = gaps(indices) - np.uint64(1)
        q = (v >> np.uint64(b)).astype(np.int64)
        lens = q + 1 + b
        starts = (np.cumsum(lens) - lens).astype(np.int64)
        bits = np.zeros(int(lens.sum()), dtype=np.uint8)
        ones = np.repeat(starts, q) + (np.arange(int(q.sum())) - np.repeat(np.cumsum(q) - q, q))
        bits[ones] = 1
        for j in range(b):
            bits[starts + q + 1 + j] = ((v >> np.uint64(b - 1 - j)) & np.uint64(1)).astype(np.uint8)
        head = bytes([b]) + int(len(indices)).to_bytes(8, "big")
        return head + np.packbits(bits).tobytes(), indices

    def decode(self, data, size, count):
        if len(data) < 9:
            raise CodecError("golomb: truncated header")
        b, n = data[0], int.from_bytes(data[1:9], "big")
        if b > 40 or n > size or n != count or n * (b + 1) > 8 * (len(data) - 9):
            raise CodecError("golomb: bad header")
        bits = np.unpackbits(np.frombuffer(data[9:], dtype=np.uint8))
        nz, rem = next_zero(bits), windows(bits, b)
        out = np.empty(n, dtype=np.uint64)
        pos, total = 0, bits.size
        nz_l, rem_l = nz.tolist(), rem.tolist()
        for i in range(n):
            z = nz_l[pos] if pos < total else total
            if z + 1 + b > total:
                raise CodecError("golomb: truncated")
            out[i] = ((z - pos) << b | rem_l[z + 1]) + 1
            pos = z + 1 + b
        return from_gaps(out, size)
