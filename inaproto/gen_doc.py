"""Generates the tables of docs/protocol.md from inaproto/wire.py (and the control plane's and the worker's
constants), and a worked example of real packets from the reference switch, so the spec cannot drift from
the code. The prose stays hand-written; each generated part sits between markers:

    <!-- BEGIN GENERATED: header -->  ...  <!-- END GENERATED: header -->

    python -m inaproto.gen_doc           # rewrite the generated parts of docs/protocol.md
    python -m inaproto.gen_doc --check   # exit 1 if any is out of date (tests/test_protocol_doc.py does the same)
"""
from __future__ import annotations

import os
import re
import struct
import sys

from . import auth, timers, wire
from .gen_c import update

PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "protocol.md")
DOC_NAMES = {"pool": "pool_index"}  # the header field as the doc names it

FIELD_MEANING = {
    "version": f"{wire.VERSION}; a packet of another version is `malformed`",
    "msg_type": "see message types",
    "codec": "wire codec of the elements: " + ", ".join(f"{c} {n}" for c, n in sorted(wire.CODEC_NAMES.items()))
             + " (0 in control messages)",
    "flags": f"bit 0 OVERFLOW ({wire.FLAG_OVERFLOW:#04x}): the aggregate does not fit the codec's range; bit 1 "
             f"PER_SLOT ({wire.FLAG_PER_SLOT:#04x}, stats_req): add each job's per-slot counters; bit 2 REPLY "
             f"({wire.FLAG_REPLY:#04x}, error): it answers the data packet whose `packet_id` and `pool_index` it "
             f"echoes; bit 3 GROUP ({wire.FLAG_GROUP:#04x}): in a join, the worker also listens on its job's "
             f"loopback group; in a result, the one copy sent to that group (\"Results to a group\"); bit 4 CONGESTED "
             f"({wire.FLAG_CONGESTED:#04x}): in an update, this worker's path is congested; in a result, some "
             f"contribution to the round was (\"Congestion\"); other bits 0",
    "job": "job id; jobs are isolated (own slots, bitmaps, counters)",
    "rank": f"worker rank (0..{wire.MAX_WORKERS - 1}); in a result or error: the rank the copy is addressed to "
            f"({wire.NO_RANK} in a result sent to the job's group)",
    "exp_cur": "signed: the agreed exponent the payload was encoded with (0 for int32)",
    "packet_id": "the slot's use number since the join plus the generation's first packet id, mod 2^32 "
                 "(set = its parity); echoed in results",
    "pool": "bit 15 = set (shadow copy), bit 14 reserved (must be 0), bits 13..0 = slot",
    "count": "number of elements in the payload (0 in control messages)",
    "exp_next": f"signed: worker's exponent for a later block; in a result, the max over workers; "
                f"{wire.EXP_NONE} when none",
    "call_kind": "the call's worker codec (" + ", ".join(f"{k} {n}" for k, n in sorted(wire.CALL_KIND_NAMES.items()))
                 + f"), \\| {wire.CALL_SPARSE:#04x} for a block-sparse call; 0 in control messages",
    "call": "the communicator's call number since its join, mod 2^16",
    "session": "the job generation's session value (from `join_ack`); 0 in join, stats and join errors",
    "call_len": f"the call's length in elements (at most {wire.MAX_CALL_LEN})",
    "boot": "the switch's random nonzero boot id, in everything the switch sends; workers echo the one of their "
            "`join_ack` (not checked)",
}

MESSAGES = {  # direction, payload
    "update": ("worker → switch", "`count` elements"),
    "result": ("switch → worker", "`count` elements (the aggregate)"),
    "join": ("worker → switch", "join payload below, zero padding to JOIN_SIZE bytes in all"),
    "join_ack": ("switch → worker", "join_ack payload below; `session` and `boot` in the header, the join's "
                                    "nonce (low 32 bits) in `packet_id`"),
    "join_wait": ("switch → worker", "u64 bitmap of the ranks whose join counts so far; the join's nonce (low 32 "
                                     "bits) in `packet_id`"),
    "error": ("switch → worker", "error payload below (`count` 0); an empty payload (header only) is "
                                 "not_member; a join's error echoes its nonce (low 32 bits) in `packet_id`"),
    "stats_req": ("control host → switch", "empty (flag PER_SLOT: per-slot counters in the reply, left out "
                                            f"past {wire.MAX_STATS_REPLY} bytes)"),
    "stats": ("switch → control host", "JSON counters"),
    "sparse_update": ("worker → switch", "block extension, then `count` elements"),
    "sparse_result": ("switch → worker", "block extension, then `count` elements (the aggregated block)"),
    "leave": ("worker → switch", "empty; `session` of the generation it leaves (0: withdraw a pending join)"),
    "abort": ("worker → switch", f"UTF-8 reason, at most {wire.MAX_ABORT_TEXT} bytes; the header names the call "
                                 "(`call`, `call_kind`, `call_len`) that failed on this rank"),
    "heartbeat": ("worker ↔ switch", "empty: the member is alive (in calls and between them); the switch answers "
                                     "a member's heartbeat with one (header only, the member's job, rank and "
                                     "session): the switch is alive"),
}

ERRORS = {
    "not_member": ("a data packet whose job has no generation, or another session (header only, REPLY)", "—"),
    "rejected": ("a join refused: unknown job, world size, rank range, window 0, bad MAC; every pending join "
                 "when the ranks ask for different packet sizes", "— (sizes: a rank that differs)"),
    "rank_taken": ("a join for a rank another live address holds, job without a key", "the rank"),
    "call_mismatch": ("the ranks' packets of one round have different call identities", "the later packet's rank"),
    "aborted": ("a member's `abort`", "the aborting rank"),
    "peer_dead": ("a member silent for PEER_SILENT s, or one that left while others remain; as a join's error (session "
                  "0): a member of the last generation re-joins while a peer of it left and has not joined again",
                  "that rank"),
    "dropped": ("a member's packet dropped for its sender's mistake (" + ", ".join(wire.TOLD_DROPS) + "): once per "
                "(generation, rank, reason), never larger than the packet (its text is cut), a REPLY; "
                "informational: a worker goes on",
                "the second byte is the drop reason's index in the drop-reason list, not a rank"),
    "pool_full": ("a shared switch's join of a new job it cannot give its least slots (`--min-slots`, default its "
                  "quota): at the job's first join, or every pending join at its barrier; the text says what "
                  "is in use", "—"),
}

DROPS = {
    "malformed": "not a packet of this version (header, type, codec, length, reserved bit), or a message a "
                 "switch never receives",
    "unknown_job": "a job the switch does not serve",
    "unknown_worker": "a rank out of range, or a job with no admitted generation (answered: not_member)",
    "spoofed": "a rank's packet from another address than it joined from, or a join from a live member's address "
               "that does not carry its generation's session (a forged re-join, keyless jobs)",
    "wrong_session": "another generation's session (answered: not_member)",
    "bad_slot": "a slot beyond the job's pool, or more elements than the job's packet size",
    "stale": "an older packet id than the slot's round",
    "ahead": "a newer packet id than the slot's round may have",
    "mismatch": "codec, count or exp_cur (or block) different from the round's",
    "duplicate": "a repeat into an incomplete round",
    "bad_codes": "an NC code outside the block's range, or 0x80",
    "bad_mac": "a keyed job's join with a wrong MAC",
    "rate_limited": "a non-member's control requests over its source's or all strangers' budget, or error "
                    "replies over their rate (a member's requests are never rate-limited)",
    "not_control": "a stats request from a host that is not a control host",
    "fragment": "an IP fragment (DPDK loop)",
    "call_mismatch": "a round's packets of different calls: the generation fails",
    "failed": "a packet of a failed generation (answered with its error)",
    "oversized": "a control request larger than the control plane takes (C loops)",
    "punt_overflow": "the queue to the control plane is full (C loops)",
    "pool_full": "a join of a new job a shared switch cannot give its least slots (answered: pool_full)",
}

STRUCT_TYPES = {"B": "u8", "H": "u16", "I": "u32", "Q": "u64", "b": "i8"}


def _constants():
    t = timers
    w = wire
    rows = [("VERSION", w.VERSION, "header byte 0"), ("DEFAULT_PORT", w.DEFAULT_PORT, "the switch's UDP port"),
            ("HEADER_SIZE", w.HEADER_SIZE, "bytes"), ("JOIN_SIZE", w.JOIN_SIZE, "a join's size, padding included"),
            ("MAX_ERROR_TEXT", w.MAX_ERROR_TEXT, "bytes of an error's text"),
            ("MAX_ABORT_TEXT", w.MAX_ABORT_TEXT, "bytes of an abort's reason"),
            ("MAX_WORKERS", w.MAX_WORKERS, "ranks per job"), ("MAX_ELEMENTS", w.MAX_ELEMENTS, "elements per packet"),
            ("MAX_SLOTS", w.MAX_SLOTS, "slots per job"), ("MAX_CALL_LEN", w.MAX_CALL_LEN, "elements per call"),
            ("switch elements", 1024, "the switch's maximum elements per packet unless `serve --elements-per-packet` "
                                      "says otherwise: what a join asking 0 gets (so asking 0 and asking the "
                                      "maximum are the same ask)"),
            ("switch slots", 512, "slots per job unless `serve --slots` says otherwise: the most window a join gets"),
            ("hostlib window", "auto", "what hostlib asks by default: 1 MiB of packets in flight (at most half "
                                       "the 8 MiB socket buffer divided by the world size), 4 to 1024 packets (1 KiB "
                                       "packets: 993, so the switch's 512 slots; 8 KiB packets: 127), at most 128 "
                                       "across a network under a congestion policy; the switch grants the smallest "
                                       "ask and every rank uses the window join_ack agreed"),
            ("hostlib elements", "256 / 1024", "what hostlib asks by default: 256 for int32, fixed (1 KiB of int32), "
                                              "1024 for nc, dither (1 KiB of codes); ranks must ask the same"),
            ("EXP_NONE", w.EXP_NONE, "exponent byte: no data"), ("EXP_NONFINITE", w.EXP_NONFINITE,
                                                                   "exponent byte: NaN/Inf seen"),
            ("BLOCK_NONE", f"{w.BLOCK_NONE:#x}", "no block"), ("NO_RANK", f"{w.NO_RANK:#x}", "an error naming no rank"),
            ("NC_BIAS", w.NC_BIAS, "NC code m is 2^(m − NC_BIAS)"), ("NC_SPAN", w.NC_SPAN, "NC levels in a block")]
    timers_ = [("JOIN_EXPIRY", t.JOIN_EXPIRY, "switch: a pending join not repeated this long expires"),
               ("MEMBER_IDLE", t.MEMBER_IDLE, "switch: a silent member's rank may be taken (keyless)"),
               ("PEER_SILENT", t.PEER_SILENT, "switch: a member silent this long is dead"),
               ("CLAIM_ACTIVE", t.CLAIM_ACTIVE, "switch: a contested pending join repeated this long after is live"),
               ("TAKEN_AFTER", t.TAKEN_AFTER, "switch: a contested live generation heard this long is running"),
               ("JOIN_REPEAT", t.JOIN_REPEAT, "worker: a join is sent this often until acked, and once at once "
                                              "after the first join_wait"),
               ("HEARTBEAT_EVERY", t.HEARTBEAT_EVERY, "worker: a heartbeat this often, in calls too, whatever else "
                                                      "it sends, from a thread that needs no interpreter lock: "
                                                      "heartbeats are what makes the switch check for silent "
                                                      "members, and their answers what tells a worker its switch "
                                                      "lives"),
               ("SWITCH_SILENT", t.SWITCH_SILENT, "worker: nothing heard from the switch this long while waiting on "
                                                  "it (a call or a join it answered before): `SwitchSilent`"),
               ("REFUSED_AFTER", t.REFUSED_AFTER, "worker: connection refused this long, nothing heard: unreachable"),
               ("ABORT_WAIT", t.ABORT_WAIT, "worker: an abort is repeated every 100 ms this long at most"),
               ("rto", t.RTO_FLOOR, "worker (hostlib's choice; any timer works): retransmission timeout "
                                    f"floor under a congestion policy, with {t.RTO_RTTS:g} smoothed round trips "
                                    f"(`none`: {t.RTO_NONE:g} s, SwitchML's constant); above it RFC 6298's SRTT + "
                                    "4 RTTVAR, each update from the smallest of 16 round-trip samples; doubling "
                                    f"per retry; a packet's first timeout at least {t.START_RTO:g} s before the "
                                    "call's first result and in slow start; a spurious retransmission doubles "
                                    f"the floor, up to {t.START_RTO:g} s; a call's tail probed after "
                                    f"{t.TAIL_PROBE_RTTS} smoothed round trips, an early resend lost too resent "
                                    f"after {t.EARLY_RTO_RTTS} (\"The worker's window\")"),
               ("max_rto", 0.1, "worker: retransmission timeout ceiling")]
    rates = [("SOURCE_RATE", t.SOURCE_RATE, "switch: a non-member's control requests per source address"),
             ("CONTROL_RATE", t.CONTROL_RATE, "switch: every non-member's control requests together"),
             ("ERROR_RATE", t.ERROR_RATE, "switch: join errors sent"),
             ("STATS_RATE", t.STATS_RATE, "switch: stats replies sent")]
    out = ["| constant | value | meaning |", "|---|---|---|"]
    out += [f"| `{n}` | {v} | {m} |" for n, v, m in rows]
    out += [f"| `{n}` | {v:g} s | {m} |" for n, v, m in timers_]
    out += [f"| `{n}` | {r:g}/s, burst {b} | {m} |" for n, (r, b), m in rates]
    return out


def _header():
    out = ["| offset | size | field | meaning |", "|---|---|---|---|"]
    for name, code in wire.HEADER_FIELDS:
        out.append(f"| {wire.OFFSETS[name]} | {struct.calcsize('>' + code)} | `{DOC_NAMES.get(name, name)}` | "
                   f"{FIELD_MEANING[name]} |")
    return out


def _code_table(head: str, names: dict, docs: dict) -> list[str]:
    """A table of wire codes (head: its columns, the code's and the name's first) with the documented columns
    of each name (docs[name], a tuple)."""
    cols = head.split(",")
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return out + [f"| {code} | {name} | " + " | ".join(docs[name]) + " |" for code, name in sorted(names.items())]


def _messages():
    return _code_table("value,name,direction,payload", wire.MSG_NAMES, MESSAGES)


def _struct_rows(fmt: str, names: list[str], base: int) -> list[str]:
    rows, off = [], base
    for code, name in zip(re.findall(r"\d*[a-zA-Z]", fmt.lstrip(">")), names):
        size = struct.calcsize(">" + code)
        if name:
            kind = STRUCT_TYPES.get(code, f"{size} bytes")
            rows.append(f"| {off} | {size} | {kind} | {name} |")
        off += size
    return rows


def _payloads():
    h = wire.HEADER_SIZE
    out = ["| offset | size | type | field |", "|---|---|---|---|", "| | | | **join** |"]
    out += _struct_rows(wire.JOIN_PAYLOAD.format, ["nonce (random per join attempt)", "world size",
                                                    "window the worker asks for (1..65535)",
                                                    "MAC (zeros for a job without a key)",
                                                    "elements per packet asked (0: the switch's maximum); every "
                                                    "rank must ask the same, or every join is refused"], h)
    out += [f"| {h + wire.JOIN_PAYLOAD.size} | {wire.JOIN_SIZE - h - wire.JOIN_PAYLOAD.size} | zeros | padding "
            f"to {wire.JOIN_SIZE} bytes |", "| | | | **join_ack** |"]
    out += _struct_rows(wire.JOIN_ACK_PAYLOAD.format, ["generation", "slots of the job",
                                                        "the job's elements per packet (what every rank asked, at "
                                                        "most the switch's maximum)",
                                                        "agreed window (the smallest asked, at most the slots)", "zeros",
                                                        "first packet id of every slot in this generation (even)"], h)
    out += ["| | | | **join_wait** |"] + _struct_rows(wire.JOIN_WAIT_PAYLOAD.format, ["bitmap of joined ranks"], h)
    out += ["| | | | **error** |"] + _struct_rows(wire.ERROR_PAYLOAD.format, ["code (error codes below)",
                                                                            "the rank it names (0xFF: none)"], h)
    out += [f"| {h + wire.ERROR_PAYLOAD.size} | ≤ {wire.MAX_ERROR_TEXT} | UTF-8 | text |",
            "| | | | **sparse_update / sparse_result** (block extension, then the elements) |"]
    out += [f"| {h} | 4 | u32 | `ext.block`: the block the elements belong to (result: the aggregated block) |",
            f"| {h + 4} | 4 | u32 | `ext.next_block`: the sender's next non-zero block (result: the smallest over "
            f"workers) |"]
    return out


def _errors():
    return _code_table("code,name,sent when,rank named", wire.ERROR_NAMES, ERRORS)


def _drops():
    return [f"- `{r}`: {DROPS[r]}" for r in wire.DROP_REASONS]


EXAMPLE_KEY = b"0123456789abcdef"


def _mac_vector():
    mac = auth.join_mac(EXAMPLE_KEY, 1, 0, 0x1122334455667788, 2, 8, 256)
    return [f"MAC test vector: key `{EXAMPLE_KEY.decode()}`, job 1, rank 0, nonce 0x1122334455667788, world 2, "
            f"window 8, 256 elements per packet → `{mac.hex()}`."]


def example_switch():
    """The reference switch of the worked example: deterministic secret, boot id and seed."""
    from switchsim.model import Switch

    return Switch({1: 2}, slots=4, max_elements=64, secret=0x5EC2E7, boot=0xB0075EED)


# where the example's ranks send from (a join_wait's cookie depends on the address; tests replay from these)
EXAMPLE_ADDRESSES = {"rank 0": ("127.0.0.1", 40000), "rank 1": ("127.0.0.1", 40001)}
EXAMPLE_NAMES = {v: k for k, v in EXAMPLE_ADDRESSES.items()}


def example_packets() -> list[tuple[str, str, bytes]]:
    """The example's requests: (who sends, what, datagram): two joins each (the second carries the cookie of
    the first's join_wait: the join counts then), one update of 4 int32 elements from each rank."""
    nonces = {0: 0x1111111111111111, 1: 0x2222222222222222}
    sw = example_switch()
    joins, session, first, boot = [], None, None, None
    for r in (0, 1):
        join = wire.pack_join(1, r, nonces[r], 2, 2, elements=4)
        what = f"join (nonce {nonces[r]:#x}, world 2, window 2, 4 elements per packet)"
        for again in (False, True):
            joins.append((f"rank {r}", what + (", again with the join_wait's cookie" if again else ""), join))
            for out, _ in sw.process(join, EXAMPLE_ADDRESSES[f"rank {r}"]):
                h = wire.unpack(out)
                if h.msg_type == wire.MSG_JOIN_WAIT:
                    join = wire.confirm_join(join, out)
                if h.msg_type == wire.MSG_JOIN_ACK:
                    session, boot = h.session, h.boot
                    first = wire.JOIN_ACK_PAYLOAD.unpack_from(out, wire.HEADER_SIZE)[-1]
    import numpy as np

    updates = []
    for r, values in ((0, [1, 2, 3, 4]), (1, [10, 20, 30, -40])):
        payload = np.array(values, ">i4").tobytes()
        updates.append((f"rank {r}", f"update of call 0 (int32, 4 elements {values}) on slot 0",
                        wire.pack(wire.MSG_UPDATE, 1, r, first, 0, first & 1, 4, wire.CODEC_INT32, 0, wire.EXP_NONE,
                                  0, payload, session, wire.call_kind("int32"), 0, 4, boot)))
    return joins + updates


def _hex(data: bytes) -> str:
    return "\n".join(data[i:i + 16].hex(" ") for i in range(0, len(data), 16))


def _example():
    """Replays example_packets() into a fresh reference switch; every request and every answer, as hex."""
    sw = example_switch()
    out = []
    for who, what, data in example_packets():
        shown = data if len(data) <= 64 else data[:64]
        out += [f"**{who} → switch**: {what}, {len(data)} bytes" + (" (the first 64 shown; the rest zeros)"
                                                                   if len(data) > 64 else ""), "```", _hex(shown), "```"]
        for reply, dst in sw.process(data, EXAMPLE_ADDRESSES[who]):
            h = wire.unpack(reply)
            out += [f"**switch → {EXAMPLE_NAMES[dst]}**: {wire.MSG_NAMES[h.msg_type]}, {len(reply)} bytes", "```", _hex(reply), "```"]
    return out


SECTIONS = {"header": _header, "messages": _messages, "payloads": _payloads, "errors": _errors,
            "drops": _drops, "constants": _constants, "mac": _mac_vector, "example": _example}


def render(text: str) -> str:
    """The doc with every generated part rewritten.

    Raises:
        ValueError: a section's markers are missing.
    """
    for name, make in SECTIONS.items():
        begin, end = f"<!-- BEGIN GENERATED: {name} -->", f"<!-- END GENERATED: {name} -->"
        pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
        if not pattern.search(text):
            raise ValueError(f"docs/protocol.md has no '{begin}' ... '{end}' markers")
        text = pattern.sub(lambda _: "\n".join([begin, *make(), end]), text)
    return text


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(PATH) as f:
        current = f.read()
    return update(PATH, render(current), "--check" in argv, "inaproto.gen_doc")


if __name__ == "__main__":
    sys.exit(main())
