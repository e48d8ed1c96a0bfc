"""Double exponential fit of the sorted values (DeepReduce, Sec. 5): y = a e^(b x) + c e^(d x) over x in
[0, 1], fitted per sign side by damped Gauss-Newton (Levenberg-Marquardt) from a two-slope start.
Sends 4 float32 per side."""
from __future__ import annotations

import numpy as np

from ..bits import CodecError
from .base import ValueCodec


def model(p, x):
    a, b, c, d = p
    return a * np.exp(b * x) + c * np.exp(d * x)


def fit(y: np.ndarray, iterations: int = 50) -> np.ndarray:
    x = np.linspace(0.0, 1.0, y.size)
    y = y.astype(np.float64)
    if y.size < 4 or np.ptp(y) == 0:
        return np.array([y.mean() if y.size else 0.0, 0.0, 0.0, 0.0])
    head = max(2, y.size // 20)
    p = np.array([y[0] - y[-1], -np.log(max(abs(y[0] / y[head]), 1.0 + 1e-6)) / x[head], y[-1], 0.0])
    lam = 1e-3
    best = ((model(p, x) - y) ** 2).sum()
    for _ in range(iterations):
        eb, ed = np.exp(p[1] * x), np.exp(p[3] * x)
        J = np.stack([eb, p[0] * x * eb, ed, p[2] * x * ed], axis=1)
        r = y - model(p, x)
        A = J.T @ J
        step = np.linalg.lstsq(A + lam * np.diag(np.diag(A) + 1e-12), J.T @ r, rcond=None)[0]
        trial = p + step
        with np.errstate(over="ignore", invalid="ignore"):
            err = ((model(trial, x) - y) ** 2).sum() if np.all(np.abs(trial[[1, 3]]) < 700) else np.inf
        if np.isfinite(err) and err < best:
            p, best, lam = trial, err, lam / 3
        else:
            lam *= 4
    return p


class DExpCodec(ValueCodec):
    name = "dexp"
    lossless = False
    sorted_input = True

    def encode(self, values):
        v = np.asarray(values, dtype=np.float32)
        if not np.all(np.isfinite(v)):
            raise ValueError("dexp: values contain NaN or Inf")
        pos, neg = v[v >= 0], v[v < 0][::-1]
        out = np.array([pos.size, neg.size], dtype="<u4").tobytes()
        return out + fit(pos).astype("<f4").tobytes() + fit(neg).astype("<f4").tobytes()

    def decode(self, data, n):
        if len(data) != 8 + 32:
            raise CodecError("dexp: wrong length")
        npos, nneg = (int(c) for c in np.frombuffer(data, dtype="<u4", count=2))
        if npos + nneg != n:
            raise CodecError("dexp: counts do not match")
        p = np.frombuffer(data, dtype="<f4", count=8, offset=8).astype(np.float64)
        with np.errstate(over="ignore", invalid="ignore"):
            pos = model(p[:4], np.linspace(0.0, 1.0, npos)) if npos else np.zeros(0)
            neg = model(p[4:], np.linspace(0.0, 1.0, nneg)) if nneg else np.zeros(0)
        if not (np.all(np.isfinite(pos)) and np.all(np.isfinite(neg))):
            raise CodecError("dexp: parameters give non-finite values")
        return np.concatenate([np.maximum(pos, 0), np.minimum(neg[::-1], 0)]).astype(np.float32)
