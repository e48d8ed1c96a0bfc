"""SparCML sparse allreduce (Renggli et al., SC'19) among the ranks of a torch.distributed process group,
on point-to-point send/recv (gloo).

A rank's data is a stream: sorted (index, value) pairs, or a dense vector once the pairs would cost as
much (nnz * (4 + 4) bytes >= N * 4 bytes). Algorithms:
  ssar_recursive_double  log2 P rounds of pairwise exchange and merge (small data); non-powers of two
                         fold the extra ranks in first and send them the result last
  ssar_split_allgather   split the index space in P ranges: each rank gathers and sums one range
                         (reduce-scatter of streams), then every range goes to every rank (allgather)
  dsar_split_allgather   the same reduce-scatter, but the summed ranges are dense (the result usually
                         is) and the allgather is dense, optionally QSGD-quantized (qsgd_levels)
`allreduce(..., algorithm="auto")` picks recursive doubling below 64 KiB of pairs per rank and
ssar_split_allgather above, as SparCML's cost model does for sparse results.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

ALGORITHMS = ("ssar_recursive_double", "ssar_split_allgather", "dsar_split_allgather")
INDEX_BYTES, VALUE_BYTES = 4, 4


@dataclass
class Stream:
    """A slice [lo, lo + size) of the vector: sparse (indices relative to lo, values) or dense."""

    size: int
    indices: np.ndarray | None = None
    values: np.ndarray | None = None
    dense: np.ndarray | None = None
    lo: int = 0

    @property
    def nbytes(self) -> int:
        return self.size * VALUE_BYTES if self.dense is not None else self.indices.size * (INDEX_BYTES + VALUE_BYTES)

    def to_dense(self) -> np.ndarray:
        if self.dense is not None:
            return self.dense
        out = np.zeros(self.size, np.float32)
        out[self.indices] = self.values
        return out

    def densify_if_worth(self) -> "Stream":
        if self.dense is None and self.indices.size * (INDEX_BYTES + VALUE_BYTES) >= self.size * VALUE_BYTES:
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


@dataclass
class Comm:
    """Point-to-point exchange of streams over a torch.distributed group, counting bytes sent."""

    group: object = None
    bytes_sent: int = 0
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

    def _pack(self, s: Stream):
        t = self._torch
        if s.dense is not None:
            head = t.tensor([1, s.size, s.lo, s.size], dtype=t.int64)
            if self.qsgd is not None:  # DSAR: the dense stage travels QSGD-quantized
                data = np.frombuffer(self.qsgd.encode(s.dense), dtype=np.uint8)
                head = t.tensor([2, s.size, s.lo, data.size], dtype=t.int64)
                return head, [t.from_numpy(data.copy())]
            return head, [t.from_numpy(s.dense.astype(np.float32))]
        head = t.tensor([0, s.size, s.lo, s.indices.size], dtype=t.int64)
        return head, [t.from_numpy(s.indices.astype(np.int32)), t.from_numpy(s.values.astype(np.float32))]

    def send(self, s: Stream, peer: int):
        head, parts = self._pack(s)
        reqs = [self.dist.isend(head, self._global(peer), group=self.group)]
        reqs += [self.dist.isend(p, self._global(peer), group=self.group) for p in parts if p.numel()]
        self.bytes_sent += s.nbytes if head[0] != 2 else int(head[3])
        return reqs

    def recv(self, peer: int) -> Stream:
        t = self._torch
        head = t.zeros(4, dtype=t.int64)
        self.dist.recv(head, self._global(peer), group=self.group)
        kind, size, lo, n = (int(v) for v in head)
        if kind == 1:
            buf = t.zeros(size, dtype=t.float32)
            self.dist.recv(buf, self._global(peer), group=self.group)
            return Stream(size, dense=buf.numpy(), lo=lo)
        if kind == 2:
            buf = t.zeros(n, dtype=t.uint8)
            if n:
                self.dist.recv(buf, self._global(peer), group=self.group)
            return Stream(size, dense=self.qsgd.decode(buf.numpy().tobytes(), size), lo=lo)
        idx, val = t.zeros(n, dtype=t.int32), t.zeros(n, dtype=t.float32)
        if n:
            self.dist.recv(idx, self._global(peer), group=self.group)
            self.dist.recv(val, self._global(peer), group=self.group)
        return Stream(size, idx.numpy().astype(np.int64), val.numpy(), lo=lo)

    def exchange(self, s: Stream, peer: int) -> Stream:
        reqs = self.send(s, peer)
        got = self.recv(peer)
        for r in reqs:
            r.wait()
        return got


def recursive_double(comm: Comm, s: Stream) -> Stream:
    P, r = comm.world, comm.rank
    p2 = 1 << (P.bit_length() - 1)
    extra = P - p2
    if r >= p2:  # fold in: hand the data to rank r - p2, get the result at the end
        for q in comm.send(s, r - p2):
            q.wait()
        return comm.recv(r - p2)
    if r < extra:
        s = merge(s, comm.recv(r + p2))
    d = 1
    while d < p2:
        s = merge(s, comm.exchange(s, r ^ d))
        d <<= 1
    if r < extra:
        for q in comm.send(s, r + p2):
            q.wait()
    return s


def split_allgather(comm: Comm, s: Stream, dense_result: bool) -> Stream:
    P, r, N = comm.world, comm.rank, s.size
    bounds = [N * j // P for j in range(P + 1)]
    mine = s.slice(bounds[r], bounds[r + 1])
    reqs = []
    for step in range(1, P):  # reduce-scatter: rank r gathers range r from everyone
        to, frm = (r + step) % P, (r - step) % P
        reqs += comm.send(s.slice(bounds[to], bounds[to + 1]), to)
        mine = merge(mine, comm.recv(frm))
    for q in reqs:
        q.wait()
    if dense_result:
        mine = Stream(mine.size, dense=mine.to_dense(), lo=mine.lo)
    parts = {r: mine}
    reqs = []
    for step in range(1, P):  # allgather of the summed ranges
        to, frm = (r + step) % P, (r - step) % P
        reqs += comm.send(mine, to)
        parts[frm] = comm.recv(frm)
    for q in reqs:
        q.wait()
    if dense_result or any(p.dense is not None for p in parts.values()):
        out = np.zeros(N, np.float32)
        for j, p in parts.items():
            out[bounds[j]:bounds[j + 1]] = p.to_dense()
        return Stream(N, dense=out)
    idx = np.concatenate([parts[j].indices + bounds[j] for j in range(P)])
    val = np.concatenate([parts[j].values for j in range(P)])
    return Stream(N, idx, val).densify_if_worth()


def allreduce(indices, values, size: int, algorithm: str = "auto", group=None, qsgd_levels: int | None = None,
              stats: dict | None = None) -> Stream:
    """Sum the sparse vectors (indices, values) of every rank of `group`; returns a Stream (sparse or dense)."""
    if algorithm == "auto":
        algorithm = "ssar_recursive_double" if len(indices) * 8 < 64 << 10 else "ssar_split_allgather"
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS} or 'auto'")
    if qsgd_levels is not None and algorithm != "dsar_split_allgather":
        raise ValueError("qsgd_levels applies to the dense stage of dsar_split_allgather")
    idx = np.asarray(indices, dtype=np.int64)
    val = np.asarray(values, dtype=np.float32)
    order = np.argsort(idx, kind="stable")
    idx, val = idx[order], val[order]
    if idx.size and (idx[0] < 0 or idx[-1] >= size or np.any(np.diff(idx) == 0)):
        raise ValueError(f"indices must be unique and in [0, {size})")
    qsgd = None
    if qsgd_levels is not None:
        from .values.qsgd import QSGDCodec

        qsgd = QSGDCodec(levels=qsgd_levels)
    comm = Comm(group, qsgd=qsgd)
    s = Stream(size, idx, val).densify_if_worth()
    if comm.world == 1:
        out = s
    elif algorithm == "ssar_recursive_double":
        out = recursive_double(comm, s)
    else:
        out = split_allgather(comm, s, dense_result=algorithm == "dsar_split_allgather")
    if stats is not None:
        stats["bytes_sent"] = stats.get("bytes_sent", 0) + comm.bytes_sent
    return out
