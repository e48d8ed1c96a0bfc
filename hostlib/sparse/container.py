"""The DeepReduce container: a sparse tensor (indices, values, size) as one self-describing byte string.

Layout (big-endian): b"DR", version, index codec id, value codec id, flags (bit 0: values reordered),
params length (u16) + params as JSON ({"index": {...}, "value": {...}}), size (u64), number of values
(u64), index part length (u64) + index part, value part length (u64) + value part, and when reordered the
map from sorted to original value position, ceil(log2 n) bits per entry (DeepReduce Sec. 5.1). decode()
needs nothing else; parts() counts a container's bits the way the paper's Fig. 1 does."""
from __future__ import annotations

import json
import struct

import numpy as np

from .bits import CodecError, pack_fixed, unpack_fixed, width_for
from .index import INDEX_CODECS
from .values import VALUE_CODECS

MAGIC, VERSION = b"DR", 2  # 2: bitmap index; polyfit and dexp send their layout packed
# append-only: ids are on the wire
INDEX_IDS = {"bloom-naive": 1, "bloom-p0": 2, "bloom-p1": 3, "bloom-p2": 4, "rle": 5, "huffman": 6, "golomb": 7,
             "delta": 8, "bitmap": 9}
VALUE_IDS = {"none": 1, "deflate": 2, "nc": 3, "qsgd": 4, "polyfit": 5, "dexp": 6}
HEAD = struct.Struct(">2sBBBBH")
MAX_SIZE = 1 << 31  # elements of a decoded tensor: a header cannot make the decoder allocate more
FLAG_REORDERED = 1


def index_codec(name: str, **params):
    try:
        return INDEX_CODECS[name](**params)
    except KeyError:
        raise ValueError(f"unknown index codec {name!r}; choose one of {sorted(INDEX_CODECS)}") from None


def value_codec(name: str, **params):
    try:
        return VALUE_CODECS[name](**params)
    except KeyError:
        raise ValueError(f"unknown value codec {name!r}; choose one of {sorted(VALUE_CODECS)}") from None


class DeepReduce:
    """index: an index codec name or object; value: a value codec name or object."""

    def __init__(self, index="delta", value="none", index_params=None, value_params=None):
        self.index = index_codec(index, **(index_params or {})) if isinstance(index, str) else index
        self.value = value_codec(value, **(value_params or {})) if isinstance(value, str) else value

    @property
    def lossless(self) -> bool:
        return self.index.lossless and self.value.lossless

    def encode(self, indices, values, size: int, dense=None) -> bytes:
        """dense (optional): the tensor the sparse one came from; values a Bloom filter's false positives
        carry are taken from it (as GRACE does), else they are 0."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        val = np.asarray(values, dtype=np.float32).reshape(-1)
        if idx.size != val.size:
            raise ValueError(f"{idx.size} indices but {val.size} values")
        if not 0 <= size <= MAX_SIZE or (idx.size and (idx.min() < 0 or idx.max() >= size)):
            raise ValueError(f"indices must lie in [0, {size})")
        order = np.argsort(idx, kind="stable")
        idx, val = idx[order], val[order]
        if np.any(np.diff(idx) == 0):
            raise ValueError("indices must be unique")
        if not np.all(np.isfinite(val)):
            raise ValueError("values contain NaN or Inf")
        index_data, positions = self.index.encode(idx, size)
        send = self._values_at(idx, val, np.asarray(positions, dtype=np.int64), dense)
        flags, perm = 0, b""
        if self.value.sorted_input and send.size:
            order = np.argsort(-send, kind="stable")
            send, flags = send[order], FLAG_REORDERED
            perm = pack_fixed(order, width_for(order.size))
        value_data = self.value.encode(send)
        params = json.dumps({"index": self.index.params(), "value": self.value.params()},
                            separators=(",", ":")).encode()
        return b"".join([HEAD.pack(MAGIC, VERSION, INDEX_IDS[self.index.name], VALUE_IDS[self.value.name], flags,
                                   len(params)), params, struct.pack(">QQQ", size, send.size, len(index_data)),
                         index_data, struct.pack(">Q", len(value_data)), value_data, perm])

    @staticmethod
    def _values_at(idx, val, positions, dense):
        at = np.searchsorted(idx, positions)
        hit = (at < idx.size) & (idx[np.minimum(at, max(idx.size - 1, 0))] == positions) if idx.size else \
            np.zeros(positions.size, bool)
        out = np.zeros(positions.size, dtype=np.float32)
        out[hit] = val[at[hit]]
        if dense is not None and not hit.all():
            out[~hit] = np.asarray(dense, dtype=np.float32).reshape(-1)[positions[~hit]]
        return out

    @staticmethod
    def _parse(data: bytes):
        """The container's fields: (index codec, value codec, flags, size, n, index part, value part,
        offset of the reordering map); CodecError for a malformed or truncated header or part."""
        try:
            magic, version, iid, vid, flags, plen = HEAD.unpack_from(data)
        except struct.error:
            raise CodecError("DeepReduce: truncated header") from None
        if magic != MAGIC or version != VERSION:
            raise CodecError(f"DeepReduce: not a version {VERSION} container (magic {magic!r}, version {version})")
        names_i = {v: k for k, v in INDEX_IDS.items()}
        names_v = {v: k for k, v in VALUE_IDS.items()}
        if iid not in names_i or vid not in names_v or flags & ~FLAG_REORDERED:
            raise CodecError(f"DeepReduce: unknown codec id ({iid}, {vid}) or flags {flags}")
        off = HEAD.size
        try:
            params = json.loads(data[off:off + plen])
            index = index_codec(names_i[iid], **params["index"])
            value = value_codec(names_v[vid], **params["value"])
        except (ValueError, KeyError, TypeError) as e:
            raise CodecError(f"DeepReduce: bad codec parameters ({e})") from None
        off += plen
        try:
            size, n, ilen = struct.unpack_from(">QQQ", data, off)
            index_data = data[off + 24:off + 24 + ilen]
            (vlen,) = struct.unpack_from(">Q", data, off + 24 + ilen)
        except struct.error:
            raise CodecError("DeepReduce: truncated") from None
        off += 24 + ilen + 8
        value_data = data[off:off + vlen]
        if len(index_data) != ilen or len(value_data) != vlen:
            raise CodecError("DeepReduce: truncated part")
        if size > MAX_SIZE or n > size:
            raise CodecError(f"DeepReduce: {n} values of a tensor of {size} (at most {MAX_SIZE} elements)")
        return index, value, flags, size, n, index_data, value_data, off + vlen

    @staticmethod
    def decode(data) -> tuple[np.ndarray, np.ndarray, int]:
        """(indices, values, size) from a container; CodecError for anything malformed or truncated."""
        data = bytes(data)
        index, value, flags, size, n, index_data, value_data, off = DeepReduce._parse(data)
        positions = index.decode(index_data, size, n)
        if positions.size != n:
            raise CodecError(f"DeepReduce: {positions.size} positions for {n} values")
        values = value.decode(value_data, n)
        if flags & FLAG_REORDERED:
            width = width_for(n)
            if len(data) - off != -(-width * n // 8):
                raise CodecError("DeepReduce: wrong reordering map length")
            order = unpack_fixed(data[off:], width, n).astype(np.int64)
            if n and (order.max() >= n or np.unique(order).size != n):
                raise CodecError("DeepReduce: reordering map is not a permutation")
            restored = np.empty(n, dtype=np.float32)
            restored[order] = values
            values = restored
        elif off != len(data):
            raise CodecError("DeepReduce: trailing bytes")
        return positions.astype(np.int64), values, int(size)

    @staticmethod
    def parts(data) -> dict[str, int]:
        """Bits of a container by part, as DeepReduce's Fig. 1 counts them: "index" (the index codec's
        output), "values" (the value codec's output less its metadata, e.g. polyfit's coefficients),
        "reordering" (the map, ceil(log2 n) bits per value, padded to a byte), and apart from those
        "value metadata" (e.g. polyfit's segment layout) and "framing" (header, codec parameters as JSON,
        size, count and part lengths). Each is whole bytes x 8; they sum to 8 * len(data)."""
        data = bytes(data)
        index, value, flags, size, n, index_data, value_data, off = DeepReduce._parse(data)
        meta = value.metadata_length(value_data, n)
        bits = {"index": 8 * len(index_data), "values": 8 * (len(value_data) - meta), "value metadata": 8 * meta,
                "reordering": 8 * (len(data) - off)}
        bits["framing"] = 8 * len(data) - sum(bits.values())
        return bits
