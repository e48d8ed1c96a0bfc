"""scapy layer for the INA header, built from the constants in wire.py, bound to the UDP port.

    from hostlib.scapy_layer import INA
    pkt = IP(dst="127.0.0.1") / UDP(dport=INA_PORT) / INA(msg_type="update", count=2) / INAInt32(values=[1, 2])
    sparse = INA(msg_type="sparse_update", count=2) / INABlock(block=4, next_block=9) / INAInt32(values=[1, 2])
    rdpcap("capture.pcap")[0][INA].show()
"""
from __future__ import annotations

from scapy.fields import (BitEnumField, BitField, ByteEnumField, ByteField, FieldListField, FlagsField,
                          ShortField, SignedByteField, SignedIntField, IntField, XBitField, XIntField)
from scapy.layers.inet import UDP
from scapy.packet import Packet, bind_layers

from . import wire

INA_PORT = wire.DEFAULT_PORT


class INA(Packet):
    name = "INA"
    fields_desc = [
        ByteField("version", wire.VERSION),
        ByteEnumField("msg_type", wire.MSG_UPDATE, wire.MSG_NAMES),
        ByteEnumField("codec", wire.CODEC_INT32, wire.CODEC_NAMES),
        FlagsField("flags", 0, 8, ["overflow"]),
        ShortField("job", 1),
        ByteField("rank", 0),
        SignedByteField("exp_cur", 0),
        IntField("packet_id", 0),
        BitEnumField("set", 0, 1, {0: "set0", 1: "set1"}),
        BitField("pool_reserved", 0, 1),
        BitField("slot", 0, 14),
        ShortField("count", None),
        SignedByteField("exp_next", wire.EXP_NONE),
        XBitField("reserved", 0, 24),
        XIntField("session", 0),
    ]

    def post_build(self, p, pay):
        if self.count is None:  # fill in the element count from the payload
            size = wire.ELEMENT_SIZE.get(self.codec, 1)
            ext = wire.BLOCK_EXT_SIZE if self.msg_type in wire.SPARSE_MESSAGES else 0
            p = p[:14] + (max(len(pay) - ext, 0) // size).to_bytes(2, "big") + p[16:]
        return p + pay



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


bind_layers(UDP, INA, dport=INA_PORT)
bind_layers(UDP, INA, sport=INA_PORT)
for _msg in (wire.MSG_UPDATE, wire.MSG_RESULT):  # dense messages: the elements follow the header
    bind_layers(INA, INAInt32, msg_type=_msg, codec=wire.CODEC_INT32)
    bind_layers(INA, INANC8, msg_type=_msg, codec=wire.CODEC_NC8)
for _msg in wire.SPARSE_MESSAGES:  # block-sparse ones: the block extension first (it finds the elements)
    bind_layers(INA, INABlock, msg_type=_msg)
