"""scapy layer for the INA header (protocol v3), built from the constants in wire.py, bound to the UDP port.

    from inaproto.scapy_layer import INA
    pkt = IP(dst="127.0.0.1") / UDP(dport=INA_PORT) / INA(msg_type="update", count=2) / INAInt32(values=[1, 2])
    sparse = INA(msg_type="sparse_update", count=2) / INABlock(block=4, next_block=9) / INAInt32(values=[1, 2])
    error = INA(job=1, boot=0xB007) / INAError(code="aborted", rank=1, text=b"rank 1 aborted call 3")
    not_member = INA(msg_type="error", codec="none")  # an error with no payload at all: ERR_NOT_MEMBER
    rdpcap("capture.pcap")[0][INA].show()

The v3 header: call_kind, call, call_len (the call's identity, in every data packet of a call and echoed in
results; 0 in control messages) and boot (the switch's boot id, in everything it sends). A packet built with
count left out gets the element count of its payload (data messages) or 0 (control messages, as wire.pack).
"""
from __future__ import annotations

from scapy.fields import (BitEnumField, BitField, ByteEnumField, ByteField, FieldListField, FlagsField, IntField,
                          ShortField, SignedByteField, SignedIntField, StrField, XBitField, XIntField)
from scapy.layers.inet import UDP
from scapy.packet import Packet, bind_bottom_up, bind_layers, bind_top_down

from . import wire

INA_PORT = wire.DEFAULT_PORT
# call_kind: a worker codec, | CALL_SPARSE for a block-sparse call ("nc sparse"); 0 (none) in control messages
CALL_KIND_NAMES = {0: "none", **{kind | sparse: wire.describe_kind(kind | sparse).removeprefix("codec ")
                                 for kind in sorted(wire.CALL_KIND_NAMES) for sparse in (0, wire.CALL_SPARSE)}}
RANK_NAMES = {wire.NO_RANK: "none"}  # the rank an error names
# the flag bits, named after wire.FLAG_* (bit i: FLAG_ value 1 << i)
_FLAGS = {v.bit_length() - 1: k[len("FLAG_"):].lower() for k, v in vars(wire).items() if k.startswith("FLAG_")}
FLAG_NAMES = [_FLAGS.get(i, f"bit{i}") for i in range(max(_FLAGS) + 1)]


class INA(Packet):
    name = "INA"
    fields_desc = [
        ByteField("version", wire.VERSION),
        ByteEnumField("msg_type", wire.MSG_UPDATE, wire.MSG_NAMES),
        ByteEnumField("codec", wire.CODEC_INT32, wire.CODEC_NAMES),
        FlagsField("flags", 0, 8, FLAG_NAMES),
        ShortField("job", 1),
        ByteField("rank", 0),
        SignedByteField("exp_cur", 0),
        IntField("packet_id", 0),
        BitEnumField("set", 0, 1, {0: "set0", 1: "set1"}),
        BitField("pool_reserved", 0, 1),
        BitField("slot", 0, 14),
        ShortField("count", None),
        SignedByteField("exp_next", wire.EXP_NONE),
        ByteEnumField("call_kind", 0, CALL_KIND_NAMES),
        ShortField("call", 0),
        XIntField("session", 0),
        IntField("call_len", 0),
        XIntField("boot", 0),
    ]

    def post_build(self, p, pay):
        if self.count is None:  # fill in the element count from the payload (control messages: 0)
            n = 0
            if self.msg_type in wire.DATA_MESSAGES:
                size = wire.ELEMENT_SIZE.get(self.codec, 1)
                ext = wire.BLOCK_EXT_SIZE if self.msg_type in wire.SPARSE_MESSAGES else 0
                n = max(len(pay) - ext, 0) // size
            at = wire.OFFSETS["count"]
            p = p[:at] + n.to_bytes(2, "big") + p[at + 2:]
        return p + pay


_NAMES = [f.name for f in INA.fields_desc]  # the pool index is three fields here
_NAMES[_NAMES.index("set"):_NAMES.index("slot") + 1] = ["pool"]
assert _NAMES == [n for n, _ in wire.HEADER_FIELDS] and len(INA()) == wire.HEADER_SIZE, \
    "the scapy layer does not follow wire.HEADER_FIELDS"


def _elements(ina: INA):
    return INAInt32 if ina.codec == wire.CODEC_INT32 else INANC8


def _count(p):
    """Element count from the INA header below (through the block extension of sparse messages)."""
    under = p.underlayer
    while under is not None and not isinstance(under, INA):
        under = under.underlayer
    return under.count if under is not None else None


class INABlock(Packet):
    """Block extension of sparse_update / sparse_result (OmniReduce-style block-sparse rounds)."""

    name = "INA block"
    fields_desc = [XIntField("block", wire.BLOCK_NONE), XIntField("next_block", wire.BLOCK_NONE)]

    def guess_payload_class(self, payload):
        return _elements(self.underlayer) if isinstance(self.underlayer, INA) else Packet.guess_payload_class(
            self, payload)


class INAInt32(Packet):
    name = "INA int32 elements"
    fields_desc = [FieldListField("values", [], SignedIntField("v", 0),
                                  count_from=_count)]


class INANC8(Packet):
    name = "INA NC codes"
    fields_desc = [FieldListField("codes", [], ByteField("c", 0),
                                  count_from=_count)]


class INAError(Packet):
    """The payload of an error (wire.pack_error): code, the rank it names (0xFF none), utf-8 text. An error
    without a payload has no INAError layer: that is ERR_NOT_MEMBER (wire.unpack_error)."""

    name = "INA error"
    fields_desc = [ByteEnumField("code", wire.ERR_REJECTED, wire.ERROR_NAMES),
                   ByteEnumField("rank", wire.NO_RANK, RANK_NAMES),
                   StrField("text", b"")]


class INAAbort(Packet):
    """The payload of an abort: the utf-8 reason the rank's call failed (at most wire.MAX_ABORT_TEXT bytes)."""

    name = "INA abort"
    fields_desc = [StrField("reason", b"")]


bind_layers(UDP, INA, dport=INA_PORT)
bind_layers(UDP, INA, sport=INA_PORT)
for _msg in (wire.MSG_UPDATE, wire.MSG_RESULT):  # dense messages: the elements follow the header
    bind_layers(INA, INAInt32, msg_type=_msg, codec=wire.CODEC_INT32)
    bind_layers(INA, INANC8, msg_type=_msg, codec=wire.CODEC_NC8)
for _msg in wire.SPARSE_MESSAGES:  # block-sparse ones: the block extension first (it finds the elements)
    bind_layers(INA, INABlock, msg_type=_msg)
for _msg, _layer in ((wire.MSG_ERROR, INAError), (wire.MSG_ABORT, INAAbort)):  # control messages: codec none
    bind_bottom_up(INA, _layer, msg_type=_msg)
    bind_top_down(INA, _layer, msg_type=_msg, codec=wire.CODEC_NONE)
