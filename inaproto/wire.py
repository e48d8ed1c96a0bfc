"""The wire format, defined once. Both sides (hostlib, switchsim), the scapy layer, the generated C header
(csrc/ina_wire.h, `python -m inaproto.gen_c`) and the tests take it from here.

docs/protocol.md describes the same bytes for people; its tables are generated from here
(`python -m inaproto.gen_doc`, and `--check` in tests/test_protocol_doc.py keeps the two honest).
All multi-byte fields are big-endian (network order).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

VERSION = 3
DEFAULT_PORT = 0xBEE0  # 48864, SwitchML's UDP port range starts here

# message types
MSG_UPDATE = 0  # worker -> switch: a block of data for one (slot, set)
MSG_RESULT = 1  # switch -> worker: the aggregate of a completed (slot, set)
MSG_JOIN = 2  # worker -> switch: join a job (barrier that starts a generation with clean slots)
MSG_JOIN_ACK = 3  # switch -> worker: every rank joined; carries the session and the switch's limits
MSG_JOIN_WAIT = 4  # switch -> worker: not everyone joined yet; payload = bitmap of joined ranks
MSG_ERROR = 5  # switch -> worker: request rejected; payload = utf-8 reason
MSG_STATS_REQ = 6  # control host -> switch: ask for counters
MSG_STATS = 7  # switch -> control host: counters as JSON
MSG_SPARSE_UPDATE = 8  # worker -> switch: one round of a block-sparse stream (block extension + elements)
MSG_SPARSE_RESULT = 9  # switch -> worker: the round's aggregated block and the stream's next block
MSG_LEAVE = 10  # worker -> switch: this rank is done; its rank is free for the next generation at once
MSG_ABORT = 11  # worker -> switch: this rank's call failed before it sent it; fail the call on every rank
MSG_HEARTBEAT = 12  # worker -> switch: this rank is alive (between calls too), so a silent rank is a dead one;
# switch -> worker: the answer to a member's heartbeat (a header, the same), so a silent switch is a dead one
MSG_NAMES = {
    MSG_UPDATE: "update", MSG_RESULT: "result", MSG_JOIN: "join", MSG_JOIN_ACK: "join_ack",
    MSG_JOIN_WAIT: "join_wait", MSG_ERROR: "error", MSG_STATS_REQ: "stats_req", MSG_STATS: "stats",
    MSG_SPARSE_UPDATE: "sparse_update", MSG_SPARSE_RESULT: "sparse_result", MSG_LEAVE: "leave",
    MSG_ABORT: "abort", MSG_HEARTBEAT: "heartbeat",
}
DATA_MESSAGES = (MSG_UPDATE, MSG_RESULT, MSG_SPARSE_UPDATE, MSG_SPARSE_RESULT)
SPARSE_MESSAGES = (MSG_SPARSE_UPDATE, MSG_SPARSE_RESULT)
CONTROL_REQUESTS = (MSG_JOIN, MSG_STATS_REQ, MSG_LEAVE, MSG_ABORT, MSG_HEARTBEAT)  # what a switch hands to its control plane

# element codecs on the wire
CODEC_NONE = 0  # control messages
CODEC_INT32 = 1  # signed int32 big-endian; used by the int32 and the fixed-point codecs
CODEC_NC8 = 2  # natural compression, one byte per element (code table below)
CODEC_NAMES = {CODEC_NONE: "none", CODEC_INT32: "int32", CODEC_NC8: "nc8"}
ELEMENT_SIZE = {CODEC_INT32: 4, CODEC_NC8: 1}

# flags
FLAG_OVERFLOW = 0x01  # the aggregate does not fit the codec's range (int32 sum, NC level > 2^63)
FLAG_PER_SLOT = 0x02  # stats_req: answer with each job's per-slot counters too (switchsim stats --watch)
FLAG_REPLY = 0x04  # error: it answers the data packet whose packet_id and pool it echoes (that round cannot complete)
# join: the worker also listens on its job's loopback group (net.job_group); result: the one copy sent to that
# group for every member (rank NO_RANK), where every member asked and joined from loopback (docs/protocol.md)
FLAG_GROUP = 0x08
# update: this worker's path is congested (a result came to it CE-marked, or its round trip rose above the path's
# base: hostlib/cc.py); result: some contribution counted in this round was congested (the flag, or CE in its IP
# header as the switch received it). The switch ORs it into the aggregate, so every worker of the job slows down
# when any path is congested (docs/protocol.md, "Congestion")
FLAG_CONGESTED = 0x10
MAX_STATS_REPLY = 60000  # a stats reply is one datagram: past this the per-slot arrays are left out

# exponent byte values (signed int8): e means every |x| in the block is < 2^e
EXP_NONE = -128  # "no data": the block is all zeros, or the packet carries no exponent
EXP_NONFINITE = 127  # a worker saw NaN/Inf; max() propagates it so every worker raises
EXP_MIN, EXP_MAX = -127, 126

# natural compression code table: bit 7 = sign, bits 6..0 = m
#   m = 0        -> 0 (0x80 is not a valid code)
#   m = 1..127   -> 2^(m - 64), i.e. 2^-63 .. 2^63
NC_BIAS = 64
NC_LEVEL_MIN, NC_LEVEL_MAX = -63, 63
# Inside a packet every code lies in [2^(e - NC_SPAN + 1), 2^e] for the block's agreed exponent e, so
# the switch holds each element as an integer < 2^(NC_SPAN-1) = 2^55 and a sum over MAX_WORKERS = 64
# workers stays below 2^61: an int64 accumulator can never overflow.
NC_SPAN = 56
MAX_WORKERS = 64
MAX_ELEMENTS = 16384  # elements one packet (and so one slot) may carry

# The header, field by field (struct codes, big-endian). Offsets, the C header and the docs table come
# from this list. packet_id counts per slot: the slot's use number (round) mod 2^32; set = its parity.
# call_kind, call and call_len are the call's identity (every data packet of a call carries them and the
# switch checks that every rank's packets of a round agree); boot is the switch's random boot id (set by
# the switch in everything it sends; a worker echoes the one of its join_ack, the switch does not check it).
HEADER_FIELDS = (
    ("version", "B"), ("msg_type", "B"), ("codec", "B"), ("flags", "B"), ("job", "H"), ("rank", "B"),
    ("exp_cur", "b"), ("packet_id", "I"), ("pool", "H"), ("count", "H"), ("exp_next", "b"),
    ("call_kind", "B"), ("call", "H"), ("session", "I"), ("call_len", "I"), ("boot", "I"),
)
HEADER = struct.Struct(">" + "".join(code for _, code in HEADER_FIELDS))
HEADER_SIZE = HEADER.size  # 24
OFFSETS = {}
for _name, _code in HEADER_FIELDS:
    OFFSETS[_name] = struct.calcsize(">" + "".join(c for n, c in HEADER_FIELDS[:len(OFFSETS)]))
del _name, _code
POOL_SET_BIT = 0x8000
POOL_RESERVED_BIT = 0x4000
POOL_SLOT_MASK = 0x3FFF
MAX_SLOTS = POOL_SLOT_MASK + 1
PACKET_ID_MASK = 0xFFFFFFFF
# IPv4 + UDP + Ethernet (with FCS, preamble and inter-frame gap left out) per packet
WIRE_OVERHEAD = 14 + 20 + 8

# join: nonce, world size, window the worker asks for, MAC (zeros for a job without a key), elements per
# packet the worker asks for (0: the switch's maximum; every rank must ask the same, or the join is refused),
# then zero padding to JOIN_SIZE bytes in all, so that no answer to a join (ack, wait, error) is larger than
# the join itself: a forged source address gains no amplification.
JOIN_PAYLOAD = struct.Struct(">QHH16sH")
JOIN_SIZE = 256
JOIN_PAYLOAD_SIZE = JOIN_SIZE - HEADER_SIZE
JOIN_MAC_SIZE = 16
# join_ack: generation, slots, the job's elements per packet (agreed: what every rank asked, at most the
# switch's maximum; the switch drops a data packet with more as bad_slot), agreed window, 2 bytes 0, and the
# packet id every slot's first round has in this generation (even, so set 0 comes first; random unless the
# switch is told)
JOIN_ACK_PAYLOAD = struct.Struct(">IHHH2xI")
JOIN_WAIT_PAYLOAD = struct.Struct(">Q")  # bitmap of the ranks joined so far
# Every answer to a join (join_wait, join_ack, an error) echoes the low 32 bits of the join's nonce in
# packet_id: a worker takes only the answers to its own join (a forged join from its address cannot fail it).
# error: code, the rank it names (NO_RANK: none), then utf-8 text; never larger than the join it answers.
# An error with no payload at all is ERR_NOT_MEMBER: the switch's answer to a data packet of a generation
# it does not have (restarted, or the job re-formed without the sender); a header, never larger than the
# packet it answers, with the switch's boot id and the packet's session, so the worker can tell which.
ERROR_PAYLOAD = struct.Struct(">BB")
MAX_ERROR_TEXT = JOIN_SIZE - HEADER_SIZE - ERROR_PAYLOAD.size
NO_RANK = 0xFF
ERR_NOT_MEMBER = 0  # implied by an empty payload
ERR_REJECTED = 1  # a join refused: unknown job, world size, rank range, window, bad MAC
ERR_RANK_TAKEN = 2  # a join for a rank another address holds (keyless job): rank = the rank
ERR_CALL_MISMATCH = 3  # the ranks' calls differ (number, codec, length): rank = a rank that differs
ERR_ABORTED = 4  # a rank's call failed before it was sent (MSG_ABORT): rank = that rank
ERR_PEER_DEAD = 5  # a member fell silent (no packet, no heartbeat) or left: rank = that rank
# a member's packet was dropped for a mistake of its sender (malformed, bad_slot, stale, ahead, mismatch,
# bad_codes): informational, once per generation, rank and reason, never larger than the packet; the second
# byte is the reason's index in DROP_REASONS (not a rank), the text the details (backend-specific)
ERR_DROPPED = 6
# a shared switch cannot give a new job the slots it needs (docs/protocol.md, "A shared switch"): the join is
# refused at once, the text saying what is in use; the subject byte is NO_RANK
ERR_POOL_FULL = 7
ERROR_NAMES = {ERR_NOT_MEMBER: "not_member", ERR_REJECTED: "rejected", ERR_RANK_TAKEN: "rank_taken",
               ERR_CALL_MISMATCH: "call_mismatch", ERR_ABORTED: "aborted", ERR_PEER_DEAD: "peer_dead",
               ERR_DROPPED: "dropped", ERR_POOL_FULL: "pool_full"}
TOLD_DROPS = ("malformed", "bad_slot", "stale", "ahead", "mismatch", "bad_codes")  # answered with ERR_DROPPED
MAX_ABORT_TEXT = 200  # an abort's reason (utf-8), after the header

# call_kind: the worker codec of the call (the switch sees only the wire codec: int32 and fixed both send
# int32 elements), plus CALL_SPARSE for a block-sparse call; 0 in control messages
CALL_KINDS = {"int32": 1, "fixed": 2, "nc": 3, "dither": 4}
CALL_KIND_NAMES = {v: k for k, v in CALL_KINDS.items()}
CALL_SPARSE = 0x80
CALL_NUMBER_MASK = 0xFFFF
MAX_CALL_LEN = 0xFFFFFFFF  # elements one call may have (call_len is 32 bits)
# block-sparse messages: 8 bytes between header and elements. In an update: the block the elements belong
# to and the sender's next non-zero block; in a result: the aggregated block and the stream's next block
# (the smallest next block over all workers). BLOCK_NONE: no elements / no further block.
BLOCK_EXT = struct.Struct(">II")
BLOCK_EXT_SIZE = BLOCK_EXT.size
BLOCK_NONE = 0xFFFFFFFF

# What a switch counts, the same names and order on every backend (the C enums are generated from these).
DROP_REASONS = ("malformed", "unknown_job", "unknown_worker", "spoofed", "wrong_session", "bad_slot", "stale",
                "ahead", "mismatch", "duplicate", "bad_codes", "bad_mac", "rate_limited", "not_control",
                "fragment", "call_mismatch", "failed", "oversized", "punt_overflow", "pool_full")
# per slot: data packets received, rounds multicast, results resent, drops, and counted contributions that were
# congested (FLAG_CONGESTED, or CE on arrival: docs/protocol.md, "Congestion")
SLOT_COUNTERS = ("received", "multicast", "resent", "dropped", "congested")


def drop_reason(index: int) -> str:
    """A drop reason's name (ERR_DROPPED's subject byte), or its number from a newer switch."""
    return DROP_REASONS[index] if index < len(DROP_REASONS) else f"drop reason {index}"


class WireError(ValueError):
    """A packet that does not follow the wire format."""


@dataclass
class Header:
    msg_type: int
    job: int = 0
    rank: int = 0
    packet_id: int = 0
    slot: int = 0
    set: int = 0
    count: int = 0
    codec: int = CODEC_NONE
    exp_cur: int = 0
    exp_next: int = EXP_NONE
    flags: int = 0
    version: int = VERSION
    session: int = 0
    block: int = BLOCK_NONE  # block-sparse messages only
    next_block: int = BLOCK_NONE
    call_kind: int = 0
    call: int = 0
    call_len: int = 0
    boot: int = 0

    @property
    def pool_index(self) -> int:
        return (self.set << 15) | self.slot

    def pack(self, payload: bytes = b"") -> bytes:
        if self.msg_type in SPARSE_MESSAGES:
            payload = BLOCK_EXT.pack(self.block, self.next_block) + bytes(payload)
        return pack(self.msg_type, self.job, self.rank, self.packet_id, self.slot, self.set, self.count,
                    self.codec, self.exp_cur, self.exp_next, self.flags, payload, self.session,
                    self.call_kind, self.call, self.call_len, self.boot)

    @property
    def call_id(self) -> tuple[int, int, int]:
        """What makes a packet part of the same call on every rank."""
        return self.call, self.call_kind, self.call_len


def pack(msg_type, job=0, rank=0, packet_id=0, slot=0, set=0, count=0, codec=CODEC_NONE,
         exp_cur=0, exp_next=EXP_NONE, flags=0, payload=b"", session=0, call_kind=0, call=0, call_len=0,
         boot=0) -> bytes:
    if not 0 <= slot < MAX_SLOTS or set not in (0, 1):
        raise WireError(f"slot {slot} / set {set} out of range")
    head = HEADER.pack(VERSION, msg_type, codec, flags, job, rank, exp_cur, packet_id & PACKET_ID_MASK,
                       (set << 15) | slot, count, exp_next, call_kind, call & CALL_NUMBER_MASK,
                       session & 0xFFFFFFFF, call_len, boot & 0xFFFFFFFF)
    return head + bytes(payload)


def pack_sparse(msg_type, job=0, rank=0, packet_id=0, slot=0, set=0, count=0, codec=CODEC_INT32,
                exp_cur=0, exp_next=EXP_NONE, flags=0, block=BLOCK_NONE, next_block=BLOCK_NONE,
                payload=b"", session=0, call_kind=0, call=0, call_len=0, boot=0) -> bytes:
    """A block-sparse update or result: header, block extension, elements."""
    return pack(msg_type, job, rank, packet_id, slot, set, count, codec, exp_cur, exp_next, flags,
                BLOCK_EXT.pack(block, next_block) + bytes(payload), session, call_kind, call, call_len, boot)


def pack_error(code: int, text: str = "", job=0, rank=0, subject=NO_RANK, session=0, boot=0, packet_id=0) -> bytes:
    """An error to a worker: code, the rank it names, the reason (cut to MAX_ERROR_TEXT bytes); packet_id:
    what it echoes (a join's nonce, low 32 bits)."""
    body = ERROR_PAYLOAD.pack(code, subject) + text.encode()[:MAX_ERROR_TEXT]
    return pack(MSG_ERROR, job=job, rank=rank, packet_id=packet_id, payload=body, session=session, boot=boot)


def unpack_error(data) -> tuple[int, int, str]:
    """(code, named rank or NO_RANK, text) of an error message; an empty payload is ERR_NOT_MEMBER."""
    if len(data) < HEADER_SIZE + ERROR_PAYLOAD.size:
        return ERR_NOT_MEMBER, NO_RANK, ""
    code, subject = ERROR_PAYLOAD.unpack_from(data, HEADER_SIZE)
    return code, subject, bytes(data[HEADER_SIZE + ERROR_PAYLOAD.size:]).decode(errors="replace")


def call_kind(codec_name: str, sparse: bool = False) -> int:
    """The call_kind of a call with this worker codec."""
    return CALL_KINDS[codec_name] | (CALL_SPARSE if sparse else 0)


def describe_kind(kind: int) -> str:
    name = CALL_KIND_NAMES.get(kind & ~CALL_SPARSE, f"kind {kind & ~CALL_SPARSE}")
    return f"codec {name}" + (" sparse" if kind & CALL_SPARSE else "")


def call_mismatch_text(job: int, rank: int, call_id, other_rank: int, other_id) -> str:
    """What differs between two ranks' packets of one round, in the switch's error (the C core words it
    the same: csrc/ina_core.c). call_id: (call, call_kind, call_len)."""
    (c, k, n), (oc, ok, on) = call_id, other_id
    if c != oc:
        return f"job {job}: ranks out of step: rank {rank} is at call {c}, rank {other_rank} at call {oc}"
    if k != ok:
        return (f"job {job} call {c}: rank {rank} called allreduce with {describe_kind(k)}, "
                f"rank {other_rank} with {describe_kind(ok)}")
    return (f"job {job} call {c}: rank {rank} called allreduce with {n} elements, "
            f"rank {other_rank} with {on}")


ECT0 = 0x02  # the IP header's ECN field of every worker datagram: ECN-capable transport (RFC 3168 ECT(0))
CE = 0x03  # what a congested queue that marks writes into it instead of dropping


def pack_join(job: int, rank: int, nonce: int, world: int, window: int, mac: bytes = bytes(JOIN_MAC_SIZE),
              elements: int = 0, group: bool = False, session: int = 0) -> bytes:
    """A join request, padded to JOIN_SIZE bytes (elements: per packet, 0 for the switch's maximum; group: the
    worker listens on its job's loopback group too, FLAG_GROUP; session: the cookie of the switch's join_wait,
    which confirms the claim, or before one came the session of the generation this worker is a member of,
    which proves a re-join from a member's address)."""
    body = JOIN_PAYLOAD.pack(nonce, world, window, mac, elements)
    return pack(MSG_JOIN, job=job, rank=rank, flags=FLAG_GROUP if group else 0,
                payload=body.ljust(JOIN_PAYLOAD_SIZE, b"\0"), session=session)


def confirm_join(join: bytes, wait: bytes) -> bytes:
    """The join again, carrying the cookie of the switch's join_wait (its session field): the join then
    counts for the barrier (docs/protocol.md, "join")."""
    out = bytearray(join)
    out[OFFSETS["session"]:OFFSETS["session"] + 4] = wait[OFFSETS["session"]:OFFSETS["session"] + 4]
    return bytes(out)


def unpack(data) -> Header:
    """Parse and check the header; raise WireError for anything a switch must drop."""
    if len(data) < HEADER_SIZE:
        raise WireError(f"truncated header: {len(data)} < {HEADER_SIZE} bytes")
    (version, msg_type, codec, flags, job, rank, exp_cur, packet_id, pool, count,
     exp_next, kind, call, session, call_len, boot) = HEADER.unpack_from(data)
    if version != VERSION:
        raise WireError(f"unknown version {version}")
    if msg_type not in MSG_NAMES:
        raise WireError(f"unknown message type {msg_type}")
    if pool & POOL_RESERVED_BIT:
        raise WireError("reserved pool-index bit 14 is set")
    h = Header(msg_type, job, rank, packet_id, pool & POOL_SLOT_MASK, pool >> 15, count, codec,
               exp_cur, exp_next, flags, version, session, call_kind=kind, call=call, call_len=call_len, boot=boot)
    if msg_type in DATA_MESSAGES:
        size = ELEMENT_SIZE.get(codec)
        if size is None:
            raise WireError(f"unknown codec {codec}")
        ext = BLOCK_EXT_SIZE if msg_type in SPARSE_MESSAGES else 0
        if len(data) != HEADER_SIZE + ext + count * size:
            raise WireError(f"payload is {len(data) - HEADER_SIZE} bytes, header says {ext} + {count} x {size}")
        if ext:
            h.block, h.next_block = BLOCK_EXT.unpack_from(data, HEADER_SIZE)
            if (count == 0) != (h.block == BLOCK_NONE):
                raise WireError(f"block extension: block {h.block:#x} with {count} elements")
            if h.block != BLOCK_NONE and h.next_block <= h.block:
                raise WireError(f"block extension: next block {h.next_block} is not after block {h.block}")
    elif msg_type == MSG_JOIN and len(data) != JOIN_SIZE:
        raise WireError(f"join is {len(data)} bytes, not {JOIN_SIZE}")
    return h


def payload_view(data, h: Header) -> np.ndarray:
    """Zero-copy view of an update/result payload as int32 (big-endian) or uint8 codes."""
    dtype = ">i4" if h.codec == CODEC_INT32 else np.uint8
    offset = HEADER_SIZE + (BLOCK_EXT_SIZE if h.msg_type in SPARSE_MESSAGES else 0)
    return np.frombuffer(data, dtype=dtype, count=h.count, offset=offset)


def nc_floor(exp: int) -> int:
    """Lowest NC level (a power of two) usable in a block whose agreed exponent is exp."""
    return max(exp - NC_SPAN + 1, NC_LEVEL_MIN)
