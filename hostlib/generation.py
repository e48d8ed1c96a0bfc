"""One home for a call's life (protocol v3): the Generation a join gives, with every transition that ends
it; the Call, whose identity every packet carries; the Outcome that says how a call's packet stream ended
(from the C loop or the Python loop); and the Link, what this worker hears of its switch.

A generation lives from a join_ack to its first failure. A failure the switch multicasts while this rank's
call can still complete is *pending*: the call ends exactly, and the next one raises it (every rank raises
the same). Every failure *ends* the generation: the next call joins a new one first; a corrupt result
*breaks* the connection (every later call raises until the user reconnects). Generation.settle is the one
place where what happened becomes a transition (TRANSITIONS); the loops report what happened (an Outcome)
and Communicator.failure builds the exception and settles it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from inaproto import wire

from .streams import CallSlots

DROP_NOTES_KEPT = 4  # the switch's last words about this worker's dropped packets, for a timeout's message

# (state, what happened, next state): every transition Generation.settle makes; an event not listed for a
# state leaves it as it is (a done call, a local error before the abort). tools/draw_architecture.py draws them.
TRANSITIONS = (
    ("live", "pending", "pending"),  # the switch failed the generation; this call can still complete exactly
    ("ended", "pending", "pending"),  # ... told after this rank gave up the generation (kept for the next call)
    ("pending", "raised", "ended"),  # a call raised the pending failure (every rank raises the same)
    ("live", "raised", "ended"),
    ("live", "switch_error", "ended"),  # an error answering this call, or the switch no longer has the generation
    ("live", "timeout", "ended"),  # no result within the timeout
    ("live", "silent", "ended"),  # nothing heard from the switch for SWITCH_SILENT seconds
    ("live", "refused", "ended"),  # nobody listens at the switch's port, or the shm switch is gone
    ("live", "aborted", "ended"),  # this rank's call failed on its own: aborted at the switch
    ("live", "bad_result", "broken"),  # a corrupt result: the connection is unusable, reconnect
    ("pending", "bad_result", "broken"),
    ("ended", "bad_result", "broken"),
)
EVENTS = frozenset(e for _, e, _ in TRANSITIONS) | {"done", "encode_error", "system_error"}
_NEXT = {(a, e): b for a, e, b in TRANSITIONS}


class Generation:
    """What one join gave: the session and boot id every packet carries, the agreed window and elements per
    packet, each slot's next packet id, the call number; and whether it failed."""

    def __init__(self, h, data: bytes):
        """From the switch's join_ack (h: its header, data: the datagram)."""
        self.number, self.slots, self.max_elements, self.window, self.first_id = (
            wire.JOIN_ACK_PAYLOAD.unpack_from(data, wire.HEADER_SIZE))
        self.session, self.boot = h.session, h.boot
        # per slot: its uses since the join (the next packet id on it, mod 2^32); the slot the next call starts on
        self.uses = np.full(self.window, self.first_id, dtype=np.uint32)
        self.next_slot = 0
        self.calls = 0  # the call number on the wire: calls since this join
        self.state = "live"  # live, pending, ended or broken (TRANSITIONS)
        self.pending = None  # in state pending, the failure told while a call could still complete
        self.drop_notes: list[str] = []
        self.join_rtt = 0.0  # the join's first round trip (join.join): the path's, before any queue

    def call(self, kind: int, length: int, codec, k: int) -> "Call":
        """The next call's identity (its seed and slots come when it starts: Call.start)."""
        return Call(self, self.calls & wire.CALL_NUMBER_MASK, kind, length, codec, min(k, self.max_elements))

    def slots_for_call(self) -> CallSlots:
        return CallSlots(self.next_slot, self.uses)

    def advance(self, slots: CallSlots, total: int | None = None, rounds=None):
        """After a call's stream ended: its slots' next packet ids, and the slot the next call starts on."""
        self.uses, self.next_slot = slots.commit(total=total, rounds=rounds)

    def called(self):
        """A call ended (exact or not): the next one has the next number."""
        self.calls += 1

    # ---------------------------------------------------------------- failure transitions
    def settle(self, event: str, error: BaseException | None = None):
        """What happened (an Outcome's status, or "pending", "raised", "silent", "aborted") as this
        generation's transition (TRANSITIONS); error: the pending failure's exception (the first one told)."""
        if event not in EVENTS:
            raise ValueError(f"generation: unknown event {event!r}")
        after = _NEXT.get((self.state, event), self.state)
        if after == "pending" and self.pending is None:
            self.pending = error
        elif after != "pending":
            self.pending = None
        self.state = after

    @property
    def ended(self) -> bool:
        """Failed, given up or broken: the next call raises its pending failure or joins a new generation."""
        return self.state != "live"

    def take_pending(self):
        """The failure the next call raises (once), or None."""
        error = self.pending
        if error is not None:
            self.settle("raised")
        return error

    def note_drop(self, text: str):
        self.drop_notes = (self.drop_notes + [text])[-DROP_NOTES_KEPT:]


class Call:
    """One allreduce: its number, kind (codec, dense/sparse) and length, the three fields the switch checks
    across ranks, packed with the generation's session and boot into every packet; its codec and elements
    per packet (a call's own: one join serves every codec); its RNG seed and slots once started."""

    __slots__ = ("gen", "number", "kind", "length", "codec", "k", "seed", "slots", "done")

    def __init__(self, gen: Generation, number: int, kind: int, length: int, codec, k: int):
        self.gen, self.number, self.kind, self.length, self.codec, self.k = gen, number, kind, length, codec, k
        self.seed, self.slots = 0, None
        self.done = False  # complete on the wire: what it raises now, every rank raises (no abort)

    def start(self, seed: int):
        self.seed, self.slots = seed, self.gen.slots_for_call()

    def fields(self) -> tuple[int, int, int, int, int]:
        """(session, call_kind, call, call_len, boot), in wire.pack's argument order."""
        return self.gen.session, self.kind, self.number, self.length & wire.MAX_CALL_LEN, self.gen.boot


@dataclass
class Outcome:
    """How a call's packet stream ended. status: "done" (result, agreed exponents, overflow flag), or what
    stopped it: "switch_error" (error: the switch's datagram), "timeout" (where: packet id, slot,
    retransmissions), "refused" (nothing listens), "encode_error", "bad_result" (a corrupt result: the
    connection is unusable), "system_error" (errno). pending: a failure's datagram told while the call could
    still complete (the next call raises it). landed (the C loop writing into out, a call that stopped): a
    bool per block of k elements, whether out holds that block's sum (a recovery needs only the others).
    What the C loop learned on the way, for the Communicator to take in (Communicator.learn): its counters,
    the round-trip estimate (srtt, rttvar, rto), the switch's last drop note, whether the kernel refused
    GSO/GRO, and when the switch was last heard."""

    status: str
    error: bytes | None = None
    where: tuple[int, int, int] | None = None
    errno: int = 0
    pending: bytes | None = None
    result: np.ndarray | None = None
    agreed: np.ndarray | None = None
    overflow: bool = False
    landed: np.ndarray | None = None
    counters: dict | None = None
    rtt: tuple[float, float, float, float] | None = None  # srtt, rttvar, rto, min_rto
    cc: object = None  # the C loop's congestion window as it left it (an ina_cc struct; Communicator.cc)
    drop_note: str | None = None
    gso_ok: bool = True
    gro_ok: bool = True
    heard_at: float | None = None
    total: int | None = None  # done, dense: packets the call sent (Generation.advance)
    rounds: list | None = None  # done, sparse: rounds per stream


class Link:
    """What this worker hears of its switch: when it was last heard (silence: SWITCH_SILENT) and since when
    its port refuses (REFUSED_AFTER); and the socket offloads the kernel took (fastpath.gso_modes)."""

    def __init__(self):
        self.heard_at = time.monotonic()
        self.refused_since: float | None = None
        self.loopback: bool | None = None  # whether the switch is on loopback (asked once)
        self.gso_ok = self.gro_ok = True  # cleared when the kernel refused UDP GSO / GRO on this socket

    def heard(self):
        self.heard_at, self.refused_since = time.monotonic(), None

    def answered(self):
        """Something listens at the switch's address (not yet proven to be the switch)."""
        self.refused_since = None

    def refused(self):
        if self.refused_since is None:
            self.refused_since = time.monotonic()

    def start_waiting(self):
        """A call or join begins: silence counts from now."""
        self.heard_at = time.monotonic()

    def silent_for(self) -> float:
        return time.monotonic() - self.heard_at
