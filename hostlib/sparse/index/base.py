from __future__ import annotations

import numpy as np

from ..bits import CodecError


class IndexCodec:
    """Compresses the sorted, unique indices of a sparse tensor of `size` elements.

    encode -> (data, positions): `positions` are the indices whose values must be sent, in the order the
    decoder yields them (the indices themselves for lossless codecs; a Bloom filter's choice otherwise).
    decode(data, size, count) -> those positions; count is how many the container says there are, checked
    before anything of that size is allocated. Parameters (`params()`) go into the DeepReduce container."""

    name = "?"
    lossless = True

    def params(self) -> dict:
        return {}

    def encode(self, indices: np.ndarray, size: int) -> tuple[bytes, np.ndarray]:
        raise NotImplementedError

    def decode(self, data: bytes, size: int, count: int) -> np.ndarray:
        raise NotImplementedError


def gaps(indices: np.ndarray) -> np.ndarray:
    """Sorted indices -> gaps >= 1 (the first counts from -1)."""
    idx = np.asarray(indices, dtype=np.int64)
    return np.diff(idx, prepend=-1).astype(np.uint64)


def from_gaps(g: np.ndarray, size: int) -> np.ndarray:
    idx = np.cumsum(g.astype(np.int64)) - 1
    if g.size and (np.any(g == 0) or idx[-1] >= size):
        raise CodecError(f"indices out of range for size {size}")
    return idx
