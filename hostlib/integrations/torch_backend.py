"""A torch.distributed backend, "ina": sums go through the switch, everything else through gloo.

    # INA_SWITCH=127.0.0.1:48864 torchrun --nproc-per-node 2 train.py
    import hostlib, torch.distributed as dist
    dist.init_process_group("ina")

What goes through the switch: all_reduce with SUM or AVG of int32 (codec int32, exact) and floating tensors
(the codec of $INA_CODEC, default fixed), allreduce_coalesced, and the reduce-scatters (an allreduce of the
whole input, then this rank's shard). Everything else (broadcast, all_gather*, barrier, send/recv, alltoall,
MIN/MAX/PRODUCT, other dtypes) runs on a gloo backend made from the same store. A subgroup (new_group) runs
entirely on gloo: the switch job belongs to the world group.

The calls through the switch run on one worker thread per group, in call order (DDP overlaps its buckets
with backward), each returning a Work at once. The switch's result goes to a staging tensor; the ranks then
vote on the call through the c10d store (CallVote): all ok, the result is released; any switch fault
(unreachable, restarted, not a member, no answer), every rank sums its intact input with a second gloo
backend instead, so a switch that dies as a call ends costs time, never a wrong or diverging result. After
a fault the calls go to gloo directly, and every $INA_RETRY_EVERY calls (default 50) the group tries to
re-join the switch. A CollectiveError (CallMismatch, CallAborted, PeerDead) and input errors are raised
through wait(), as gloo raises its errors.

The backend is registered when hostlib is imported (hostlib/__init__.py; after torch's own import if torch
comes later) or by torch's backend autoload (the "torch.backends" entry point in pyproject.toml).
"""
from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import errors
from ..codecs import get_codec
from ..worker import Communicator
from .common import switch_address

BACKEND = "ina"
RETRY_EVERY = 50  # calls on gloo between two attempts to re-join the switch ($INA_RETRY_EVERY)
JOIN_TIMEOUT = 10.0  # seconds the switch's join barrier waits; the store's barrier before it has every rank ready
FLOAT_CODECS = ("fixed", "nc")
SWITCH_FAULTS = (errors.SwitchFault, OSError)  # OSError: CallTimeout, SwitchUnreachable, a dead route
log = logging.getLogger(__name__)

Op = dist.ReduceOp


def register():
    """Register "ina" with torch.distributed (idempotent): init_process_group("ina") then builds a
    ProcessGroupINA. extended_api: the creator learns whether it makes the world group or a subgroup."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])


def autoload():
    """torch's backend autoload calls this while torch is being imported: an error here would make
    `import torch` fail, so it only warns."""
    try:
        register()
    except Exception as e:  # noqa: BLE001 - never break torch's import
        warnings.warn(f"hostlib: torch.distributed backend 'ina' not registered: {e}", stacklevel=2)


def _create(opts, backend_options=None) -> "ProcessGroupINA":
    """The creator init_process_group / new_group call; backend_options (pg_options=) may be a dict of
    ProcessGroupINA's keyword arguments."""
    kwargs = dict(backend_options) if isinstance(backend_options, dict) else {}
    return ProcessGroupINA(opts.store, opts.group_rank, opts.group_size, opts.timeout,
                           use_switch=not opts.global_ranks_in_group, **kwargs)


class CallVote:
    """Every rank's outcome of a call ("ok", "fault", "error"), agreed through the c10d store before any
    result is released: a switch that dies as a call ends can leave one rank with the result and another
    with an error. Each rank adds its outcome to the call's counter (one round trip); the last to arrive
    writes the verdict (any error > any fault > ok), which the others read (a second round trip), and
    deletes the previous vote's keys, which every rank has read since it voted on this one. A rank whose
    own outcome is an error does not wait: it raises whatever the others decide."""

    FIELD = {"ok": 1, "fault": 1 << 20, "error": 1 << 40}
    MASK = (1 << 20) - 1

    def __init__(self, store, size: int):
        self.store, self.size = store, size
        self.votes, self.seconds = 0, 0.0
        self._previous: str | None = None

    def __call__(self, key: str, outcome: str) -> str:
        start = time.perf_counter()
        total = self.store.add(key, self.FIELD[outcome])
        ok, fault, error = total & self.MASK, total >> 20 & self.MASK, total >> 40
        if ok + fault + error == self.size:
            verdict = "error" if error else "fault" if fault else "ok"
            self.store.set(key + "/verdict", verdict)
            if self._previous is not None:
                self.store.delete_key(self._previous)
                self.store.delete_key(self._previous + "/verdict")
        elif outcome == "error":
            verdict = "error"
        else:
            verdict = self.store.get(key + "/verdict").decode()
        self._previous = key
        self.votes += 1
        self.seconds += time.perf_counter() - start
        return verdict


class ProcessGroupINA(dist.ProcessGroup):
    """The "ina" process group (see the module's docstring). A Python ProcessGroup, as torchft's: c10d's C++
    callers (DDP's reducer, functional collectives) reach these methods through its trampoline; the gloo
    backend registered on it answers whatever is not overridden here."""

    def __init__(self, store, rank: int, size: int, c10d_timeout: timedelta = timedelta(minutes=30), switch=None,
                 codec: str | None = None, job: int | None = None, retry_every: int | None = None,
                 use_switch: bool = True, **connect_kwargs):
        """Join the switch (world group) once every rank is ready, or start on gloo if it is unreachable.

        Args:
            store, rank, size, c10d_timeout: from init_process_group (the group's prefixed store; the gloo
                backends' timeout).
            switch: "HOST:PORT" (default $INA_SWITCH, or $MASTER_ADDR:$INA_SWITCH_PORT).
            codec: for floating tensors, 'fixed' or 'nc' (default $INA_CODEC or fixed); int32 tensors use int32.
            job: the switch job (default $INA_JOB or 1).
            retry_every: calls between attempts to re-join after a fault (default $INA_RETRY_EVERY or 50).
            use_switch: False for a subgroup: gloo only.
            **connect_kwargs: hostlib.connect options (window, elements_per_packet, timeout, rounding...);
                fast defaults to False where $INA_FAST=0. init_process_group(pg_options={...}) passes them.

        Raises:
            ValueError: an unknown codec, no switch address.
            INAError: the switch refused the join (unknown job, wrong world size, bad key).
        """
        super().__init__(rank, size)
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, c10d_timeout)
        self._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        for device in ("cpu", "cuda"):
            self._register_backend(torch.device(device), dist.ProcessGroup.BackendType.GLOO, self.gloo)
        self.use_switch = use_switch
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ina-pg")
        self._worker_thread: threading.Thread | None = None
        self._warned: set[str] = set()
        self.comm: Communicator | None = None
        self._buffers: dict = {}  # (shape, dtype) -> the switch's result buffer (_scratch)
        self.counters = {"switch_calls": 0, "gloo_calls": 0, "faults": 0, "rejoins": 0, "failed_rejoins": 0}
        if not use_switch:
            self._warn_once("subgroup", "process group 'ina': a subgroup runs every collective on gloo (the "
                                        "switch job belongs to the world group)")
            return
        self.codec = codec or os.environ.get("INA_CODEC", "fixed")
        if self.codec not in FLOAT_CODECS:
            raise ValueError(f"process group 'ina': codec must be one of {FLOAT_CODECS} (int32 tensors always use "
                             f"int32), got {self.codec!r}")
        self.switch = switch_address(switch)
        self.job = int(os.environ.get("INA_JOB", 1)) if job is None else job
        self.retry_every = max(1, int(os.environ.get("INA_RETRY_EVERY", RETRY_EVERY)) if retry_every is None
                               else retry_every)
        if os.environ.get("INA_FAST") == "0":
            connect_kwargs.setdefault("fast", False)
        connect_kwargs.setdefault("join_timeout", JOIN_TIMEOUT)
        self.connect_kwargs = connect_kwargs
        rounding = {"rounding": connect_kwargs["rounding"]} if "rounding" in connect_kwargs else {}
        self._codecs = {"float": get_codec(self.codec, **rounding), "int32": get_codec("int32")}
        # the vote's store and the fallback's gloo are this group's own: the worker thread alone uses them,
        # in call order, so every rank issues the same sequence whatever the caller's thread does meanwhile
        self.vote = CallVote(dist.PrefixStore("ina/", store), size)
        self._fallback = dist.ProcessGroupGloo(dist.PrefixStore("ina-fallback/", store), rank, size, c10d_timeout)
        self._calls = 0  # calls that could go through the switch, the same count on every rank
        self._joins = 0
        self._retry_at = 0  # without a connection: the call that joins again
        self._down = False  # a switch fault sent the calls to gloo
        outcome, error = self._try_join(initial=True)
        verdict = self.vote("join", outcome)
        if verdict == "ok":
            return
        self._drop_comm()
        if outcome == "error":
            raise error
        if verdict == "error":
            raise RuntimeError(f"process group 'ina': another rank failed to join the switch at {self.switch}")
        self._switch_down(error, at=0)

    # ------------------------------------------------------------------ c10d's interface
    def getBackendName(self) -> str:
        return BACKEND

    def allreduce(self, tensors, opts=None):
        tensors, op = _as_list(tensors), _reduce_op(opts)
        if len(tensors) != 1 or not self._through_switch(tensors, op):
            return self.gloo.allreduce(tensors, opts or dist.AllreduceOptions())
        (t,) = tensors

        def run():
            total = self._sum(t)
            t.copy_(self._mean(total, op).view_as(t))
            return tensors

        return self._submit(tensors, run)

    def allreduce_coalesced(self, tensors, opts=None):
        tensors, op = list(tensors), _reduce_op(opts)
        if not tensors or not self._through_switch(tensors, op):
            return self.gloo.allreduce_coalesced(tensors, opts or dist.AllreduceCoalescedOptions())

        def run():
            total = self._mean(self._sum(torch.cat([t.reshape(-1) for t in tensors])), op)
            for t, part in zip(tensors, total.split([t.numel() for t in tensors])):
                t.copy_(part.view_as(t))
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
        if self.use_switch and threading.current_thread() is not self._worker_thread:
            self._worker.submit(lambda: None).result()
        return self.gloo.barrier(opts or dist.BarrierOptions())

    def shutdown(self):
        """Finish the calls in flight, leave the switch (its ranks are free at once), shut gloo down."""
        self._worker.shutdown(wait=True)
        self._drop_comm()
        if self.use_switch:
            self._fallback.shutdown()
        dist.ProcessGroup.shutdown(self)

    def ina_stats(self) -> dict:
        """Counters: calls through the switch and through gloo (fallback), faults, re-joins, the store votes
        and their seconds, and the live connection's CommStats."""
        stats = dict(self.counters)
        if self.use_switch:
            stats.update(votes=self.vote.votes, vote_seconds=self.vote.seconds, switch=self.switch, codec=self.codec,
                         connected=self.comm is not None)
            if self.comm is not None:
                stats["comm"] = self.comm.stats.as_dict()
        return stats

    # ------------------------------------------------------------------ routing
    def _through_switch(self, tensors, op) -> bool:
        """Whether the switch can sum these: SUM or AVG of dense int32 or floating tensors, one dtype and one
        device for all; the rest goes to gloo, with a warning once per reason."""
        if not self.use_switch:
            return False
        if op not in (Op.SUM, Op.AVG):
            self._warn_once(f"op {op}", f"process group 'ina': {op} is not a sum: delegated to gloo")
            return False
        first = tensors[0]
        if any(t.layout != torch.strided or t.dtype != first.dtype or t.device != first.device for t in tensors):
            return False
        if first.dtype != torch.int32 and not first.dtype.is_floating_point:
            self._warn_once(f"dtype {first.dtype}", f"process group 'ina': {first.dtype} tensors are summed by "
                                                    f"gloo (the switch sums int32 exactly and floats by codec)")
            return False
        return True

    def _submit(self, tensors, run):
        """run() on the worker thread, after the caller's CUDA stream has produced the tensors; a Work of
        its future at once (errors come out of wait())."""
        fut = torch.futures.Future()
        ready = _cuda_event(tensors)

        def task():
            self._worker_thread = threading.current_thread()
            try:
                if ready is not None:
                    ready.synchronize()
                out = run()
                for device in {t.device for t in tensors if t.is_cuda}:
                    torch.cuda.current_stream(device).synchronize()
                fut.set_result(out)
            except BaseException as e:  # noqa: BLE001 - handed to wait()
                fut.set_exception(e)

        self._worker.submit(task)
        return FutureWork(fut)

    def _scatter(self, outputs, inputs, op):
        """Sum the inputs (one switch call), then each output gets this rank's shard of its input's sum."""
        total = self._mean(self._sum(torch.cat([i.reshape(-1) for i in inputs])), op)
        at = 0
        for out, inp in zip(outputs, inputs):
            shard = out.numel()
            out.copy_(total[at + self.rank() * shard: at + (self.rank() + 1) * shard].view_as(out))
            at += inp.numel()
        return outputs

    def _mean(self, total: torch.Tensor, op) -> torch.Tensor:
        """The switch's or gloo's sum, divided for AVG the same way either path went."""
        if op != Op.AVG:
            return total
        if total.dtype.is_floating_point:
            return total.div_(self.size())
        return total.div_(self.size(), rounding_mode="trunc")

    # ------------------------------------------------------------------ the switch, and falling back
    def _sum(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, a new tensor (x stays intact): through the switch where every rank's call
        worked, else through gloo on every rank (worker thread only)."""
        n = self._calls
        self._calls += 1
        if self.comm is None and n < self._retry_at:
            return self._gloo_sum(x)
        rejoin = self.comm is None
        outcome, error, total = "ok", None, None
        if rejoin:
            outcome, error = self._try_join(initial=False)
        if outcome == "ok":
            try:
                total = self._switch_sum(x)
            except SWITCH_FAULTS as e:
                outcome, error = "fault", e
            except Exception as e:  # noqa: BLE001 - CollectiveError, input errors: raised below
                outcome, error = "error", e
        verdict = self.vote(f"call/{n}", outcome)
        if verdict == "ok":
            if rejoin and self._down:
                self._down = False
                self.counters["rejoins"] += 1
                log.warning("process group 'ina': rank %d re-joined switch %s at call %d", self.rank(), self.switch, n)
            self.counters["switch_calls"] += 1
            return total
        if verdict == "error":  # raised on every rank; the next call joins a fresh generation first
            self._drop_comm()
            self._retry_at = n + 1
            if outcome == "error":
                raise error
            raise errors.CallAborted(f"rank {self.rank()}: call {n} failed on another rank (its error is raised "
                                     f"there)", switch=self.switch, job=self.job)
        self._switch_down(error, at=n)
        return self._gloo_sum(x)

    def _switch_sum(self, x: torch.Tensor) -> torch.Tensor:
        """One allreduce through the switch into a new tensor. The connection was joined with the float codec;
        int32 tensors switch it to int32 for this call (every packet carries its call's codec, so one job
        and one join serve both)."""
        comm = self.comm
        codec = self._codecs["int32" if x.dtype == torch.int32 else "float"]
        comm.codec = codec
        comm.k = min(self.connect_kwargs.get("elements_per_packet") or codec.default_elements, comm.max_elements)
        if x.is_cuda:
            return comm.allreduce(x)
        return comm.allreduce(x, out=self._scratch(x))

    def _scratch(self, x: torch.Tensor) -> torch.Tensor:
        """A result buffer of x's shape and dtype, kept for the next calls of that size (every caller copies
        the sum out before the next call): a fresh 64 MiB tensor per call costs its page faults, ~10 ms."""
        key = (tuple(x.shape), x.dtype)
        buf = self._buffers.pop(key, None)
        if buf is None:
            buf = torch.empty(x.shape, dtype=x.dtype)
        self._buffers[key] = buf  # most recent last; two sizes kept (e.g. a bucket and the last, shorter one)
        while len(self._buffers) > 2:
            self._buffers.pop(next(iter(self._buffers)))
        return buf

    def _gloo_sum(self, x: torch.Tensor) -> torch.Tensor:
        """The fallback: every rank's intact input summed by the group's own gloo backend, on the host."""
        host = x.detach().to("cpu", copy=True)
        opts = dist.AllreduceOptions()
        opts.reduceOp = Op.SUM
        self._fallback.allreduce([host], opts).wait()
        self.counters["gloo_calls"] += 1
        return host

    def _try_join(self, initial: bool):
        """Join once every rank is ready (a store barrier, so the switch's join barrier never waits for a rank
        that is still computing). Returns ("ok" | "fault" | "error", the exception or None): unreachable is a
        fault; a refused join an error at init_process_group, a fault when re-joining (the restarted switch
        may serve other jobs: training goes on)."""
        self.vote(f"ready/{self._joins}", "ok")
        self._joins += 1
        try:
            self.comm = Communicator(self.switch, self.rank(), self.size(), job=self.job, codec=self.codec,
                                     **self.connect_kwargs)
            return "ok", None
        except SWITCH_FAULTS as e:
            return "fault", e
        except errors.INAError as e:
            return ("error" if initial else "fault"), e
        except Exception as e:  # noqa: BLE001 - a bad option: raised at init_process_group
            return "error", e

    def _switch_down(self, error, at: int):
        """Go on through gloo: a warning the first time, a counter always, and a re-join attempt at call
        at + retry_every (the same call on every rank: `at` is the failed call, 0 for a failed first join)."""
        self._drop_comm()
        self.counters["failed_rejoins" if self._down else "faults"] += 1
        self._down = True
        self._retry_at = at + self.retry_every
        why = error if error is not None else "a switch fault on another rank"
        self._warn_once("fault", f"process group 'ina': switch {self.switch} failed ({why}); the calls go through "
                                 f"gloo, with a re-join every {self.retry_every} calls")
        log.warning("process group 'ina': rank %d: switch fault (%s); gloo until call %d", self.rank(), why,
                    self._retry_at)

    def _drop_comm(self):
        if self.comm is not None:
            try:
                self.comm.close()
            except OSError:
                pass  # the switch learns it from the silence
            self.comm = None

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
    """The Work of a call on the worker thread. Not c10d's _create_work_from_future, whose wait() returns the
    future's exception as a value: here wait() and get_future().wait() raise it, as gloo's Work does."""

    def __init__(self, future: torch.futures.Future):
        super().__init__()
        self.future = future

    def wait(self, timeout=None) -> bool:
        self.future.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return self.future

    def is_completed(self) -> bool:
        return self.future.done()


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
