"""The exceptions a Communicator raises, built from what happened, in one wording for the C and the Python
loop. Builders only: none of them changes a generation or a connection (Generation.settle does, through
Communicator.failure), so the same error can be built, spied on or re-worded without side effects.
`who` is the Communicator, read-only: its rank, job, switch, generation and link.
"""
from __future__ import annotations

import os

from inaproto import wire
from inaproto.timers import SWITCH_SILENT

from . import errors
from .errors import INAError


def of_outcome(who, outcome, call=None) -> BaseException:
    """The exception for a call's stream (or a wait on the switch) that stopped: outcome.status says why."""
    status = outcome.status
    if status == "switch_error":
        return from_datagram(who, outcome.error)
    if status == "timeout":
        return errors.CallTimeout(timeout_message(who, *outcome.where), switch=who.switch, job=who.job)
    if status == "refused":
        return refused(who)
    if status == "silent":
        return silent(who)
    if status == "bad_result":
        from .codecs import natural

        return ValueError(natural.BAD_CODE_MESSAGE)
    if status == "encode_error":
        return ValueError(f"codec {call.codec.name!r}: kernel status {outcome.errno} while encoding")
    if status == "system_error":
        return OSError(outcome.errno, f"worker socket: {os.strerror(outcome.errno)}")
    return RuntimeError(f"allreduce: unknown outcome {outcome}")


def from_datagram(who, data) -> INAError:
    """A switch's MSG_ERROR datagram as an exception: a CollectiveError (mismatch, abort, dead peer: every
    rank gets it) or a SwitchFault (restarted, not a member: a bare header)."""
    h = wire.unpack(data)
    code, subject, text = wire.unpack_error(data)
    rank = None if subject == wire.NO_RANK else subject
    kw = dict(switch=who.switch, job=who.job, rank=rank)
    if len(data) == wire.HEADER_SIZE and h.boot != who.boot:
        return errors.SwitchRestarted(
            f"rank {who.rank}: switch {who.switch} restarted (boot id {h.boot:#010x}, the job joined "
            f"{who.boot:#010x}) and lost job {who.job}'s state; the next call re-joins", **kw)
    if len(data) == wire.HEADER_SIZE:
        return errors.NotMember(
            f"rank {who.rank}: switch {who.switch} no longer has generation {who.gen.number} of job "
            f"{who.job}: the job re-formed without this worker; the next call re-joins", **kw)
    cls = errors.ERROR_CLASSES.get(wire.ERROR_NAMES.get(code, ""), INAError)
    if code == wire.ERR_PEER_DEAD and rank == who.rank:  # this process was stopped or starved meanwhile
        text = f"this rank was declared dead by the switch while it could not run (stopped?): {text}"
    return cls(f"rank {who.rank}: switch {who.switch}: {text}", **kw)


def join_refused(who, data) -> INAError:
    """The switch's answer to a join that it refused (no session: not of a generation)."""
    code, subject, text = wire.unpack_error(data)
    cls = {wire.ERR_RANK_TAKEN: errors.RankTaken, wire.ERR_PEER_DEAD: errors.PeerDead,
           wire.ERR_POOL_FULL: errors.PoolFull}.get(code, errors.JoinRejected)
    return cls(f"switch {who.switch} rejected rank {who.rank}: {text}", switch=who.switch, job=who.job,
               rank=None if subject == wire.NO_RANK else subject)


def refused(who) -> INAError:
    """A switch that is not there (UDP: its port refuses; shm: its process exited)."""
    return errors.SwitchUnreachable(
        f"rank {who.rank}: job {who.job}: no switch at {who.switch} (connection refused"
        f"{'' if who.link.refused_since is not None else '; its process exited'}): it died or was never started",
        switch=who.switch, job=who.job)


def silent(who) -> INAError:
    """Nothing heard from the switch for SWITCH_SILENT seconds while this worker waited on it."""
    seconds = max(who.link.silent_for(), SWITCH_SILENT)
    return errors.SwitchSilent(
        f"rank {who.rank}: job {who.job}: nothing heard from switch {who.switch} for {seconds:.1f} s "
        f"while waiting on it (its heartbeat answers stopped): it is stopped, hung, or the path to it is "
        f"cut; the next call re-joins", switch=who.switch, job=who.job)


def timeout_message(who, pid: int, slot: int, tries: int) -> str:
    """One wording of "gave up" for the Python and the C loop, listing the likely causes: pid and slot of the
    packet that got no result, its retransmissions so far."""
    notes = who.drop_notes
    told = f"; the switch dropped packets of this rank: {' | '.join(notes)}" if notes else ""
    return (f"rank {who.rank}: job {who.job}: no result for packet {pid} (slot {slot}) after {tries} "
            f"retransmissions in {who.timeout:g} s, although the switch at {who.switch} and the peers "
            f"seem alive (a peer that heartbeats but never makes this call?){told}; the next call re-joins")
