"""The worker protocol loop in Python (the C loop's twin: fastpath.py): drive a call's stream (streams.py) to
its end over the Communicator's channel — send what the window allows, take results, resend what is overdue
(a timeout per packet, backing off), name a silent or absent switch — and decode the result. Used where the
C loop does not apply (INA_KERNELS=numpy, fast=False, GPU codes, layouts the kernels do not take).
"""
from __future__ import annotations

import time

import numpy as np

from . import cc, wire
from .channel import parse
from .generation import Outcome
from .streams import SCAN_EVERY, DenseStream, InFlight


def window_loop(comm, stream, progress) -> np.ndarray:
    """Drive a stream to the end and decode its result."""
    drive(comm, stream, progress)
    values = stream.codec.decode(stream.result, stream.agreed, comm.world_size, stream.k)[:stream.N]
    return values.astype(stream.flat.dtype, copy=False)

def drive(comm, stream, progress):
    """Drive a stream (streams.py) to the end: send what is ready, take results, resend what is overdue;
    then raise what the agreed exponents or the OVERFLOW flag say."""
    inflight: dict[int, InFlight] = {}
    next_scan = 0.0
    gen, window = stream.call.gen, comm.cc
    first_result = None  # when the call's first result came: the peers are in the call (cc.Window.result)
    # bytes in flight: the window counts packets of a full packet's bytes (the C loop's inflight)
    load, full_packet = [0], wire.HEADER_SIZE + stream.k * wire.ELEMENT_SIZE[stream.codec.wire_codec]
    while not stream.finished():
        now = time.monotonic()
        for key in stream.ready(lambda: load[0] >= window.allowed(stream.W) * full_packet):
            if gen.pending is not None:  # a new round in a failed generation can never complete
                raise gen.take_pending()
            flags = window.take_echo() if isinstance(stream, DenseStream) else 0
            packet = stream.build(key, flags)
            comm.chan.send(packet)
            rto = comm.rtt.rto if window.policy == cc.NONE or not window.early(first_result) else \
                max(comm.rtt.rto, cc.START_RTO)
            inflight[key] = InFlight(now, now + rto, rto, seq=window.sent, flags=flags, size=len(packet),
                                     last_sent=now)
            window.sent += 1
            load[0] += len(packet)
        comm.chan.wait(SCAN_EVERY if inflight else 0.0)
        got = False
        for h, data in _results(comm, stream, inflight):
            key = stream.on_result(h, data, comm.stats)
            if key is None:
                continue
            now, got = time.monotonic(), True
            first_result = first_result or now
            rec = inflight.pop(key)
            load[0] -= rec.size
            _answered(comm, stream, rec, h, now, first_result)
            if progress is not None and (done := stream.report(key)) is not None:
                progress(done)
        if got and window.policy != cc.NONE:
            _gaps(comm, stream, inflight, time.monotonic())
        now = time.monotonic()
        if now >= next_scan:
            next_scan = now + SCAN_EVERY
            _scan(comm, stream, inflight, now, first_result)
            comm.check_switch()
            comm.check_silence()
    stream.commit()
    if progress is not None:
        progress(stream.N)
    comm.check_result(stream.call, stream.exps, stream.agreed, stream.overflow)

def _answered(comm, stream, rec: InFlight, h, now: float, first_result: float):
    """A packet's result came: a round-trip sample; a resend answered sooner than half a round trip
    after it went answered an earlier send: it was spurious. A dense call's
    result steps the congestion window (a round trip of the path only for a packet sent once, after the
    call's first result: cc.Window.result)."""
    srtt = comm.rtt.srtt
    if rec.tries and srtt is not None and now - rec.last_sent < srtt / 2:
        comm.stats.spurious_retransmissions += 1
        # the timer was short, or a gap's resend early: either way the floor goes up (the C loop says why)
        comm.rtt.min_rto = cc.spurious_floor(comm.rtt.policy, comm.rtt.min_rto, min(cc.START_RTO, comm.rtt.max_rto))
    if rec.tries and srtt is not None:
        comm.stats.repair(now - rec.first_sent, srtt)
    comm.rtt.sample(now - rec.first_sent)
    if isinstance(stream, DenseStream):
        path = rec.tries == 0 and rec.first_sent >= first_result
        comm.cc.result(rec.seq, now - rec.first_sent if path else -1.0, bool(h.flags & wire.FLAG_CONGESTED),
                       stream.W)


def _gaps(comm, stream, inflight: dict, now: float):
    """Resend at once, once, every packet a gap shows lost (stream.gaps: TCP's fast retransmit)."""
    for key in stream.gaps():
        rec = inflight.get(key)
        if rec is None or rec.fast:
            continue
        _resend_early(comm, stream, key, rec, now)


def _resend_early(comm, stream, key: int, rec: InFlight, now: float):
    """An early resend (a gap, a tail probe), once a send: should it be lost too, its timer fires
    cc.EARLY_RTO_RTTS round trips later, not after the timeout's floor, which spurious resends may have raised
    to START_RTO (the C loop's resend_early)."""
    comm.chan.send(stream.build(key, rec.flags))
    comm.stats.retransmissions += 1
    comm.stats.fast_retransmits += 1
    srtt = comm.rtt.srtt
    rec.fast, rec.tries, rec.last_sent = True, rec.tries + 1, now
    rec.deadline = now + (rec.rto if srtt is None else min(rec.rto, cc.EARLY_RTO_RTTS * srtt))


def _scan(comm, stream, inflight: dict, now: float, first_result):
    """Rebuild and resend every packet whose timeout expired, backing off; give up after comm.timeout. At a
    dense call's tail, a packet unanswered cc.TAIL_PROBE_RTTS round trips after its last send is resent once
    before its timeout (_tail_probe)."""
    for key, rec in inflight.items():
        if now < rec.deadline and _tail_probe(comm, stream, rec, now, first_result):
            _resend_early(comm, stream, key, rec, now)
            continue
        if now < rec.deadline:
            continue
        if now - rec.first_sent > comm.timeout:
            pid, slot = stream.where(key)
            raise comm.failure(Outcome("timeout", where=(pid, slot, rec.tries)), stream.call)
        comm.chan.send(stream.build(key, rec.flags))
        comm.stats.retransmissions += 1
        rec.rto = min(rec.rto * 2, comm.rtt.max_rto)
        rec.deadline, rec.tries, rec.last_sent = now + rec.rto, rec.tries + 1, now


def _tail_probe(comm, stream, rec: InFlight, now: float, first_result) -> bool:
    """Every packet sent once (no later send can show a loss as a gap), a result seen (the peers are in the
    call), a policy in force: a packet not resent yet and cc.TAIL_PROBE_RTTS round trips past its last send
    (the C loop's tail_probe)."""
    srtt = comm.rtt.srtt
    return (isinstance(stream, DenseStream) and comm.policy != cc.NONE and srtt is not None and
            first_result is not None and not rec.fast and stream.n_sent == stream.total and
            now - rec.last_sent >= cc.TAIL_PROBE_RTTS * srtt)


def _results(comm, stream, inflight: dict):
    """Parsed datagrams waiting on the socket. A switch's error of this generation ends the call when
    the call cannot complete: the switch no longer has the generation, or the error answers a packet
    in flight; otherwise (the failure's multicast) it is pending and every packet in flight is resent
    at once: rounds that completed answer with their result, so a call that completed on the peers
    completes here too, and the next call raises."""
    gen = stream.call.gen
    while (data := comm.chan.recv()) is not None:
        h = parse(data)
        if h is None:
            continue
        if h.job != comm.job or h.session != gen.session:
            comm.stats.stale_results += 1  # not of this job's generation
            continue
        comm.link.heard()  # of this generation: the switch (junk from its address is not)
        if h.msg_type == wire.MSG_HEARTBEAT:
            continue  # the switch's answer to a heartbeat: it is alive
        if h.msg_type == wire.MSG_ERROR and comm.dropped_note(data):
            continue
        if h.msg_type == wire.MSG_ERROR:
            answered = h.flags & wire.FLAG_REPLY and any(stream.where(k) == (h.packet_id, h.slot) for k in inflight)
            if len(data) == wire.HEADER_SIZE or answered:
                raise comm.failure(Outcome("switch_error", error=data), stream.call)
            gen.settle("pending", comm.error_from_datagram(data))
            for rec in inflight.values():
                rec.deadline = 0.0
            continue
        yield h, data
