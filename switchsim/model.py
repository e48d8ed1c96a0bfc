"""Reference model of the INA switch data plane. Every other backend is tested against this file.

It follows SwitchML's per-packet state machine (docs/protocol.md, "Switch state machine"): S slots x 2
sets per job, worker bitmaps with the clear-the-other-set rule, write on first / add / read-only on
duplicate, multicast on completion, unicast resend of a completed set, drop otherwise, max exponent.
Block-sparse rounds (OmniReduce-style, wire.MSG_SPARSE_UPDATE) use the same slots, sets, bitmaps and
packet ids: in a round every worker sends either the round's block or no elements, and each packet says
where its sender's next non-zero block is; the round completes when every worker has moved past the block,
and its result carries the smallest next block, so all workers know which block the next round is about.
Where SwitchML's P4 can be driven into silent wrong sums by stale packets (a late duplicate from a worker
that has moved on, a worker two uses ahead), the model compares packet ids and drops them instead: a packet
id counts the uses of its slot, and a new round is accepted only with the one id it must have (the slot's
previous round + 1, that round complete).
Admission (protocol v2): data packets are accepted only from the address each rank joined from and with
the generation's session value; the join barrier itself is the control plane's (switchsim/control.py).

The model is transport-free: `process(data, src)` returns the packets to send as (bytes, address) pairs,
where addresses are whatever the transport passes in (a UDP (host, port) tuple, a test's port number).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from inaproto import nc, wire

from .config import SwitchConfig, config_of
from .control import ControlPlane

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

# counters kept per slot (arrays of shape [slots]) and switch-wide drop reasons: wire.py names them
SLOT_COUNTERS = wire.SLOT_COUNTERS
DROP_REASONS = wire.DROP_REASONS


def serial_gt(a: int, b: int) -> bool:
    """a > b in 32-bit serial-number arithmetic (RFC 1982): packet ids may wrap."""
    return 0 < ((a - b) & 0xFFFFFFFF) < 0x80000000


def _next_round(st, other, x: int, first_id: int):
    """The one packet id a new round of (slot, set x) may have: the slot's previous round (in the other
    set) + 1 once that round is complete; the generation's first id (even) in set 0 for a fresh slot.
    None: no new round may start."""
    if other.round_id is None:
        return first_id if x == 0 and st.round_id is None else None
    return (other.round_id + 1) & wire.PACKET_ID_MASK if other.complete else None


def _behind_or_ahead(pid: int, expected) -> str:
    return "ahead" if expected is None or serial_gt(pid, expected) else "stale"


@dataclass
class SlotSet:
    """One (slot, set) pair: what SwitchML keeps in registers, plus the round's packet id."""

    bitmap: int = 0
    count: int = 0
    round_id: int | None = None
    complete: bool = False
    codec: int = wire.CODEC_NONE
    n_elems: int = 0
    exp_cur: int = 0
    exp_max: int = wire.EXP_NONE
    acc: np.ndarray | None = None
    result: bytes = b""  # payload of the result, kept for unicast resends
    flags: int = 0
    call_id: tuple = (0, 0, 0)  # (call, call_kind, call_len) of the round's first packet
    writer: int = 0  # the rank whose packet started the round (named in a call mismatch)
    sparse: bool = False  # a block-sparse round: the fields below apply
    block: int = wire.BLOCK_NONE  # the block the round's elements belong to (none yet: BLOCK_NONE)
    next_block: int = wire.BLOCK_NONE  # smallest next non-zero block over the workers heard so far


@dataclass
class Job:
    job_id: int
    world_size: int
    slots: int
    max_elements: int
    sets: list = field(default_factory=list)  # sets[2*slot + set]
    addresses: list = field(default_factory=list)  # rank -> the address it joined from (admitted)
    counters: dict = field(default_factory=dict)
    generation: int = 0  # 0: never admitted, no data packet is accepted
    session: int = 0
    first_id: int = 0  # every slot's first round has this packet id
    heard: list = field(default_factory=list)  # rank -> admitted packets (the control plane's liveness)
    failed: bytes | None = None  # the generation failed: the error (code, rank, text) every data packet gets
    elements: int = 0  # the generation's agreed elements per packet
    group: object = None  # where a completed round's result goes once for every member; None: one per member
    told: list = field(default_factory=list)  # rank -> bitmask of TOLD_DROPS reasons answered this generation

    def __post_init__(self):
        self.reset_slots()
        self.counters = {name: np.zeros(self.slots, dtype=np.int64) for name in SLOT_COUNTERS}
        self.heard = [0] * self.world_size

    def reset_slots(self):
        self.sets = [SlotSet() for _ in range(2 * self.slots)]


def _kind_call_len(st: SlotSet) -> tuple[int, int, int]:
    """A round's call identity in pack_sparse's argument order (call_kind, call, call_len)."""
    call, kind, n = st.call_id
    return kind, call, n


class Switch:
    """The data plane of one switch, shared by any number of isolated jobs, with its control plane."""

    def __init__(self, config: SwitchConfig | dict[int, int], **kw):
        """Args:
            config: a SwitchConfig, or the jobs dict (job id -> world size) with SwitchConfig's fields as
                keywords, so tests can write Switch({1: 2}, slots=4).
            **kw: SwitchConfig fields (with a jobs dict), or the control plane's options (secret, clock,
                join_expiry, member_idle).

        Raises:
            ValueError: an invalid configuration (SwitchConfig's checks).
        """
        self.config, control = config_of(config, kw)
        c = self.config
        self.jobs: dict[int, Job] = {j: Job(j, n, c.slots, c.max_elements) for j, n in c.jobs.items()}
        self.slots, self.max_elements = c.slots, c.max_elements
        self.nc_deterministic = c.nc_rounding == "deterministic"
        self.seed = c.seed
        self.nc_elements_rounded = 0  # counter for the switch's NC random stream
        self.drops = dict.fromkeys(DROP_REASONS, 0)
        self.packets_in = self.packets_out = 0
        self.overflows = 0
        self.boot = 0  # the control plane sets the switch's boot id (set_boot)
        self.control = ControlPlane(self, c, **control)

    # ------------------------------------------------------------------ entry point
    def process(self, data, src) -> list[tuple[bytes, object]]:
        """Handle one received packet. Transport-free, so every server (and the tests) drive the same
        reference and faster backends are compared with it packet for packet.

        Args:
            data: the datagram's bytes.
            src: the sender's address, in whatever form the server uses (compared, never parsed).

        Returns:
            The packets to emit, as (bytes, destination address); empty for a drop, which is counted.
            Never raises on bad input: a hostile packet must not stop the switch.
        """
        self.packets_in += 1
        try:
            h = wire.unpack(data)
        except wire.WireError as e:
            return self._malformed(data, src, str(e))
        if h.msg_type in (wire.MSG_UPDATE, wire.MSG_SPARSE_UPDATE):
            out = self._update(h, data, src)
        elif h.msg_type in wire.CONTROL_REQUESTS:
            out = self.control.handle(h, data, src)
        else:  # results, acks... are never sent to a switch
            return self._malformed(data, src, f"a {wire.MSG_NAMES[h.msg_type]} is never sent to a switch")
        self.packets_out += len(out)
        return out

    def _drop(self, reason, job: Job | None = None, slot: int | None = None):
        self.drops[reason] += 1
        if job is not None and slot is not None:
            job.counters["dropped"][slot] += 1
        return []

    # ------------------------------------------------------------------ what the control plane calls
    def admit(self, job_id: int, generation: int, session: int, first_id: int, addresses: list,
              elements: int | None = None, group=None):
        """A new generation: these ranks' addresses, its session and first packet id, clean slots. The
        control plane decides; the data plane only checks, so every backend gets the same decision.

        Args:
            job_id: a job the switch serves.
            generation: the generation's number (0 would admit nothing).
            session: the value every data packet of the generation must carry.
            first_id: every slot's first packet id.
            addresses: rank -> the address it joined from.
            elements: the generation's elements per packet (None: the switch's maximum); a data packet
                with more is dropped as bad_slot.
            group: where a completed round's result goes once for every member (rank NO_RANK, FLAG_GROUP),
                or None: a copy to each member's address.

        Raises:
            KeyError: a job the switch does not serve.
        """
        job = self.jobs[job_id]
        job.generation, job.session, job.first_id, job.addresses = generation, session, first_id, list(addresses)
        job.failed = None
        job.told = [0] * job.world_size
        job.elements = self.max_elements if elements is None else elements
        job.group = group
        job.reset_slots()

    def add_job(self, job_id: int, world_size: int, slots: int, base: int = 0):
        """A shared switch admitted a job (switchsim/control.py): slots of its own, clean, no generation yet
        (admit follows). base, its offset in the switch's pool, is the P4 program's (one register pool).

        Raises:
            ValueError: a job already served.
        """
        if job_id in self.jobs:
            raise ValueError(f"job {job_id} is served already")
        self.jobs[job_id] = Job(job_id, world_size, slots, self.max_elements)

    def remove_job(self, job_id: int):
        """The job ended: its slots and state go; its later packets are dropped as unknown_job.

        Raises:
            KeyError: a job not served.
        """
        del self.jobs[job_id]

    def set_boot(self, boot: int):
        """The switch's boot id, which everything it sends carries (a worker tells a restart by it)."""
        self.boot = boot

    def fail(self, job_id: int, code: int, rank: int, text: str) -> list[tuple[bytes, object]]:
        """The job's generation failed (a call mismatch, an abort, a dead member): every member gets the
        error now, and every later data packet of the generation gets it again, until the ranks re-join.
        The first failure stands; a second one only repeats it.

        Args:
            job_id: a job the switch serves, with an admitted generation.
            code, rank, text: the error (wire.ERR_*, the rank it names, the reason).

        Returns:
            The error for each member, as (bytes, address); empty for a job without a generation.
        """
        job = self.jobs[job_id]
        if not job.generation:
            return []
        if job.failed is None:
            job.failed = wire.ERROR_PAYLOAD.pack(code, rank) + text.encode()[:wire.MAX_ERROR_TEXT]
        return [(self._error(job, r), job.addresses[r]) for r in range(job.world_size)]

    def failed(self, job_id: int) -> bool:
        """Whether the job's current generation failed (the control plane frees its ranks)."""
        return self.jobs[job_id].failed is not None

    def _error(self, job: Job, rank: int, answered=None) -> bytes:
        """The generation's error; as the answer to a packet (FLAG_REPLY) it echoes its packet id and pool,
        so the worker knows that round, and so its call, cannot complete."""
        if answered is None:
            return wire.pack(wire.MSG_ERROR, job=job.job_id, rank=rank, payload=job.failed, session=job.session,
                             boot=self.boot)
        return wire.pack(wire.MSG_ERROR, job=job.job_id, rank=rank, packet_id=answered.packet_id,
                         slot=answered.slot, set=answered.set, flags=wire.FLAG_REPLY, payload=job.failed,
                         session=job.session, boot=self.boot)
    def member_packets(self, job_id: int) -> list[int]:
        """Admitted packets per rank, which the control plane reads to tell a live rank from a gone one.

        Args:
            job_id: a job the switch serves.

        Returns:
            rank -> admitted packets so far (a running count: a rank whose count stops moving is idle).
        """
        return list(self.jobs[job_id].heard)

    def count_drop(self, reason: str):
        """Count a drop the control plane decided (e.g. rate_limited), in the same counters as the data plane's.

        Args:
            reason: a key of DROP_REASONS.
        """
        self.drops[reason] += 1

    # ------------------------------------------------------------------ data plane
    def _admitted(self, h, src):
        """The job, or the drop reason: a rank of an admitted generation, from its address, with its session.
        Whether the generation failed is the caller's to check."""
        job = self.jobs.get(h.job)
        if job is None:
            return "unknown_job"
        if h.rank >= job.world_size or not job.generation:
            return "unknown_worker"
        if src != job.addresses[h.rank]:
            return "spoofed"
        if h.session != job.session:
            return "wrong_session"
        job.heard[h.rank] += 1
        return job

    def _malformed(self, data, src, why: str):
        """A datagram that does not parse: if its job and rank bytes (offsets 4 and 6 in every version) name
        a member that sent it from its address, tell it why (a client's mistake: an old version, a wrong
        length); anyone else gets nothing."""
        if len(data) < wire.OFFSETS["rank"] + 1:
            return self._drop("malformed")
        job = self.jobs.get(int.from_bytes(data[4:6], "big"))
        rank = data[6]
        if job is None or not job.generation or rank >= job.world_size or job.addresses[rank] != src:
            return self._drop("malformed")
        out = self._tell(job, rank, None, src, len(data), "malformed", why)
        self.packets_out += len(out)
        return out

    def _tell(self, job, rank: int, h, src, size: int, reason: str, detail: str, slot: int | None = None):
        """A member's packet dropped for its sender's mistake: counted; the first time this generation for
        this rank and reason, answered with ERR_DROPPED (the reason's index, the detail), a reply to the
        packet (h: its header, if it parsed) cut so that it is never larger than the packet."""
        self._drop(reason, job, slot)
        bit = 1 << wire.TOLD_DROPS.index(reason)
        if job.told[rank] & bit or size < wire.HEADER_SIZE + wire.ERROR_PAYLOAD.size:
            return []
        job.told[rank] |= bit
        body = wire.ERROR_PAYLOAD.pack(wire.ERR_DROPPED, wire.DROP_REASONS.index(reason))
        body += f"{reason}: {detail}".encode()[:size - wire.HEADER_SIZE - len(body)]
        echo = dict(packet_id=h.packet_id, slot=h.slot, set=h.set) if h is not None else {}
        return [(wire.pack(wire.MSG_ERROR, job=job.job_id, rank=rank, flags=wire.FLAG_REPLY, payload=body,
                           session=job.session, boot=self.boot, **echo), src)]

    def _not_member(self, h, src, reason: str):
        """A data packet of a generation this switch does not have (it restarted, or the job re-formed
        without the sender): a header-only error with our boot id and the packet's session, never larger
        than the packet, so its worker fails at once by name instead of by timeout."""
        self._drop(reason)
        return [(wire.pack(wire.MSG_ERROR, job=h.job, rank=h.rank, packet_id=h.packet_id, slot=h.slot, set=h.set,
                           flags=wire.FLAG_REPLY, session=h.session, boot=self.boot), src)]

    def _update(self, h, data, src):
        job = self._admitted(h, src)
        if job in ("unknown_worker", "wrong_session"):
            return self._not_member(h, src, job)
        if isinstance(job, str):
            return self._drop(job)
        if h.slot >= job.slots or h.count > job.elements:
            return self._tell(job, h.rank, h, src, len(data), "bad_slot",
                              f"slot {h.slot} with {h.count} elements; the job has {job.slots} slots of "
                              f"{job.elements} elements")
        s, x = h.slot, h.set
        job.counters["received"][s] += 1
        st, other = job.sets[2 * s + x], job.sets[2 * s + (1 - x)]
        bit = 1 << h.rank
        before = st.bitmap

        if before & bit:
            return self._duplicate(job, h, st, other, src, len(data))
        if job.failed is not None:  # no new contribution after a failure; completed rounds still resend
            return self._failed(job, h, src)

        sparse = h.msg_type == wire.MSG_SPARSE_UPDATE
        if before == 0:
            expected = _next_round(st, other, x, job.first_id)
            if h.packet_id != expected:
                return self._out_of_order(job, h, src, len(data), expected)
            values = self._values(h, data)
            if values is None:
                return self._bad_codes(job, h, src, len(data))
            st.round_id, st.complete, st.count = h.packet_id, False, 0
            st.call_id, st.writer = h.call_id, h.rank
            st.codec, st.n_elems, st.exp_cur, st.exp_max = h.codec, h.count, h.exp_cur, h.exp_next
            st.acc = values  # write
            st.flags = 0
            st.sparse, st.block, st.next_block = sparse, h.block, h.next_block
        else:
            if h.packet_id != st.round_id or st.complete:
                return self._out_of_order(job, h, src, len(data), st.round_id)
            if h.call_id != st.call_id:
                self._drop("call_mismatch", job, s)
                text = wire.call_mismatch_text(job.job_id, h.rank, h.call_id, st.writer, st.call_id)
                return self.fail(job.job_id, wire.ERR_CALL_MISMATCH, h.rank, text)
            if sparse and not self._sparse_fits(st, h) or not sparse and (
                    st.sparse or (h.codec, h.count, h.exp_cur) != (st.codec, st.n_elems, st.exp_cur)):
                return self._tell(job, h.rank, h, src, len(data), "mismatch",
                                  f"codec {h.codec}, {h.count} elements, exponent {h.exp_cur}; the round has codec "
                                  f"{st.codec}, {st.n_elems} elements, exponent {st.exp_cur}", s)
            values = self._values(h, data)
            if values is None:
                return self._bad_codes(job, h, src, len(data))
            if sparse:
                self._sparse_add(st, h, values)
            else:
                st.acc = st.acc + values  # add
                st.exp_max = max(st.exp_max, h.exp_next)
        return self._counted(job, h, st, other)

    def _counted(self, job, h, st, other):
        """h's rank is in the round (step 4): its bit, its congestion (docs/protocol.md, "Congestion": only a
        counted contribution's flag is the round's), and the result once every rank's is."""
        bit = 1 << h.rank
        st.bitmap |= bit
        other.bitmap &= ~bit
        st.count += 1
        if h.flags & wire.FLAG_CONGESTED:
            st.flags |= wire.FLAG_CONGESTED
            job.counters["congested"][h.slot] += 1
        return self._complete(job, h, st) if st.count == job.world_size else []

    def _out_of_order(self, job, h, src, size: int, expected):
        reason = _behind_or_ahead(h.packet_id, expected)
        wanted = "no new round yet" if expected is None else f"the slot's round is {expected}"
        return self._tell(job, h.rank, h, src, size, reason, f"packet id {h.packet_id} on slot {h.slot} set {h.set}; "
                                                             f"{wanted}", h.slot)

    def _bad_codes(self, job, h, src, size: int):
        return self._tell(job, h.rank, h, src, size, "bad_codes",
                          f"NC codes outside the block's range for exponent {h.exp_cur}, or 0x80", h.slot)

    def _duplicate(self, job, h, st, other, src, size: int):
        """A packet from a worker already counted in (slot, set): resend a completed round, else drop."""
        if h.packet_id != st.round_id:  # a protocol violation
            return self._out_of_order(job, h, src, size, st.round_id)
        other.bitmap &= ~(1 << h.rank)
        if st.complete:
            job.counters["resent"][h.slot] += 1
            return [(self._result(job, h, st, h.rank), src)]  # unicast back to the (admitted) sender
        if job.failed is not None:
            return self._failed(job, h, src)
        return self._drop("duplicate", job, h.slot)

    def _failed(self, job, h, src):
        """A packet of a failed generation that no completed round answers: the error again (the first
        copy may have been lost), to the admitted sender only."""
        self._drop("failed", job, h.slot)
        return [(self._error(job, h.rank, h), src)]

    def _complete(self, job, h, st):
        """Every worker contributed: compute the result once and multicast it to the members."""
        st.complete = True
        self._finish(st)
        job.counters["multicast"][h.slot] += 1
        return self._to_members(job, h, st)

    def _to_members(self, job, h, st):
        """The round's result for every member: one copy to the job's group where the control plane named one
        (rank NO_RANK, FLAG_GROUP), else a copy to each member's address."""
        if job.group is not None:
            return [(self._result(job, h, st, wire.NO_RANK, wire.FLAG_GROUP), job.group)]
        return [(self._result(job, h, st, r), job.addresses[r]) for r in range(job.world_size)]

    @staticmethod
    def _sparse_fits(st: SlotSet, h) -> bool:
        """A block-sparse packet joins a round if it agrees on codec and exponent, its elements belong to
        the round's block, and no worker claims a next block at or before the block being summed."""
        if not st.sparse or (h.codec, h.exp_cur) != (st.codec, st.exp_cur):
            return False
        if h.count and st.block != wire.BLOCK_NONE and (h.block, h.count) != (st.block, st.n_elems):
            return False
        block = h.block if h.count else st.block
        return block == wire.BLOCK_NONE or min(h.next_block, st.next_block) > block

    @staticmethod
    def _sparse_add(st: SlotSet, h, values):
        """Elements: write if the round has none yet, else add. Next block: keep the smallest, and the
        max exponent among the workers whose next block it is (the others hold zeros there)."""
        if h.count:
            if st.block == wire.BLOCK_NONE:
                st.block, st.n_elems, st.acc = h.block, h.count, values
            else:
                st.acc = st.acc + values
        if h.next_block < st.next_block:
            st.next_block, st.exp_max = h.next_block, h.exp_next
        elif h.next_block == st.next_block:
            st.exp_max = max(st.exp_max, h.exp_next)

    def _values(self, h, data):
        """Payload as int64 (int32 elements, or NC codes as multiples of the block's floor level)."""
        payload = wire.payload_view(data, h)
        if h.codec == wire.CODEC_INT32:
            return payload.astype(np.int64)
        return nc.codes_to_int(payload, h.exp_cur)

    def _finish(self, st: SlotSet):
        """Turn the accumulator into the result payload (once per round, so resends are identical)."""
        if st.codec == wire.CODEC_INT32:
            if st.acc.size and (st.acc.min() < INT32_MIN or st.acc.max() > INT32_MAX):
                st.flags |= wire.FLAG_OVERFLOW
                self.overflows += 1
            st.result = st.acc.astype(">i4").tobytes()  # wraps like the hardware; the flag says so
        else:
            codes, overflow = nc.int_to_codes(st.acc, st.exp_cur, self.nc_deterministic,
                                                   self.seed, self.nc_elements_rounded)
            self.nc_elements_rounded += st.acc.size
            if overflow:
                st.flags |= wire.FLAG_OVERFLOW
                self.overflows += 1
            st.result = codes.tobytes()

    def _result(self, job, h, st, rank, group=0):
        """A copy of the round's result for rank (NO_RANK and FLAG_GROUP: the group's one copy)."""
        if st.sparse:
            return wire.pack_sparse(wire.MSG_SPARSE_RESULT, job.job_id, rank, st.round_id, h.slot, h.set,
                                    st.n_elems, st.codec, st.exp_cur, st.exp_max, st.flags | group, st.block,
                                    st.next_block, st.result, job.session, *_kind_call_len(st), self.boot)
        call, kind, n = st.call_id
        return wire.pack(wire.MSG_RESULT, job=job.job_id, rank=rank, packet_id=st.round_id, slot=h.slot,
                         set=h.set, count=st.n_elems, codec=st.codec, exp_cur=st.exp_cur,
                         exp_next=st.exp_max, flags=st.flags | group, payload=st.result, session=job.session,
                         call_kind=kind, call=call, call_len=n, boot=self.boot)

    # ------------------------------------------------------------------ counters
    def stats(self, per_slot: bool = False) -> dict:
        """The counters in the one layout every backend reports (`switchsim stats`, --json-stats, tests).

        Args:
            per_slot: add each job's per-slot arrays (large: slots entries per counter).

        Returns:
            packets_in/out, dropped by reason, overflows, per job its counters, plus the control plane's.
        """
        jobs = {}
        for job_id, job in self.jobs.items():
            j = {"world_size": job.world_size, "slots": job.slots, "generation": job.generation,
                 "failed": job.failed is not None}
            j.update({name: int(c.sum()) for name, c in job.counters.items()})
            if per_slot:
                j["per_slot"] = {name: c.tolist() for name, c in job.counters.items()}
            jobs[str(job_id)] = j
        return self.control.annotate({"packets_in": self.packets_in, "packets_out": self.packets_out,
                                      "dropped": dict(self.drops), "overflows": self.overflows, "jobs": jobs})
