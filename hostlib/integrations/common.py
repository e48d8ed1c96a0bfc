"""What the DDP hook and the Horovod optimizer share: one switch connection per process, made on first
use (a join barrier every rank reaches in the same call), gradient averaging, and error feedback for
codecs whose rounding is biased."""
from __future__ import annotations

import os
import threading
import zlib

import numpy as np

from .. import rng, wire
from ..codecs import natural
from ..feedback import ErrorFeedback
from ..worker import Communicator


def switch_address(switch=None) -> str:
    """switch, else $INA_SWITCH, else $MASTER_ADDR:$INA_SWITCH_PORT (default port 48864): a launcher such
    as torchrun or horovodrun sets MASTER_ADDR, the user sets where the switch listens.

    Args:
        switch: an explicit "HOST:PORT" (or anything str() makes one of), or None.

    Returns:
        The address as "HOST:PORT".

    Raises:
        ValueError: none given and none in the environment.
    """
    if switch:
        return str(switch)
    if os.environ.get("INA_SWITCH"):
        return os.environ["INA_SWITCH"]
    if os.environ.get("MASTER_ADDR"):
        return f"{os.environ['MASTER_ADDR']}:{os.environ.get('INA_SWITCH_PORT', wire.DEFAULT_PORT)}"
    raise ValueError("no switch address: pass switch='HOST:PORT' or set INA_SWITCH (or MASTER_ADDR and "
                     "INA_SWITCH_PORT)")


class DenseReducer:
    """Dense INA through the switch: 'int32' (exact, integer gradients), 'fixed' or 'nc'; with error
    feedback the local rounding error of each tensor goes into its next gradient."""

    def __init__(self, codec: str, deterministic: bool, error_feedback: bool):
        """Args:
            codec: "int32", "fixed" or "nc".
            deterministic: NC rounds to nearest (then its bias is what error feedback corrects).
            error_feedback: keep each tensor's local rounding error for its next gradient.
        """
        self.codec, self.deterministic = codec, deterministic
        self.memory = ErrorFeedback(error_feedback)

    def average(self, reducer, flat: np.ndarray, key) -> np.ndarray:
        """The strategy's step, called by GradientReducer.average (which holds the connection).

        Args:
            reducer: the GradientReducer, for its Communicator (reducer.comm).
            flat: this rank's gradient, 1-D float.
            key: the tensor's identity across steps (e.g. the DDP bucket index), for error feedback.

        Returns:
            The mean over ranks, flat's dtype.

        Raises:
            ValueError: with int32, a gradient that is not integer or does not fit int32.
        """
        comm = reducer.comm
        if self.codec == "int32":
            ints = np.rint(flat)
            if not np.array_equal(ints, flat) or np.abs(ints).max(initial=0) > np.iinfo(np.int32).max:
                raise ValueError("codec 'int32' needs integer gradients that fit int32; use 'fixed' or 'nc'")
            return (comm.allreduce(ints.astype(np.int32)).astype(np.float64) / comm.world_size).astype(flat.dtype)
        x = flat.astype(np.float32, copy=False)
        if self.memory.enabled:
            x = self.memory.compensate(x, key)
            self.memory.update(key, x - self._local_rounding(x))
        total = comm.allreduce(x)
        return (total / np.float32(comm.world_size)).astype(flat.dtype, copy=False)

    def _local_rounding(self, x: np.ndarray) -> np.ndarray:
        """What this rank's own packets carry of x, as far as it is known before the allreduce (NC's
        rounding without the block floor, which only touches values 2^-55 below the block's max)."""
        if self.codec == "nc":
            return natural.decode(natural.encode(x, deterministic=self.deterministic))
        return x  # fixed point: the rounding error is below 2^-31 of the block's max


class BlockSparseReducer:
    """Block-sparse INA through the switch: each tensor keeps the `ratio` of its blocks (elements_per_packet
    elements each) with the largest norm; the rest stays in the error feedback for later steps."""

    def __init__(self, ratio: float, error_feedback: bool):
        """Args:
            ratio: fraction of each tensor's blocks sent per step, in (0, 1].
            error_feedback: keep the unsent blocks for later steps (without it they are lost).
        """
        self.ratio, self.error_feedback = ratio, error_feedback
        self.sparsifier = None  # made on first use: its block is the connection's packet size

    def average(self, reducer, flat: np.ndarray, key) -> np.ndarray:
        """As DenseReducer.average: the mean over ranks of the blocks each rank selected."""
        from ..sparse import Sparsifier

        comm = reducer.comm
        if self.sparsifier is None:
            self.sparsifier = Sparsifier("blocktopk", self.ratio, block=comm.k, error_feedback=self.error_feedback)
        idx, val = self.sparsifier(flat, key)
        x = np.zeros(flat.size, np.float32)
        x[idx] = val
        total = comm.allreduce(x, sparse=True)
        return (total / np.float32(comm.world_size)).astype(flat.dtype, copy=False)


def stream_seed(base: int, step: int, rank: int, key) -> int:
    """One seed per (step, rank, tensor): a stochastic codec that reused one stream would round every
    step's and every rank's values the same way, so its errors would add up instead of averaging out.
    key may be an int (DDP's bucket index) or a name (Horovod's); names hash with CRC-32, the same in
    every process (Python's hash() of a str is not)."""
    k = key if isinstance(key, (int, np.integer)) else zlib.crc32(repr(key).encode())
    return rng.derive_seed(base, step, rank, int(k)) & (2**63 - 1)


class AllgatherTopkReducer:
    """The sparse path without the switch (whose dense aggregation cannot sum index sets): top-`ratio`
    with error feedback, each rank's sparse gradient in a DeepReduce container, exchanged with the
    framework's allgather (`reducer.allgather`). Codecs that draw random numbers (a `seed` parameter:
    qsgd, nc, bloom) get a fresh seed per (step, rank, tensor) from the one given (default 0), so a
    run is reproducible; steps are counted per tensor key and pickle with the state."""

    uses_switch = False

    def __init__(self, error_feedback: bool, ratio=0.01, index="delta", value="none", index_params=None,
                 value_params=None):
        """Args:
            error_feedback: keep the unsent elements for later steps.
            ratio: fraction of elements each rank sends per step.
            index, value, index_params, value_params: the DeepReduce index and value codecs and their options.
        """
        from .. import sparse

        self.sparsifier = sparse.Sparsifier("topk", ratio, error_feedback=error_feedback)
        self.container = sparse.DeepReduce(index, value, index_params, value_params)  # checks the options
        self.codecs = (index, value, dict(index_params or {}), dict(value_params or {}))
        self.steps: dict = {}  # tensor key -> steps done
        self.bytes_sent = 0

    def container_for(self, step: int, rank: int, key):
        """The DeepReduce of this (step, rank, tensor): each seeded codec's seed derived from its own."""
        from ..sparse import DeepReduce

        index, value, index_params, value_params = self.codecs
        seeded = []
        for codec, params in ((self.container.index, index_params), (self.container.value, value_params)):
            seed = codec.params().get("seed")
            seeded.append(params if seed is None else {**params, "seed": stream_seed(seed, step, rank, key)})
        if seeded == [index_params, value_params]:
            return self.container
        return DeepReduce(index, value, *seeded)

    def average(self, reducer, flat: np.ndarray, key) -> np.ndarray:
        """As DenseReducer.average, through reducer.allgather instead of the switch.

        Raises:
            ValueError: a rank's gradient has another size (the ranks' models differ).
        """
        from ..sparse import DeepReduce

        step = self.steps.get(key, 0)
        self.steps[key] = step + 1
        idx, val = self.sparsifier(flat, key)
        blob = self.container_for(step, getattr(reducer, "rank", 0) or 0, key).encode(idx, val, flat.size)
        self.bytes_sent += len(blob)
        total = np.zeros(flat.size, np.float64)
        for data in reducer.allgather(blob):
            i, v, size = DeepReduce.decode(data)
            if size != flat.size:
                raise ValueError(f"a rank sent a gradient of {size} elements, this one has {flat.size}")
            np.add.at(total, i, v)
        return (total / reducer.world_size).astype(flat.dtype)


TOPK_OPTIONS = ("ratio", "index", "value", "index_params", "value_params")


def make_strategy(codec: str, error_feedback, block_topk, connect_kwargs: dict):
    """The reducer strategy for the options, chosen once so that each step does not re-decide.

    Args:
        codec: "fixed", "nc", "int32" or "topk".
        error_feedback: True, False, or None for the default (on for deterministic NC and the sparse paths).
        block_topk: a fraction of blocks for block-sparse INA (fixed or nc), or None for dense.
        connect_kwargs: hostlib.connect options; the top-k options are taken out of it.

    Returns:
        A DenseReducer, BlockSparseReducer or AllgatherTopkReducer.

    Raises:
        ValueError: an unknown codec, a block_topk out of (0, 1] or with int32/topk, or connection options
            with topk (which does not use the switch).
    """
    if codec not in ("fixed", "nc", "int32", "topk"):
        raise ValueError(f"codec must be 'fixed', 'nc', 'int32' or 'topk', got {codec!r}")
    if block_topk is not None and (codec not in ("fixed", "nc") or not 0 < block_topk <= 1):
        raise ValueError("block_topk is a fraction in (0, 1] of blocks, for codec 'fixed' or 'nc'")
    if codec == "topk":
        opts = {k: connect_kwargs.pop(k) for k in TOPK_OPTIONS if k in connect_kwargs}
        if connect_kwargs:
            raise ValueError(f"codec 'topk' takes {', '.join(TOPK_OPTIONS)}; not {sorted(connect_kwargs)}")
        return AllgatherTopkReducer(error_feedback is not False, **opts)
    if block_topk is not None:
        return BlockSparseReducer(block_topk, error_feedback is not False)
    deterministic = connect_kwargs.get("rounding") == "deterministic"
    # error feedback by default for the one biased rounding here: deterministic NC
    return DenseReducer(codec, deterministic, (codec == "nc" and deterministic) if error_feedback is None
                        else bool(error_feedback))


class GradientReducer:
    """Averages gradient tensors over the job's ranks: one switch connection per process (made by
    connect(), on first use), and a strategy per way of reducing (DenseReducer, BlockSparseReducer,
    AllgatherTopkReducer). Pickles without its connection (it reconnects on first use), like PowerSGD's
    state.

    Args:
        switch: "HOST:PORT" (default $INA_SWITCH, or $MASTER_ADDR:$INA_SWITCH_PORT).
        codec: 'fixed', 'nc', 'int32', or 'topk' (by allgather; with ratio=, index=, value=,
            index_params=, value_params=).
        job: the switch job (default $INA_JOB or 1).
        error_feedback: keep what compression dropped for the next step (default: on for deterministic
            NC and for the sparse paths).
        block_topk: with 'fixed' or 'nc', send each tensor's top fraction of blocks by block-sparse INA.
        **connect_kwargs: any hostlib.connect option (window, elements_per_packet, timeout, rounding...).
    """

    def __init__(self, switch=None, codec: str = "fixed", job: int | None = None, error_feedback: bool | None = None,
                 block_topk: float | None = None, **connect_kwargs):
        self.strategy = make_strategy(codec, error_feedback, block_topk, connect_kwargs)
        self.switch, self.codec, self.block_topk = switch, codec, block_topk
        self.job = int(os.environ.get("INA_JOB", 1)) if job is None else job
        self.connect_kwargs = connect_kwargs
        self.comm: Communicator | None = None
        self.allgather = None  # bytes -> list of every rank's bytes (the allgather path)
        self.rank = self.world_size = None
        self._lock = threading.Lock()

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has sent: wire bytes through the switch, or its DeepReduce containers."""
        if not getattr(self.strategy, "uses_switch", True):
            return self.strategy.bytes_sent
        return self.comm.stats.wire_bytes_sent if self.comm is not None else 0

    def connect(self, rank: int, world_size: int) -> Communicator | None:
        """Join the switch on first use (idempotent, thread-safe), since rank and world size are known only
        once the framework has started; every rank reaches it on its first gradient, so the join barrier
        holds.

        Args:
            rank, world_size: this rank in the framework's process group.

        Returns:
            The Communicator, or None for a strategy that does not use the switch.

        Raises:
            TimeoutError, INAError: as in hostlib.connect.
        """
        with self._lock:
            self.rank, self.world_size = rank, world_size
            if getattr(self.strategy, "uses_switch", True) and self.comm is None:
                self.comm = Communicator(switch_address(self.switch), rank, world_size, job=self.job,
                                         codec=self.codec, **self.connect_kwargs)
            return self.comm

    def average(self, flat: np.ndarray, key) -> np.ndarray:
        """The mean over ranks of flat; every rank must call it with the same tensors in the same order.

        Args:
            flat: this rank's gradient, 1-D float.
            key: the tensor's identity across steps (error feedback keeps residuals by it).

        Returns:
            The mean, flat's dtype.

        Raises:
            TimeoutError, INAError, ValueError: as in Communicator.allreduce (and DenseReducer.average).
        """
        return self.strategy.average(self, flat, key)

    def close(self):
        """Leave the job, so its ranks can join again at once (a later connect() joins anew)."""
        if self.comm is not None:
            self.comm.close()
            self.comm = None

    def __getstate__(self):  # the connection, the lock and the framework's allgather stay behind
        return {k: v for k, v in self.__dict__.items() if k not in ("comm", "_lock", "allgather")}

    def __setstate__(self, state):
        self.__dict__.update(state, comm=None, allgather=None, _lock=threading.Lock())
