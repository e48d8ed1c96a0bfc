"""The worker protocol loop in C (csrc/ina_worker.c): the same packets as Communicator's Python loop,
with the codec kernels called per packet and sendmmsg/recvmmsg batches, so the interpreter is off the
per-packet path. Communicator uses it when the kernels are built and the input has a native layout
(int32 codec: integers; fixed and nc: float32); INA_KERNELS=numpy or fast=False keeps the Python loop.
"""
from __future__ import annotations

import os
import time

import numpy as np

from inaproto import wire
from inaproto.timers import SWITCH_SILENT

from . import cc, kernels
from .codecs import natural
from .generation import Outcome
from .shm import ShmSocket

RUN_MS = 50  # the C loop returns this often, so signals (Ctrl-C), progress callbacks and silence checks are served


def gso_modes(link) -> tuple[bool, bool]:
    """Whether the C loop sends runs of same-size packets as UDP GSO sends, and receives with UDP_GRO
    (csrc/ina_gso.h); the datagrams are the same either way.

    INA_GSO=0: neither; INA_GSO=1: both wherever the switch is; unset (auto): GRO always, GSO sends only to
    a switch on loopback. Why not everywhere by default: a NIC or the kernel cuts a GSO send into datagrams
    before the wire, but a switch that reads a veth through a packet socket (DPDK's net_af_packet, bmv2)
    gets it uncut, as one oversized frame."""
    mode = os.environ.get("INA_GSO", "auto")
    if mode == "0":
        return False, False
    if mode == "1":
        return True, True
    return link.loopback, True


def kind(codec, flat: np.ndarray):
    """The C loop's codec kind for this codec and input, or None where only the Python loop applies."""
    name = codec.native_kind(flat) if kernels.enabled() else None
    return getattr(kernels.lib, f"INA_WK_{name}") if name else None


def out_dtype(kind_: int):
    """The dtype the C loop decodes results into: int32 sums for int32, float32 for fixed and nc."""
    return np.int32 if kind_ == kernels.lib.INA_WK_INT32 else np.float32


# the C loop's counters, added by name to the Communicator's CommStats after each call
COUNTERS = ("packets_sent", "bytes_sent", "packets_received", "bytes_received", "heartbeat_answers",
            "retransmissions", "spurious_retransmissions", "duplicate_results", "stale_results", "gso_sends",
            "gro_segments", "switch_drops", "fast_retransmits")
STATUS = {"INA_WK_DONE": "done", "INA_WK_SWITCH_ERROR": "switch_error", "INA_WK_TIMEOUT": "timeout",
          "INA_WK_REFUSED": "refused", "INA_WK_ENCODE_ERROR": "encode_error", "INA_WK_BAD_RESULT": "bad_result",
          "INA_WK_SYSTEM_ERROR": "system_error"}


def allreduce(comm, call, kind_: int, flat: np.ndarray, exps, progress, held=None, out=None,
              bound: "BoundFrame | None" = None) -> Outcome:
    """Run one call's packet stream (call: generation.Call, started) in the C loop; its Outcome. Done, the
    Outcome holds the result (native int32 sums for int32 and fixed, NC codes per element; with out,
    contiguous of out_dtype(kind_) and possibly flat itself, the loop decodes each result into out instead),
    the agreed exponents, the overflow flag and how far the call's slots moved. Otherwise
    it says what stopped the stream, for Communicator.failure: "silent" too when nothing of the generation
    came for SWITCH_SILENT seconds (the heartbeat thread beats meanwhile; the switch answers each), checked
    between the C loop's chunks (RUN_MS). Every packet carries the call's identity; results of another call are
    stale. It writes nothing of comm's: what it learned is in the Outcome (Communicator.learn takes it in).
    held (a bool per block: this worker's block is non-zero): block-sparse. bound: a persistent call's frame
    (flat summed into itself, its pointers set once)."""
    lib = kernels.lib
    w, keep = _loop_args(comm, call, kind_, flat, exps, held, out) if bound is None else bound.args(comm, call, exps)
    rc = lib.ina_wk_start(w)
    if rc == lib.INA_WK_NO_MEMORY:
        raise MemoryError(f"native worker loop: no memory for a window of {w.window} x {w.k} elements")
    if rc != 0:
        raise ValueError(f"native worker loop: bad parameters (window {w.window}, k {w.k}, world {w.world}, "
                         f"kind {w.kind}, exponents {'given' if exps is not None else 'none'})")
    heard_at = comm.link.heard_at
    try:
        rc, heard_at = _run(w, flat.size, progress, heard_at)
    except BaseException as e:  # an interrupt: raised between the loop's chunks, out partly written
        e.landed = _landed(w, keep, held is not None)
        e.outcome = _learned(Outcome("interrupted"), w, heard_at)
        raise
    finally:
        lib.ina_wk_finish(w)
    return _learned(_outcome(w, rc, keep, held is not None), w, heard_at)


FRAMES = 8  # call shapes (elements, packet size, window, kind) whose C-loop frame a connection keeps
WK_SIZE = kernels.ffi.sizeof("ina_wk") if kernels.ffi is not None else 0  # bytes of the C loop's struct


class _Frame:
    """The C loop's argument struct for one call shape on one socket, with the small arrays it points into,
    made once: each call copies the template over the struct (counters zeroed, the shape's fields back)
    and sets only what changes per call. Building them afresh was a third of a small call's Python, paid with
    cold caches on every call (issue 37)."""

    __slots__ = ("w", "template", "agreed", "done", "rounds")

    def __init__(self, comm, n: int, k: int, window: int, kind_: int):
        ffi = kernels.ffi
        nb = -(-n // k)
        self.agreed = np.empty(nb, dtype=np.int8)
        self.done = np.empty(nb + min(window, nb), dtype=np.uint8)
        self.rounds = np.zeros(window, dtype=np.uint32)  # rounds per stream: read back by sparse calls
        t = self.template = ffi.new("ina_wk *")
        t.fd, t.job, t.rank, t.world = comm.sock.fileno(), comm.job, comm.rank, comm.world_size
        t.group_fd = comm.group.fileno() if comm.group is not None else -1
        t.shm = comm.sock.handle if isinstance(comm.sock, ShmSocket) else ffi.NULL
        t.window, t.k, t.kind, t.n = window, k, kind_, n
        t.agreed, t.done = ffi.from_buffer("int8_t[]", self.agreed), ffi.from_buffer(self.done)
        t.stream_rounds = ffi.from_buffer("uint32_t[]", self.rounds)
        self.w = ffi.new("ina_wk *")


class Frames(dict):
    """A connection's frames, per call shape (at most FRAMES)."""

    def get_frame(self, comm, n: int, k: int, window: int, kind_: int) -> _Frame:
        key = (n, k, window, kind_, comm.sock)
        frame = self.get(key)
        if frame is None:
            if len(self) >= FRAMES:
                self.clear()
            frame = self[key] = _Frame(comm, n, k, window, kind_)
        return frame


def _frame(comm, n: int, k: int, window: int, kind_: int) -> _Frame:
    """This call shape's frame on comm's socket, reset for a call: counters zero, agreed and done cleared."""
    frame = comm.c_frames.get_frame(comm, n, k, window, kind_)
    kernels.ffi.memmove(frame.w, frame.template, WK_SIZE)
    frame.agreed.fill(wire.EXP_NONE)
    frame.done.fill(0)
    return frame


def _loop_args(comm, call, kind_, flat, exps, held, out):
    """The C loop's arguments (ina_wk, on its call shape's frame), and the arrays it points into (kept alive by
    the caller)."""
    ffi, lib = kernels.ffi, kernels.lib
    n = flat.size
    if out is not None and (out.dtype != out_dtype(kind_) or out.size != n or not out.flags.c_contiguous):
        raise ValueError(f"native worker loop: out must be {n} contiguous {np.dtype(out_dtype(kind_))}")
    frame = _frame(comm, n, call.k, call.gen.window, kind_)
    w = frame.w
    keep = {"src": np.ascontiguousarray(flat, dtype=np.int32 if kind_ == lib.INA_WK_INT32 else np.float32),
            "agreed": frame.agreed, "done": frame.done, "rounds": frame.rounds,
            "result": out if out is not None else np.zeros(n, dtype=np.uint8 if kind_ == lib.INA_WK_NC else np.int32)}
    w.src = ffi.from_buffer(keep["src"])
    w.result = ffi.from_buffer(keep["result"])
    if out is not None:
        w.out = w.result  # each result decoded into out as it lands
    _call_args(w, comm, call, exps, keep, gso_modes(comm.link))
    if held is not None:
        frame.rounds.fill(0)
        keep["held"] = np.ascontiguousarray(held, dtype=np.uint8)
        w.sparse, w.held = 1, ffi.from_buffer("uint8_t[]", keep["held"])
    return w, keep


def _call_args(w, comm, call, exps, keep: dict, gso: tuple[bool, bool]):
    """What every call sets of its own in the C loop's arguments: its identity, slots and seed, its exponents,
    and the connection's round-trip estimate, window and offloads as the last call left them."""
    ffi = kernels.ffi
    keep["uses"] = uses = np.ascontiguousarray(call.slots.uses, dtype=np.uint32)
    w.session, w.call_kind, w.call, w.call_len, w.boot = call.fields()
    w.first_slot, w.slot_uses = call.slots.first, ffi.from_buffer("uint32_t[]", uses)
    w.deterministic = int(getattr(call.codec, "deterministic", False))
    w.seed = call.seed & kernels.MASK64
    if exps is not None:
        keep["exps"] = np.ascontiguousarray(exps, dtype=np.int8)
        w.exps = ffi.from_buffer("int8_t[]", keep["exps"])
    rtt = comm.rtt  # the estimate carries over between the C and the Python loop
    w.rto, w.min_rto, w.max_rto, w.timeout = rtt.rto, rtt.min_rto, rtt.max_rto, comm.timeout
    w.have_srtt = rtt.srtt is not None
    w.srtt, w.rttvar = rtt.srtt or 0.0, rtt.rttvar
    if comm.cc_struct is not None:  # the window as the last C call left it: one copy (Communicator.cc)
        w.cc = comm.cc_struct[0]
    else:  # the Python loop's, or a new generation's
        for name in cc.FIELDS:
            setattr(w.cc, name, getattr(comm.cc, name))
    # what the kernel refused once (the C loop clears the flag) is not tried again on this communicator
    w.gso, w.gro = gso[0] and comm.link.gso_ok, gso[1] and comm.link.gro_ok


class BoundFrame(_Frame):
    """The frame of a persistent call (persistent.PersistentAllreduce): one array summed into itself on every
    call, so its pointers, the result's place and the offload modes are set once, in the template. keep_from:
    the C loop also copies the sums from that element on into one of two tail buffers, in turn (kept)."""

    __slots__ = ("keep", "gso", "tails")

    def __init__(self, comm, flat: np.ndarray, k: int, window: int, kind_: int, keep_from: int | None = None):
        super().__init__(comm, flat.size, k, window, kind_)
        ffi, t = kernels.ffi, self.template
        self.keep = {"src": flat, "agreed": self.agreed, "done": self.done, "rounds": self.rounds, "result": flat,
                     "buffer": ffi.from_buffer(flat)}
        t.src = t.result = t.out = self.keep["buffer"]
        self.gso = gso_modes(comm.link)
        self.tails: list = []
        if keep_from is not None:
            self.tails = [np.empty(flat.size - keep_from, flat.dtype) for _ in range(2)]
            self.keep["tail buffers"] = [ffi.from_buffer(a) for a in self.tails]
            t.keep, t.keep_from = self.keep["tail buffers"][0], keep_from

    def kept(self) -> tuple[int, np.ndarray]:
        """After a call that succeeded: (keep_from, the tail it wrote); the next call writes the other buffer."""
        tail = self.tails[0]
        self.tails.reverse()
        self.keep["tail buffers"].reverse()
        self.template.keep = self.keep["tail buffers"][0]
        return self.template.keep_from, tail

    def args(self, comm, call, exps):
        """This call's arguments on the frame, as _loop_args makes them for flat, out=flat."""
        kernels.ffi.memmove(self.w, self.template, WK_SIZE)
        self.agreed.fill(wire.EXP_NONE)
        self.done.fill(0)
        _call_args(self.w, comm, call, exps, self.keep, self.gso)
        return self.w, self.keep


def _run(w, n: int, progress, heard_at: float) -> tuple[int, float]:
    """The C loop in RUN_MS chunks until it ends; its status (SILENT when nothing of the generation came for
    SWITCH_SILENT seconds) and when the switch was last heard. Between chunks: silence, progress."""
    lib = kernels.lib
    reported = heard = 0
    while True:
        now = time.monotonic()
        if w.switch_heard != heard:  # a packet of this generation (junk from the switch's address is not)
            heard, heard_at = w.switch_heard, now
        if now - heard_at >= SWITCH_SILENT:
            return SILENT, heard_at
        rc = lib.ina_wk_run(w, RUN_MS)
        if progress is not None and w.ndone != reported:
            reported = w.ndone
            progress(min(n, max(0, w.ndone - w.D) * w.k))  # sparse: blocks received
        if rc != lib.INA_WK_AGAIN:
            break
    if rc == lib.INA_WK_DONE and progress is not None:
        progress(n)
    if w.switch_heard != heard:
        heard_at = time.monotonic()
    return rc, heard_at


SILENT = -1000  # _run's status for a silent switch (not one of the C loop's)


def _learned(outcome: Outcome, w, heard_at: float) -> Outcome:
    """What the C loop counted and learned, into its Outcome: counters, drop notes, offloads, RTT."""
    ffi = kernels.ffi
    # most are zero on a healthy call (retransmissions, duplicates, drops...)
    outcome.counters = {name: n for name in COUNTERS if (n := getattr(w, name))}
    if w.retransmissions:
        outcome.counters["repairs"] = list(w.repairs)
    if w.dropped_len:  # the last ERR_DROPPED's words, for a timeout's message (as worker.py _dropped_note)
        _, reason, text = wire.unpack_error(bytes(ffi.buffer(w.dropped, w.dropped_len)))
        outcome.drop_note = text or wire.drop_reason(reason)
    outcome.gso_ok, outcome.gro_ok = bool(w.gso), bool(w.gro)
    if w.have_srtt:
        outcome.rtt = (w.srtt, w.rttvar, w.rto, w.min_rto)
    outcome.cc = ffi.new("ina_cc *", w.cc)  # a copy: the frame's struct serves the next call of its shape
    outcome.heard_at = heard_at
    return outcome


def _status_of(rc: int) -> str:
    """The Outcome status of the C loop's return code (the table made once)."""
    if not _BY_RC:
        _BY_RC.update({getattr(kernels.lib, name): status for name, status in STATUS.items()})
        _BY_RC[SILENT] = "silent"
    return _BY_RC[rc]


_BY_RC: dict = {}


def _outcome(w, rc: int, keep: dict, sparse: bool) -> Outcome:
    """The C loop's status as an Outcome; done, with how far the call's slots moved."""
    ffi = kernels.ffi
    status = _status_of(rc)
    error = bytes(ffi.buffer(w.error, w.error_len)) if w.error_len else None
    if status != "done":
        landed = _landed(w, keep, sparse)
        return Outcome(status, error=error if status == "switch_error" else None,
                       where=(w.timeout_pid, w.timeout_slot, w.timeout_tries), errno=w.sys_errno,
                       pending=error if status != "switch_error" else None, landed=landed)
    done = Outcome("done", pending=error, result=keep["result"], agreed=keep["agreed"], overflow=bool(w.overflow))
    if sparse:  # where the call's slots go on (Communicator.learn moves the generation on)
        done.rounds = keep["rounds"][:w.streams].tolist()
    else:
        done.total = w.total
    return done


def _landed(w, keep: dict, sparse: bool):
    """Per block, whether out holds its sum (a stopped call's partial result); None without out."""
    if sparse or w.out == kernels.ffi.NULL:
        return None
    return keep["done"][w.D: w.D + w.nb].astype(bool)


def decode(kind_: int, result: np.ndarray, agreed: np.ndarray, world_size: int, k: int, dtype) -> np.ndarray:
    """The allreduce values from the C loop's result buffer (as the codecs' decode, in C)."""
    lib = kernels.lib
    if kind_ == lib.INA_WK_INT32:
        return result.astype(dtype, copy=False)
    if kind_ == lib.INA_WK_FIXED:
        return kernels.fixed_dequantize(result, agreed, world_size, k)
    return natural.decode(result)  # float32: the C kernel
