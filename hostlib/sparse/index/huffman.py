"""Huffman coding of the delta-varint byte stream of the indices (canonical code, lengths <= 20 bits;
the 256 code lengths travel with the data)."""
from __future__ import annotations

import heapq

import numpy as np

from ..bits import CodecError, varint_decode, varint_encode, windows
from .base import IndexCodec, from_gaps, gaps

MAX_LEN = 20


def code_lengths(freq: np.ndarray) -> np.ndarray:
    freq = freq.astype(np.int64).copy()
    while True:
        lengths = np.zeros(256, dtype=np.int64)
        live = [(int(f), i, [i]) for i, f in enumerate(freq) if f > 0]
        if len(live) == 1:
            lengths[live[0][1]] = 1
            return lengths
        heapq.heapify(live)
        while len(live) > 1:
            f1, t1, s1 = heapq.heappop(live)
            f2, t2, s2 = heapq.heappop(live)
            for s in s1 + s2:
                lengths[s] += 1
            heapq.heappush(live, (f1 + f2, min(t1, t2), s1 + s2))
        if lengths.max() <= MAX_LEN:
            return lengths
        freq = np.where(freq > 0, (freq + 1) // 2, 0)  # flatten the distribution until the codes fit


def canonical(lengths: np.ndarray) -> np.ndarray:
    codes = np.zeros(256, dtype=np.int64)
    code, prev = 0, 0
    for sym in sorted((int(n), s) for s, n in enumerate(lengths) if n > 0):
        code <<= sym[0] - prev
        codes[sym[1]], prev = code, sym[0]
        code += 1
    return codes


class HuffmanCodec(IndexCodec):
    name = "huffman"

    def encode(self, indices, size):
        stream = np.frombuffer(varint_encode(gaps(indices)), dtype=np.uint8)
        if stream.size == 0:
            return bytes(257), indices
        lengths = code_lengths(np.bincount(stream, minlength=256))
        codes = canonical(lengths)
        ln, cd = lengths[stream], codes[stream]
        starts = np.cumsum(ln) - ln
        bits = np.zeros(int(ln.sum()), dtype=np.uint8)
        for j in range(MAX_LEN):
            sel = ln > j
            bits[starts[sel] + j] = (cd[sel] >> (ln[sel] - 1 - j)) & 1
        head = bytes(lengths.astype(np.uint8)) + int(stream.size).to_bytes(8, "big")
        return head + np.packbits(bits).tobytes(), indices

    def decode(self, data, size, count):
        if len(data) < 257:
            raise CodecError("huffman: truncated table")
        lengths = np.frombuffer(data[:256], dtype=np.uint8).astype(np.int64)
        if len(data) == 257 and not lengths.any() and count == 0:
            return np.zeros(0, np.int64)
        if len(data) < 264 or lengths.max() > MAX_LEN or not lengths.any():
            raise CodecError("huffman: bad table")
        n = int.from_bytes(data[256:264], "big")
        if n > 8 * (len(data) - 264) or n > 10 * count or n < count:  # >= 1 bit per byte, 1..10 bytes per gap
            raise CodecError("huffman: symbol count does not fit the data")
        codes = canonical(lengths)
        L = int(lengths.max())
        table_sym = np.full(1 << L, -1, dtype=np.int64)
        table_len = np.zeros(1 << L, dtype=np.int64)
        for s in np.flatnonzero(lengths):
            lo = int(codes[s]) << (L - lengths[s])
            table_sym[lo:lo + (1 << (L - lengths[s]))] = s
            table_len[lo:lo + (1 << (L - lengths[s]))] = lengths[s]
        bits = np.unpackbits(np.frombuffer(data[264:], dtype=np.uint8))
        win = windows(bits, L).tolist()
        tsym, tlen = table_sym.tolist(), table_len.tolist()
        out = bytearray(n)
        pos, total = 0, bits.size
        for i in range(n):
            w = win[pos] if pos <= total else 0
            s, ln = tsym[w], tlen[w]
            if s < 0 or pos + ln > total:
                raise CodecError("huffman: bad or truncated code")
            out[i] = s
            pos += ln
        return from_gaps(varint_decode(bytes(out), count), size)
