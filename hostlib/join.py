"""The join barrier, as a worker runs it: a join repeated every JOIN_REPEAT until the switch's join_ack, the
switch's cookie echoed from its first join_wait on (docs/protocol.md, "Joins"), a re-join proven with the
session of the generation it leaves; a refusal, a silent switch or missing ranks named by the time limit."""
from __future__ import annotations

import secrets
import time

from inaproto import auth
from inaproto.timers import JOIN_REPEAT

from . import errors, failures, wire
from .generation import Generation

JOIN_ANSWERS = (wire.MSG_JOIN_WAIT, wire.MSG_JOIN_ACK, wire.MSG_ERROR)


def join(comm, window: int, timeout: float, elements: int = 0) -> Generation:
    """The join barrier; elements: per packet (0: the switch's maximum), the same on every rank. Returns
    the generation the switch's join_ack gives."""
    nonce = secrets.randbits(64)
    window, elements = min(window, 0xFFFF), min(elements, 0xFFFF)
    mac = (auth.join_mac(comm.key, comm.job, comm.rank, nonce, comm.world_size, window, elements) if comm.key
           else bytes(wire.JOIN_MAC_SIZE))
    # a member of a generation re-joining from its address proves it with that generation's session
    proof = comm.gen.session if comm.gen is not None else 0
    packet = wire.pack_join(comm.job, comm.rank, nonce, comm.world_size, window, mac, elements,
                          group=comm.group is not None, session=proof)
    echo = nonce & wire.PACKET_ID_MASK  # the switch's answers to this join carry it (others are not ours)
    deadline = time.monotonic() + timeout
    joined, heard, refused, confirmed, rtt = 0, False, False, False, 0.0
    comm.link.answered()  # refusals count from this join on
    while True:
        sent_at = time.monotonic()  # before the send: the packet's delay starts inside it (a netem queue's did)
        comm.chan.send(packet)
        until = min(time.monotonic() + JOIN_REPEAT, deadline)
        while time.monotonic() < until:
            comm.chan.wait(until - time.monotonic())
            while (data := comm.chan.recv()) is not None:
                if not data:
                    refused = True
                    continue
                try:
                    h = wire.unpack(data)
                except wire.WireError:
                    continue
                if h.job != comm.job or h.packet_id != echo or h.msg_type not in JOIN_ANSWERS:
                    continue  # not an answer to this join: a late one to an earlier join, or a forged join's
                rtt = rtt or time.monotonic() - sent_at  # the first answer: a round trip of the idle path
                heard = True
                comm.link.heard()
                if h.msg_type == wire.MSG_ERROR and h.session == 0:
                    raise failures.join_refused(comm, data)
                if h.msg_type == wire.MSG_JOIN_WAIT:
                    joined = int.from_bytes(data[wire.HEADER_SIZE:wire.HEADER_SIZE + 8], "big")
                    packet = wire.confirm_join(packet, data)  # its cookie: the switch counts the join with it
                    if not confirmed:  # at once the first time, then with every repeat
                        confirmed = True
                        comm.chan.send(packet)
                if h.msg_type == wire.MSG_JOIN_ACK:
                    gen = Generation(h, data)
                    gen.join_rtt = rtt
                    return gen
        if not heard:
            comm.check_switch()
        else:  # a switch that answered this join and then stopped answering is named, not waited for
            comm.check_silence()
        if time.monotonic() >= deadline:
            where = f"{comm.address[0]}:{comm.address[1]}"
            if not heard:
                why = "connection refused" if refused else "no answer"
                raise errors.CallTimeout(f"rank {comm.rank}: switch at {where} unreachable ({why}) after "
                                         f"{timeout:g} s", switch=comm.switch, job=comm.job)
            missing = [r for r in range(comm.world_size) if not joined >> r & 1 and r != comm.rank]
            raise errors.CallTimeout(f"rank {comm.rank}: job {comm.job}: ranks {missing} did not join "
                                     f"within {timeout:g} s (a peer is dead or missing)",
                                     rank=missing[0] if missing else None, switch=comm.switch, job=comm.job)

def withdraw(comm):
    """A join given up: a leave without a session withdraws this address's pending claim on the rank,
    so a new process can take it at once (instead of after the claim expires)."""
    try:
        comm.chan.sock.send(wire.pack(wire.MSG_LEAVE, job=comm.job, rank=comm.rank))
    except OSError:
        pass
