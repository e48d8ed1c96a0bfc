"""One allreduce's packets as a stream object, driven by Communicator's window loop (worker.py).

A stream says which packets are ready to go (`ready`), builds a packet from its key (`build`: a new
packet or a resend rebuilt bit for bit from the source tensor), takes a result (`on_result`: the key it
completes, or None), and says when it is done (`finished`). The loop owns what every stream shares: the
in-flight records, the retransmission scan with backoff, the RTT estimator and the timeout message.
The names follow the C port (csrc/ina_worker.c: entry, build, build_sparse, on_result, on_sparse_result,
finished, rtt_sample), so the two can be read side by side.
"""
from __future__ import annotations

import collections

from dataclasses import dataclass

import numpy as np

from inaproto import wire

from . import cc

SCAN_EVERY = 0.002  # seconds between retransmission scans (the C loop's SCAN_EVERY)
RTT_BATCH = 16  # RTT samples per estimator update, their minimum (the C loop's RTT_BATCH)


@dataclass
class InFlight:
    """A packet sent and not yet answered (the C loop's entry)."""

    first_sent: float
    deadline: float
    rto: float
    tries: int = 0
    seq: int = 0  # its send number (cc.Window.sent)
    flags: int = 0  # its header's flags (FLAG_CONGESTED echoed): a resend is rebuilt bit for bit
    fast: bool = False  # resent early, at a gap or a tail probe (once; then the timer: pyloop._resend_early)
    size: int = 0  # its bytes (the congestion window counts them)
    last_sent: float = 0.0  # when it last went: its first send or its latest resend


class RttEstimator:
    """The retransmission timeout (RFC 6298's SRTT/RTTVAR), clamped to [min_rto, max_rto]; carried over
    calls and shared with the C loop. An update takes the smallest of RTT_BATCH samples, each from a
    packet's first send to its result: a result that waited for a peer's retransmission, or for this
    worker's, is not a round trip, and under loss such samples held the timeout at max_rto (8 workers, 5 %
    loss: 1.8 s instead of 0.6 s). Not Karn's rule: when the timeout is below the real round trip (a queue
    the first samples did not see), every packet is resent, Karn's rule leaves no sample to correct it, and
    every packet stays resent (10 Mbit/s links: 7,700 retransmissions for 4,096 packets); the smallest
    first-send sample is a real round trip either way."""

    def __init__(self, rto: float, max_rto: float, policy: int = cc.NONE):
        self.min_rto, self.max_rto, self.rto = float(rto), float(max_rto), float(rto)
        self.policy = policy  # the congestion policy: its floor is a few round trips (cc.rto_floor)
        self.srtt: float | None = None
        self.rttvar = 0.0
        self._batch: list[float] = []

    def sample(self, r: float):
        self._batch.append(r)
        if len(self._batch) < RTT_BATCH:
            return
        r = min(self._batch)
        self._batch.clear()
        if self.srtt is None:
            self.srtt, self.rttvar = r, r / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - r)
            self.srtt = 0.875 * self.srtt + 0.125 * r
        self.rto = min(max(self.srtt + 4 * self.rttvar, cc.rto_floor(self.policy, self.srtt, self.min_rto)),
                       self.max_rto)

    def seed(self, r: float):
        """A first estimate from one round trip the join measured, where none was made yet (a policy only:
        "none" keeps its constant floor until calls measure). The timeout itself starts at START_RTO, as
        SwitchML's: one idle round trip says nothing of the queue a first call's window builds."""
        if self.srtt is None and r > 0 and self.policy != cc.NONE:
            self.srtt, self.rttvar = r, r / 2
            self.rto = min(max(cc.START_RTO, cc.rto_floor(self.policy, r, self.min_rto)), self.max_rto)


class CallSlots:
    """Where one allreduce's packets go: its j-th lane (packet q's lane is q mod W, a sparse stream's is
    its index) uses slot (first + j) mod W, and that lane's i-th packet has the slot's packet id
    uses[slot] + i (mod 2^32), so every slot's ids run on without gaps whatever the calls in between."""

    def __init__(self, first: int, uses: np.ndarray):
        self.first, self.W, self.uses = first, uses.size, uses.copy()

    def slot(self, j: int) -> int:
        return (self.first + j) % self.W

    def pid(self, j: int, i: int) -> int:
        return (int(self.uses[self.slot(j)]) + i) & wire.PACKET_ID_MASK

    def locate(self, h) -> tuple[int, int]:
        """(lane, index) of a result; a lane >= W for a slot this worker does not use."""
        if h.slot >= self.W:
            return self.W, wire.PACKET_ID_MASK + 1
        return (h.slot - self.first) % self.W, (h.packet_id - int(self.uses[h.slot])) & wire.PACKET_ID_MASK

    def commit(self, total: int | None = None, rounds=None) -> tuple[np.ndarray, int]:
        """After the call: (every slot's next packet id, the slot the next call starts on). A dense call sent
        packets 0..total-1 (lane j carries q = j, j + W, ...); a sparse one sent rounds[s] packets on stream
        s. The next call starts on the slot after the last lane used."""
        W, uses = self.W, self.uses  # uses: this call's own copy (uint32: ids wrap mod 2^32 as they should)
        if rounds is None:  # every lane sent total // W packets, the first total % W one more: slices, no index arrays
            q, r = divmod(total, W)
            if q:
                uses += np.uint32(q & wire.PACKET_ID_MASK)
            end = self.first + r
            uses[self.first:min(end, W)] += np.uint32(1)
            if end > W:
                uses[:end - W] += np.uint32(1)
            return uses, end % W
        used = np.asarray(rounds, dtype=np.int64)
        slots = (self.first + np.arange(used.size)) % W  # one vector step: a window has hundreds of lanes
        uses[slots] = ((uses[slots].astype(np.int64) + used) & wire.PACKET_ID_MASK).astype(np.uint32)
        return uses, (self.first + len(rounds)) % W


class Stream:
    """What both kinds of stream share: the call's context and its output (result, agreed exponents,
    overflow), filled from accepted results."""

    def __init__(self, comm, call, flat: np.ndarray, exps):
        """call: generation.Call (started: its seed and slots are set)."""
        self.comm, self.call, self.flat, self.exps, self.seed, self.slots = comm, call, flat, exps, call.seed, call.slots
        self.codec, self.k, self.W, self.n = call.codec, call.k, call.gen.window, comm.world_size
        self.N = flat.size
        self.nb = -(-self.N // self.k)
        self.agreed = np.full(self.nb, wire.EXP_NONE, dtype=np.int16)
        self.result = np.zeros(self.nb * self.k, dtype=self.codec.result_dtype())
        self.overflow = False

    def encode(self, block: int, exp_cur: int) -> tuple[bytes, int]:
        """Block `block` encoded with the agreed exponent: (payload, element count)."""
        lo, hi = block * self.k, min(block * self.k + self.k, self.N)
        data = self.flat[lo:hi]
        if exp_cur == wire.EXP_NONFINITE:
            data = np.zeros(hi - lo, dtype=self.flat.dtype)  # everyone raises at the end
        return self.codec.encode(data, exp_cur, self.n, self.seed, lo), hi - lo

    def store(self, block: int, h, data):
        """An accepted result's elements for `block`."""
        self.result[block * self.k:block * self.k + h.count] = wire.payload_view(data, h)


class DenseStream(Stream):
    """Packet q goes on lane q mod W; for codecs with a shared scale the data is shifted by D = min(W,
    blocks): packet q carries block q - D and this worker's exponent of block q. q is sent once q - W
    (same slot) and q - D (its exponent) are done. Lanes run on their own, as SwitchML's slots do: a lane
    waiting for a lost packet holds back only itself, not the lanes behind it."""

    def __init__(self, comm, call, flat, exps):
        super().__init__(comm, call, flat, exps)
        self.D = min(self.W, self.nb) if exps is not None else 0
        self.total = max(1, self.nb + self.D)  # an empty call still sends one empty packet: its identity is checked
        self.done = np.zeros(self.total, dtype=bool)
        self.sent = np.zeros(self.total, dtype=bool)
        self.ndone = 0
        self.una = 0  # the first packet not done
        # the packets in the order they were first sent, each one's place in it, the last send whose result
        # came (+1) and the sends below gap_scan looked at for a gap: a lane held back by a loss sends its next
        # packet late, so packet numbers are not the send order (the C loop's order)
        self.order = np.zeros(self.total, dtype=np.int64)
        self.place = np.zeros(self.total, dtype=np.int64)
        self.n_sent = self.hi_sent = self.gap_scan = 0
        self.report_every = max(1, self.total // 100)
        self.candidates = collections.deque(range(min(self.W, self.total)))  # what a completion may have freed

    def sendable(self, q: int) -> bool:
        W, D, done = self.W, self.D, self.done
        return q < self.total and not self.sent[q] and (q < W or done[q - W]) and (D == 0 or q < D or done[q - D])

    def ready(self, full):
        """The packets that may go while full() (the congestion window's) is False; those past it wait, in
        order. The first packet not done goes whatever the window: ranks whose windows differ never wait on
        each other's packets (the C loop's send_ready)."""
        if full() and self.sendable(self.una):
            yield self._sending(self.una)
        while self.candidates:
            q = self.candidates[0]
            if self.sendable(q):
                if full():
                    return
                self.candidates.popleft()
                yield self._sending(q)
            else:
                self.candidates.popleft()

    def _sending(self, q: int) -> int:
        self.sent[q] = True
        self.order[self.n_sent], self.place[q] = q, self.n_sent
        self.n_sent += 1
        return q

    def gaps(self):
        """Packets not done whose results DUPTHRESH packets sent after them passed: lost (or their results
        were); each send is looked at once, when the results pass it, in send order (RACK's; the C loop's gap)."""
        k = self.gap_scan
        while k + cc.DUPTHRESH < self.hi_sent:
            if not self.done[self.order[k]]:
                yield int(self.order[k])
            k += 1
        self.gap_scan = k

    def build(self, q: int, flags: int = 0) -> bytes:
        pid, slot = self.where(q)
        exps, nb = self.exps, self.nb
        exp_next = int(exps[q]) if exps is not None and q < nb else wire.EXP_NONE
        payload, count, exp_cur = b"", 0, 0
        if self.D <= q < self.D + nb:
            exp_cur = int(self.agreed[q - self.D]) if exps is not None else 0
            payload, count = self.encode(q - self.D, exp_cur)
        return wire.pack(wire.MSG_UPDATE, *self.comm.addressing(), pid, slot, pid & 1, count, self.codec.wire_codec,
                         exp_cur, exp_next, flags, payload, *self.call.fields())

    def on_result(self, h, data, stats) -> int | None:
        j, i = self.slots.locate(h)
        q = i * self.W + j
        if h.msg_type != wire.MSG_RESULT or q >= self.total:
            stats.stale_results += 1
            return None
        if self.done[q]:
            stats.duplicate_results += 1
            return None
        expect = 0 if q < self.D or not self.N else min(self.k, self.N - (q - self.D) * self.k)
        if h.count != expect or h.codec != self.codec.wire_codec:
            stats.stale_results += 1
            return None
        self.overflow |= bool(h.flags & wire.FLAG_OVERFLOW)
        if self.exps is not None and q < self.nb:
            self.agreed[q] = h.exp_next
        if self.D <= q < self.D + self.nb:
            self.store(q - self.D, h, data)
        self.done[q] = True
        self.ndone += 1
        if self.sent[q]:
            self.hi_sent = max(self.hi_sent, int(self.place[q]) + 1)
        while self.una < self.total and self.done[self.una]:
            self.una += 1
        self.candidates.append(q + self.W)  # its lane's next packet
        if self.D and self.D != self.W:
            self.candidates.append(q + self.D)  # the packet that carries its block
        return q

    def finished(self) -> bool:
        return self.ndone == self.total

    def where(self, q: int) -> tuple[int, int]:
        """(packet id, slot) of packet q."""
        return self.slots.pid(q % self.W, q // self.W), self.slots.slot(q % self.W)

    def report(self, q: int) -> int | None:
        """Elements done, for a progress callback, now and then."""
        return min(self.N, self.ndone * self.k) if self.ndone % self.report_every == 0 else None

    def commit(self):
        self.call.gen.advance(self.slots, total=self.total)


class SparseStream(Stream):
    """Block-sparse allreduce: block j travels on stream j mod S (S = min(W, blocks)), one lane each:
    round r of stream s is its slot's r-th use in the call.

    Round 0 announces: each worker sends no elements, only its first non-zero block of the stream (and,
    for codecs with a shared scale, that block's exponent). Every later round is about the block the
    previous result named (the smallest next block over workers, with the max exponent of the workers
    holding it): its holders send it, the others send the header alone with their next block. The switch
    emits the block once every worker has moved past it. Unlike OmniReduce, a worker without the block
    still sends a header: it acknowledges the previous result, so two sets per slot are enough to recover
    any loss. Streams end on an even round (one padding round if needed: a protocol-v1 rule that kept sets
    alternating; with per-slot packet ids it is no longer needed)."""

    def __init__(self, comm, call, flat, exps, held: np.ndarray):
        super().__init__(comm, call, flat, exps)
        S = self.S = min(self.W, self.nb)
        nonzero = np.flatnonzero(held)
        self.mine = [nonzero[nonzero % S == s].tolist() for s in range(S)]
        self.ptr, self.rounds = [0] * S, [0] * S
        self.target: list = [None] * S  # None: the announce round; BLOCK_NONE: the padding round
        self.exp_target = [wire.EXP_NONE] * S  # agreed exponent of the target block
        self.active = [False] * S  # a round of the stream is in flight
        self.to_start = list(range(S))
        self.emitted = self.streams_done = 0
        self.last_real = False  # the round last accepted carried a block

    def ready(self, full=None):
        """Every stream whose next round may start (one round each: the congestion window does not apply)."""
        starting, self.to_start = self.to_start, []
        for s in starting:
            self.active[s] = True
            yield s

    def upcoming(self, s: int, skip: int) -> tuple[int, int]:
        """This worker's next non-zero block of stream s (skipping `skip` of them) and its exponent."""
        i = self.ptr[s] + skip
        b = self.mine[s][i] if i < len(self.mine[s]) else wire.BLOCK_NONE
        return b, int(self.exps[b]) if self.exps is not None and b != wire.BLOCK_NONE else wire.EXP_NONE

    def holds_target(self, s: int) -> bool:
        return self.ptr[s] < len(self.mine[s]) and self.mine[s][self.ptr[s]] == self.target[s]

    def gaps(self):
        return ()  # one round per stream: no later packet passes one

    def build(self, s: int, flags: int = 0) -> bytes:
        pid, slot = self.where(s)
        exp_cur = self.exp_target[s] if self.exps is not None else 0
        block, count, payload = wire.BLOCK_NONE, 0, b""
        if self.target[s] == wire.BLOCK_NONE:
            nxt, exp_next = wire.BLOCK_NONE, wire.EXP_NONE
        elif self.target[s] is not None and self.holds_target(s):
            block = self.target[s]
            payload, count = self.encode(block, exp_cur)
            nxt, exp_next = self.upcoming(s, 1)
        else:
            nxt, exp_next = self.upcoming(s, 0)
        return wire.pack_sparse(wire.MSG_SPARSE_UPDATE, *self.comm.addressing(), pid, slot, pid & 1, count,
                                self.codec.wire_codec, exp_cur, exp_next, 0, block, nxt, payload,
                                *self.call.fields())

    def plausible(self, s: int, h) -> bool:
        """Whether a result can be the answer to stream s's current round: anything else is never accepted."""
        t, NONE = self.target[s], wire.BLOCK_NONE
        real = t is not None and t != NONE
        if h.codec != self.codec.wire_codec or h.block != (t if real else NONE):
            return False
        if h.count != (min(self.k, self.N - t * self.k) if real else 0):
            return False
        nxt = h.next_block
        return nxt == NONE or (nxt % self.S == s and nxt < self.nb and (not real or nxt > t))

    def on_result(self, h, data, stats) -> int | None:
        s, r = self.slots.locate(h)
        if h.msg_type != wire.MSG_SPARSE_RESULT or s >= self.S or r > self.rounds[s]:
            stats.stale_results += 1
            return None
        if r < self.rounds[s] or not self.active[s]:
            stats.duplicate_results += 1
            return None
        if not self.plausible(s, h):
            stats.stale_results += 1
            return None
        t = self.target[s]
        self.overflow |= bool(h.flags & wire.FLAG_OVERFLOW)
        self.last_real = t is not None and t != wire.BLOCK_NONE
        if self.last_real:
            self.store(t, h, data)
            self.agreed[t] = h.exp_cur
            self.emitted += 1
            if self.holds_target(s):
                self.ptr[s] += 1
        self.active[s] = False
        self.rounds[s] += 1
        self.target[s], self.exp_target[s] = h.next_block, h.exp_next
        if h.next_block != wire.BLOCK_NONE or self.rounds[s] % 2:
            self.to_start.append(s)
        else:
            self.streams_done += 1
        return s

    def finished(self) -> bool:
        return self.streams_done == self.S

    def where(self, s: int) -> tuple[int, int]:
        """(packet id, slot) of stream s's current round."""
        return self.slots.pid(s, self.rounds[s]), self.slots.slot(s)

    def report(self, s: int) -> int | None:
        """Elements done, for a progress callback, when the round just accepted carried a block."""
        return min(self.N, self.emitted * self.k) if self.last_real else None

    def commit(self):
        self.call.gen.advance(self.slots, rounds=self.rounds)
