"""Counter-based random bits: element i of a stream (seed, offset) depends only on (seed, offset + i).

So a retransmitted packet is rebuilt bit for bit, and a C or CUDA kernel can reproduce the stream
without state. The mix is SplitMix64 (Steele et al.), applied to (key(seed) + counter * golden gamma).
"""
from __future__ import annotations

import numpy as np

GAMMA = np.uint64(0x9E3779B97F4A7C15)
M1 = np.uint64(0xBF58476D1CE4E5B9)
M2 = np.uint64(0x94D049BB133111EB)
MASK64 = (1 << 64) - 1


def _mix(z: np.ndarray) -> np.ndarray:
    z ^= z >> np.uint64(30)
    z *= M1
    z ^= z >> np.uint64(27)
    z *= M2
    z ^= z >> np.uint64(31)
    return z


def key(seed: int) -> int:
    """The stream key for a seed (one SplitMix64 step, as a Python int)."""
    z = (int(seed) * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def bits64(seed: int, offset: int, n: int) -> np.ndarray:
    """n random uint64 words for counters offset .. offset+n-1."""
    z = np.arange(offset, offset + n, dtype=np.uint64)
    z *= GAMMA
    z += np.uint64(key(seed))
    return _mix(z)


def derive_seed(*parts: int) -> int:
    """One 64-bit seed from several integers (job, rank, call number...)."""
    s = 0x243F6A8885A308D3
    for p in parts:
        s = key(s ^ (int(p) & MASK64))
    return s
