"""Run-length coding of the index bitmap: alternating run lengths (zeros first, possibly 0) as varints."""
from __future__ import annotations

import numpy as np

from ..bits import CodecError, varint_decode, varint_encode
from .base import IndexCodec


class RLECodec(IndexCodec):
    name = "rle"

    def encode(self, indices, size):
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size == 0:
            return varint_encode([size]), idx
        brk = np.flatnonzero(np.diff(idx) != 1) + 1
        starts = idx[np.concatenate(([0], brk))]
        ends = idx[np.concatenate((brk - 1, [idx.size - 1]))] + 1
        zero_runs = starts - np.concatenate(([0], ends[:-1]))
        runs = np.empty(2 * starts.size + 1, dtype=np.int64)
        runs[0:-1:2], runs[1:-1:2], runs[-1] = zero_runs, ends - starts, size - ends[-1]
        return varint_encode(runs), idx

    def decode(self, data, size, count):
        runs = varint_decode(data).astype(np.int64)
        if runs.size % 2 == 0 or runs.sum() != size or runs[1::2].sum() != count:
            raise CodecError(f"rle: runs do not cover {size} elements with {count} set")
        bounds = np.cumsum(runs)
        starts, ends = bounds[0:-1:2], bounds[1::2]
        lens = ends - starts
        return np.repeat(starts - np.concatenate(([0], np.cumsum(lens)[:-1])), lens) + np.arange(int(lens.sum()))
