"""What the DDP hook and the Horovod optimizer share: one switch connection per process, made on first
use (a join barrier every rank reaches in the same call), gradient averaging, and error feedback for
codecs whose rounding is biased."""
from __future__ import annotations

import os
import threading

import numpy as np

from .. import wire
from ..codecs import natural
from ..worker import Communicator


def switch_address(switch=None) -> str:
    """switch, else $INA_SWITCH, else $MASTER_ADDR:$INA_SWITCH_PORT (default port 48864): a launcher such
    as torchrun or horovodrun sets MASTER_ADDR, the user sets where the switch listens."""
    if switch:
        return str(switch)
    if os.environ.get("INA_SWITCH"):
        return os.environ["INA_SWITCH"]
    if os.environ.get("MASTER_ADDR"):
        return f"{os.environ['MASTER_ADDR']}:{os.environ.get('INA_SWITCH_PORT', wire.DEFAULT_PORT)}"
    raise ValueError("no switch address: pass switch='HOST:PORT' or set INA_SWITCH (or MASTER_ADDR and "
                     "INA_SWITCH_PORT)")


class GradientReducer:
    """Averages gradient tensors over the job's ranks through the switch.

    codec 'fixed' and 'nc' carry any float gradient; 'int32' carries gradients that are integers (it
    raises otherwise) and is exact. error_feedback (default: on for deterministic NC rounding, the one
    biased codec here) adds each tensor's local rounding error, kept per key, to its next gradient.

    codec 'topk' is the sparse path: top-`ratio` sparsification with error feedback, each rank's sparse
    gradient in a DeepReduce container (`index`, `value` codec names, `index_params`, `value_params`),
    exchanged with the framework's allgather (`self.allgather`, set by the integration) instead of the
    switch, whose dense aggregation cannot sum index sets.

    block_topk=RATIO (with 'fixed' or 'nc') sends through the switch's block-sparse INA instead: each
    tensor keeps the RATIO of its blocks (elements_per_packet elements each) with the largest norm, the
    rest goes to the residual (error feedback), and only those blocks travel."""

    def __init__(self, switch=None, codec: str = "fixed", job: int | None = None, error_feedback: bool | None = None,
                 block_topk: float | None = None, **connect_kwargs):
        if codec not in ("fixed", "nc", "int32", "topk"):
            raise ValueError(f"codec must be 'fixed', 'nc', 'int32' or 'topk', got {codec!r}")
        if block_topk is not None and (codec not in ("fixed", "nc") or not 0 < block_topk <= 1):
            raise ValueError("block_topk is a fraction in (0, 1] of blocks, for codec 'fixed' or 'nc'")
        self.block_topk = block_topk
        self.block_sparsifier = None
        self.block_error_feedback = error_feedback is not False
        self.switch = switch
        self.codec = codec
        self.job = int(os.environ.get("INA_JOB", 1)) if job is None else job
        self.sparse = None
        if codec == "topk":
            from .. import sparse

            self.sparsifier = sparse.Sparsifier("topk", connect_kwargs.pop("ratio", 0.01),
                                                error_feedback=error_feedback is not False)
            self.sparse = sparse.DeepReduce(connect_kwargs.pop("index", "delta"), connect_kwargs.pop("value", "none"),
                                            connect_kwargs.pop("index_params", None),
                                            connect_kwargs.pop("value_params", None))
            if connect_kwargs:
                raise ValueError(f"codec 'topk' takes ratio, index, value, index_params, value_params; "
                                 f"not {sorted(connect_kwargs)}")
        self.connect_kwargs = connect_kwargs
        deterministic = connect_kwargs.get("rounding") == "deterministic"
        self.error_feedback = (codec == "nc" and deterministic) if error_feedback is None else error_feedback
        self.residuals: dict = {}
        self.comm: Communicator | None = None
        self.allgather = None  # bytes -> list of every rank's bytes (the sparse path)
        self.sparse_bytes_sent = 0
        self.world_size = None
        self._lock = threading.Lock()

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has sent: wire bytes through the switch, or its DeepReduce containers."""
        if self.sparse is not None:
            return self.sparse_bytes_sent
        return self.comm.stats.wire_bytes_sent if self.comm is not None else 0

    def connect(self, rank: int, world_size: int) -> Communicator | None:
        with self._lock:
            self.world_size = world_size
            if self.sparse is None and self.comm is None:
                self.comm = Communicator(switch_address(self.switch), rank, world_size, job=self.job,
                                         codec=self.codec, **self.connect_kwargs)
            return self.comm

    def average(self, flat: np.ndarray, key) -> np.ndarray:
        """The mean over ranks of flat (a 1-D float array of this rank's gradient)."""
        if self.sparse is not None:
            return self._average_sparse(flat, key)
        comm = self.comm
        if self.block_topk is not None:
            return self._average_block_sparse(flat, key)
        if self.codec == "int32":
            ints = np.rint(flat)
            if not np.array_equal(ints, flat) or np.abs(ints).max(initial=0) > np.iinfo(np.int32).max:
                raise ValueError("codec 'int32' needs integer gradients that fit int32; use 'fixed' or 'nc'")
            return (comm.allreduce(ints.astype(np.int32)).astype(np.float64) / comm.world_size).astype(flat.dtype)
        x = flat.astype(np.float32, copy=False)
        if self.error_feedback:
            r = self.residuals.get(key)
            if r is not None and r.shape == x.shape:
                x = x + r
            self.residuals[key] = x - self._local_rounding(x)
        total = comm.allreduce(x)
        return (total / np.float32(comm.world_size)).astype(flat.dtype, copy=False)

    def _average_block_sparse(self, flat: np.ndarray, key) -> np.ndarray:
        from ..sparse import Sparsifier

        comm = self.comm
        if self.block_sparsifier is None:
            self.block_sparsifier = Sparsifier("blocktopk", self.block_topk, block=comm.k,
                                               error_feedback=self.block_error_feedback)
        idx, val = self.block_sparsifier(flat, key)
        x = np.zeros(flat.size, np.float32)
        x[idx] = val
        total = comm.allreduce(x, sparse=True)
        return (total / np.float32(comm.world_size)).astype(flat.dtype, copy=False)

    def _average_sparse(self, flat: np.ndarray, key) -> np.ndarray:
        from ..sparse import DeepReduce

        idx, val = self.sparsifier(flat, key)
        blob = self.sparse.encode(idx, val, flat.size)
        self.sparse_bytes_sent += len(blob)
        total = np.zeros(flat.size, np.float64)
        for data in self.allgather(blob):
            i, v, size = DeepReduce.decode(data)
            if size != flat.size:
                raise ValueError(f"a rank sent a gradient of {size} elements, this one has {flat.size}")
            np.add.at(total, i, v)
        return (total / self.world_size).astype(flat.dtype)

    def _local_rounding(self, x: np.ndarray) -> np.ndarray:
        """What this rank's own packets carry of x, as far as it is known before the allreduce (NC's
        rounding without the block floor, which only touches values 2^-55 below the block's max)."""
        if self.codec == "nc":
            det = self.connect_kwargs.get("rounding") == "deterministic"
            return natural.decode(natural.encode(x, deterministic=det))
        return x  # fixed point: the rounding error is below 2^-31 of the block's max

    def close(self):
        if self.comm is not None:
            self.comm.close()
            self.comm = None
