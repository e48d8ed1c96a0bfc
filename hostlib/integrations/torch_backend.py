"""A torch.distributed backend, "ina": sums go through the switch, everything else through gloo.

    # INA_SWITCH=127.0.0.1:48864 torchrun --nproc-per-node 2 train.py
    import hostlib, torch.distributed as dist
    dist.init_process_group("ina")

What goes through the switch: all_reduce with SUM or AVG of int32 (codec int32, exact), float32, bfloat16 and
float16 tensors (16-bit as float32; reductions of at most SMALL_ELEMENTS elements, a loss or metrics, in fixed
point with one exponent per element, larger ones by the codec of $INA_CODEC, default fixed),
allreduce_coalesced, and the reduce-scatters (an allreduce of the whole input, then this rank's shard).
Everything else (broadcast, all_gather*, barrier, send/recv, alltoall, MIN/MAX/PRODUCT, float64 and other
dtypes) runs on a gloo backend made from the same store (torch_calls.SMALL_ELEMENTS: 64). A subgroup (new_group) runs entirely on gloo: the
switch job belongs to the world group.

The calls through the switch run in call order on one queue per group (futures.CallQueue: its thread for
DDP's buckets, which overlap backward; the waiting thread itself for a synchronous call), each returning a
Work at once. The commonest call, a synchronous dist.all_reduce of one contiguous float32 or int32 host
tensor, takes the inline path: the same steps with the route and a view of the tensor's memory kept per
address, size and dtype (its lane), so a 1 KiB call's Python is a small part of the call. A call's error
completes the Work's future as a C++ error holding the Python exception (futures.ErrorFuture), so DDP,
FSDP2, functional collectives and wait() raise it by name. A call costs no store operation: while the
switch lives, a call completes or fails on every rank (protocol v3). A sum lands in the caller's tensor
block by block (no copy of it).

Its parts: this module is the c10d adapter (registration, the collectives, Works, what goes to gloo);
torch_calls.py the call path (route, lane, landing, what is kept of a sum); torch_failover.py the failure
protocol (joins voted through the store, the recovery when the switch fails under a call, gloo meanwhile,
re-joins every $INA_RETRY_EVERY calls), specified in docs/protocol.md, "The torch backend's failover". A
CollectiveError (CallMismatch, CallAborted, PeerDead) and input errors are raised on every rank, as gloo
raises its errors.

The backend is registered when hostlib is imported (hostlib/__init__.py; after torch's own import if torch
comes later) or by torch's backend autoload (the "torch.backends" entry point in pyproject.toml).
"""
from __future__ import annotations

import logging
import os
import threading
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from ..worker import Communicator
from . import futures
from .common import switch_address
from .torch_calls import Lane, SwitchCalls, _kind
from .torch_failover import COUNTERS, Failover

BACKEND = "ina"
JOIN_TIMEOUT = 10.0  # seconds the switch's join barrier waits; the store's barrier before it has every rank ready
FLOAT_CODECS = ("fixed", "nc")
SWITCH_DTYPES = (torch.int32, torch.float32, torch.bfloat16, torch.float16)
log = logging.getLogger(__name__)

Op = dist.ReduceOp
_SUM, _AVG = int(Op.SUM), int(Op.AVG)
SUMS = frozenset((Op.SUM, Op.AVG))  # what the switch sums (AVG: a sum, then divided as gloo divides)


def register():
    """Register "ina" with torch.distributed (idempotent): init_process_group("ina") then builds a
    ProcessGroupINA. extended_api: the creator learns whether it makes the world group or a subgroup."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])


def _create(opts, backend_options=None) -> "ProcessGroupINA":
    """The creator init_process_group / new_group call; backend_options (pg_options=) may be a dict of
    ProcessGroupINA's keyword arguments."""
    kwargs = dict(backend_options) if isinstance(backend_options, dict) else {}
    return ProcessGroupINA(opts.store, opts.group_rank, opts.group_size, opts.timeout,
                           use_switch=not opts.global_ranks_in_group, **kwargs)


class ProcessGroupINA(dist.ProcessGroup):
    """The "ina" process group (see the module's docstring). A Python ProcessGroup, as torchft's: c10d's C++
    callers (DDP's reducer, functional collectives) reach these methods through its trampoline; the gloo
    backend registered on it answers whatever is not overridden here. Its parts: `calls` (torch_calls: the
    call path) and `failover` (torch_failover: joins, recovery, gloo while the switch is down)."""

    def __init__(self, store, rank: int, size: int, c10d_timeout: timedelta = timedelta(minutes=30), switch=None,
                 codec: str | None = None, job: int | None = None, retry_every: int | None = None,
                 use_switch: bool = True, strict: bool | None = None, **connect_kwargs):
        """Join the switch (world group) once every rank is ready, or start on gloo if it is unreachable.

        Args:
            store, rank, size, c10d_timeout: from init_process_group (the group's prefixed store; the gloo
                backends' timeout, also the longest a rank waits for the others after a switch fault).
            switch: "HOST:PORT" (default $INA_SWITCH, or $MASTER_ADDR:$INA_SWITCH_PORT).
            codec: for floating tensors, 'fixed' or 'nc' (default $INA_CODEC or fixed); int32 tensors use int32,
                reductions of at most SMALL_ELEMENTS elements per-element fixed point (EXACT_SMALL).
            job: the switch job (default $INA_JOB or 1).
            retry_every: calls between attempts to re-join after a fault (default $INA_RETRY_EVERY or 50).
            use_switch: False for a subgroup: gloo only.
            strict: a switch that cannot be joined at init_process_group raises instead of starting on gloo
                (default $INA_STRICT=1).
            **connect_kwargs: hostlib.connect options (window, elements_per_packet, timeout, rounding...);
                fast defaults to False where $INA_FAST=0. init_process_group(pg_options={...}) passes them.

        Raises:
            ValueError: an unknown codec, no switch address.
            INAError: the switch refused the join (unknown job, wrong world size, bad key); with strict, also
                an unreachable switch or an address that does not resolve.
        """
        super().__init__(rank, size)
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, c10d_timeout)
        self._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        for device in ("cpu", "cuda"):
            self._register_backend(torch.device(device), dist.ProcessGroup.BackendType.GLOO, self.gloo)
        self.use_switch = use_switch
        self._worker = futures.CallQueue(f"ina-pg-{rank}")  # the switch's calls, in call order
        self._warned: set[str] = set()
        self._done = DoneWork()  # the Work of every inline call that succeeded with asyncOp False: dist.all_reduce
        # waits on it at once and drops it (a Work costs more to make than the rest of the inline path)
        self.paths: dict[tuple, int] = {}  # (what, path): calls per kind of call and the path that carried it
        self.failover: Failover | None = None
        self._reads = _python_reads  # the inline path's reads of a call's tensor and options (inline_call.cpp)
        self._lanes = None  # the lanes the reads look in (SwitchCalls.lanes: none on a subgroup)
        if not use_switch:
            self._warn_once("subgroup", "process group 'ina': a subgroup runs every collective on gloo (the "
                                        "switch job belongs to the world group)")
            return
        self.codec = codec or os.environ.get("INA_CODEC", "fixed")
        if self.codec not in FLOAT_CODECS:
            raise ValueError(f"process group 'ina': codec must be one of {FLOAT_CODECS} (int32 tensors always use "
                             f"int32), got {self.codec!r}")
        self.switch = switch_address(switch)
        if os.environ.get("INA_FAST") == "0":
            connect_kwargs.setdefault("fast", False)
        connect_kwargs.setdefault("join_timeout", JOIN_TIMEOUT)
        job = int(os.environ.get("INA_JOB", 1)) if job is None else job
        self.failover = Failover(store, rank, size, c10d_timeout, self.switch, job, self.codec, connect_kwargs,
                                 retry_every, on_drop=lambda: self.calls.reset())
        self.calls = SwitchCalls(self.failover, self.codec, connect_kwargs, self._count)
        self._lanes = self.calls.lanes
        ext = futures.extension()  # built (once per machine) before the first call, not inside DDP's backward
        self._reads = ext.inline_call if ext is not None else _python_reads
        self.failover.start(os.environ.get("INA_STRICT") == "1" if strict is None else strict)
        self.failover.watch(lambda fn, *args: self._worker.submit(fn, *args), self.calls.idle_recovery)

    @property
    def comm(self) -> Communicator | None:
        """The switch connection while joined (None on gloo)."""
        return self.failover.comm if self.failover is not None else None

    # ------------------------------------------------------------------ c10d's interface
    def getBackendName(self) -> str:
        return BACKEND

    def allreduce(self, tensors, opts=None):
        got = self._reads(tensors, opts, self._lanes)  # the inline path's: a lane, (key, avg, asyncOp), or None
        if got is not None:
            if got.__class__ is Lane:  # a synchronous SUM on a tensor seen before: the commonest call
                lane, avg, asynchronous = got, False, False
            else:  # its tensor's first call (its lane made now), an AVG or an asyncOp call
                key, avg, asynchronous = got
                lane = self.calls.lane(tensors[0], key) if self.comm is not None else None
            if lane is not None and self._worker.enter():  # nothing queued or running: this thread runs it
                return self._inline_allreduce(tensors[0], lane, avg, asynchronous)
        tensors, op = _as_list(tensors), _reduce_op(opts)
        if len(tensors) != 1 or not self._through_switch(tensors, op):
            return self.gloo.allreduce(tensors, opts or dist.AllreduceOptions())
        (t,) = tensors

        def run():
            flat = t if t.dim() == 1 else t.reshape(-1)  # t's memory, or a copy of a strided t
            self._finish(t, self.calls.sum(flat), op, in_place=flat)
            return tensors

        return self._submit(tensors, run)

    def allreduce_coalesced(self, tensors, opts=None):
        tensors, op = list(tensors), _reduce_op(opts)
        if not tensors or not self._through_switch(tensors, op):
            return self.gloo.allreduce_coalesced(tensors, opts or dist.AllreduceCoalescedOptions())

        def run():
            total = self.calls.sum(torch.cat([t.reshape(-1) for t in tensors]))
            for t, part in zip(tensors, total.split([t.numel() for t in tensors])):
                self._finish(t, part, op)
            return tensors

        return self._submit(tensors, run)

    def reduce_scatter_single(self, output, input, opts=None):
        """FSDP's gradient reduce-scatter (reduce_scatter_tensor, _reduce_scatter_base): the switch sums the
        whole input, this rank keeps its shard."""
        op = _reduce_op(opts)
        if not self._through_switch([output, input], op) or input.numel() != output.numel() * self.size():
            return self.gloo._reduce_scatter_base(output, input, opts or dist.ReduceScatterOptions())
        return self._submit([output, input], lambda: self._scatter([output], [input], op))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, outputs, inputs, opts=None):
        op = _reduce_op(opts)
        flat = [t for ts in inputs for t in ts]
        if (len(outputs) != 1 or len(inputs[0]) != self.size() or any(t.numel() != outputs[0].numel() for t in flat)
                or not self._through_switch([*outputs, *flat], op)):
            return self.gloo.reduce_scatter(outputs, inputs, opts or dist.ReduceScatterOptions())
        return self._submit(outputs + flat, lambda: self._scatter(outputs, [torch.cat(
            [t.reshape(-1) for t in inputs[0]])], op))

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        op = _reduce_op(opts)
        if not self._through_switch([*outputs, *inputs], op) or any(
                i.numel() != o.numel() * self.size() for o, i in zip(outputs, inputs)):
            works = [self.gloo._reduce_scatter_base(o, i, opts or dist.ReduceScatterOptions())
                     for o, i in zip(outputs, inputs)]  # as all_gather_single_coalesced
            return FutureWork(torch.futures.collect_all([w.get_future() for w in works]))
        return self._submit([*outputs, *inputs], lambda: self._scatter(outputs, inputs, op))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        """gloo's _allgather_base per pair (its binding has no coalesced form), one Work for all (DTensor's
        full_tensor comes here)."""
        works = [self.gloo._allgather_base(o, i, opts or dist.AllgatherOptions()) for o, i in zip(outputs, inputs)]
        return FutureWork(torch.futures.collect_all([w.get_future() for w in works]))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def barrier(self, opts=None):
        """gloo's barrier after this rank's calls through the switch are done (gloo's own barrier waits for
        the work queued before it, too)."""
        if self.use_switch and threading.current_thread() is not self._worker.thread:
            self._worker.drain()
        return self.gloo.barrier(opts or dist.BarrierOptions())

    def shutdown(self):
        """Finish the calls in flight, leave the switch (its ranks are free at once), shut gloo down."""
        if self.failover is not None:
            self.failover.stop_watching()
        self._worker.close()
        if self.failover is not None:
            self.failover.close()
        dist.ProcessGroup.shutdown(self)

    def ina_stats(self) -> dict:
        """Counters: calls through the switch and through gloo (fallback), faults, re-joins, the join votes,
        the recoveries' seconds, which path carried each kind of call, and the live connection's CommStats."""
        stats = dict.fromkeys(("switch_calls",) + COUNTERS, 0) | {"last_fault": None}  # a subgroup: all zero
        paths = dict(self.paths)
        if self.failover is not None:
            for key, n in self.calls.lane_counts().items():
                paths[key] = paths.get(key, 0) + n
        stats["paths"] = {f"{w} -> {p}": n for (w, p), n in paths.items() if n}
        if self.failover is not None:
            stats.update(self.failover.stats(), switch_calls=self.calls.switch_calls, last_fault=self.failover.last_fault,
                         future_errors="extension" if futures.extension() else "text")
            if self.comm is not None:
                stats["comm"] = self.comm.stats.as_dict()
        return stats

    # ------------------------------------------------------------------ routing
    def _through_switch(self, tensors, op) -> bool:
        """Whether the switch can sum these: SUM or AVG of dense int32, float32, bfloat16 or float16 tensors,
        one dtype and one device for all; the rest goes to gloo, with a warning once per reason (float64:
        the switch's codecs carry 32 bits, and a float64 sum is never quantized silently)."""
        if not self.use_switch:
            return False
        first = tensors[0]
        if op not in SUMS:
            return self._to_gloo(f"op {op}", f"{op} is not a sum: delegated to gloo")
        if (any(t.dtype != first.dtype or t.device != first.device or t.layout != torch.strided for t in tensors)
                if len(tensors) > 1 else first.layout != torch.strided):
            return self._to_gloo("mixed", "tensors of different dtypes, devices or layouts: gloo sums them")
        if first.dtype not in SWITCH_DTYPES:
            return self._to_gloo(_kind(first), f"{first.dtype} tensors are summed by gloo (the switch sums int32 "
                                               f"exactly and 32/16-bit floats by codec)")
        return True

    def _to_gloo(self, what: str, why: str) -> bool:
        self._warn_once(what, f"process group 'ina': {why}")
        self._count(what, "gloo")
        return False

    def _count(self, what: str, path: str, n: int = 1):
        key = (what, path)
        self.paths[key] = self.paths.get(key, 0) + n

    def _submit(self, tensors, run):
        """run() on the worker thread, after the caller's CUDA stream has produced the tensors; a Work of
        its future at once. An error completes the future with a C++ error (futures.ErrorFuture): DDP's
        reducer, functional collectives, comm hooks and wait() raise it as the exception it is."""
        if not _on_cuda(tensors) and futures.on_callers_thread():
            done = DoneWork()
            if self._worker.try_run(lambda: done.run(run)):  # synchronous: no future, no queue, no hand-off
                return done
        fut = futures.ErrorFuture()
        ready = _cuda_event(tensors)

        def task():
            try:
                if ready is not None:
                    ready.synchronize()
                out = run()
                for device in {t.device for t in tensors if t.is_cuda}:
                    torch.cuda.current_stream(device).synchronize()
            except BaseException as e:  # noqa: BLE001 - handed to wait()
                fut.set_exception(e)
                return
            fut.set_result(out)

        return FutureWork(fut.future, fut, self._worker, self._worker.submit(task))

    def _inline_allreduce(self, t: torch.Tensor, lane, avg: bool, asynchronous: bool) -> "DoneWork":
        """The call users and the bench make most, run on the caller's thread (the queue entered) with the least
        Python: dist.all_reduce of one contiguous float32 or int32 host tensor, SUM or AVG, from the main thread
        outside backward with no call queued, while the switch is joined, on the lane of the tensor's memory.
        The same call as the general path (_submit's synchronous branch, _sum, _finish) without its per-call
        closures, checks and tensor views: on a 2-core machine that four ranks and the switch share, each
        call's Python runs with cold caches and costs several times its measure in a tight loop (issue 37)."""
        try:
            total = self.calls.sum(t, lane)
            if total is not t:  # a recovery's sum: the switch failed under the call
                self._finish(t, total, Op.AVG if avg else Op.SUM)
            elif avg:
                t.div_(self.size(), rounding_mode=None if t.dtype.is_floating_point else "trunc")
        except BaseException as e:  # noqa: BLE001 - raised by wait()
            return DoneWork(error=e)
        finally:
            self._worker.leave()
        return DoneWork([t]) if asynchronous else self._done

    def _scatter(self, outputs, inputs, op):
        """Sum the inputs (one switch call), then each output gets this rank's shard of its input's sum."""
        total = self.calls.sum(torch.cat([i.reshape(-1) for i in inputs]))
        at = 0
        for out, inp in zip(outputs, inputs):
            shard = out.numel()
            start = at + self.rank() * shard
            self._finish(out, total[start: start + shard], op)
            at += inp.numel()
        return outputs

    def _finish(self, out: torch.Tensor, total: torch.Tensor, op, in_place: torch.Tensor | None = None):
        """out (the caller's tensor) = total (flat: its sum), divided for AVG as gloo divides. total is
        in_place (out's elements, flat) when the sum landed in out itself."""
        avg = op == Op.AVG
        mode = None if not avg or total.dtype.is_floating_point else "trunc"
        if total is in_place and out.is_contiguous():
            if avg:
                out.div_(self.size(), rounding_mode=mode)
        elif avg:
            out.copy_(torch.div(total, self.size(), rounding_mode=mode).view(out.shape))
        else:
            out.copy_(total.view(out.shape))

    def _warn_once(self, key: str, message: str):
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=2)


# The collectives gloo runs, by this group's method name (Python's name and the name c10d's C++ trampoline looks
# up) -> the gloo backend's method. Called through the backend's own binding, which releases the GIL before
# gloo queues the work: c10d's trampoline holds it when it falls through to the registered backend, and a gloo
# thread that frees a Python-owned tensor under gloo's queue lock needs it, so the two deadlock.
DELEGATED = {"broadcast": "broadcast", "allgather": "allgather", "allgather_coalesced": "allgather_coalesced",
             "all_gather_single": "_allgather_base", "_allgather_base": "_allgather_base", "gather": "gather",
             "scatter": "scatter", "reduce": "reduce", "alltoall": "alltoall", "all_to_all_single": "alltoall_base",
             "alltoall_base": "alltoall_base", "send": "send", "recv": "recv", "recv_anysource": "recv_anysource",
             "monitored_barrier": "monitored_barrier"}


def _delegate(name: str, backend_method: str):
    def method(self, *args):
        while args and args[-1] is None:  # an absent opts: the binding's default
            args = args[:-1]
        return getattr(self.gloo, backend_method)(*args)

    method.__name__ = name
    method.__doc__ = f"gloo's {backend_method}."
    return method


class FutureWork(dist.Work):
    """The Work of a call on the worker thread. wait() raises the call's exception itself (as gloo's Work
    raises its errors); get_future() is completed with a C++ error for C++ readers (futures.ErrorFuture),
    not with c10d's _create_work_from_future, whose wait() returns the exception as a value."""

    def __init__(self, future: torch.futures.Future, source: "futures.ErrorFuture | None" = None,
                 queue: "futures.CallQueue | None" = None, entry=None):
        super().__init__()
        self.future, self.source, self.queue, self.entry = future, source, queue, entry

    def wait(self, timeout=None) -> bool:
        if self.source is None:
            self.future.wait()
            return True
        if self.entry is not None:
            self.queue.run_until(self.entry)  # not started yet: run it (and the calls before it) here
            self.entry = None
        self.source.completed.wait()
        if self.source.error is not None:
            raise self.source.error
        return True

    def get_future(self) -> torch.futures.Future:
        if self.entry is not None:
            self.queue.wake()  # its reader waits on the future: the queue's thread must run the call
        return self.future

    def is_completed(self) -> bool:
        if self.entry is not None:
            self.queue.wake()
        return self.future.done()


def _python_reads(tensors, opts, lanes: dict):
    """inline_call.cpp's reads, in Python (where the extension is not built): for one contiguous strided CPU
    tensor and a SUM or AVG call from the main thread outside backward (futures.on_callers_thread), its lane
    (lanes[(address, elements, dtype)]) where it has one and the call is a synchronous SUM, else ((address,
    elements, dtype), avg, asyncOp); None for any other call."""
    if tensors.__class__ not in (list, tuple) or len(tensors) != 1 or opts.__class__ is not dist.AllreduceOptions:
        return None
    t = tensors[0]
    if not futures.on_callers_thread() or not isinstance(t, torch.Tensor):
        return None
    if not t.is_cpu or t.layout is not torch.strided or not t.is_contiguous():
        return None
    op = int(opts.reduceOp.op)  # an int: comparing pybind enums costs more than the read (cold, ~3 us)
    if op != _SUM and op != _AVG:
        return None
    key, avg = (t.data_ptr(), t.numel(), t.dtype), op == _AVG
    lane = lanes.get(key) if not avg and not opts.asyncOp and lanes.__class__ is dict else None
    return lane if lane is not None else (key, avg, opts.asyncOp)


class DoneWork(dist.Work):
    """The Work of a call already run on the caller's thread (a call from the main thread with nothing
    queued: c10d's synchronous all_reduce waits on it at once). wait() raises the call's exception; a future
    is made only if someone asks for one."""

    def __init__(self, result=None, error: BaseException | None = None):
        super().__init__()
        self.result, self.error, self._future = result, error, None

    def run(self, fn):
        try:
            self.result = fn()
        except BaseException as e:  # noqa: BLE001 - raised by wait()
            self.error = e

    def wait(self, timeout=None) -> bool:
        if self.error is not None:
            raise self.error
        return True

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            done = futures.ErrorFuture()
            if self.error is not None:
                done.set_exception(self.error)
            else:
                done.set_result(self.result)
            self._future = done.future
        return self._future

    def is_completed(self) -> bool:
        return True


def _on_cuda(tensors) -> bool:
    return tensors[0].is_cuda if len(tensors) == 1 else any(t.is_cuda for t in tensors)


def _as_list(tensors):
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _reduce_op(opts):
    """The ReduceOp of c10d's options (or a bare op, as ProcessGroup.allreduce's overloads take)."""
    if opts is None:
        return Op.SUM
    op = getattr(opts, "reduceOp", opts)  # options hold a ReduceOp, whose .op is the RedOpType
    return op if isinstance(op, Op.RedOpType) else op.op


def _cuda_event(tensors):
    """An event on the caller's current stream of the tensors' GPU, or None for host tensors."""
    cuda = next((t for t in tensors if t.is_cuda), None)
    if cuda is None:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(cuda.device))
    return event


for _name, _method in DELEGATED.items():
    setattr(ProcessGroupINA, _name, _delegate(_name, _method))
register()  # importing this module is enough (whatever was imported first: torch_autoload.being_imported)
