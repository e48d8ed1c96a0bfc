"""Generates p4/ina.p4 from its template p4/ina.p4.in and inaproto/wire.py: constants, the INA header and
the per-lane code (v1model has no loops), so the P4 program never restates the wire format by hand.

    python -m inaproto.gen_p4             # rewrite p4/ina.p4
    python -m inaproto.gen_p4 --check     # exit 1 if p4/ina.p4 is out of date (tests/test_p4.py does the same)
    python -m inaproto.gen_p4 --compile   # also compile it with p4c-bm2-ss into p4/build/ (JSON + P4Info)
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile

from . import gen_c, wire

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATE = os.path.join(ROOT, "p4", "ina.p4.in")
PATH = os.path.join(ROOT, "p4", "ina.p4")
BUILD = os.path.join(ROOT, "p4", "build")
JSON, P4INFO = os.path.join(BUILD, "ina.json"), os.path.join(BUILD, "ina.p4info.txtpb")

LANES = 64  # elements per packet: 64 int32 lanes = 256 bytes, under BMv2's 512-byte deparser limit
SLOT_CAPACITY = 4096  # slots over all jobs (each has two sets)
MEMBER_CAPACITY = 1024  # ranks over all jobs
JOB_CAPACITY = 64
SOURCE_CELLS = 1024  # meter cells of strangers' control requests, by a hash of the source address
PORT_RANGE_MASK = 0xFFF0  # the parser takes INA on UDP ports DEFAULT_PORT .. DEFAULT_PORT + 15
UDP_HEADER = 8
FRAME_HEADERS = 14 + 20 + UDP_HEADER  # Ethernet, IPv4 without options, UDP: before the INA header
# struct codes of wire.HEADER_FIELDS -> P4 types (signed fields are bits: P4 casts where it compares them);
# "Nx" padding becomes a reserved bit<8N> field
P4_TYPES = {"B": "bit<8>", "b": "bit<8>", "H": "bit<16>", "h": "bit<16>", "I": "bit<32>", "i": "bit<32>"}
# why the data plane sends a packet to the controller (packet_in.punt)
PUNT_CONTROL = 0  # a control request (join, leave, stats, abort, heartbeat): the control plane answers it
PUNT_CALL_MISMATCH = 1  # a data packet whose call differs from its round's: fail the job (packet_in has the round's call)
PUNT_FAILED = 2  # a data packet of a failed generation: answer the stored error


def constants() -> list[str]:
    w = wire
    c = [("bit<8>", "VERSION", w.VERSION), ("bit<16>", "PORT_RANGE", w.DEFAULT_PORT),
         ("bit<16>", "PORT_RANGE_MASK", PORT_RANGE_MASK), ("bit<16>", "UDP_HEADER", UDP_HEADER)]
    c += [("bit<8>", f"MSG_{name.upper()}", code) for code, name in sorted(w.MSG_NAMES.items())]
    c += [("bit<8>", "MSG_MAX", max(w.MSG_NAMES))]
    c += [("bit<8>", f"CODEC_{name.upper()}", code) for code, name in sorted(w.CODEC_NAMES.items())]
    c += [("bit<8>", "CODEC_MAX", max(w.CODEC_NAMES)), ("bit<8>", "FLAG_OVERFLOW", w.FLAG_OVERFLOW),
          ("bit<8>", "FLAG_REPLY", w.FLAG_REPLY), ("bit<8>", "FLAG_CONGESTED", w.FLAG_CONGESTED),
          ("bit<2>", "ECN_ECT0", w.ECT0), ("bit<2>", "ECN_CE", w.CE),
          ("bit<8>", "EXP_NONE", w.EXP_NONE & 0xFF), ("int<16>", "NC_BIAS", w.NC_BIAS),
          ("int<16>", "NC_SPAN", w.NC_SPAN), ("int<16>", "NC_LEVEL_MIN", w.NC_LEVEL_MIN),
          ("int<16>", "NC_LEVEL_MAX", w.NC_LEVEL_MAX), ("bit<16>", "HEADER_SIZE", w.HEADER_SIZE),
          ("bit<16>", "BLOCK_EXT_SIZE", w.BLOCK_EXT_SIZE), ("bit<32>", "BLOCK_NONE", w.BLOCK_NONE),
          ("bit<16>", "JOIN_SIZE", w.JOIN_SIZE), ("bit<32>", "FRAME_HEADERS", FRAME_HEADERS),
          ("bit<8>", "PUNT_CONTROL", PUNT_CONTROL), ("bit<8>", "PUNT_CALL_MISMATCH", PUNT_CALL_MISMATCH),
          ("bit<8>", "PUNT_FAILED", PUNT_FAILED)]
    c += [("bit<8>", f"DROP_{r.upper()}", i) for i, r in enumerate(w.DROP_REASONS)]
    c += [("bit<32>", "DROP_COUNT", len(w.DROP_REASONS)), ("bit<16>", "LANES_16", LANES)]
    # ERR_DROPPED: the error payload (code, the drop reason's index), the reasons that are told (a bit per
    # DROP_* index), and how long the told text may be (the longest reason's name)
    assert len(w.DROP_REASONS) <= 32 and w.ERROR_PAYLOAD.size == 2
    c += [("bit<8>", "ERR_DROPPED", w.ERR_DROPPED), ("bit<32>", "ERROR_PAYLOAD_SIZE", w.ERROR_PAYLOAD.size),
          ("bit<32>", "TOLD_MASK", sum(1 << w.DROP_REASONS.index(r) for r in w.TOLD_DROPS)),
          ("bit<32>", "TOLD_TEXT_SIZE", TOLD_TEXT_SIZE)]
    lines = [f"const {t} {name} = {v};" for t, name, v in c]
    # int32 lanes two to a 64-bit slot of acc_even / acc_odd (int32_layout's docstring)
    lines += [f"const bit<{I32_BITS}> {name} = 0x{v:0{I32_BITS // 4}x};" for name, v in I32_CONSTANTS.items()]
    lines += [f"#define LANES {LANES}", f"#define SLOT_CAPACITY {SLOT_CAPACITY}",
              f"#define SET_CAPACITY {2 * SLOT_CAPACITY}", f"#define MEMBER_CAPACITY {MEMBER_CAPACITY}",
              f"#define JOB_CAPACITY {JOB_CAPACITY}", f"#define SOURCE_CELLS {SOURCE_CELLS}"]
    return ["// generated from inaproto/wire.py"] + lines


TOLD_TEXT_SIZE = max(len(r) for r in wire.TOLD_DROPS)  # bytes of told_text_t

# int32 lanes: a packet's `count` lanes are parsed as a few wide headers (all 64 as one of 2048 bits, fewer
# as runs of 8, 4, 2 and 1 lanes: p4c shifts BMv2's wide values by at most 256 bits) and added as two numbers
# of LANES / 2 slots of 64 bits (acc_even: the lanes at even positions counted from the last, acc_odd: the
# others), so a packet costs BMv2 a handful of primitives on wide values instead of a read, an add and a write
# per lane. A slot holds its lane's exact sum + 2^62 (the sum of up to 255 int32 values is within +-2^39: a
# slot never borrows from or carries into the next): a lane v comes in as v + 2^31 (v ^ 0x80000000, unsigned),
# so a write stores it + (2^62 - 2^31) and an add adds it - 2^31. The result is a slot's low 32 bits (2^62 is
# 0 mod 2^32); the sum left int32 unless (slot + 2^31) >> 32 == 2^30.
I32_BITS = 32 * LANES
_REP = sum(1 << (64 * j) for j in range(LANES // 2))  # 1 in every 64-bit slot
I32_CONSTANTS = {
    "I32_BIAS": sum(0x80000000 << (32 * i) for i in range(LANES)),  # XOR: every lane + 2^31 (as unsigned)
    "I32_LOW": _REP * 0xFFFFFFFF,  # the low 32 bits of every slot
    "I32_WRITE": _REP * ((1 << 62) - (1 << 31)),
    "I32_HALF": _REP * (1 << 31),
    "I32_HIGH": _REP * 0xFFFFFFFF00000000,
    "I32_OK": _REP * (1 << 62),  # slot + 2^31, high 32 bits, of a sum within int32
}
I32_RUN = 8  # lanes in each header of the i32_8 stack (256 bits)
I32_RUNS = LANES // I32_RUN - 1  # its depth: up to 63 lanes
I32_TAIL = [4, 2, 1]  # then a header each for the count's low bits, in packet order


def told_text() -> list[str]:
    """An action that puts the drop reason's name (the model's ERR_DROPPED text up to its colon) into
    hdr.told_text, left-aligned, and its length into meta.text_len; one branch per wire.TOLD_DROPS reason."""
    out = ["    action told_text() {  // generated from wire.TOLD_DROPS: the reason's name, left-aligned",
           "        meta.text_len = 0;", "        hdr.told_text.text = 0;"]
    for i, r in enumerate(wire.TOLD_DROPS):
        text = int.from_bytes(r.encode().ljust(TOLD_TEXT_SIZE, b"\0"), "big")
        out.append(f"        {'else ' if i else ''}if (meta.reason == DROP_{r.upper()}) "
                   f"{{ hdr.told_text.text = 0x{text:0{2 * TOLD_TEXT_SIZE}x}; meta.text_len = {len(r)}; }}  // {r}")
    return out + ["    }"]


def p4_type(code: str) -> str:
    """The P4 type of one field's struct code (wire.HEADER_FIELDS); ValueError for one P4 has no type for."""
    pad = re.fullmatch(r"(\d*)x", code)
    if pad:
        return f"bit<{8 * int(pad.group(1) or 1)}>"
    if code not in P4_TYPES:
        raise ValueError(f"wire.HEADER_FIELDS uses struct code {code!r}: add its P4 type to gen_p4.P4_TYPES")
    return P4_TYPES[code]


def ina_header() -> list[str]:
    """The header, field by field from wire.HEADER_FIELDS; the pool index splits into set, reserved, slot."""
    fields = []
    for name, code in wire.HEADER_FIELDS:
        if name == "pool":
            assert (wire.POOL_SET_BIT, wire.POOL_RESERVED_BIT, wire.POOL_SLOT_MASK) == (0x8000, 0x4000, 0x3FFF)
            fields += ["bit<1> set;", "bit<1> pool_reserved;", "bit<14> slot;"]
        else:
            fields.append(f"{p4_type(code)} {name};")
    return ["header ina_t {  // generated from wire.HEADER_FIELDS", *("    " + f for f in fields), "}"]


def _action(name: str, head: list[str], lane: str, tail: list[str] = ()) -> list[str]:
    body = [f"    action {name}() {{", *("        " + x for x in head)]
    for i in range(LANES):
        body += ["        " + x for x in lane.replace("{i}", str(i)).splitlines()]
    return body + ["        " + x for x in tail] + ["    }", ""]


# Per-lane code works in the scratch fields meta.s (struct scratch_t) rather than in expressions or locals:
# p4c gives every lane's sub-expression a temporary of its own, and BMv2 pays for each field of the packet's
# state on every packet (64 lanes of temporaries cost half its packet rate).
NC_CHECK = """if (hdr.l8[{i}].isValid()) {
    meta.s.m = (bit<16>)hdr.l8[{i}].v[6:0];
    if (hdr.l8[{i}].v != 0) { if (meta.s.m < meta.nc_lo) { meta.bad_codes = 1; } if (meta.s.m > meta.nc_hi) { meta.bad_codes = 1; } }
}"""
NC_VALUE = """if (hdr.l8[{i}].v != 0) {
    meta.s.mag = (bit<64>)1 << (bit<8>)((bit<16>)hdr.l8[{i}].v[6:0] - meta.nc_lo);
    if (hdr.l8[{i}].v[7:7] == 1) { meta.s.t = meta.s.t - meta.s.mag; } else { meta.s.t = meta.s.t + meta.s.mag; }
}"""
NC_ENCODE = """meta.s.t = 0;
if (meta.n_elems > {i}) {
    acc{i}.read(meta.s.t, meta.idx);
    meta.s.mag = meta.s.t;
    if (meta.s.t[63:63] == 1) { meta.s.mag = 0 - meta.s.t; }
    meta.s.x = meta.s.mag; meta.s.hb = 0;
    if (meta.s.x[63:32] != 0) { meta.s.hb = meta.s.hb + 32; meta.s.x = meta.s.x >> 32; }
    if (meta.s.x[31:16] != 0) { meta.s.hb = meta.s.hb + 16; meta.s.x = meta.s.x >> 16; }
    if (meta.s.x[15:8] != 0) { meta.s.hb = meta.s.hb + 8; meta.s.x = meta.s.x >> 8; }
    if (meta.s.x[7:4] != 0) { meta.s.hb = meta.s.hb + 4; meta.s.x = meta.s.x >> 4; }
    if (meta.s.x[3:2] != 0) { meta.s.hb = meta.s.hb + 2; meta.s.x = meta.s.x >> 2; }
    if (meta.s.x[1:1] != 0) { meta.s.hb = meta.s.hb + 1; }
    meta.s.top = (bit<64>)1 << meta.s.hb;
    meta.s.rem = meta.s.mag - meta.s.top;
    meta.s.up = 0;
    if (meta.nc_det == 1) {
        if (meta.s.hb != 0) { if (meta.s.rem >= meta.s.top >> 1) { meta.s.up = 1; } }
    } else {
        random(meta.s.r, 64w0, 64w0xFFFFFFFFFFFFFFFF);  // constant bounds: no temporary per lane
        if ((meta.s.r & (meta.s.top - 1)) < meta.s.rem) { meta.s.up = 1; }  // uniform on [0, top)
    }
    meta.s.lvl = meta.nc_lo + (bit<16>)meta.s.hb + meta.s.up;
    if (meta.s.lvl > 127) { meta.s.lvl = 127; if (meta.s.mag != 0) { meta.overflow = 1; } }
    meta.s.code = 0;
    if (meta.s.mag != 0) { meta.s.code = meta.s.t[63:63] ++ meta.s.lvl[6:0]; }
    meta.s.t = (bit<64>)meta.s.code;
    hdr.l8[{i}].setValid(); hdr.l8[{i}].v = meta.s.code;
}
acc{i}.write(meta.idx, meta.s.t);  // the code, so resends are identical (outside the if: p4c copies a
                                   // conditional extern call's arguments into a temporary field each)"""


def _i32(n: int) -> str:
    return f"hdr.i32_{n}"


def _runs(order) -> list[str]:
    return [f"hdr.i32_{I32_RUN}[{k}]" for k in order]


def int32_in() -> list[str]:
    """The packet's int32 lanes, right-aligned in meta.s.w (the first lane highest; a round's packets all
    carry n_elems lanes), biased and spread: meta.s.e / meta.s.o, the lanes at even / odd positions counted
    from the last, each in the low half of a slot."""
    out = [f"if ({_i32(LANES)}.isValid()) {{ meta.s.w = {_i32(LANES)}.v; }} else {{", "    meta.s.w = 0;"]
    parts = [(h, 32 * I32_RUN) for h in _runs(range(I32_RUNS))] + [(_i32(n), 32 * n) for n in I32_TAIL]
    out += [f"    if ({h}.isValid()) {{ meta.s.w = (meta.s.w << {bits}) | (bit<{I32_BITS}>){h}.v; }}"
            for h, bits in parts]
    return out + ["}", "meta.s.w = meta.s.w ^ I32_BIAS;", "meta.s.e = meta.s.w & I32_LOW;",
                  "meta.s.o = (meta.s.w >> 32) & I32_LOW;"]


I32_RESULT = ["if (((meta.s.a + I32_HALF) & I32_HIGH) != I32_OK || ((meta.s.b + I32_HALF) & I32_HIGH) != I32_OK) {",
              "    meta.overflow = 1;  // a lane's sum left int32", "}"]
I32_OUT = ["meta.s.w = (meta.s.a & I32_LOW) | ((meta.s.b & I32_LOW) << 32);  // the sums' low 32 bits, in lane order"]


def int32_out(by_count: bool) -> list[str]:
    """meta.s.w's lanes into the int32 headers, the last lanes first: those the packet has (by_count False:
    a dense round's completing packet carries n_elems lanes), or n_elems lanes (headers made valid or not)."""
    parts = [(_i32(n), 32 * n, f"meta.n_elems[{n.bit_length() - 1}:{n.bit_length() - 1}] == 1")
             for n in reversed(I32_TAIL)]
    parts += [(h, 32 * I32_RUN, f"meta.s.sh > {k}") for h, k in zip(_runs(reversed(range(I32_RUNS))),
                                                                   reversed(range(I32_RUNS)))]
    if by_count:
        out = [f"if (meta.n_elems == LANES_16) {{ {_i32(LANES)}.setValid(); {_i32(LANES)}.v = meta.s.w; }} "
               f"else {{ {_i32(LANES)}.setInvalid(); }}",
               f"meta.s.sh = (bit<16>)meta.n_elems[5:3];  // headers of the i32_{I32_RUN} stack"]
        for h, bits, cond in parts:
            out.append(f"if ({cond}) {{ {h}.setValid(); {h}.v = meta.s.w[{bits - 1}:0]; meta.s.w = meta.s.w >> {bits}; }} "
                       f"else {{ {h}.setInvalid(); }}")
        return out
    out = [f"if ({_i32(LANES)}.isValid()) {{ {_i32(LANES)}.v = meta.s.w; }} else {{"]
    out += [f"    if ({h}.isValid()) {{ {h}.v = meta.s.w[{bits - 1}:0]; meta.s.w = meta.s.w >> {bits}; }}"
            for h, bits, _ in parts]
    return out + ["}"]


def _body(name: str, lines: list[str], comment: str = "") -> list[str]:
    return [f"    action {name}() {{{'  // ' + comment if comment else ''}", *("        " + x for x in lines), "    }", ""]


def lane_actions() -> list[str]:
    """Every lane action, each a single action so that a read-modify-write of the lanes is atomic."""
    read = ["acc_even.read(meta.s.a, meta.idx);", "acc_odd.read(meta.s.b, meta.idx);"]
    add = ["meta.s.a = meta.s.a + meta.s.e - I32_HALF;", "meta.s.b = meta.s.b + meta.s.o - I32_HALF;",
           "acc_even.write(meta.idx, meta.s.a);", "acc_odd.write(meta.idx, meta.s.b);"]
    out = _body("write32", int32_in() + ["acc_even.write(meta.idx, meta.s.e + I32_WRITE);",
                                         "acc_odd.write(meta.idx, meta.s.o + I32_WRITE);"], "lanes = values")
    out += _body("add32", int32_in() + read + add, "lanes += values")
    # the packet completing a dense int32 round carries all n_elems lanes: add and write the result in place
    out += _body("add_finish32", int32_in() + read + add + I32_RESULT + I32_OUT + int32_out(False),
                 "lanes += values, the result into the packet")
    out += _action("write_nc", [], "meta.s.t = 0;\n" + NC_VALUE + "\nacc{i}.write(meta.idx, meta.s.t);")
    out += _action("add_nc", [], "acc{i}.read(meta.s.t, meta.idx);\n" + NC_VALUE + "\nacc{i}.write(meta.idx, meta.s.t);")
    # a round without elements (n_elems 0: dense calls of no data, sparse rounds no block came in) never wrote
    # the lanes: nothing to check
    out += _body("finish32", read + ["if (meta.n_elems != 0) {", *("    " + x for x in I32_RESULT), "}"] + I32_OUT
                 + int32_out(True), "the result: n_elems lanes")
    out += _body("resend32", read + I32_OUT + int32_out(True), "the stored result: n_elems lanes")
    out += _action("resend_nc", [],
                   "if (meta.n_elems > {i}) { acc{i}.read(meta.s.t, meta.idx); hdr.l8[{i}].setValid(); "
                   "hdr.l8[{i}].v = meta.s.t[7:0]; }")
    out += _action("finish_nc", [], NC_ENCODE)
    return out


def lane_parser() -> list[str]:
    """Parser states that extract `count` lanes without a loop (a state per bit of count, so 7 states per
    codec instead of 64 transitions: BMv2 pays per transition; 64 lanes take one): NC codes into the l8
    stack, int32 lanes into i32_64 (all 64) or the i32_8 stack and i32_4, i32_2, i32_1 (int32_in)."""
    out = []
    top = 1 << (LANES.bit_length() - 1)  # count <= LANES: its bits from this one down
    assert top == LANES == 64 and I32_RUN == 8  # int32_out's n_elems[5:3]: the count's bits of the i32_8 stack
    for stack in ("i32", "l8"):
        chunk = top
        while chunk:
            nxt, b = f"parse_{stack}_{chunk >> 1}" if chunk > 1 else "accept", chunk.bit_length() - 1
            if stack == "l8":
                extracts = ["pkt.extract(hdr.l8.next);"] * chunk
            elif chunk == LANES or chunk < I32_RUN:
                extracts = [f"pkt.extract(hdr.i32_{chunk});"]
            else:
                extracts = [f"pkt.extract(hdr.i32_{I32_RUN}.next);"] * (chunk // I32_RUN)
            out += [f"    state parse_{stack}_{chunk} {{",
                    f"        transition select(hdr.ina.count[{b}:{b}]) {{ 1: parse_{stack}_{chunk}_take; default: {nxt}; }}",
                    "    }", f"    state parse_{stack}_{chunk}_take {{",
                    *("        " + " ".join(extracts[i:i + 4]) for i in range(0, len(extracts), 4)),
                    f"        transition {'accept;  // count <= LANES' if chunk == LANES else nxt + ';'}", "    }"]
            chunk >>= 1
    return out


def render() -> str:
    with open(TEMPLATE) as f:
        text = f.read()
    parts = {
        "CONSTANTS": constants(),
        "INA_HEADER": ina_header(),
        "LANE_PARSER": lane_parser(),
        "TOP": [str(1 << (LANES.bit_length() - 1))],
        "LANE_REGISTERS": ["    // int32 lanes, two to a 64-bit slot (gen_p4.I32_CONSTANTS); NC lanes, one a register",
                           f"    register<bit<{I32_BITS}>>(SET_CAPACITY) acc_even;",
                           f"    register<bit<{I32_BITS}>>(SET_CAPACITY) acc_odd;",
                           *(f"    register<bit<64>>(SET_CAPACITY) acc{i};" for i in range(LANES))],
        "I32_BITS": [str(I32_BITS)],
        "I32_HEADER_TYPES": [f"header i32_{n}_t {{ bit<{32 * n}> v; }}" for n in [LANES, I32_RUN, *I32_TAIL]],
        "I32_HEADERS": [f"    i32_{LANES}_t i32_{LANES};", f"    i32_{I32_RUN}_t[{I32_RUNS}] i32_{I32_RUN};",
                        *(f"    i32_{n}_t i32_{n};" for n in I32_TAIL)],
        "I32_EMIT": [f"        pkt.emit(hdr.i32_{n});" for n in [LANES, I32_RUN, *I32_TAIL]],
        "NO_LANES": [f"        {h}.setInvalid();" for h in [_i32(LANES), *_runs(range(I32_RUNS)), *map(_i32, I32_TAIL)]]
                    + ["        hdr.l8.pop_front(LANES);"],
        "DECODE_NC": _action("check_nc", [], NC_CHECK),
        "LANE_ACTIONS": lane_actions(),
        "TOLD_TEXT": told_text(),
        "TOLD_TEXT_BITS": [str(8 * TOLD_TEXT_SIZE)],
    }
    for key, lines in parts.items():
        text = text.replace(f"@@{key}@@", "\n".join(lines).rstrip("\n"))
    header = "/* GENERATED by `python -m inaproto.gen_p4` from p4/ina.p4.in and inaproto/wire.py: do not edit. */\n"
    return header + text


# Where find_tool looks after $VAR and PATH: $P4_TOOLCHAIN_HOME/bin (the toolchain's env.sh sets it), then
# a prebuilt toolchain next to this checkout (../shared/p4-toolchain).
TOOL_ENV = {"simple_switch_grpc": "SIMPLE_SWITCH_GRPC", "p4c-bm2-ss": "P4C"}
TOOLCHAIN_BINS = [os.path.join(os.path.dirname(ROOT), "shared", "p4-toolchain", "bin")]


def find_tool(name: str) -> str | None:
    """A P4 tool (simple_switch_grpc, p4c-bm2-ss): $SIMPLE_SWITCH_GRPC / $P4C if it names an executable,
    else PATH, else $P4_TOOLCHAIN_HOME/bin, else the prebuilt toolchain (TOOLCHAIN_BINS). None if none has it."""
    env = os.environ.get(TOOL_ENV.get(name, ""), "")
    if env and os.path.isfile(env) and os.access(env, os.X_OK):
        return env
    found = shutil.which(name)
    if found:
        return found
    home = os.environ.get("P4_TOOLCHAIN_HOME")
    for d in ([os.path.join(home, "bin")] if home else []) + TOOLCHAIN_BINS:
        path = os.path.join(d, name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def find_p4c() -> str | None:
    return find_tool("p4c-bm2-ss")


def p4c_command(p4c: str) -> list[str]:
    """p4c finds its include files at <bin>/../p4include; where a copy of a toolchain lost that symlink
    (a plain file instead), run a cached copy of the compiler next to a working one."""
    home = os.path.dirname(os.path.dirname(os.path.realpath(p4c)))
    inc = os.path.join(home, "p4include")
    if os.path.isdir(inc) or not os.path.isdir(os.path.join(home, "share", "p4c", "p4include")):
        return [p4c]
    cache = os.path.join(os.path.expanduser("~"), ".cache", "ina-emulator", "p4c")
    exe = os.path.join(cache, "bin", os.path.basename(p4c))
    if not os.path.exists(exe) or os.path.getsize(exe) != os.path.getsize(p4c):
        os.makedirs(os.path.dirname(exe), exist_ok=True)
        shutil.copy2(p4c, exe + ".tmp")
        os.replace(exe + ".tmp", exe)
    link = os.path.join(cache, "p4include")
    if not os.path.islink(link):
        os.symlink(os.path.join(home, "share", "p4c", "p4include"), link)
    return [exe]


def compile_p4(source: str, out_dir: str, p4c: str | None = None) -> tuple[str, str]:
    """Compile a v1model program; returns (BMv2 JSON path, P4Info text path). Raises RuntimeError."""
    p4c = p4c or find_p4c()
    if p4c is None:
        raise RuntimeError("p4c-bm2-ss not found (set $P4C or put it on PATH; see p4/README.md)")
    base = os.path.join(os.path.abspath(out_dir), os.path.splitext(os.path.basename(source))[0])
    cmd = p4c_command(p4c) + ["--std", "p4-16", "--arch", "v1model", "-o", base + ".json",
                              "--p4runtime-files", base + ".p4info.txtpb", os.path.basename(source)]
    # from the source's directory, so the outputs name it "ina.p4" wherever it was compiled
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.dirname(os.path.abspath(source)))
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
    return base + ".json", base + ".p4info.txtpb"


def compiled_differs(p4c: str | None = None) -> list[str]:
    """Compile p4/ina.p4 afresh; the committed outputs that differ from the fresh ones."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "ina.p4")
        shutil.copy(PATH, src)
        fresh = compile_p4(src, tmp, p4c)
        stale = []
        for new, old in zip(fresh, (JSON, P4INFO)):
            with open(new) as a, open(old) as b:
                if a.read() != b.read():
                    stale.append(old)
        return stale


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if gen_c.update(PATH, render(), "--check" in argv, "inaproto.gen_p4"):
        return 1
    if "--compile" in argv:
        os.makedirs(BUILD, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "ina.p4")
            shutil.copy(PATH, src)
            for new, old in zip(compile_p4(src, tmp), (JSON, P4INFO)):
                shutil.copy(new, old)
    return 0


if __name__ == "__main__":
    sys.exit(main())
