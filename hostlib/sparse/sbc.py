"""Sparse Binary Compression (Sattler et al., 2019): of the accumulated update keep the p largest and the
p smallest entries, send the side whose mean has the larger magnitude as one float (its mean) plus its
positions as Golomb-coded gaps; what is not sent stays in the residual. With `delay` n the worker
accumulates n local steps before it communicates (communication delay).

Message: b"SB", version, size (u64), mean (float32), Golomb positions (index/golomb.py)."""
from __future__ import annotations

import math
import struct

import numpy as np

from ..feedback import ErrorFeedback

from .bits import CodecError
from .index.golomb import GolombCodec

HEAD = struct.Struct(">2sBQf")
MAGIC, VERSION = b"SB", 1


def encode(x: np.ndarray, p: float) -> tuple[bytes, np.ndarray]:
    """(message, what the message decodes to) for a flat float array."""
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    if not np.all(np.isfinite(x)):
        raise ValueError("sbc: input contains NaN or Inf")
    k = min(x.size, max(1, math.ceil(p * x.size))) if x.size else 0
    sent = np.zeros(x.size, np.float32)
    if k == 0:
        return HEAD.pack(MAGIC, VERSION, x.size, 0.0) + GolombCodec().encode(np.zeros(0, np.int64), 1)[0], sent
    part = np.argpartition(x, (k - 1, x.size - k))
    bottom, top = part[:k], part[x.size - k:]
    mean_top, mean_bottom = float(x[top].mean()), float(x[bottom].mean())
    idx, mean = (top, mean_top) if abs(mean_top) >= abs(mean_bottom) else (bottom, mean_bottom)
    idx = np.sort(idx)
    mean = float(np.float32(mean))
    sent[idx] = mean
    return HEAD.pack(MAGIC, VERSION, x.size, mean) + GolombCodec().encode(idx, x.size)[0], sent


def decode(data) -> np.ndarray:
    data = bytes(data)
    if len(data) < HEAD.size:
        raise CodecError("sbc: truncated header")
    magic, version, size, mean = HEAD.unpack_from(data)
    if magic != MAGIC or version != VERSION or not math.isfinite(mean) or size > 1 << 31:
        raise CodecError("sbc: not an SBC message")
    body = data[HEAD.size:]
    count = int.from_bytes(body[1:9], "big") if len(body) >= 9 else -1
    idx = GolombCodec().decode(body, max(int(size), 1), count)
    out = np.zeros(int(size), np.float32)
    out[idx] = mean
    return out


class SBC:
    """The compressor with residual accumulation and communication delay, per tensor key."""

    def __init__(self, p: float = 0.01, delay: int = 1):
        if not 0 < p <= 0.5 or delay < 1:
            raise ValueError("sbc: p must be in (0, 0.5] and delay >= 1")
        self.p, self.delay = p, delay
        self.memory = ErrorFeedback()
        self.steps: dict = {}

    @property
    def residuals(self) -> dict:
        return self.memory.residuals

    def step(self, update, key=0):
        """Add one local update; every `delay`-th call returns the message to send (else None)."""
        acc = self.memory.compensate(np.asarray(update, dtype=np.float32).reshape(-1), key)
        self.steps[key] = self.steps.get(key, 0) + 1
        if self.steps[key] % self.delay:
            self.memory.update(key, acc)
            return None
        message, sent = encode(acc, self.p)
        self.memory.update(key, acc - sent)
        return message
