"""Bloom-filter index compression (DeepReduce, Sec. 4): the sender inserts the r indices into a filter of
m = ceil(k r / ln 2) bits with k = ceil(log2(1/fpr)) hashes; the receiver queries all d positions and gets
the positives P (true and false). The policy decides which values travel:
  naive  the r true values, assigned to the first r positives (false positives shift values: lossy)
  p0     the values at every positive (a false positive gets its value, 0 for a sparse input): exact
  p1     r positives drawn at random (seeded, so the receiver draws the same)
  p2     r positives drawn from conflict sets, smallest first (Algorithm 1): a singleton set is a sure
         true positive
Hashes: double hashing on SplitMix64 of (seed, index), bit i of x = ((h1 + i h2) mod 2^32) m >> 32, the
same on every process and machine; the C kernels (csrc/ina_kernels.c) compute the same bits."""
from __future__ import annotations

import math

import numpy as np

from ... import kernels, rng
from ..bits import CodecError
from .base import IndexCodec

POLICIES = ("naive", "p0", "p1", "p2")
CHUNK = 1 << 22
_LOW32 = np.uint64(0xFFFFFFFF)


MAX_BITS = 1 << 32


def sizing(r: int, fpr: float) -> tuple[int, int]:
    """(k hashes, m bits) for r items at false-positive rate fpr."""
    k = max(1, math.ceil(math.log2(1 / fpr)))
    m = max(8, math.ceil(k * r / math.log(2)))
    if m >= MAX_BITS:
        raise ValueError(f"bloom: {r} indices at fpr {fpr} need {m} bits, more than 2^32")
    return k, m


def expected_fpr(r: int, k: int, m: int) -> float:
    return (1 - math.exp(-k * r / m)) ** k


def _hash_pair(x: np.ndarray, key: int):
    z = x.astype(np.uint64) * rng.GAMMA + np.uint64(key)
    h = rng._mix(z)
    return h & _LOW32, (h >> np.uint64(32)) | np.uint64(1)


def _bit(h1, h2, i: int, m: int) -> np.ndarray:
    return ((((h1 + np.uint64(i) * h2) & _LOW32) * np.uint64(m)) >> np.uint64(32)).astype(np.int64)


def positions(x: np.ndarray, i: int, key: int, m: int, pair=None) -> np.ndarray:
    h1, h2 = pair if pair is not None else _hash_pair(x, key)
    return _bit(h1, h2, i, m)


def insert(indices: np.ndarray, k: int, m: int, key: int) -> np.ndarray:
    """The filter as packed bits (np.packbits order), m bits."""
    idx = np.ascontiguousarray(indices, dtype=np.int64)
    if kernels.enabled():
        packed = np.zeros(-(-m // 8), dtype=np.uint8)
        kernels.lib.ina_bloom_insert(kernels.ffi.from_buffer("int64_t[]", idx), idx.size, k, m, key,
                                     kernels.ffi.from_buffer("uint8_t[]", packed))
        return packed
    bits = np.zeros(m, dtype=bool)
    pair = _hash_pair(idx.astype(np.uint64), key)
    for i in range(k):
        bits[positions(None, i, key, m, pair)] = True
    return np.packbits(bits)


def query(size: int, packed: np.ndarray, k: int, key: int, m: int, expect: int = 0) -> np.ndarray:
    """Every x in [0, size) the filter answers yes for, sorted."""
    packed = np.ascontiguousarray(packed, dtype=np.uint8)
    if kernels.enabled():
        cap = expect + 1024
        while True:
            out = np.empty(cap, dtype=np.int64)
            n = kernels.lib.ina_bloom_query(size, kernels.ffi.from_buffer("uint8_t[]", packed), k, m, key,
                                            kernels.ffi.from_buffer("int64_t[]", out), cap)
            if n <= cap:
                return out[:n]
            cap = n
    bits = np.unpackbits(packed)[:m].astype(bool)
    out = []
    for lo in range(0, size, CHUNK):
        cand = np.arange(lo, min(size, lo + CHUNK), dtype=np.uint64)
        h1, h2 = _hash_pair(cand, key)
        for i in range(k):  # each hash keeps only the candidates still answering yes
            keep = bits[_bit(h1, h2, i, m)]
            cand, h1, h2 = cand[keep], h1[keep], h2[keep]
        out.append(cand.astype(np.int64))
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def conflict_choice(P: np.ndarray, r: int, k: int, m: int, key: int, rs: np.random.Generator) -> np.ndarray:
    """Algorithm 1 of DeepReduce: group P by filter bit, take sets smallest first; a singleton's item is
    taken as is, a larger set gives one random item not taken yet; repeat until r items."""
    if r >= P.size:
        return P
    pair = _hash_pair(P.astype(np.uint64), key)
    bit = np.concatenate([positions(None, i, key, m, pair) for i in range(k)])
    item = np.tile(np.arange(P.size), k)
    order = np.lexsort((item, bit))
    bit, item = bit[order], item[order]
    first = np.flatnonzero(np.diff(bit, prepend=-1))
    sizes = np.diff(np.append(first, bit.size))
    chosen = np.zeros(P.size, dtype=bool)
    chosen[item[first[sizes == 1]]] = True  # singletons: true positives
    count = int(chosen.sum())
    if count >= r:
        return P[np.sort(np.flatnonzero(chosen))[:r]]
    groups = [item[f:f + s] for f, s in zip(first[sizes > 1][np.argsort(sizes[sizes > 1], kind="stable")],
                                            np.sort(sizes[sizes > 1], kind="stable"))]
    while count < r:
        progress = False
        for g in groups:
            left = g[~chosen[g]]
            if left.size:
                chosen[left[rs.integers(left.size)]] = True
                count += 1
                progress = True
                if count == r:
                    break
        if not progress:
            break
    return P[np.flatnonzero(chosen)]


class BloomCodec(IndexCodec):
    def __init__(self, policy: str = "p0", fpr: float = 0.001, seed: int = 0):
        if policy not in POLICIES:
            raise ValueError(f"bloom policy must be one of {POLICIES}")
        if not 0 < fpr < 1:
            raise ValueError("bloom: fpr must be in (0, 1)")
        self.policy, self.fpr, self.seed = policy, float(fpr), int(seed)
        self.name = f"bloom-{policy}"
        self.lossless = policy == "p0"

    def params(self):
        return {"fpr": self.fpr, "seed": self.seed}

    def _select(self, P, r, k, m, key):
        if self.policy == "p0":
            return P
        if self.policy == "naive":
            return P[:r]
        rs = np.random.default_rng([self.seed, r, m])
        if self.policy == "p1":
            return np.sort(rs.choice(P, size=min(r, P.size), replace=False)) if P.size > r else P
        return conflict_choice(P, r, k, m, key, rs)

    def encode(self, indices, size):
        idx = np.asarray(indices, dtype=np.int64)
        r = idx.size
        k, m = sizing(max(r, 1), self.fpr)
        key = rng.key(self.seed)
        packed = insert(idx, k, m, key)
        head = int(m).to_bytes(8, "big") + bytes([k]) + int(r).to_bytes(8, "big")
        data = head + packed.tobytes()
        if self.policy == "naive":
            return data, idx  # the true values, which the receiver maps onto its first r positives
        return data, self._select(query(size, packed, k, key, m, self._expect(r, k, m, size)), r, k, m, key)

    @staticmethod
    def _expect(r, k, m, size) -> int:
        return int(r + 1.5 * expected_fpr(max(r, 1), k, m) * max(size - r, 0))

    def decode(self, data, size, count):
        if len(data) < 17:
            raise CodecError("bloom: truncated header")
        m, k, r = int.from_bytes(data[:8], "big"), data[8], int.from_bytes(data[9:17], "big")
        if not 8 <= m < MAX_BITS or not 1 <= k <= 64 or r > size or len(data) != 17 + -(-m // 8) or \
                (self.policy != "p0" and r != count):
            raise CodecError("bloom: bad header or truncated filter")
        packed = np.frombuffer(data[17:], dtype=np.uint8)
        key = rng.key(self.seed)
        P = query(size, packed, k, key, m, count if self.policy == "p0" else self._expect(r, k, m, size))
        if self.policy == "p0" and P.size != count:
            raise CodecError(f"bloom: {P.size} positives, the container says {count}")
        return self._select(P, r, k, m, key)
