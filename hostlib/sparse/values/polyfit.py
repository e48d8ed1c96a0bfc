"""Piecewise polynomial fit of the sorted values (DeepReduce, Sec. 5). Positive and negative values are
fitted apart, each sorted by magnitude; a side is split at the point farthest (squared) from the chord
between its ends, then the worst segment again, up to `segments` pieces of at least degree + 1 points;
each piece is a least-squares polynomial of `degree` in x scaled to [0, 1].

`segments=None` (the default) takes Lemma 1's heuristic per side: p = ceil(2 sqrt(M)) with
M = |(y[1] - y[2]) - (y[l-1] - y[l])| over the side's l sorted values (the paper states it for the
positive side; the negative side is the same curve by magnitude).

Layout: metadata, then the coefficients. Metadata (what the decoder needs besides the coefficients):
the number of positive values, each side's segment count and its inner segment boundaries, all at
ceil(log2(n + 1)) bits (positions in the sorted order, the width the paper gives the reordering map),
zero-padded to a byte. Coefficients: float32 (the paper's 32 bits), min(degree, length - 1) + 1 per
segment, highest power first. The container sends the reordering map."""
from __future__ import annotations

import math

import numpy as np

from ..bits import CodecError, pack_fixed, unpack_fixed, width_for
from .base import ValueCodec

MAX_SEGMENTS = 64


def lemma1_segments(y: np.ndarray) -> int:
    """DeepReduce Lemma 1's segment count for one side's values sorted by decreasing magnitude, clipped to
    1..MAX_SEGMENTS (M is in the values' own units, so small gradients get one segment)."""
    y = np.asarray(y, dtype=np.float64)
    if y.size < 2:
        return 1
    m = abs((y[0] - y[1]) - (y[-2] - y[-1]))
    return int(min(MAX_SEGMENTS, max(1, math.ceil(2 * math.sqrt(m)))))


def split_points(y: np.ndarray, segments: int, min_len: int) -> list[int]:
    """Segment boundaries [0, ..., len(y)] by the chord heuristic."""
    bounds = [0, y.size]
    while len(bounds) - 1 < segments:
        best, where = 0.0, None
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b - a < 2 * min_len:
                continue
            xs = np.arange(a, b)
            chord = y[a] + (y[b - 1] - y[a]) * (xs - a) / max(b - 1 - a, 1)
            d = (chord - y[a:b]) ** 2
            d[:min_len], d[-min_len:] = -1, -1  # both pieces keep enough points to fit
            i = int(np.argmax(d))
            if d[i] > best:
                best, where = float(d[i]), a + i
        if where is None:
            break
        bounds = sorted(bounds + [where])
    return bounds


class PolyFitCodec(ValueCodec):
    name = "polyfit"
    lossless = False
    sorted_input = True

    def __init__(self, degree: int = 5, segments: int | None = None):
        if not 0 <= degree <= 12 or not (segments is None or 1 <= segments <= MAX_SEGMENTS):
            raise ValueError(f"polyfit: degree must be in 0..12 and segments in 1..{MAX_SEGMENTS} or None "
                             f"(Lemma 1), got degree={degree}, segments={segments}")
        self.degree, self.segments = int(degree), None if segments is None else int(segments)

    def params(self):
        return {"degree": self.degree, "segments": self.segments}

    def _bounds(self, y: np.ndarray) -> list[int]:
        if y.size == 0:
            return [0]
        return split_points(y, self.segments or lemma1_segments(y), self.degree + 1)

    def _coefficients(self, y: np.ndarray, bounds: list[int]) -> bytes:
        out = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            deg = min(self.degree, b - a - 1)
            coef = np.polyfit(np.linspace(0.0, 1.0, b - a), y[a:b].astype(np.float64), deg)
            out.append(coef.astype("<f4").tobytes())
        return b"".join(out)

    def encode(self, values):
        v = np.asarray(values, dtype=np.float32)
        if not np.all(np.isfinite(v)):
            raise ValueError("polyfit: values contain NaN or Inf")
        if np.any(np.diff(v) > 0):
            raise ValueError("polyfit: values must come sorted in descending order")
        pos, neg = v[v >= 0], v[v < 0][::-1]  # both by decreasing magnitude
        bp, bn = self._bounds(pos), self._bounds(neg)
        fields = [pos.size, len(bp) - 1, len(bn) - 1] + bp[1:-1] + bn[1:-1]
        return pack_fixed(fields, width_for(v.size + 1)) + self._coefficients(pos, bp) + \
            self._coefficients(neg, bn)

    def layout(self, data: bytes, n: int) -> tuple[int, list[int], list[int], int]:
        """(positive count, positive side's bounds, negative side's bounds, metadata bytes) of n values."""
        w, cap = width_for(n + 1), self.segments or MAX_SEGMENTS
        npos, sp, sn = (int(f) for f in unpack_fixed(data, w, 3))
        nneg = n - npos
        if npos > n or sp > min(npos, cap) or sn > min(nneg, cap) or (sp == 0) != (npos == 0) or \
                (sn == 0) != (nneg == 0):
            raise CodecError(f"polyfit: bad layout ({npos} positive of {n}, segments {sp} + {sn})")
        inner = max(sp - 1, 0) + max(sn - 1, 0)
        fields = [int(f) for f in unpack_fixed(data, w, 3 + inner)[3:]]
        bp = [0] + fields[:max(sp - 1, 0)] + [npos] if sp else [0]
        bn = [0] + fields[max(sp - 1, 0):] + [nneg] if sn else [0]
        if any(b <= a for side in (bp, bn) for a, b in zip(side[:-1], side[1:])):
            raise CodecError("polyfit: segment boundaries are not increasing")
        return npos, bp, bn, -(-(3 + inner) * w // 8)

    def metadata_length(self, data, n):
        return self.layout(data, n)[3]

    def _evaluate(self, coef: np.ndarray, off: int, bounds: list[int]) -> tuple[np.ndarray, int]:
        y = np.zeros(bounds[-1], dtype=np.float64)
        for a, b in zip(bounds[:-1], bounds[1:]):
            k = min(self.degree, b - a - 1) + 1
            with np.errstate(over="ignore", invalid="ignore"):
                y[a:b] = np.polyval(coef[off:off + k], np.linspace(0.0, 1.0, b - a))
            off += k
        return y, off

    def decode(self, data, n):
        npos, bp, bn, meta = self.layout(data, n)
        ncoef = sum(min(self.degree, b - a - 1) + 1 for side in (bp, bn) for a, b in zip(side[:-1], side[1:]))
        if len(data) != meta + 4 * ncoef:
            raise CodecError(f"polyfit: {len(data)} bytes, the layout needs {meta + 4 * ncoef}")
        coef = np.frombuffer(data, dtype="<f4", offset=meta).astype(np.float64)
        pos, off = self._evaluate(coef, 0, bp)
        neg, _ = self._evaluate(coef, off, bn)
        if not (np.all(np.isfinite(pos)) and np.all(np.isfinite(neg))):
            raise CodecError("polyfit: coefficients give non-finite values")
        return np.concatenate([np.maximum(pos, 0), np.minimum(neg[::-1], 0)]).astype(np.float32)
