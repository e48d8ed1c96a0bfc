"""A torch.distributed backend, "ina": sums go through the switch, everything else through gloo.

    # INA_SWITCH=127.0.0.1:48864 torchrun --nproc-per-node 2 train.py
    import hostlib, torch.distributed as dist
    dist.init_process_group("ina")

What goes through the switch: all_reduce with SUM or AVG of int32 (codec int32, exact), float32, bfloat16 and
float16 tensors (16-bit as float32; reductions of at most SMALL_ELEMENTS elements, a loss or metrics, in fixed
point with one exponent per element, larger ones by the codec of $INA_CODEC, default fixed),
allreduce_coalesced, and the reduce-scatters (an allreduce of the whole input, then this rank's shard).
Everything else (broadcast, all_gather*, barrier, send/recv, alltoall, MIN/MAX/PRODUCT, float64 and other
dtypes) runs on a gloo backend made from the same store. A subgroup (new_group) runs entirely on gloo: the
switch job belongs to the world group.

The calls through the switch run in call order on one queue per group (futures.CallQueue: its thread for
DDP's buckets, which overlap backward; the waiting thread itself for a synchronous call), each returning a
Work at once. The commonest call, a synchronous dist.all_reduce of one contiguous float32 or int32 host
tensor, takes the inline path: the same steps with the route and a view of the tensor's memory kept per
address, size and dtype (its lane), so a 1 KiB call's Python is a small part of the call. A call's error
completes the Work's future as a C++ error holding the Python exception (futures.ErrorFuture), so DDP,
FSDP2, functional collectives and wait() raise it by name. A call costs no store operation: while the
switch lives, a call completes or fails on every rank (protocol v3). A sum lands in the caller's tensor
block by block (no copy of it). When the switch fails under a call, the ranks agree
through the store on where each is (Recovery): the ranks that completed the last call hand the part of its
sum the others missed (its last window of blocks, kept) to them, or, all in one call, each block that landed
somewhere comes from its lowest holder and the rest is summed on gloo from the inputs (a block holds its
input until its sum lands); then the calls go to gloo; every $INA_RETRY_EVERY calls (default 50) the group
tries to re-join the switch (one store vote). A CollectiveError (CallMismatch, CallAborted, PeerDead)
and input errors are raised on every rank, as gloo raises its errors.

The backend is registered when hostlib is imported (hostlib/__init__.py; after torch's own import if torch
comes later) or by torch's backend autoload (the "torch.backends" entry point in pyproject.toml).
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import threading
import time
import warnings
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from .. import errors
from ..codecs import get_codec
from ..worker import Communicator
from . import futures
from .common import switch_address

BACKEND = "ina"
RETRY_EVERY = 50  # calls on gloo between two attempts to re-join the switch ($INA_RETRY_EVERY)
RECOVERY_POLL = 0.2  # seconds between the watcher's looks for another rank's recovery ($INA_RECOVERY_POLL)
JOIN_TIMEOUT = 10.0  # seconds the switch's join barrier waits; the store's barrier before it has every rank ready
FLOAT_CODECS = ("fixed", "nc")
SWITCH_DTYPES = (torch.int32, torch.float32, torch.bfloat16, torch.float16)
LANES = 1024  # host tensors whose lane (_Lane) a group keeps: a per-parameter loop of a large model fits
SMALL_ELEMENTS = 64  # floating reductions up to this size (a loss, metrics) go per element (EXACT_SMALL)
EXACT_SMALL = "small"  # the path's key: the fixed codec, one element per packet, so each has its own exponent
SWITCH_FAULTS = (errors.SwitchFault, OSError)  # OSError: CallTimeout, SwitchUnreachable, a dead route
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


class CallVote:
    """Every rank's outcome of a join ("ok", "fault", "error"), agreed through the c10d store: the join is
    the one step whose outcome is voted (at init_process_group and when re-joining after a fault), never a
    call. Each rank adds its outcome to the key's counter (one round trip); the last to arrive writes the
    verdict (any error > any fault > ok), which the others read, and deletes the previous vote's keys, which
    every rank has read since it voted on this one. A rank whose own outcome is an error does not wait."""

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


class Recovery:
    """What the ranks do when the switch fails under a call, through the c10d store, on the failure path
    only (a call that works costs no store operation).

    A call through the switch completes on every rank or on none while the switch lives (protocol v3). If it
    dies as call m ends, some ranks may hold m's result and go on to call m+1, which then fails on them, while
    the others fail on m: each rank publishes its Place (the call it failed on, what landed of it, what it
    kept of the one before), every rank reads all of them, so all know m (the lowest) and who is at m+1. A
    rank at m+1 kept the part of m's sum a rank at m can lack, and the lowest such rank broadcasts it on the
    fallback gloo group to the ranks at m, which complete m's sum with it: every rank ends m with the same
    bytes. The call each rank is in then runs on gloo. Every
    rank makes the same decisions from the same published numbers; the epoch (faults so far, the same count
    on every rank) keeps one fault's keys apart from the next's."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta):
        self.store, self.rank, self.size, self.timeout = store, rank, size, timeout
        self.epoch = 0
        self.seconds = 0.0

    def begun(self, epoch: int) -> bool:
        """Whether some rank has begun recovery `epoch` (the watcher's poll: one store check)."""
        return self.store.check([f"recover/{epoch}/begun"])

    def note_error(self, call: int):
        """This rank raises call `call`'s error (every rank does, but a rank whose switch failed under the
        same call waits in agree(): it learns here that the call failed, and raises too). Failure path only."""
        self.store.set(f"recover/{self.epoch}/{self.rank}", f"error {call}")
        self.epoch += 1

    def agree(self, place: "Place") -> list["Place"]:
        """Publish where this rank is (the call it failed on, what of it landed, what it kept of the one
        before); every rank's, in rank order.

        Raises:
            CallAborted: another rank raised an error instead (its call failed at the switch before it died).
        """
        start = time.perf_counter()
        prefix = f"recover/{self.epoch}/"
        self.epoch += 1
        self.store.set(prefix + "begun", "1")
        self.store.set(prefix + str(self.rank), place.said())
        keys = [prefix + str(r) for r in range(self.size)]
        self.store.wait(keys, self.timeout)
        said = [self.store.get(k).decode() for k in keys]
        self.seconds += time.perf_counter() - start
        raised = [r for r, v in enumerate(said) if v.startswith("error")]
        if raised:
            raise errors.CallAborted(f"rank {self.rank}: call {place.call} failed at the switch on rank "
                                     f"{raised[0]} ({said[raised[0]]}); it is raised here too", rank=raised[0])
        places = [Place.heard(v) for v in said]
        low = min(p.call for p in places)
        if any(p.call not in (low, low + 1) for p in places):
            raise RuntimeError(f"process group 'ina': ranks failed on calls {[p.call for p in places]} (more than "
                               f"one call apart); the switch's fault cannot be recovered")
        return places


@dataclasses.dataclass
class Place:
    """Where a rank stands when the switch fails (Recovery.agree publishes it): the call it failed on (or
    would make next: idle), its length, the element from which its result of that call is missing (the C
    loop writes each block's sum in place as it lands: the blocks before hold their sum; 0 when none landed
    or the input was copied), how many blocks landed, and the element from which it kept the previous call's
    sum (-1: nothing kept)."""

    call: int
    numel: int = 0
    missing_from: int = 0
    landed: int = 0
    kept_from: int = -1
    idle: bool = False

    def said(self) -> str:
        return f"{self.call} {self.numel} {self.missing_from} {self.landed} {self.kept_from} {int(self.idle)}"

    @classmethod
    def heard(cls, text: str) -> "Place":
        call, numel, missing_from, landed, kept_from, idle = (int(v) for v in text.split())
        return cls(call, numel, missing_from, landed, kept_from, bool(idle))


class ProcessGroupINA(dist.ProcessGroup):
    """The "ina" process group (see the module's docstring). A Python ProcessGroup, as torchft's: c10d's C++
    callers (DDP's reducer, functional collectives) reach these methods through its trampoline; the gloo
    backend registered on it answers whatever is not overridden here."""

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
        self.comm: Communicator | None = None
        self._kept: tuple | None = None  # (call, first element, its sum from there: a tensor or array): _keep
        self._landing: tuple | None = None  # an in-place call's (block size, window, numpy view): _switch_sum
        self._lands: dict = {}  # (dtype, block size, non-empty) -> whether sums land block by block
        self._lanes: dict = {}  # (address, numel, dtype) -> _Lane of the inline path; a connection's (_drop_comm
        # empties it before the next join)
        self._done = DoneWork()  # the Work of every inline call that succeeded with asyncOp False: dist.all_reduce
        # waits on it at once and drops it (a Work costs more to make than the rest of the inline path)
        self.last_fault: str | None = None  # the last switch fault, named (ina_stats)
        self.counters = {"switch_calls": 0, "gloo_calls": 0, "faults": 0, "rejoins": 0, "failed_rejoins": 0,
                         "recovered_results": 0, "landed_sums": 0}
        self.paths: dict[tuple, int] = {}  # (what, path): calls per kind of call and the path that carried it
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
        self.strict = os.environ.get("INA_STRICT") == "1" if strict is None else strict
        if os.environ.get("INA_FAST") == "0":
            connect_kwargs.setdefault("fast", False)
        connect_kwargs.setdefault("join_timeout", JOIN_TIMEOUT)
        self.connect_kwargs = connect_kwargs
        rounding = {"rounding": connect_kwargs["rounding"]} if "rounding" in connect_kwargs else {}
        self._codecs = {"float": get_codec(self.codec, **rounding), "int32": get_codec("int32"),
                        EXACT_SMALL: get_codec("fixed")}
        self._routes: dict = {}  # (dtype, small) -> (codec, elements per packet, path name): _route
        # the join votes, the recovery and the fallback's gloo are this group's own: the worker thread alone
        # uses them, in call order, so every rank issues the same sequence whatever the caller's thread does
        ina_store = dist.PrefixStore("ina/", store)
        self.vote = CallVote(ina_store, size)
        self.recovery = Recovery(ina_store, rank, size, c10d_timeout)
        self._fallback = dist.ProcessGroupGloo(dist.PrefixStore("ina-fallback/", store), rank, size, c10d_timeout)
        self._calls = 0  # calls that could go through the switch, the same count on every rank
        self._joins = 0
        self._retry_at = 0  # without a connection: the call that joins again
        self._down = False  # a switch fault sent the calls to gloo
        futures.extension()  # built (once per machine) before the first call, not inside DDP's backward
        self.recovery_poll = float(os.environ.get("INA_RECOVERY_POLL", RECOVERY_POLL))
        self._closed = threading.Event()
        self._watched = -1
        self._watcher = threading.Thread(target=self._watch, name=f"ina-recovery-{rank}", daemon=True)
        outcome, error = self._try_join(initial=True)
        verdict = self.vote("join", outcome)
        if verdict == "ok":
            log.info("process group 'ina': rank %d joined switch %s (job %d, codec %s)", rank, self.switch,
                     self.job, self.codec)
            self._watcher.start()
            return
        self._drop_comm()
        if outcome == "error":
            raise error
        if verdict == "error":
            raise RuntimeError(f"process group 'ina': another rank failed to join the switch at {self.switch}")
        if self.strict:
            raise errors.SwitchUnreachable(f"process group 'ina' (INA_STRICT=1): cannot join switch {self.switch}"
                                           f": {error or 'a switch fault on another rank'}", switch=self.switch,
                                           job=self.job)
        self._switch_down(error, at=0)
        self._watcher.start()

    # ------------------------------------------------------------------ c10d's interface
    def getBackendName(self) -> str:
        return BACKEND

    def allreduce(self, tensors, opts=None):
        work = self._inline_allreduce(tensors, opts) if self.comm is not None else None
        if work is not None:
            return work
        tensors, op = _as_list(tensors), _reduce_op(opts)
        if len(tensors) != 1 or not self._through_switch(tensors, op):
            return self.gloo.allreduce(tensors, opts or dist.AllreduceOptions())
        (t,) = tensors

        def run():
            flat = t if t.dim() == 1 else t.reshape(-1)  # t's memory, or a copy of a strided t
            self._finish(t, self._sum(flat), op, in_place=flat)
            return tensors

        return self._submit(tensors, run)

    def allreduce_coalesced(self, tensors, opts=None):
        tensors, op = list(tensors), _reduce_op(opts)
        if not tensors or not self._through_switch(tensors, op):
            return self.gloo.allreduce_coalesced(tensors, opts or dist.AllreduceCoalescedOptions())

        def run():
            total = self._sum(torch.cat([t.reshape(-1) for t in tensors]))
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
        if self.use_switch:
            self._closed.set()
            self._watcher.join(5)
        self._worker.close()
        self._drop_comm()
        if self.use_switch:
            self._fallback.shutdown()
        dist.ProcessGroup.shutdown(self)

    def ina_stats(self) -> dict:
        """Counters: calls through the switch and through gloo (fallback), faults, re-joins, the join votes,
        the recoveries' seconds, which path carried each kind of call, and the live connection's CommStats."""
        stats = dict(self.counters, paths={f"{w} -> {p}": n for (w, p), n in self.paths.items()},
                     last_fault=self.last_fault)
        if self.use_switch:
            stats.update(votes=self.vote.votes, vote_seconds=self.vote.seconds, recoveries=self.recovery.epoch,
                         recovery_seconds=self.recovery.seconds, switch=self.switch, codec=self.codec,
                         connected=self.comm is not None, future_errors="extension" if futures.extension() else
                         "text")
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

    def _count(self, what: str, path: str):
        key = (what, path)
        self.paths[key] = self.paths.get(key, 0) + 1

    def _submit(self, tensors, run):
        """run() on the worker thread, after the caller's CUDA stream has produced the tensors; a Work of
        its future at once. An error completes the future with a C++ error (futures.ErrorFuture): DDP's
        reducer, functional collectives, comm hooks and wait() raise it as the exception it is."""
        if not _on_cuda(tensors) and self._worker.on_callers_thread():
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

    def _inline_allreduce(self, tensors, opts) -> "DoneWork | None":
        """The call users and the bench make most, run here with the least Python: dist.all_reduce of one
        contiguous float32 or int32 host tensor, SUM or AVG, from the main thread outside backward with no call
        queued, while the switch is joined. The same call as the general path (_submit's synchronous branch,
        _sum, _finish) without its per-call closures, checks and tensor views: on a 2-core machine that four
        ranks and the switch share, each call's Python runs with cold caches and costs several times its
        measure in a tight loop (issue 37). Returns the call's Work, or None where the general path applies."""
        if opts is None or len(tensors) != 1:
            return None
        t = tensors[0]
        if not t.is_cpu or t.layout is not torch.strided or not t.is_contiguous():
            return None
        op = int(opts.reduceOp.op)  # an int: comparing pybind enums costs more than the read (cold, ~3 us)
        avg = op == _AVG
        if not avg and op != _SUM:
            return None
        lane = self._lane(t)
        if lane is None or not self._worker.enter_here():
            return None
        try:
            total = self._sum(t, lane)
            if total is not t:  # a recovery's sum: the switch failed under the call
                self._finish(t, total, Op.AVG if avg else Op.SUM)
            elif avg:
                t.div_(self.size(), rounding_mode=None if t.dtype.is_floating_point else "trunc")
        except BaseException as e:  # noqa: BLE001 - raised by wait()
            return DoneWork(error=e)
        finally:
            self._worker.leave()
        return DoneWork(tensors) if opts.asyncOp else self._done

    def _lane(self, t: torch.Tensor) -> "_Lane | None":
        """t's lane (made at its first call, kept per address, size and dtype while this connection lives), or
        None where the inline path does not apply: other dtypes, an empty tensor, sums that do not land block by
        block (the Python loop)."""
        key = (t.data_ptr(), t.numel(), t.dtype)
        lane = self._lanes.get(key)
        if lane is not None:
            return lane
        n = key[1]
        if t.dtype not in (torch.float32, torch.int32) or n == 0:
            return None
        view = np.frombuffer((ctypes.c_byte * (n * t.element_size())).from_address(key[0]),
                             dtype=np.float32 if t.dtype == torch.float32 else np.int32)
        codec, k, path = self._route(t)
        if not self.comm.lands_blocks(view, codec):
            return None
        if len(self._lanes) >= LANES:
            self._lanes.clear()
        lane = self._lanes[key] = _Lane(view, codec, k, (_kind(t), path))
        return lane

    def _scatter(self, outputs, inputs, op):
        """Sum the inputs (one switch call), then each output gets this rank's shard of its input's sum."""
        total = self._sum(torch.cat([i.reshape(-1) for i in inputs]))
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

    # ------------------------------------------------------------------ the switch, and falling back
    def _sum(self, x: torch.Tensor, lane: "_Lane | None" = None) -> torch.Tensor:
        """x (flat) summed over the ranks, a tensor of x's dtype: x itself (the sum lands in place) or
        another; through the switch, or through gloo on every rank while the switch is down (worker thread
        only). With x's lane (the inline path: the switch is joined), x is any contiguous shape, and the sum
        lands in it."""
        n = self._calls
        self._calls += 1
        what = _kind(x) if lane is None else lane.count[0]
        if self.comm is None and (n < self._retry_at or not self._rejoin(n)):
            self._count(what, "gloo (switch down)")
            return self._gloo_sum(x)
        try:
            total, path = self._switch_sum(x, lane)
        except SWITCH_FAULTS as e:
            self._count(what, "gloo (recovered)")
            return self._recover(n, x if lane is None else x.view(-1), e)
        except Exception:  # a CollectiveError or the call's input (every rank raises; the next call re-joins)
            self._count(what, "error")
            self.recovery.note_error(n)
            raise
        self.counters["switch_calls"] += 1
        self._count(what, path)
        self._keep(n, x, total, lane)
        return total

    def _keep(self, n: int, x: torch.Tensor, total: torch.Tensor, lane: "_Lane | None" = None):
        """What a recovery may have to hand to ranks that missed call n's last results: a rank whose call
        failed has every block's sum but those of the window's last packets (it sent a slot's next packet
        only after the result of its last), so of a sum landed block by block the last `window` blocks (a
        lane's into its own buffer); otherwise the whole sum (a copy when it is x, the caller's)."""
        if lane is not None:
            lane.kept[...] = lane.tail
            self._kept, self._landing = (n, lane.start, lane.kept), None
            return
        if self._landing is None:
            self._kept = (n, 0, total.clone() if total is x else total)
            return
        k, window, flat = self._landing  # flat: total's numpy view (a numpy copy costs a third of torch's)
        self._landing = None  # not holding the caller's tensor
        start = _kept_from(flat.size, k, window)
        self._kept = (n, start, flat[start:].copy())

    def _rejoin(self, n: int) -> bool:
        """At call n (the same on every rank): join the switch again; False (and the next try later) if any
        rank could not."""
        outcome, error = self._try_join(initial=False)
        if self.vote(f"call/{n}", outcome) == "ok":
            self._down = False
            self.counters["rejoins"] += 1
            log.warning("process group 'ina': rank %d re-joined switch %s at call %d: sums go through the switch "
                        "again", self.rank(), self.switch, n)
            return True
        self._switch_down(error, at=n)
        return False

    def _place(self, n: int, x: torch.Tensor | None, error: BaseException | None) -> tuple["Place", torch.Tensor]:
        """This rank's Place at a recovery, and per element whether x holds its sum."""
        landed = getattr(error, "landed", None) if self._landing is not None else None
        if x is None or landed is None or not landed.any():
            mask = None
            place = Place(n, 0 if x is None else x.numel(), idle=x is None)
        else:
            mask = torch.from_numpy(landed).repeat_interleave(self._landing[0])[: x.numel()]
            missing = (~mask).nonzero()
            place = Place(n, x.numel(), int(missing[0]) if missing.numel() else x.numel(), int(landed.sum()))
        kept = self._kept
        if kept is not None and kept[0] == n - 1:
            place.kept_from = kept[1]
        return place, mask

    def _recover(self, n: int, x: torch.Tensor | None, error: BaseException | None) -> torch.Tensor | None:
        """The switch failed under call n on this rank (x: its input, the blocks that landed holding their
        sum), or another rank's did while this one was idle before call n (x None, from the watcher): agree
        on where each rank is (Recovery), hand call n-1's kept sum to the ranks that missed part of it, or
        sum call n on gloo (a block that landed anywhere from its lowest holder alone), then go on through
        gloo."""
        place, mask = self._place(n, x, error)
        places = self.recovery.agree(place)
        low = min(p.call for p in places)
        ahead = [r for r, p in enumerate(places) if p.call == low + 1]
        kept, self._kept = self._kept, None
        self._switch_down(error, at=max(p.call for p in places))
        if ahead:  # call `low` completed on the ranks in `ahead`: the part others lack goes to them
            result = self._hand_over(n, low, places, ahead[0], kept, x, mask)
            if n == low:
                self.counters["recovered_results"] += 1
                return result
        elif any(p.landed for p in places):  # every rank is in call n: the blocks that landed are its sums
            return self._landed_sum(x, mask, places)
        return None if x is None else self._gloo_sum(x)

    def _hand_over(self, n, low, places, src, kept, x, mask):
        """Call `low`'s sum from rank src (which completed it) to the ranks at `low`: the elements from the
        first any of them misses, broadcast on the fallback gloo group; a rank at low returns its sum."""
        need = min(p.missing_from for p in places if p.call == low)
        if places[src].kept_from < 0 or places[src].kept_from > need:
            raise RuntimeError(f"process group 'ina': call {low}'s sum is needed from element {need}, rank {src} "
                               f"kept it from element {places[src].kept_from}: the fault cannot be recovered")
        if self.rank() == src:
            _, start, total = kept
            part = torch.as_tensor(total[need - start:]).contiguous()
        else:  # a rank at low + 1 completed low: it kept (part of) its sum
            numel = next(p.numel for p in places if p.call == low)
            part = torch.empty(numel - need, dtype=x.dtype if n == low else torch.as_tensor(kept[2]).dtype)
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self._fallback.broadcast([part], opts).wait()
        if n != low:
            return None
        if mask is None:
            result = torch.empty_like(x)
            result[need:] = part
            return result
        missing = ~mask[need:]
        x[need:][missing] = part[missing]
        return x

    def _landed_sum(self, x: torch.Tensor, mask: torch.Tensor | None, places) -> torch.Tensor:
        """Call n on gloo when the switch died under it on every rank with some blocks landed: per element,
        the lowest rank holding its sum gives it and the others 0, or every rank its input where none holds
        it; one gloo sum (exact where one rank gives: x + 0)."""
        if any(p.idle for p in places) or x is None:
            raise RuntimeError("process group 'ina': a rank was idle while others hold sums of its call: the "
                               "fault cannot be recovered")
        size = self.size()
        holder = torch.zeros(x.numel(), dtype=torch.int32)
        if mask is not None:
            holder[mask] = size - self.rank()
        opts = dist.AllreduceOptions()
        opts.reduceOp = Op.MAX
        self._fallback.allreduce([holder], opts).wait()  # size - the lowest holder, 0 where none
        give = (holder == 0) | (holder == size - self.rank())
        part = torch.where(give, x.detach(), torch.zeros((), dtype=x.dtype))
        opts = dist.AllreduceOptions()
        opts.reduceOp = Op.SUM
        self._fallback.allreduce([part], opts).wait()
        self.counters["gloo_calls"] += 1
        self.counters["landed_sums"] += 1
        return part

    def _watch(self):
        """The watcher thread: a rank that completed its last call and makes no other (the switch died as that
        call ended: the last step's last bucket, then a collective of another group) would hold the others'
        recovery forever. Every RECOVERY_POLL seconds it looks for a recovery begun by another rank (one store
        check) and, if there is one, joins it from the worker thread, between calls."""
        while not self._closed.wait(self.recovery_poll):
            epoch = self.recovery.epoch
            try:
                begun = self.recovery.begun(epoch)
            except Exception:  # noqa: BLE001 - a store gone at shutdown
                return
            if begun and self._watched != epoch:
                self._watched = epoch
                self._worker.submit(self._join_recovery, epoch)

    def _join_recovery(self, epoch: int):
        if self.recovery.epoch == epoch:  # not yet handled by a call of this rank's own
            try:
                self._recover(self._calls, None, None)
            except Exception as e:  # noqa: BLE001 - the next call goes to gloo anyway; say why
                log.warning("process group 'ina': rank %d: joining another rank's recovery failed: %s",
                            self.rank(), e)

    def _switch_sum(self, x: torch.Tensor, lane: "_Lane | None" = None) -> tuple[torch.Tensor, str]:
        """One allreduce through the switch, and the path's name. The connection was joined with the float
        codec; each call passes its own (every packet carries its call's codec, so one job and one join serve
        all; _route says which). A float32 or int32 tensor on the host gets its sum in place (the C loop
        writes each block as its result lands; after a fault the error's `landed` says which: _landing is
        their size and the window), through its lane when it has one (the inline path's: route and view
        made at its first call); 16-bit floats travel as float32, in a copy."""
        if lane is not None:
            comm = self.comm
            if comm.gen is not lane.gen:  # the lane's first call on this generation (a re-join may change both)
                lane.land_on(comm.gen)
            self._landing = lane.landing
            comm.allreduce_in_place(lane.view, lane.codec, lane.k)
            return x, lane.count[1]
        codec, k, path = self._route(x)
        self._landing = None
        if x.is_cuda:
            wide = x if x.dtype in (torch.int32, torch.float32) else x.float()
            return self.comm.allreduce(wide, codec=codec, elements=k).to(x.dtype), path
        if x.dtype in (torch.int32, torch.float32):
            flat = (x.detach() if x.requires_grad else x).numpy()
            key = (x.dtype, k, flat.size > 0)
            lands = self._lands.get(key)
            if lands is None:  # the C loop's or the Python loop's: asked once per connection and route
                lands = self._lands[key] = self.comm.lands_blocks(flat, codec)
            if lands:
                self._landing = (min(k, self.comm.max_elements), self.comm.window, flat)
            self.comm.allreduce(flat, out=flat, codec=codec, elements=k)
            return x, path
        wide = x.float()  # a copy: x stays intact whatever lands
        self.comm.allreduce(wide.numpy(), out=wide.numpy(), codec=codec, elements=k)
        return wide.to(x.dtype), path

    def _route(self, x: torch.Tensor) -> tuple:
        """(codec, elements per packet, path name) of a call, per dtype and size class: int32 tensors int32;
        floating tensors of at most SMALL_ELEMENTS elements (a loss, a metric) per-element fixed point,
        accurate to float32 rounding per element whatever the magnitudes; larger ones the group's codec."""
        key = (x.dtype, x.numel() <= SMALL_ELEMENTS)
        route = self._routes.get(key)
        if route is None:
            name = "int32" if x.dtype == torch.int32 else EXACT_SMALL if key[1] else "float"
            codec = self._codecs[name]
            k = 1 if name == EXACT_SMALL else self.connect_kwargs.get("elements_per_packet") or codec.default_elements
            route = self._routes[key] = (codec, k, f"switch ({codec.name}{', per element' if k == 1 else ''})")
        return route

    def _gloo_sum(self, x: torch.Tensor) -> torch.Tensor:
        """The fallback: every rank's intact input summed by the group's own gloo backend, on the host."""
        host = x.detach().to("cpu", copy=True)
        opts = dist.AllreduceOptions()
        opts.reduceOp = Op.SUM
        self._fallback.allreduce([host], opts).wait()
        self.counters["gloo_calls"] += 1
        return host.to(x.device) if x.is_cuda else host

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
        """Go on through gloo, with a re-join attempt at call at + retry_every (the same call on every rank).
        One warning and one log line when the state changes (switch -> gloo), a counter for every failed
        re-join."""
        self._drop_comm()
        self._kept = None
        self.counters["failed_rejoins" if self._down else "faults"] += 1
        if error is not None:
            self.last_fault = f"{type(error).__name__}: {error}"
        self._retry_at = at + self.retry_every
        if self._down:
            return
        self._down = True
        why = error if error is not None else "a switch fault on another rank"
        self._warn_once("fault", f"process group 'ina': switch {self.switch} failed ({why}); the calls go through "
                                 f"gloo, with a re-join every {self.retry_every} calls")
        log.warning("process group 'ina': rank %d: switch %s failed (%s): sums go through gloo, a re-join every "
                    "%d calls", self.rank(), self.switch, why, self.retry_every)

    def _drop_comm(self):
        self._lands, self._lanes = {}, {}
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


class _Lane:
    """What the inline path (ProcessGroupINA._inline_allreduce) keeps of one host tensor's memory while the
    connection lives: a numpy view of the memory that does not hold it (used only while the call's tensor has
    that address, size and dtype, so the memory is the caller's, alive), the route (codec, elements per
    packet) and the (kind, path) its calls count under. Making the view costs more than the rest of the call."""

    __slots__ = ("view", "codec", "k", "count", "gen", "landing", "start", "tail", "kept")

    def __init__(self, view, codec, k, count):
        self.view, self.codec, self.k, self.count = view, codec, k, count
        self.gen = None  # the generation landing, start, tail and kept were made for

    def land_on(self, gen):
        """Its calls' landing on generation gen (block size, window, view: ProcessGroupINA._landing) and what
        _keep keeps of their sums (the tail from `start`, copied into `kept`, a buffer of the lane's own: the
        kept sum of the last call that succeeded, overwritten only by the next success, which replaces it)."""
        k = min(self.k, gen.max_elements)
        self.landing = (k, gen.window, self.view)
        self.start = _kept_from(self.view.size, k, gen.window)
        self.tail = self.view[self.start:]
        self.kept = np.empty_like(self.tail)
        self.gen = gen


def _kept_from(size: int, k: int, window: int) -> int:
    """The first element _keep keeps of a sum of size elements landed in blocks of k with this window: the
    last `window` blocks' (a rank whose call failed lacks at most those)."""
    return max(0, -(-size // k) - window) * k


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


def _kind(x: torch.Tensor) -> str:
    """A call's kind for ina_stats' paths: its dtype, and "small" for a loss or metric."""
    small = x.dtype.is_floating_point and x.numel() <= SMALL_ELEMENTS
    kind = _KINDS.get((x.dtype, small))
    if kind is None:
        kind = _KINDS[x.dtype, small] = str(x.dtype).replace("torch.", "") + (" small" if small else "")
    return kind


_KINDS: dict = {}


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
