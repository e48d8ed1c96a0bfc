"""SparCML sparse allreduce (Renggli et al., SC'19) among the ranks of a torch.distributed process group,
on point-to-point send/recv (gloo).

A rank's data is a stream: sorted (index, value) pairs, or a dense vector once the pairs would cost as
much (nnz * (c + 4) bytes >= N * 4 bytes, c the index width below). Algorithms:
  ssar_recursive_double  log2 P rounds of pairwise exchange and merge (small data); non-powers of two
                         fold the extra ranks in first and send them the result last
  ssar_split_allgather   split the index space in P ranges: each rank gathers and sums one range
                         (reduce-scatter of streams, P - 1 direct sends), then every range goes to every
                         rank (allgather: recursive doubling, log2 P messages, Bruck's for other P)
  dsar_split_allgather   the same reduce-scatter, but the summed ranges are dense (the result usually
                         is) and the allgather is dense, optionally QSGD-quantized (qsgd_levels)
`allreduce(..., algorithm="auto")` picks recursive doubling below 64 KiB of pairs per rank and
ssar_split_allgather above, as SparCML's cost model does for sparse results.

Wire: a message is one int64 length and one byte buffer holding stream records (4 int64: kind, size,
lo, n; then the body). A sparse index takes c = ceil(log2(size) / 8) bytes (the paper's c: the fewest
whole bytes that hold size - 1, little-endian), so no index wraps whatever the size.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from .. import rng

ALGORITHMS = ("ssar_recursive_double", "ssar_split_allgather", "dsar_split_allgather")
VALUE_BYTES = 4
SPARSE, DENSE, QUANTIZED = 0, 1, 2
_HEAD = 4 * 8  # a record's header: kind, size, lo, n as int64
_FRESH = itertools.count()  # calls without a seed: a new QSGD stream each


def index_width(size: int) -> int:
    """Bytes per index (SparCML's c >= ceil(log2 N / 8)): 1 up to N = 256, 2 up to 65,536, 4 up to 2^32."""
    return max(1, -(-(int(size) - 1).bit_length() // 8))


def pack_indices(idx: np.ndarray, size: int) -> bytes:
    c = index_width(size)
    if idx.size and (idx.min() < 0 or idx.max() >= size):
        raise ValueError(f"sparcml: index outside [0, {size})")
    return np.ascontiguousarray(idx.astype("<u8").view(np.uint8).reshape(-1, 8)[:, :c]).tobytes()


def unpack_indices(buf, size: int, n: int) -> np.ndarray:
    c = index_width(size)
    raw = np.zeros((n, 8), np.uint8)
    raw[:, :c] = np.frombuffer(buf, np.uint8, n * c).reshape(n, c)
    return raw.view("<u8").reshape(n).astype(np.int64)


@dataclass
class Stream:
    """A slice [lo, lo + size) of the vector: sparse (indices relative to lo, values) or dense; `coded`
    keeps a quantized slice's bytes, so a rank forwards exactly what its owner sent."""

    size: int
    indices: np.ndarray | None = None
    values: np.ndarray | None = None
    dense: np.ndarray | None = None
    lo: int = 0
    coded: bytes | None = None

    @property
    def nbytes(self) -> int:
        if self.coded is not None:
            return len(self.coded)
        if self.dense is not None:
            return self.size * VALUE_BYTES
        return self.indices.size * (index_width(self.size) + VALUE_BYTES)

    def to_dense(self) -> np.ndarray:
        if self.dense is not None:
            return self.dense
        out = np.zeros(self.size, np.float32)
        out[self.indices] = self.values
        return out

    def densify_if_worth(self) -> "Stream":
        if self.dense is None and self.nbytes >= self.size * VALUE_BYTES:
            return Stream(self.size, dense=self.to_dense(), lo=self.lo)
        return self

    def slice(self, lo: int, hi: int) -> "Stream":
        if self.dense is not None:
            return Stream(hi - lo, dense=self.dense[lo:hi].copy(), lo=lo)
        a, b = np.searchsorted(self.indices, [lo, hi])
        return Stream(hi - lo, self.indices[a:b] - lo, self.values[a:b], lo=lo)


def merge(a: Stream, b: Stream) -> Stream:
    """a + b (same slice), sparse while that is smaller."""
    if a.dense is not None or b.dense is not None:
        out = a.to_dense().copy()
        out += b.to_dense()
        return Stream(a.size, dense=out, lo=a.lo)
    idx = np.concatenate([a.indices, b.indices])
    uniq, inv = np.unique(idx, return_inverse=True)
    vals = np.zeros(uniq.size, np.float64)
    np.add.at(vals, inv, np.concatenate([a.values, b.values]).astype(np.float64))
    return Stream(a.size, uniq.astype(np.int64), vals.astype(np.float32), lo=a.lo).densify_if_worth()


def quantize(qsgd, s: Stream) -> Stream:
    """The owner's slice as every rank will see it: the owner keeps the decoded values too, not its exact
    sum, so all ranks end bit-identical. The random stream is (codec seed, global position lo + i)."""
    coded = qsgd.encode(s.to_dense(), offset=s.lo)
    return Stream(s.size, dense=qsgd.decode(coded, s.size), lo=s.lo, coded=coded)


def encode_record(s: Stream) -> bytes:
    if s.coded is not None:
        kind, n, body = QUANTIZED, len(s.coded), s.coded
    elif s.dense is not None:
        kind, n, body = DENSE, s.size, s.dense.astype("<f4").tobytes()
    else:
        kind, n = SPARSE, s.indices.size
        body = pack_indices(s.indices, s.size) + s.values.astype("<f4").tobytes()
    return np.array([kind, s.size, s.lo, n], "<i8").tobytes() + body


def decode_records(buf: bytes, qsgd=None) -> list[Stream]:
    """The streams of one message; a malformed one raises ValueError rather than yield wrong data."""
    out, pos = [], 0
    while pos < len(buf):
        if pos + _HEAD > len(buf):
            raise ValueError("sparcml: truncated record header")
        kind, size, lo, n = (int(v) for v in np.frombuffer(buf, "<i8", 4, pos))
        pos += _HEAD
        body_len = {SPARSE: n * (index_width(size) + VALUE_BYTES), DENSE: size * VALUE_BYTES, QUANTIZED: n}.get(kind)
        if body_len is None or n < 0 or size < 0 or pos + body_len > len(buf):
            raise ValueError(f"sparcml: malformed record (kind {kind}, size {size}, n {n})")
        body, pos = buf[pos:pos + body_len], pos + body_len
        if kind == SPARSE:
            c = index_width(size)
            val = np.frombuffer(body, "<f4", n, n * c).astype(np.float32)
            out.append(Stream(size, unpack_indices(body, size, n), val, lo=lo))
        elif kind == DENSE:
            out.append(Stream(size, dense=np.frombuffer(body, "<f4").astype(np.float32), lo=lo))
        elif qsgd is None:
            raise ValueError("sparcml: quantized record but no QSGD codec on this rank")
        else:
            out.append(Stream(size, dense=qsgd.decode(bytes(body), size), lo=lo, coded=bytes(body)))
    return out


@dataclass
class Comm:
    """Point-to-point messages of streams over a torch.distributed group, counting messages and payload
    bytes (indices and values, not the 32-byte record headers) sent."""

    group: object = None
    bytes_sent: int = 0
    messages: int = 0
    qsgd: object = None
    _torch: object = field(default=None, repr=False)

    def __post_init__(self):
        import torch
        import torch.distributed as dist

        self._torch, self.dist = torch, dist
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)

    def _global(self, r):
        return self.dist.get_global_rank(self.group, r) if self.group is not None else r

    def send(self, streams: list[Stream], peer: int):
        t = self._torch
        payload = b"".join(encode_record(s) for s in streams)
        reqs = [self.dist.isend(t.tensor([len(payload)], dtype=t.int64), self._global(peer), group=self.group)]
        if payload:
            data = t.from_numpy(np.frombuffer(payload, np.uint8).copy())
            reqs.append(self.dist.isend(data, self._global(peer), group=self.group))
        self.messages += 1
        self.bytes_sent += sum(s.nbytes for s in streams)
        return reqs

    def recv(self, peer: int) -> list[Stream]:
        t = self._torch
        head = t.zeros(1, dtype=t.int64)
        self.dist.recv(head, self._global(peer), group=self.group)
        buf = t.zeros(int(head[0]), dtype=t.uint8)
        if buf.numel():
            self.dist.recv(buf, self._global(peer), group=self.group)
        return decode_records(buf.numpy().tobytes(), self.qsgd)

    def exchange(self, streams: list[Stream], to: int, frm: int | None = None) -> list[Stream]:
        reqs = self.send(streams, to)
        got = self.recv(to if frm is None else frm)
        for r in reqs:
            r.wait()
        return got


def _one(streams: list[Stream]) -> Stream:
    if len(streams) != 1:
        raise ValueError(f"sparcml: expected one stream in the message, got {len(streams)}")
    return streams[0]


def recursive_double(comm: Comm, s: Stream) -> Stream:
    P, r = comm.world, comm.rank
    p2 = 1 << (P.bit_length() - 1)
    extra = P - p2
    if r >= p2:  # fold in: hand the data to rank r - p2, get the result at the end
        for q in comm.send([s], r - p2):
            q.wait()
        return _one(comm.recv(r - p2))
    if r < extra:
        s = merge(s, _one(comm.recv(r + p2)))
    d = 1
    while d < p2:
        s = merge(s, _one(comm.exchange([s], r ^ d)))
        d <<= 1
    if r < extra:
        for q in comm.send([s], r + p2):
            q.wait()
    return s


def reduce_scatter(comm: Comm, s: Stream, bounds: list[int]) -> Stream:
    """Rank r sums range r from everyone's direct sends (the paper's split phase, (P - 1) alpha)."""
    P, r = comm.world, comm.rank
    mine, reqs = s.slice(bounds[r], bounds[r + 1]), []
    for step in range(1, P):
        to, frm = (r + step) % P, (r - step) % P
        reqs += comm.send([s.slice(bounds[to], bounds[to + 1])], to)
        mine = merge(mine, _one(comm.recv(frm)))
    for q in reqs:
        q.wait()
    return mine


def _allgather_round(P: int, r: int, d: int):
    """(to, from, ranges sent, ranges received) of the round at distance d."""
    if P & (P - 1) == 0:  # recursive doubling: swap the aligned group of d ranges with partner r ^ d
        peer = r ^ d
        return peer, peer, range(r - r % d, r - r % d + d), range(peer - peer % d, peer - peer % d + d)
    cnt = min(d, P - d)  # Bruck: rank r holds ranges r .. r + d - 1 (mod P), passes them to r - d
    frm = (r + d) % P
    return (r - d) % P, frm, [(r + i) % P for i in range(cnt)], [(frm + i) % P for i in range(cnt)]


def allgather(comm: Comm, mine: Stream, bounds: list[int]) -> list[Stream]:
    """Every rank's range to every rank in ceil(log2 P) messages per rank (the paper's L1(P) latency):
    recursive doubling for powers of two, Bruck's dissemination otherwise."""
    P, r = comm.world, comm.rank
    parts, d = {r: mine}, 1
    while d < P:
        to, frm, send_ids, recv_ids = _allgather_round(P, r, d)
        got = comm.exchange([parts[j] for j in send_ids], to, frm)
        if [(g.lo, g.size) for g in got] != [(bounds[j], bounds[j + 1] - bounds[j]) for j in recv_ids]:
            raise ValueError(f"sparcml: allgather round {d} got ranges {[(g.lo, g.size) for g in got]}")
        parts.update(zip(recv_ids, got))
        d <<= 1
    return [parts[j] for j in range(P)]


def split_allgather(comm: Comm, s: Stream, dense_result: bool) -> Stream:
    P, r, N = comm.world, comm.rank, s.size
    bounds = [N * j // P for j in range(P + 1)]
    mine = reduce_scatter(comm, s, bounds)
    if dense_result:
        mine = Stream(mine.size, dense=mine.to_dense(), lo=mine.lo)
        if comm.qsgd is not None:  # SparCML quantizes only this dense stage
            mine = quantize(comm.qsgd, mine)
    parts = allgather(comm, mine, bounds)
    if dense_result or any(p.dense is not None for p in parts):
        out = np.zeros(N, np.float32)
        for j, p in enumerate(parts):
            out[bounds[j]:bounds[j + 1]] = p.to_dense()
        return Stream(N, dense=out)
    idx = np.concatenate([p.indices + p.lo for p in parts])
    val = np.concatenate([p.values for p in parts])
    return Stream(N, idx, val).densify_if_worth()


def _qsgd_codec(levels: int, seed: int | None):
    """A seed per call: QSGD is unbiased only over fresh randomness. Only a range's owner draws (the
    others decode its bytes), so ranks need not agree on the seed; pass the training step for runs
    that repeat exactly."""
    from .values.qsgd import QSGDCodec

    return QSGDCodec(levels=levels, seed=rng.derive_seed(0x5EED, next(_FRESH)) if seed is None
                     else rng.derive_seed(int(seed)))


def allreduce(indices, values, size: int, algorithm: str = "auto", group=None, qsgd_levels: int | None = None,
              stats: dict | None = None, seed: int | None = None) -> Stream:
    """Sum the sparse vectors (indices, values) of every rank of `group`; returns a Stream (sparse or dense).
    `seed` picks the QSGD randomness of this call (default: fresh per call)."""
    if algorithm == "auto":
        algorithm = "ssar_recursive_double" if len(indices) * 8 < 64 << 10 else "ssar_split_allgather"
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS} or 'auto'")
    if qsgd_levels is not None and algorithm != "dsar_split_allgather":
        raise ValueError("qsgd_levels applies to the dense stage of dsar_split_allgather")
    idx = np.asarray(indices, dtype=np.int64)
    val = np.asarray(values, dtype=np.float32)
    if idx.shape != val.shape or idx.ndim != 1:
        raise ValueError(f"indices and values must be 1-D of one length, got {idx.shape} and {val.shape}")
    order = np.argsort(idx, kind="stable")
    idx, val = idx[order], val[order]
    if idx.size and (idx[0] < 0 or idx[-1] >= size or np.any(np.diff(idx) == 0)):
        raise ValueError(f"indices must be unique and in [0, {size})")
    qsgd = _qsgd_codec(qsgd_levels, seed) if qsgd_levels is not None else None
    comm = Comm(group, qsgd=qsgd)
    s = Stream(size, idx, val).densify_if_worth()
    if comm.world == 1:
        out = s  # nothing travels, nothing to quantize
    elif algorithm == "ssar_recursive_double":
        out = recursive_double(comm, s)
    else:
        out = split_allgather(comm, s, dense_result=algorithm == "dsar_split_allgather")
    if stats is not None:
        stats["bytes_sent"] = stats.get("bytes_sent", 0) + comm.bytes_sent
        stats["messages"] = stats.get("messages", 0) + comm.messages
    return out
