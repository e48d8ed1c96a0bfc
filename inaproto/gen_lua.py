"""Generates inaproto/ina.lua, a Wireshark/tshark dissector, from its template inaproto/ina.lua.in and
inaproto/wire.py (constants, header fields, message layouts), so the dissector never restates the wire
format by hand. The package ships ina.lua; `switchsim dissector --path` prints where it is.

    python -m inaproto.gen_lua            # rewrite inaproto/ina.lua
    python -m inaproto.gen_lua --check    # exit 1 if it is out of date (tests/test_dissector.py does the same)
"""
from __future__ import annotations

import os
import re
import struct
import sys

from . import gen_c, gen_p4, wire

HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATE = os.path.join(HERE, "ina.lua.in")
PATH = os.path.join(HERE, "ina.lua")

# The UDP ports the dissector claims: the P4 parser's range, DEFAULT_PORT .. DEFAULT_PORT + 15.
PORTS = (wire.DEFAULT_PORT, wire.DEFAULT_PORT | (~gen_p4.PORT_RANGE_MASK & 0xFFFF))
# NC codes: bit 7 the sign, bits 6..0 the level m (wire.py's table); sign with m = 0 is not a code.
NC_SIGN = 1 << (wire.NC_LEVEL_MAX + wire.NC_BIAS).bit_length()
NC_INVALID = NC_SIGN
# Names of the fields of the fixed-layout payloads, in the order of their struct in wire.py (pad bytes
# have none); a struct that gains or loses a field fails the generator rather than the dissector.
PAYLOADS = {
    wire.MSG_JOIN: (wire.JOIN_PAYLOAD, ("nonce", "world", "window", "mac", "elements")),
    wire.MSG_JOIN_ACK: (wire.JOIN_ACK_PAYLOAD, ("generation", "slots", "elements", "window", "first_packet_id")),
    wire.MSG_JOIN_WAIT: (wire.JOIN_WAIT_PAYLOAD, ("joined",)),
    wire.MSG_ERROR: (wire.ERROR_PAYLOAD, ("code", "rank")),  # then the text; no payload at all: not_member
}
# utf-8 text after the fixed layout (if any): its field
TEXT_PAYLOADS = {wire.MSG_ERROR: "error", wire.MSG_STATS: "stats", wire.MSG_ABORT: "abort"}
# call_kind: a worker codec, | CALL_SPARSE for a block-sparse call ("nc sparse"); 0 (none) in control messages
CALL_KIND_NAMES = {0: "none", **{kind | sparse: wire.describe_kind(kind | sparse).removeprefix("codec ")
                                 for kind in sorted(wire.CALL_KIND_NAMES) for sparse in (0, wire.CALL_SPARSE)}}
# value_strings of fields (Lua tables in CONSTANTS): every value a name, or "Unknown"
STRINGS = {"msg_type": "MSG_NAMES", "codec": "CODEC_NAMES", "call_kind": "CALL_KIND_NAMES",
           "error.code": "ERROR_NAMES"}
BLOCK_EXT = (wire.BLOCK_EXT, ("block", "next_block"))
LABELS = {"msg_type": "Message type", "exp_cur": "Exponent of the payload", "exp_next": "Exponent of a later block",
          "packet_id": "Packet id", "pool": "Pool index", "pool_reserved": "Reserved bit", "next_block": "Next block",
          "first_packet_id": "First packet id", "elements": "Elements per packet", "world": "World size",
          "joined": "Ranks joined (bitmap)", "mac": "MAC", "error": "Reason", "stats": "Counters (JSON)",
          "block_ext": "Block extension", "elem": "Element", "code": "NC code", "value": "NC value",
          "call_kind": "Call kind", "call": "Call number", "call_len": "Call length (elements)",
          "boot": "Switch boot id", "error.code": "Error code", "error.rank": "Rank named", "abort": "Reason"}
HEX = {"flags", "pool", "session", "nonce", "joined", "call_kind", "boot"}
FLAGS = sorted((v, k[len("FLAG_"):].lower()) for k, v in vars(wire).items() if k.startswith("FLAG_"))


class Hex(int):
    """An int the generated Lua spells in hex (masks, bits)."""


def _lua(v) -> str:
    """A Python value as a Lua literal (tables from dicts and lists)."""
    if isinstance(v, Hex):
        return f"0x{v:X}"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v) if -0x10000 < v < 0x10000 else f"0x{v:X}"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, dict):
        return "{ " + ", ".join(f"[{_lua(k)}] = {_lua(x)}" if isinstance(k, int) else f"{k} = {_lua(x)}"
                                for k, x in v.items()) + " }"
    return "{ " + ", ".join(_lua(x) for x in v) + " }"


def _kind(code: str) -> tuple[int, str]:
    """(size, ProtoField type) of one struct item: 'b' int8, 'H' uint16, '3x' uint24, '16s' bytes."""
    size = struct.calcsize(">" + code)
    if code.endswith("s"):
        return size, "bytes"
    return size, ("int" if code[-1] in "bhiq" else "uint") + str(8 * size)


def layout(s: struct.Struct, names) -> list[dict]:
    """Offset, size and type of each named field of a big-endian struct (pad bytes skipped)."""
    out, offset = [], 0
    for count, code in re.findall(r"(\d*)([a-zA-Z?])", s.format.lstrip("<>!=@")):
        item = (count or "") + code if code in "sx" else code
        for _ in range(1 if code in "sx" else int(count or 1)):
            size, kind = _kind(item)
            if code != "x":
                out.append(dict(name=None, offset=offset, size=size, kind=kind))
            offset += size
    assert offset == s.size and len(out) == len(names), f"{s.format}: names {names} do not fit"
    for f, name in zip(out, names):
        f["name"] = name
    return out


def header_layout() -> list[dict]:
    """wire.HEADER_FIELDS with offsets; flags and the pool index get their sub-fields."""
    out = []
    for name, code in wire.HEADER_FIELDS:
        size, kind = _kind(code)
        f = dict(name=name, offset=wire.OFFSETS[name], size=size, kind=kind)
        if name == "flags":
            f["children"] = [f"flags.{n}" for _, n in FLAGS]
        if name == "pool":
            f["children"] = ["set", "pool_reserved", "slot"]
        out.append(f)
    return out


def _field(key: str, kind: str, base: str = "", strings: str = "nil", mask: int | None = None) -> tuple[str, str]:
    """(key, Lua ProtoField constructor) for field ina.<key>; label from LABELS or the key's last part."""
    last = key.rsplit(".", 1)[-1]
    label = _lua(LABELS.get(key, LABELS.get(last, last.replace("_", " ").capitalize())))
    args = [_lua("ina." + key), label]
    if kind == "bool":
        args += [base, strings, _lua(Hex(mask))]
    elif kind.startswith(("uint", "int")):
        args += [base or "base.DEC", strings] + ([_lua(Hex(mask))] if mask is not None else [])
    return key, f"ProtoField.{kind}({', '.join(args)})"


def fields() -> list[tuple[str, str]]:
    """Every field of the dissector, in tree order: header (with flag bits and the pool index's parts),
    block extension, elements, the control payloads."""
    out = []
    for f in header_layout():
        out.append(_field(f["name"], f["kind"], "base.HEX" if f["name"] in HEX else "", STRINGS.get(f["name"], "nil")))
        bits = str(8 * f["size"])
        if f["name"] == "flags":
            out += [_field(f"flags.{n}", "bool", bits, "nil", v) for v, n in FLAGS]
        if f["name"] == "pool":
            out += [_field("set", f["kind"], "", "nil", wire.POOL_SET_BIT),
                    _field("pool_reserved", f["kind"], "", "nil", wire.POOL_RESERVED_BIT),
                    _field("slot", f["kind"], "", "nil", wire.POOL_SLOT_MASK)]
    out.append(_field("block_ext", "none"))
    out += [_field(f["name"], f["kind"]) for f in layout(*BLOCK_EXT)]
    out += [_field("elements", "none"), _field("elem", f"int{8 * wire.ELEMENT_SIZE[wire.CODEC_INT32]}"),
            _field("nc.code", f"uint{8 * wire.ELEMENT_SIZE[wire.CODEC_NC8]}", "base.HEX"), _field("nc.value", "double")]
    for msg, (s, names) in PAYLOADS.items():
        msg_name = wire.MSG_NAMES[msg]
        out += [_field(key, f["kind"], "base.HEX" if f["name"] in HEX else "", STRINGS.get(key, "nil"))
                for f in layout(s, names) for key in [f"{msg_name}.{f['name']}"]]
    out += [_field(name, "string") for name in TEXT_PAYLOADS.values()]
    return out


def _payload_layout(msg: int) -> list[dict]:
    s, names = PAYLOADS[msg]
    return [dict(field=f"{wire.MSG_NAMES[msg]}.{f['name']}", offset=f["offset"], size=f["size"])
            for f in layout(s, names)]


def constants() -> list[str]:
    """The constants and tables the dissector's code reads, each from wire.py."""
    w = wire
    scalars = dict(VERSION=w.VERSION, HEADER_SIZE=w.HEADER_SIZE, BLOCK_EXT_SIZE=w.BLOCK_EXT_SIZE,
                   BLOCK_NONE=Hex(w.BLOCK_NONE), JOIN_SIZE=w.JOIN_SIZE,
                   POOL_SET_BIT=Hex(w.POOL_SET_BIT), POOL_RESERVED_BIT=Hex(w.POOL_RESERVED_BIT),
                   POOL_RESERVED_INDEX=w.POOL_RESERVED_BIT.bit_length() - 1,
                   POOL_SLOT_MASK=Hex(w.POOL_SLOT_MASK), FLAG_OVERFLOW=Hex(w.FLAG_OVERFLOW),
                   EXP_NONFINITE=w.EXP_NONFINITE, NC_BIAS=w.NC_BIAS, NC_SIGN=Hex(NC_SIGN),
                   NC_INVALID=Hex(NC_INVALID), MSG_JOIN=w.MSG_JOIN, MSG_STATS=w.MSG_STATS,
                   MSG_ERROR=w.MSG_ERROR, MSG_ABORT=w.MSG_ABORT, ERR_NOT_MEMBER=w.ERR_NOT_MEMBER,
                   CODEC_NC8=w.CODEC_NC8, PORTS=f"{PORTS[0]}-{PORTS[1]}")
    tables = dict(
        MSG_NAMES=dict(sorted(w.MSG_NAMES.items())), CODEC_NAMES=dict(sorted(w.CODEC_NAMES.items())),
        EXP_NAMES={w.EXP_NONE: "none", w.EXP_NONFINITE: "nonfinite"}, BLOCK_NAMES={w.BLOCK_NONE: "none"},
        ELEMENT_SIZE=dict(sorted(w.ELEMENT_SIZE.items())), DATA_MESSAGES=dict.fromkeys(w.DATA_MESSAGES, True),
        SPARSE_MESSAGES=dict.fromkeys(w.SPARSE_MESSAGES, True), TEXT_PAYLOADS=TEXT_PAYLOADS,
        CALL_KIND_NAMES=CALL_KIND_NAMES, ERROR_NAMES=dict(sorted(w.ERROR_NAMES.items())),
        RANK_NAMES={w.NO_RANK: "none"}, PAYLOAD_SIZE={msg: s.size for msg, (s, _) in PAYLOADS.items()})
    lines = ["-- generated from inaproto/wire.py"]
    lines += [f"local {k} = {_lua(v)}" for k, v in scalars.items()]
    lines += [f"local {k} = {_lua(v)}" for k, v in tables.items()]
    lines.append("local HEADER = {")
    for f in header_layout():
        item = dict(name=f["name"], offset=f["offset"], size=f["size"])
        item.update({"signed": True} if f["kind"].startswith("int") else {})
        item.update({"children": f["children"]} if "children" in f else {})
        lines.append(f"    {_lua(item)},")
    lines.append("}")
    lines.append("local BLOCK_EXT = " + _lua([dict(field=f["name"], offset=f["offset"], size=f["size"])
                                              for f in layout(*BLOCK_EXT)]))
    lines.append("local PAYLOADS = {")
    lines += [f"    [{msg}] = {_lua(_payload_layout(msg))}," for msg in PAYLOADS]
    lines.append("}")
    return lines


def render() -> str:
    with open(TEMPLATE) as f:
        text = f.read()
    decl = fields()
    parts = {
        "CONSTANTS": constants(),
        "FIELDS": ["local F = {"] + [f"    [{_lua(k)}] = {v}," for k, v in decl] + ["}"]
                  + ["ina.fields = {"] + [f"    F[{_lua(k)}]," for k, _ in decl] + ["}"],
    }
    for key, lines in parts.items():
        text = text.replace(f"@@{key}@@", "\n".join(lines))
    return ("-- GENERATED by `python -m inaproto.gen_lua` from inaproto/ina.lua.in and inaproto/wire.py: "
            "do not edit.\n" + text)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return gen_c.update(PATH, render(), "--check" in argv, "inaproto.gen_lua")


if __name__ == "__main__":
    sys.exit(main())
