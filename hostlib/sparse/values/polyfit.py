"""Piecewise polynomial fit of the sorted values (DeepReduce, Sec. 5). Positive and negative values are
fitted apart, each sorted by magnitude; a side is split at the point farthest (squared) from the chord
between its ends, then the worst segment again, up to `segments` pieces of at least degree + 1 points;
each piece is a least-squares polynomial of `degree` in x scaled to [0, 1]. Sends the split points and
float32 coefficients only; the container sends the reordering map."""
from __future__ import annotations

import numpy as np

from ..bits import CodecError
from .base import ValueCodec


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

    def __init__(self, degree: int = 5, segments: int = 4):
        if not 0 <= degree <= 12 or not 1 <= segments <= 64:
            raise ValueError("polyfit: degree must be in 0..12 and segments in 1..64")
        self.degree, self.segments = int(degree), int(segments)

    def params(self):
        return {"degree": self.degree, "segments": self.segments}

    def _fit_side(self, y: np.ndarray) -> bytes:
        """y sorted by decreasing magnitude; returns count, then (end, coefficients) per segment."""
        out = [np.array([y.size, 0], dtype="<u4").tobytes()]
        if y.size == 0:
            return b"".join(out)
        bounds = split_points(y, self.segments, self.degree + 1)
        out[0] = np.array([y.size, len(bounds) - 1], dtype="<u4").tobytes()
        for a, b in zip(bounds[:-1], bounds[1:]):
            x = np.linspace(0.0, 1.0, b - a)
            deg = min(self.degree, b - a - 1)
            coef = np.zeros(self.degree + 1)
            coef[self.degree - deg:] = np.polyfit(x, y[a:b].astype(np.float64), deg) if b - a > 1 else [y[a]]
            out.append(np.array([b], dtype="<u4").tobytes() + coef.astype("<f4").tobytes())
        return b"".join(out)

    def encode(self, values):
        v = np.asarray(values, dtype=np.float32)
        if not np.all(np.isfinite(v)):
            raise ValueError("polyfit: values contain NaN or Inf")
        if np.any(np.diff(v) > 0):
            raise ValueError("polyfit: values must come sorted in descending order")
        pos, neg = v[v >= 0], v[v < 0][::-1]  # both by decreasing magnitude
        return self._fit_side(pos) + self._fit_side(neg)

    def _read_side(self, data: bytes, off: int, limit: int):
        if len(data) < off + 8:
            raise CodecError("polyfit: truncated")
        n, nseg = np.frombuffer(data, dtype="<u4", count=2, offset=off)
        if n > limit or nseg > self.segments:
            raise CodecError("polyfit: more values or segments than the container holds")
        off += 8
        y = np.zeros(int(n), dtype=np.float64)
        a, rec = 0, 4 + 4 * (self.degree + 1)
        for _ in range(int(nseg)):
            if len(data) < off + rec:
                raise CodecError("polyfit: truncated segment")
            b = int(np.frombuffer(data, dtype="<u4", count=1, offset=off)[0])
            coef = np.frombuffer(data, dtype="<f4", count=self.degree + 1, offset=off + 4).astype(np.float64)
            if not a < b <= n:
                raise CodecError("polyfit: bad segment bounds")
            with np.errstate(over="ignore", invalid="ignore"):
                y[a:b] = np.polyval(coef, np.linspace(0.0, 1.0, b - a))
            a, off = b, off + rec
        if a != n or not np.all(np.isfinite(y)):
            raise CodecError("polyfit: segments do not cover the values, or give non-finite ones")
        return y, off

    def decode(self, data, n):
        pos, off = self._read_side(data, 0, n)
        neg, off = self._read_side(data, off, n - pos.size)
        if off != len(data) or pos.size + neg.size != n:
            raise CodecError("polyfit: wrong length")
        return np.concatenate([np.maximum(pos, 0), np.minimum(neg[::-1], 0)]).astype(np.float32)
