"""Counter-based random bits: element i of a stream (seed, offset) depends only on (seed, offset + i).

So a retransmitted packet is rebuilt bit for bit, and a C, SIMD or CUDA kernel can reproduce the stream
without state. Two generators (docs/protocol.md, "Random stream"):

- `philox`: Philox-4x32-10 (Salmon et al., SC'11, as Random123), the worker codecs' stream (NC, stochastic
  fixed point, dithering); csrc/ina_philox.h is its C/CUDA twin. Fixed point and dithering read a 32-bit
  word per element; NC a byte per element (`philox_bytes`, one draw per 16 elements) and, where that byte
  leaves the rounding undecided, the element's word of sub-stream 1 (hostlib/codecs/natural.py).
- `bits64`: SplitMix64 (Steele et al.) of key(seed) + counter * golden gamma, for the switch's own NC
  re-compression (`bits64_pairs`: a word per two elements), the network impairments, Bloom hashes and seed
  derivation.
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


def bits64_pairs(seed: int, offset: int, n: int) -> np.ndarray:
    """n uniform uint64 for elements offset .. offset+n-1 of a paired stream (the switch's NC rounding): two
    elements a word, element 2j gets word j with its halves swapped and 2j + 1 word j, so a rounding that reads
    at most the top 32 bits reads a half of its own, and a SIMD lane gets 8 elements' halves from 4 words."""
    first = offset >> 1
    words = bits64(seed, first, ((offset + n + 1) >> 1) - first)
    c = np.arange(offset, offset + n, dtype=np.uint64)
    w = words[(c >> np.uint64(1)) - np.uint64(first)]
    return np.where(c & np.uint64(1), w, (w << np.uint64(32)) | (w >> np.uint64(32)))


def derive_seed(*parts: int) -> int:
    """One 64-bit seed from several integers (job, rank, call number...)."""
    s = 0x243F6A8885A308D3
    for p in parts:
        s = key(s ^ (int(p) & MASK64))
    return s


PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)
MASK32 = np.uint64(0xFFFFFFFF)
# sub-streams: main uniform, second uniform, NC's floor raising (CUDA), a float64 NC uniform's last bits
SUB_MAIN, SUB_EXTRA, SUB_RAISE, SUB_LOW = 0, 1, 2, 3


def philox4x32_10(ctr, key) -> np.ndarray:
    """Random123's philox4x32_R(10, ctr, key) on arrays: ctr is 4 arrays (or ints) of 32-bit words, key 2
    ints; returns a (4, n) uint64 array of 32-bit words. The 32x32->64 products fit uint64 exactly."""
    x = [np.atleast_1d(np.asarray(c, dtype=np.uint64)) & MASK32 for c in ctr]
    x = np.broadcast_arrays(*x)
    x0, x1, x2, x3 = (a.copy() for a in x)
    k0, k1 = (int(k) & 0xFFFFFFFF for k in key)
    m0, m1 = np.uint64(PHILOX_M[0]), np.uint64(PHILOX_M[1])
    for _ in range(10):
        p0 = x0 * m0
        p1 = x2 * m1
        x0, x1, x2, x3 = ((p1 >> np.uint64(32)) ^ x1 ^ np.uint64(k0), p1 & MASK32,
                          (p0 >> np.uint64(32)) ^ x3 ^ np.uint64(k1), p0 & MASK32)
        k0 = (k0 + PHILOX_W[0]) & 0xFFFFFFFF
        k1 = (k1 + PHILOX_W[1]) & 0xFFFFFFFF
    return np.stack([x0, x1, x2, x3])


def philox_at(seed: int, positions, substream: int = SUB_MAIN) -> np.ndarray:
    """The uint32 words of absolute stream positions (any order) of one sub-stream: position i is word
    i & 3 of the draw with counter (i >> 2, i >> 34, substream, 0) and key (seed low, seed high)."""
    pos = np.asarray(positions, dtype=np.uint64)
    q = pos >> np.uint64(2)
    seed = int(seed) & MASK64
    out = philox4x32_10((q, q >> np.uint64(32), substream, 0), (seed, seed >> 32))
    return np.take_along_axis(out, (pos & np.uint64(3)).astype(np.int64)[None], 0)[0].astype(np.uint32)


def philox(seed: int, offset: int, n: int, substream: int = SUB_MAIN) -> np.ndarray:
    """n uint32 words of the worker codecs' stream for positions offset .. offset+n-1 (one draw per 4)."""
    if n <= 0:
        return np.zeros(0, dtype=np.uint32)
    q0, q1 = offset >> 2, (offset + n - 1) >> 2
    q = np.arange(q0, q1 + 1, dtype=np.uint64)
    seed = int(seed) & MASK64
    words = philox4x32_10((q, q >> np.uint64(32), substream, 0), (seed, seed >> 32))
    return words.T.reshape(-1)[offset & 3:(offset & 3) + n].astype(np.uint32)


def philox_bytes(seed: int, offset: int, n: int, substream: int = SUB_MAIN) -> np.ndarray:
    """n uint8 of the stream read a byte per position: position i is byte i & 3 (little-endian, bits
    8 (i & 3) ..) of the word at position i >> 2, so one 128-bit draw feeds 16 positions (NC's first 8 random
    bits per element; csrc/ina_ncmath.h `ina_nc_byte`)."""
    if n <= 0:
        return np.zeros(0, dtype=np.uint8)
    w0, w1 = offset >> 2, (offset + n - 1) >> 2
    words = philox(seed, w0, w1 - w0 + 1, substream).astype("<u4")
    return words.view(np.uint8)[offset & 3:(offset & 3) + n].copy()
