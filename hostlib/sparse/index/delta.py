"""Delta + varint: gaps between sorted indices as LEB128 (1 byte per gap below 128)."""
from __future__ import annotations

from ..bits import varint_decode, varint_encode
from .base import IndexCodec, from_gaps, gaps


class DeltaCodec(IndexCodec):
    name = "delta"

    def encode(self, indices, size):
        return varint_encode(gaps(indices)), indices

    def decode(self, data, size, count):
        return from_gaps(varint_decode(data, count), size)
