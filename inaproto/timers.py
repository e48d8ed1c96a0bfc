"""The protocol's timers and rate limits, defined once: the switch's control plane (switchsim/control.py),
the worker (hostlib), the C loops' header (csrc/ina_wire.h, `python -m inaproto.gen_c`) and the constants
table of docs/protocol.md (`python -m inaproto.gen_doc`) take them from here. Seconds unless said.
"""
from __future__ import annotations

# ---------------------------------------------------------------- the worker
JOIN_REPEAT = 0.1  # a join is sent this often until acked (and once at once after the first join_wait)
# a heartbeat this often, in calls and between them, from a thread that needs no interpreter lock; six fall
# in PEER_SILENT and in SWITCH_SILENT, so a few lost datagrams (5 % loss each way) never look like silence
HEARTBEAT_EVERY = 0.5
# nothing heard from the switch this long while waiting on it (a call, or a join it answered): SwitchSilent
SWITCH_SILENT = 3.0
REFUSED_AFTER = 0.5  # "connection refused" this long with nothing heard: no switch listens there
ABORT_WAIT = 1.0  # an abort is repeated every 100 ms at most this long, until the switch's error confirms it
# the retransmission timeout (hostlib's choice, hostlib/cc.py; any timer works): its floor under cc="none" (a
# constant, as SwitchML's timer), and under a policy RTO_FLOOR and RTO_RTTS smoothed round trips (a scheduler's
# hiccup on a loaded host is not a loss); a packet's first timeout before the call's first result and in slow
# start (the peers may not be in the call; no estimate has seen the queue a doubling window builds)
RTO_NONE = 0.03
RTO_FLOOR = 0.005
RTO_RTTS = 4.0
START_RTO = RTO_NONE
# under a policy: a dense call that has sent every packet has no later send to show a loss as a gap, so a packet
# unanswered TAIL_PROBE_RTTS smoothed round trips after its last send is resent once (RFC 8985's tail loss
# probe); an early resend (a gap's, a probe) lost too is resent again EARLY_RTO_RTTS round trips later, not at
# the floor, which spurious resends may have raised to START_RTO
TAIL_PROBE_RTTS = 2
EARLY_RTO_RTTS = 3

# ---------------------------------------------------------------- the switch
JOIN_EXPIRY = 3.0  # a pending join lives this long without being repeated
MEMBER_IDLE = 3.0  # a keyless job's member silent this long (no packet) may have its rank taken over
PEER_SILENT = 3.0  # a member silent this long (no data packet, no heartbeat) is dead: its generation fails
CLAIM_ACTIVE = 0.3  # a claim repeated this long after another address asked is a live process's
TAKEN_AFTER = 1.5  # a rank held by a live generation is refused once every member was heard this long after

# rate limits: (per second, burst)
CONTROL_RATE = (2000.0, 200)  # requests of non-members handled, all sources together
SOURCE_RATE = (50.0, 20)  # requests of non-members handled per source address
MEMBER_RATE = (20000.0, 2000)  # members' requests, where a data plane meters every punt (the P4 program)
ERROR_RATE = (50.0, 50)  # join errors sent
STATS_RATE = (20.0, 20)  # stats replies sent
SOURCES_KEPT = 4096  # source addresses whose budget the control plane remembers (least recently heard go)
