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

from . import kernels
from . import errors
from .codecs import natural

RUN_MS = 50  # the C loop returns this often, so signals (Ctrl-C), progress callbacks and silence checks are served


def gso_modes(comm) -> tuple[bool, bool]:
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
    loopback = comm._loopback
    if loopback is None:  # the peer does not change: asked once per connection
        try:
            loopback = comm.sock.getpeername()[0].startswith("127.")
        except OSError:
            loopback = False
        comm._loopback = loopback
    return loopback, True


def kind(codec, flat: np.ndarray):
    """The C loop's codec kind for this codec and input, or None where only the Python loop applies."""
    name = codec.native_kind(flat) if kernels.enabled() else None
    return getattr(kernels.lib, f"INA_WK_{name}") if name else None


def out_dtype(kind_: int):
    """The dtype the C loop decodes results into: int32 sums for int32, float32 for fixed and nc."""
    return np.int32 if kind_ == kernels.lib.INA_WK_INT32 else np.float32


def allreduce(comm, kind_: int, flat: np.ndarray, exps, seed: int, slots, progress, held=None, out=None):
    """Run one allreduce's packet stream on `slots` (streams.CallSlots); returns (result, agreed exponents,
    overflow flag) and moves the communicator's slot counters on.

    result holds native int32 sums (int32, fixed) or NC codes per element; with out (contiguous, of
    out_dtype(kind_), possibly flat itself) the loop decodes each result into out instead and returns it.
    Every packet carries the call's identity (comm._call, comm._call_kind, comm._call_len: set by the
    Communicator's _begin_call) and the join_ack's boot (comm.boot); results of another call are stale.
    Between the C loop's chunks (RUN_MS) comm.check_silence() raises SwitchSilent when nothing came for
    SWITCH_SILENT seconds (the heartbeat thread beats meanwhile; the switch answers each).
    Raises errors.CallTimeout when a packet gets no result within comm.timeout, comm.error_from_datagram(error)
    when the switch sends an error of this session that ends the call (worker.py _results: not a member, or
    the answer to a packet in flight; a failure's multicast becomes comm._pending if the call still completes),
    and comm.refused_error() when no switch is there (its UDP port refused for INA_WK_REFUSED_AFTER_MS, or the
    shared-memory switch is gone). held (a bool per block: this worker's block is non-zero) makes it the
    block-sparse allreduce."""
    ffi, lib = kernels.ffi, kernels.lib
    n, k = flat.size, comm.k
    src = np.ascontiguousarray(flat, dtype=np.int32 if kind_ == lib.INA_WK_INT32 else np.float32)
    nb = -(-n // k)
    agreed = np.full(nb, -128, dtype=np.int8)
    if out is not None:
        if out.dtype != out_dtype(kind_) or out.size != n or not out.flags.c_contiguous:
            raise ValueError(f"native worker loop: out must be {n} contiguous {np.dtype(out_dtype(kind_))}")
        result = out
    else:
        result = np.zeros(n, dtype=np.uint8 if kind_ == lib.INA_WK_NC else np.int32)
    total_max = nb + min(comm.window, nb)
    done = np.zeros(total_max, dtype=np.uint8)
    exps_c = np.ascontiguousarray(exps, dtype=np.int8) if exps is not None else None
    w = ffi.new("ina_wk *")
    w.fd, w.job, w.rank, w.world, w.session = comm.sock.fileno(), comm.job, comm.rank, comm.world_size, comm.session
    w.call, w.call_kind, w.call_len = comm._call & 0xFFFF, comm._call_kind, comm._call_len
    w.boot = comm.boot
    w.shm = getattr(comm.sock, "handle", None) or ffi.NULL  # hostlib.shm: rings instead of the socket
    w.window, w.k, w.kind = comm.window, k, kind_
    uses = np.ascontiguousarray(slots.uses, dtype=np.uint32)
    rounds = np.zeros(comm.window, dtype=np.uint32)
    w.first_slot, w.slot_uses, w.stream_rounds = slots.first, ffi.from_buffer("uint32_t[]", uses), ffi.from_buffer(
        "uint32_t[]", rounds)
    w.deterministic = int(getattr(comm.codec, "deterministic", False))
    w.seed = seed & kernels.MASK64
    w.src, w.n = ffi.from_buffer(src), n
    w.exps = ffi.from_buffer("int8_t[]", exps_c) if exps_c is not None else ffi.NULL
    w.agreed, w.result, w.done = ffi.from_buffer("int8_t[]", agreed), ffi.from_buffer(result), ffi.from_buffer(done)
    w.out = ffi.from_buffer(out) if out is not None else ffi.NULL
    rtt = comm.rtt  # the estimate carries over between the C and the Python loop
    w.rto, w.min_rto, w.max_rto, w.timeout = rtt.rto, rtt.min_rto, rtt.max_rto, comm.timeout
    w.have_srtt = rtt.srtt is not None
    # what the kernel refused once (the C loop clears the flag) is not tried again on this communicator
    gso, gro = gso_modes(comm)
    w.gso, w.gro = gso and getattr(comm, "_gso_ok", True), gro and getattr(comm, "_gro_ok", True)
    w.srtt, w.rttvar = rtt.srtt or 0.0, rtt.rttvar
    if held is not None:
        held_c = np.ascontiguousarray(held, dtype=np.uint8)
        w.sparse, w.held = 1, ffi.from_buffer("uint8_t[]", held_c)
    rc = lib.ina_wk_start(w)
    if rc == lib.INA_WK_NO_MEMORY:
        raise MemoryError(f"native worker loop: no memory for a window of {comm.window} x {k} elements")
    if rc != 0:
        raise ValueError(f"native worker loop: bad parameters (window {w.window}, k {w.k}, world {w.world}, "
                         f"kind {w.kind}, exponents {'given' if exps is not None else 'none'})")
    try:
        reported = received = 0
        while True:
            if w.packets_received + w.heartbeat_answers != received:  # anything at all is the switch
                received, comm._heard_at = w.packets_received + w.heartbeat_answers, time.monotonic()
            comm.check_silence()
            rc = lib.ina_wk_run(w, RUN_MS)
            if progress is not None and w.ndone != reported:
                reported = w.ndone
                progress(min(n, max(0, w.ndone - w.D) * k))  # sparse: blocks received
            if rc != lib.INA_WK_AGAIN:
                break
        if rc == lib.INA_WK_DONE and progress is not None:
            progress(n)
    finally:
        lib.ina_wk_finish(w)
        s = comm.stats
        s.packets_sent += w.packets_sent
        s.bytes_sent += w.bytes_sent
        s.packets_received += w.packets_received
        s.bytes_received += w.bytes_received
        s.heartbeat_answers += w.heartbeat_answers
        s.retransmissions += w.retransmissions
        s.duplicate_results += w.duplicate_results
        s.stale_results += w.stale_results
        s.gso_sends += w.gso_sends
        s.gro_segments += w.gro_segments
        s.switch_drops += w.switch_drops
        if w.dropped_len:  # the last ERR_DROPPED's words, for a timeout's message (as worker.py _dropped_note)
            _, reason, text = wire.unpack_error(bytes(ffi.buffer(w.dropped, w.dropped_len)))
            name = wire.DROP_REASONS[reason] if reason < len(wire.DROP_REASONS) else f"drop reason {reason}"
            comm.drop_notes = (getattr(comm, "drop_notes", []) + [text or name])[-4:]
        if gso:
            comm._gso_ok = bool(w.gso)
        if gro:
            comm._gro_ok = bool(w.gro)
        if w.have_srtt:
            rtt.srtt, rtt.rttvar, rtt.rto = w.srtt, w.rttvar, w.rto
    error = bytes(ffi.buffer(w.error, w.error_len)) if w.error_len else None
    if rc == lib.INA_WK_SWITCH_ERROR:
        raise comm.error_from_datagram(error)
    if error is not None and comm._pending is None:
        # the failure's multicast came while every round could still complete (worker.py _results): the
        # call goes on to its end; the next call raises it
        comm._pending = comm.error_from_datagram(error)
    if rc == lib.INA_WK_TIMEOUT:
        comm._rejoin = True
        raise errors.CallTimeout(comm.timeout_message(w.timeout_pid, w.timeout_slot, w.timeout_tries),
                                 switch=comm.switch, job=comm.job)
    if rc == lib.INA_WK_REFUSED:
        if w.shm == ffi.NULL and getattr(comm, "_refused_since", None) is None:
            comm._refused_since = time.monotonic()  # the Python loop's state: refused_error words it "refused"
        raise comm.refused_error()
    if rc == lib.INA_WK_ENCODE_ERROR:
        raise ValueError(f"codec {comm.codec.name!r}: kernel status {w.sys_errno} while encoding")
    if rc == lib.INA_WK_BAD_RESULT:
        comm.mark_broken("corrupt result")
        raise ValueError(natural.BAD_CODE_MESSAGE)
    if rc == lib.INA_WK_SYSTEM_ERROR:
        raise OSError(w.sys_errno, f"worker socket: {os.strerror(w.sys_errno)}")
    if held is not None:
        slots.commit(comm, rounds=rounds[:w.streams].tolist())
    else:
        slots.commit(comm, total=w.total)
    return result, agreed, bool(w.overflow)


def decode(kind_: int, result: np.ndarray, agreed: np.ndarray, world_size: int, k: int, dtype) -> np.ndarray:
    """The allreduce values from the C loop's result buffer (as the codecs' decode, in C)."""
    lib = kernels.lib
    if kind_ == lib.INA_WK_INT32:
        return result.astype(dtype, copy=False)
    if kind_ == lib.INA_WK_FIXED:
        return kernels.fixed_dequantize(result, agreed, world_size, k)
    return natural.decode(result)  # float32: the C kernel
