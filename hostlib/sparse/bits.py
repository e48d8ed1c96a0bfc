"""Bit-level packing shared by the sparse codecs (vectorised with numpy; decoders check every length)."""
from __future__ import annotations

import numpy as np


class CodecError(ValueError):
    """Malformed or truncated compressed data."""


def varint_encode(v) -> bytes:
    """LEB128: 7 bits per byte, high bit = more bytes follow."""
    v = np.asarray(v, dtype=np.uint64).reshape(-1)
    if v.size == 0:
        return b""
    nbytes = np.ones(v.size, dtype=np.int64)
    for j in range(1, 10):
        nbytes += v >= np.uint64(1) << np.uint64(7 * j)
    starts = np.cumsum(nbytes) - nbytes
    out = np.zeros(int(nbytes.sum()), dtype=np.uint8)
    for j in range(int(nbytes.max())):
        sel = nbytes > j
        byte = ((v[sel] >> np.uint64(7 * j)) & np.uint64(0x7F)).astype(np.uint8)
        byte |= np.where(nbytes[sel] > j + 1, 0x80, 0).astype(np.uint8)
        out[starts[sel] + j] = byte
    return out.tobytes()


def varint_decode(data, count: int | None = None) -> np.ndarray:
    b = np.frombuffer(bytes(data), dtype=np.uint8)
    if b.size == 0:
        if count:
            raise CodecError(f"varint: expected {count} values, got none")
        return np.zeros(0, np.uint64)
    ends = np.flatnonzero((b & 0x80) == 0)
    if ends.size == 0 or ends[-1] != b.size - 1:
        raise CodecError("varint: truncated (last byte says more follow)")
    if count is not None and ends.size != count:
        raise CodecError(f"varint: expected {count} values, got {ends.size}")
    starts = np.concatenate(([0], ends[:-1] + 1))
    lens = ends - starts + 1
    if lens.max() > 10:
        raise CodecError("varint: value longer than 64 bits")
    out = np.zeros(ends.size, dtype=np.uint64)
    for j in range(int(lens.max())):
        sel = lens > j
        out[sel] |= (b[starts[sel] + j] & np.uint8(0x7F)).astype(np.uint64) << np.uint64(7 * j)
    return out


def pack_fixed(values, width: int) -> bytes:
    """Unsigned values of `width` bits each, MSB first, packed back to back."""
    v = np.asarray(values, dtype=np.uint64).reshape(-1)
    if width == 0 or v.size == 0:
        return b""
    shifts = np.arange(width - 1, -1, -1, dtype=np.uint64)
    bits = ((v[:, None] >> shifts) & np.uint64(1)).astype(np.uint8)
    return np.packbits(bits.reshape(-1)).tobytes()


def unpack_fixed(data, width: int, count: int) -> np.ndarray:
    if width == 0 or count == 0:
        return np.zeros(count, np.uint64)
    need = -(-width * count // 8)
    if len(data) < need:
        raise CodecError(f"packed field: {len(data)} bytes, need {need}")
    bits = np.unpackbits(np.frombuffer(bytes(data[:need]), dtype=np.uint8))[: width * count]
    bits = bits.reshape(count, width).astype(np.uint64)
    return (bits << np.arange(width - 1, -1, -1, dtype=np.uint64)).sum(axis=1, dtype=np.uint64)


def width_for(n: int) -> int:
    """Bits to hold values 0..n-1 (ceil(log2 n)), at least 1."""
    return max(1, int(n - 1).bit_length())


def windows(bits: np.ndarray, width: int) -> np.ndarray:
    """For every position p, the integer of bits[p:p+width] (zero-padded past the end)."""
    padded = np.concatenate([bits.astype(np.int64), np.zeros(width, np.int64)])
    out = np.zeros(bits.size + 1, dtype=np.int64)
    for j in range(width):
        out = (out << 1) | padded[j:j + bits.size + 1]
    return out


def next_zero(bits: np.ndarray) -> np.ndarray:
    """For every position p, the first q >= p with bits[q] == 0 (bits.size if none)."""
    zeros = np.flatnonzero(bits == 0)
    return np.append(zeros, bits.size)[np.searchsorted(zeros, np.arange(bits.size + 1))]
