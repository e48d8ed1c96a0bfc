"""PyTorch DDP communication hook: each gradient bucket is averaged through the INA switch.

    from hostlib.integrations.torch import INAHookState, ina_hook
    ddp.register_comm_hook(INAHookState(switch="127.0.0.1:48864", codec="fixed"), ina_hook)

Rank, world size and the job come from the initialised process group (torchrun, init_process_group);
the switch address from `switch`, $INA_SWITCH, or $MASTER_ADDR:$INA_SWITCH_PORT. The hook returns a
torch Future at once; a worker thread per state runs the buckets in DDP's order (the same on every
rank, which is what the switch's packet stream needs), so backward keeps computing meanwhile; the C
protocol loop releases the GIL. CUDA buckets with codec 'nc' (without error feedback) are encoded and
decoded on their GPU (hostlib.cuda: only the 8-bit codes cross to the host) where the CUDA kernels are
built; other CUDA buckets are copied through host memory.
"""
# no `from __future__ import annotations`: DDP checks that the bucket annotation is dist.GradBucket itself

from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from .common import DenseReducer, GradientReducer


class INAHookState:
    """State of `ina_hook`: a GradientReducer (the switch connection, made on the first bucket; codec;
    error feedback) and the process group. Pickles without its connection, thread and process group (as
    PowerSGD's state does): after unpickling it uses the default group and reconnects on first use.

    Args:
        switch: "HOST:PORT" (default $INA_SWITCH, or $MASTER_ADDR:$INA_SWITCH_PORT).
        codec: 'fixed', 'nc', 'int32', or 'topk' (the sparse path with ratio=, index=, value= DeepReduce
            codecs, exchanged by allgather).
        job: the switch job (default $INA_JOB or 1).
        error_feedback: as in GradientReducer.
        process_group: the group whose rank and size join the switch (default: the world).
        **connect_kwargs: block_topk, and any `hostlib.connect` option (window, elements_per_packet,
            timeout, rounding, ...).
    """

    def __init__(self, switch=None, codec: str = "fixed", job: int | None = None, error_feedback=None,
                 process_group=None, **connect_kwargs):
        self.reducer = GradientReducer(switch, codec, job, error_feedback, **connect_kwargs)
        self.process_group = process_group
        self._start()

    def _start(self):
        self.reducer.allgather = self._allgather_bytes
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ina-hook")

    def __getstate__(self):
        return {"reducer": self.reducer}

    def __setstate__(self, state):
        self.reducer, self.process_group = state["reducer"], None
        self._start()

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has sent (GradientReducer.bytes_sent), to compare codecs by traffic."""
        return self.reducer.bytes_sent

    def connect(self, rank: int, world_size: int):
        """GradientReducer.connect: join on first use.

        Args:
            rank, world_size: this rank in the process group.

        Returns:
            The Communicator, or None for the allgather path.
        """
        return self.reducer.connect(rank, world_size)

    def rank_and_size(self):
        """Read from the process group at each bucket, not at construction, so the state can be made (or
        unpickled) before init_process_group.

        Returns:
            (rank, world size) in process_group (default: the world).

        Raises:
            RuntimeError: torch.distributed is not initialised.
        """
        if not dist.is_initialized():
            raise RuntimeError("ina_hook needs an initialised torch.distributed process group")
        pg = self.process_group or dist.group.WORLD
        return dist.get_rank(pg), dist.get_world_size(pg)

    def _allgather_bytes(self, blob: bytes) -> list[bytes]:
        out = [None] * dist.get_world_size(self.process_group)
        dist.all_gather_object(out, blob, group=self.process_group)
        return out

    def close(self):
        """Finish the buckets in flight, then leave the job so its ranks are free at once."""
        self._executor.shutdown(wait=True)
        self.reducer.close()


def _gpu_codes(state: INAHookState, buffer: torch.Tensor) -> bool:
    """Whether the bucket takes the GPU path: dense NC without error feedback (whose residuals live in host
    memory) on a CUDA buffer, with the CUDA kernels available (hostlib.cuda.allreduce_applies)."""
    strategy, comm = state.reducer.strategy, state.reducer.comm
    if not buffer.is_cuda or not isinstance(strategy, DenseReducer) or strategy.codec != "nc":
        return False
    from ..cuda import allreduce_applies

    return not strategy.memory.enabled and allreduce_applies(comm.codec, buffer)


def _average_on_gpu(comm, buffer: torch.Tensor) -> torch.Tensor:
    """DenseReducer.average's NC mean on the GPU, rounded as the host path: the sum in float32, divided by the
    world size in float32, rounded into the buffer's dtype. The divisor is a device tensor, since torch
    multiplies by the reciprocal of a Python-number divisor (another rounding)."""
    total = comm.allreduce(buffer.detach().float())
    total.div_(torch.full((), comm.world_size, dtype=torch.float32, device=total.device))
    buffer.copy_(total.view_as(buffer))
    return buffer


def _average_bucket(state: INAHookState, buffer: torch.Tensor, key) -> torch.Tensor:
    """The mean over ranks of the bucket, written into the bucket's buffer in place (as allreduce_hook)."""
    state.connect(*state.rank_and_size())
    if _gpu_codes(state, buffer):
        return _average_on_gpu(state.reducer.comm, buffer)
    host = buffer.detach().to("cpu", copy=True)
    as_float = host.float() if host.dtype in (torch.float16, torch.bfloat16) else host
    mean = state.reducer.average(as_float.numpy().reshape(-1), key)
    buffer.copy_(torch.from_numpy(mean).view_as(buffer))
    return buffer


def ina_hook(state: INAHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average `bucket.buffer()` over the ranks through the switch (like allreduce_hook).

    Args:
        state: the INAHookState given to register_comm_hook.
        bucket: DDP's gradient bucket; its buffer is overwritten with the mean.

    Returns:
        A Future, at once, of the bucket's buffer; it holds the exception (TimeoutError, INAError, ...)
        when the reduction fails, which DDP raises in backward().
    """
    from .futures import ErrorFuture

    buffer = bucket.buffer()
    key = bucket.index()
    fut = ErrorFuture()  # an error as a C++ error: DDP raises the exception itself, not "Unable to cast"

    def done(f):
        try:
            result = f.result()
        except Exception as e:  # noqa: BLE001 - handed to DDP, which raises it in backward()
            fut.set_exception(e)
            return
        fut.set_result(result)

    state._executor.submit(_average_bucket, state, buffer, key).add_done_callback(done)
    return fut.future
