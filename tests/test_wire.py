import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, strategies as st

from hostlib import wire

DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"


@given(msg=st.sampled_from([wire.MSG_UPDATE, wire.MSG_RESULT]), job=st.integers(0, 0xFFFF),
       rank=st.integers(0, 63), pid=st.integers(0, 2**32 - 1), slot=st.integers(0, wire.MAX_SLOTS - 1),
       set_=st.integers(0, 1), codec=st.sampled_from([wire.CODEC_INT32, wire.CODEC_NC8]),
       count=st.integers(0, 300), e1=st.integers(-128, 127), e2=st.integers(-128, 127), flags=st.integers(0, 255),
       session=st.integers(0, 2**32 - 1))
def test_pack_unpack_roundtrip(msg, job, rank, pid, slot, set_, codec, count, e1, e2, flags, session):
    payload = bytes(count * wire.ELEMENT_SIZE[codec])
    data = wire.pack(msg, job, rank, pid, slot, set_, count, codec, e1, e2, flags, payload, session)
    h = wire.unpack(data)
    assert (h.msg_type, h.job, h.rank, h.packet_id, h.slot, h.set, h.count, h.codec, h.exp_cur, h.exp_next,
            h.flags, h.session) == (msg, job, rank, pid, slot, set_, count, codec, e1, e2, flags, session)
    assert h.pack(payload) == data
    assert wire.payload_view(data, h).size == count


@pytest.mark.parametrize("mutate,reason", [
    (lambda b: b[:10], "truncated"),
    (lambda b: bytes([9]) + b[1:], "version"),
    (lambda b: b[:1] + bytes([200]) + b[2:], "message type"),
    (lambda b: b[:2] + bytes([9]) + b[3:], "codec"),
    (lambda b: b[:12] + bytes([b[12] | 0x40]) + b[13:], "reserved"),
    (lambda b: b + b"\x00", "payload"),
    (lambda b: b[:-1], "payload"),
])
def test_malformed_headers_are_rejected(mutate, reason):
    good = wire.pack(wire.MSG_UPDATE, count=2, codec=wire.CODEC_INT32, payload=bytes(8))
    with pytest.raises(wire.WireError, match=reason):
        wire.unpack(mutate(good))


def test_byte_layout_matches_docs():
    """docs/protocol.md's header table lists every field at the offset wire.py packs it."""
    rows = re.findall(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*`(\w+)`", DOC.read_text(), re.M)
    assert rows, "no header table in docs/protocol.md"
    fields = {name: (int(off), int(size)) for off, size, name in rows}
    data = wire.pack(wire.MSG_RESULT, job=0x1234, rank=0x56, packet_id=0x789ABCDE, slot=0x0123, set=1, count=0,
                     codec=wire.CODEC_NC8, exp_cur=-3, exp_next=9, flags=wire.FLAG_OVERFLOW, session=0xC0FFEE42)
    expect = {"version": wire.VERSION, "msg_type": wire.MSG_RESULT, "codec": wire.CODEC_NC8,
              "flags": wire.FLAG_OVERFLOW, "job": 0x1234, "rank": 0x56, "exp_cur": (-3) & 0xFF,
              "packet_id": 0x789ABCDE, "pool_index": 0x8123, "count": 0, "exp_next": 9, "reserved": 0,
              "session": 0xC0FFEE42}
    assert set(fields) == set(expect)
    assert {("pool" if n == "pool_index" else n): o for n, (o, _) in fields.items()} == wire.OFFSETS
    for name, value in expect.items():
        off, size = fields[name]
        assert int.from_bytes(data[off:off + size], "big") == value, name
    assert max(o + s for o, s in fields.values()) == wire.HEADER_SIZE == len(data)


def test_scapy_layer_builds_the_same_bytes():
    scapy_layer = pytest.importorskip("hostlib.scapy_layer", reason="scapy is in the [test] extra")
    from scapy.all import IP, UDP, raw

    values = np.array([5, -7, 2**31 - 1], dtype=np.int64)
    ours = wire.pack(wire.MSG_UPDATE, job=2, rank=1, packet_id=99, slot=7, set=1, count=3,
                     codec=wire.CODEC_INT32, exp_cur=-2, exp_next=5, payload=values.astype(">i4").tobytes())
    theirs = raw(scapy_layer.INA(msg_type="update", job=2, rank=1, packet_id=99, slot=7, set=1, exp_cur=-2,
                                 exp_next=5) / scapy_layer.INAInt32(values=values.tolist()))
    assert theirs == ours
    # and a captured datagram on the INA port dissects back into fields
    pkt = IP(raw(IP(dst="127.0.0.1") / UDP(sport=40000, dport=wire.DEFAULT_PORT) / ours))
    ina = pkt[scapy_layer.INA]
    assert (ina.job, ina.rank, ina.slot, ina.set, ina.count) == (2, 1, 7, 1, 3)
    assert pkt[scapy_layer.INAInt32].values == values.tolist()
    nc = wire.pack(wire.MSG_RESULT, count=2, codec=wire.CODEC_NC8, payload=bytes([0x41, 0xC0]))
    assert scapy_layer.INA(nc)[scapy_layer.INANC8].codes == [0x41, 0xC0]


def test_scapy_layer_dissects_and_builds_block_sparse_messages():
    scapy_layer = pytest.importorskip("hostlib.scapy_layer", reason="scapy is in the [test] extra")
    from scapy.all import IP, UDP, raw

    values = [3, -4]
    ours = wire.pack_sparse(wire.MSG_SPARSE_UPDATE, 1, 2, 40, 3, 0, 2, wire.CODEC_INT32, 0, wire.EXP_NONE, 0,
                            block=17, next_block=30, payload=np.array(values, ">i4").tobytes())
    theirs = raw(scapy_layer.INA(msg_type="sparse_update", job=1, rank=2, packet_id=40, slot=3)
                 / scapy_layer.INABlock(block=17, next_block=30) / scapy_layer.INAInt32(values=values))
    assert theirs == ours
    pkt = IP(raw(IP(dst="127.0.0.1") / UDP(sport=40000, dport=wire.DEFAULT_PORT) / ours))
    assert (pkt[scapy_layer.INABlock].block, pkt[scapy_layer.INABlock].next_block) == (17, 30)
    assert pkt[scapy_layer.INA].count == 2 and pkt[scapy_layer.INAInt32].values == values
    empty = wire.pack_sparse(wire.MSG_SPARSE_RESULT, codec=wire.CODEC_NC8, next_block=5)
    ina = scapy_layer.INA(empty)
    assert ina[scapy_layer.INABlock].block == wire.BLOCK_NONE and ina[scapy_layer.INABlock].next_block == 5


def test_block_extension_layout_matches_docs():
    rows = re.findall(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*`ext\.(\w+)`", DOC.read_text(), re.M)
    h = wire.HEADER_SIZE
    assert {name: (int(off), int(size)) for off, size, name in rows} == {"block": (h, 4), "next_block": (h + 4, 4)}
    data = wire.pack_sparse(wire.MSG_SPARSE_RESULT, count=1, block=0x01020304, next_block=0x05060708,
                            payload=bytes(4))
    assert data[h:h + 4] == b"\x01\x02\x03\x04" and data[h + 4:h + 8] == b"\x05\x06\x07\x08"
    assert wire.HEADER_SIZE + wire.BLOCK_EXT_SIZE == 32
    for code in wire.SPARSE_MESSAGES:
        assert re.search(rf"^\| {code} \| {wire.MSG_NAMES[code]} \|", DOC.read_text(), re.M)


def test_generated_c_header_is_up_to_date():
    """csrc/ina_wire.h is generated from inaproto/wire.py (python -m inaproto.gen_c); a stale copy fails."""
    from inaproto import gen_c

    with open(gen_c.PATH) as f:
        assert f.read() == gen_c.render(), "run: python -m inaproto.gen_c"
    assert gen_c.main(["--check"]) == 0


def test_join_answers_are_never_larger_than_the_join():
    """Anti-amplification by construction: every reply to a join (ack, wait, the longest error) fits in it."""
    join = wire.pack_join(1, 0, 7, 4, 64)
    assert len(join) == wire.JOIN_SIZE and wire.unpack(join).msg_type == wire.MSG_JOIN
    ack = wire.pack(wire.MSG_JOIN_ACK, payload=wire.JOIN_ACK_PAYLOAD.pack(1, 2, 3, 4, 5))
    wait = wire.pack(wire.MSG_JOIN_WAIT, payload=wire.JOIN_WAIT_PAYLOAD.pack(5))
    error = wire.pack(wire.MSG_ERROR, payload=bytes(wire.MAX_ERROR_TEXT))
    assert max(len(ack), len(wait), len(error)) <= len(join)
    with pytest.raises(wire.WireError, match="join is"):
        wire.unpack(join[:-1])  # an unpadded join is malformed: it could be answered with more than it sent
