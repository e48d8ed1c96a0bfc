"""Double exponential fit of the sorted values (DeepReduce, Sec. 5): y = a e^(b x) + c e^(d x) over x in
[0, 1], fitted per sign side by damped Gauss-Newton (Levenberg-Marquardt) from a two-slope start.
Layout: metadata (the number of positive values at ceil(log2(n + 1)) bits, zero-padded to a byte), then
4 float32 (the paper's 32 bits) per non-empty side."""
from __future__ import annotations

import numpy as np

from ..bits import CodecError, pack_fixed, unpack_fixed, width_for
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
    with np.errstate(over="ignore"):  # a huge y[0] over a tiny y[head] is inf: clamped to 1e12 below
        ratio = abs(y[0]) / max(abs(y[head]), np.finfo(np.float64).tiny)  # a zero at y[head] must not give inf
    p = np.array([y[0] - y[-1], -np.log(min(max(ratio, 1.0 + 1e-6), 1e12)) / x[head], y[-1], 0.0])
    lam = 1e-3
    best = ((model(p, x) - y) ** 2).sum()
    for _ in range(iterations):
        eb, ed = np.exp(p[1] * x), np.exp(p[3] * x)
        J = np.stack([eb, p[0] * x * eb, ed, p[2] * x * ed], axis=1)
        r = y - model(p, x)
        A = J.T @ J
        try:
            step = np.linalg.lstsq(A + lam * np.diag(np.diag(A) + 1e-12), J.T @ r, rcond=None)[0]
        except np.linalg.LinAlgError:  # a degenerate Jacobian: keep the best fit so far
            break
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
        coef = [fit(side).astype("<f4").tobytes() for side in (pos, neg) if side.size]
        return pack_fixed([pos.size], width_for(v.size + 1)) + b"".join(coef)

    def metadata_length(self, data, n):
        return -(-width_for(n + 1) // 8)

    def decode(self, data, n):
        meta = self.metadata_length(data, n)
        npos = int(unpack_fixed(data, width_for(n + 1), 1)[0])
        nneg = n - npos
        if npos > n or len(data) != meta + 16 * ((npos > 0) + (nneg > 0)):
            raise CodecError(f"dexp: {len(data)} bytes for {npos} positive of {n} values")
        p = np.frombuffer(data, dtype="<f4", offset=meta).astype(np.float64)
        with np.errstate(over="ignore", invalid="ignore"):
            pos = model(p[:4], np.linspace(0.0, 1.0, npos)) if npos else np.zeros(0)
            neg = model(p[-4:], np.linspace(0.0, 1.0, nneg)) if nneg else np.zeros(0)
        if not (np.all(np.isfinite(pos)) and np.all(np.isfinite(neg))):
            raise CodecError("dexp: parameters give non-finite values")
        return np.concatenate([np.maximum(pos, 0), np.minimum(neg[::-1], 0)]).astype(np.float32)
