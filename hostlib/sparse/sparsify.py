"""Sparsifiers with error feedback: what is not sent is kept (per key) and added to the next gradient,
so nothing is lost over time, only delayed (Stich et al.; the residual accumulation of SBC and DGC)."""
from __future__ import annotations

import math

import numpy as np

from ..feedback import ErrorFeedback


METHODS = ("topk", "randomk", "threshold", "blocktopk", "buckettopk")


def bucket_topk(x, k: int, bucket: int = 512) -> np.ndarray:
    """SparCML's selection (Algorithm 1's TopK, k = 2..16 of each 512 in its experiments): the k largest
    |x| of every bucket of `bucket` consecutive elements, so each region of the model sends its share.
    Ties go to the lower index; a short last bucket keeps min(k, its length). Sorted int64 indices."""
    a = np.abs(np.asarray(x, dtype=np.float64).reshape(-1))
    if k < 0 or bucket < 1:
        raise ValueError(f"bucket_topk: need k >= 0 and bucket >= 1, got k={k}, bucket={bucket}")
    if not np.all(np.isfinite(a)):
        raise ValueError("bucket_topk: input contains NaN or Inf")
    n, k = a.size, min(int(k), bucket)
    if n == 0 or k == 0:
        return np.zeros(0, np.int64)
    nb = -(-n // bucket)
    pad = np.full(nb * bucket, -1.0)  # below every |x|: padding is picked only after a bucket's real ones
    pad[:n] = a
    top = np.argsort(-pad.reshape(nb, bucket), axis=1, kind="stable")[:, :k]
    idx = (top + bucket * np.arange(nb)[:, None]).reshape(-1)
    return np.sort(idx[idx < n]).astype(np.int64)


class Sparsifier:
    """method: 'topk' (largest |x|), 'randomk' (uniform, seeded), 'threshold' (|x| >= threshold),
    'blocktopk' (the blocks of `block` elements with the largest L2 norm: the sparsity block-sparse INA
    carries) or 'buckettopk' (SparCML's: the ceil(ratio * bucket) largest |x| of every `bucket` elements);
    ratio: the fraction of elements (of blocks for blocktopk) kept. Call with a tensor (and a key per
    tensor) to get (indices, values) of the flattened tensor."""

    def __init__(self, method: str = "topk", ratio: float = 0.01, threshold: float | None = None,
                 error_feedback: bool = True, seed: int = 0, block: int = 256, bucket: int = 512):
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}")
        if block < 1 or bucket < 1:
            raise ValueError("block and bucket must be >= 1")
        self.block, self.bucket = block, bucket
        if method == "threshold" and (threshold is None or threshold < 0):
            raise ValueError("threshold sparsification needs threshold >= 0")
        if method != "threshold" and not 0 < ratio <= 1:
            raise ValueError("ratio must be in (0, 1]")
        self.method, self.ratio, self.threshold = method, ratio, threshold
        self.error_feedback = error_feedback
        self.rs = np.random.default_rng(seed)
        self.memory = ErrorFeedback(error_feedback)

    @property
    def residuals(self) -> dict:
        return self.memory.residuals

    def count(self, n: int) -> int:
        return min(n, max(1, math.ceil(self.ratio * n))) if n else 0

    def __call__(self, x, key=0) -> tuple[np.ndarray, np.ndarray]:
        flat = np.asarray(x, dtype=np.float32).reshape(-1)
        if not np.all(np.isfinite(flat)):
            raise ValueError("sparsify: input contains NaN or Inf")
        acc = self.memory.compensate(flat, key)
        if self.method == "topk":
            k = self.count(acc.size)
            idx = np.sort(np.argpartition(np.abs(acc), acc.size - k)[acc.size - k:]) if k else np.zeros(0, np.int64)
        elif self.method == "blocktopk":
            idx = self._top_blocks(acc)
        elif self.method == "buckettopk":
            idx = bucket_topk(acc, self.count(self.bucket), self.bucket)
        elif self.method == "randomk":
            idx = np.sort(self.rs.choice(acc.size, size=self.count(acc.size), replace=False))
        else:
            idx = np.flatnonzero(np.abs(acc) >= self.threshold)
        values = acc[idx].copy()
        acc[idx] = 0
        self.memory.update(key, acc)
        return idx.astype(np.int64), values

    def _top_blocks(self, acc: np.ndarray) -> np.ndarray:
        b = self.block
        nb = -(-acc.size // b)
        padded = np.zeros(nb * b, np.float64)
        padded[:acc.size] = acc
        norms = np.einsum("ij,ij->i", padded.reshape(nb, b), padded.reshape(nb, b))
        kb = self.count(nb)
        top = np.sort(np.argpartition(norms, nb - kb)[nb - kb:]) if kb else np.zeros(0, np.int64)
        idx = (top[:, None] * b + np.arange(b)).reshape(-1)
        return idx[idx < acc.size]
