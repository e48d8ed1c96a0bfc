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
       session=st.integers(0, 2**32 - 1), kind=st.integers(0, 255), call=st.integers(0, 0xFFFF),
       call_len=st.integers(0, wire.MAX_CALL_LEN), boot=st.integers(0, 2**32 - 1))
def test_pack_unpack_roundtrip(msg, job, rank, pid, slot, set_, codec, count, e1, e2, flags, session, kind, call,
                               call_len, boot):
    payload = bytes(count * wire.ELEMENT_SIZE[codec])
    data = wire.pack(msg, job, rank, pid, slot, set_, count, codec, e1, e2, flags, payload, session, kind, call,
                     call_len, boot)
    assert len(data) == wire.HEADER_SIZE + len(payload)
    h = wire.unpack(data)
    assert (h.msg_type, h.job, h.rank, h.packet_id, h.slot, h.set, h.count, h.codec, h.exp_cur, h.exp_next,
            h.flags, h.session, h.call_kind, h.call, h.call_len, h.boot) == (
        msg, job, rank, pid, slot, set_, count, codec, e1, e2, flags, session, kind, call, call_len, boot)
    assert h.call_id == (call, kind, call_len)
    assert h.pack(payload) == data
    assert wire.payload_view(data, h).size == count


@given(kind=st.integers(0, 255), call=st.integers(0, 0xFFFF), call_len=st.integers(0, wire.MAX_CALL_LEN),
       boot=st.integers(0, 2**32 - 1), block=st.integers(0, 1000))
def test_sparse_pack_unpack_roundtrip_of_the_call_and_boot(kind, call, call_len, boot, block):
    data = wire.pack_sparse(wire.MSG_SPARSE_RESULT, 3, 1, 8, 2, 0, 1, wire.CODEC_INT32, 0, wire.EXP_NONE, 0,
                            block, block + 1, bytes(4), 77, kind, call, call_len, boot)
    h = wire.unpack(data)
    assert (h.block, h.next_block, h.session, h.call_id, h.boot) == (block, block + 1, 77, (call, kind, call_len), boot)
    assert h.pack(bytes(4)) == data


def test_call_numbers_wrap_and_the_header_is_version_3():
    """The call number is the call count mod 2^16; every other v3 field keeps its bits; 32 header bytes."""
    h = wire.unpack(wire.pack(wire.MSG_UPDATE, codec=wire.CODEC_INT32, call=0x12345, session=-1 & 0xFFFFFFFF,
                              boot=0x1_0000_0007))
    assert (h.version, h.call, h.session, h.boot) == (3, 0x2345, 0xFFFFFFFF, 7)
    assert wire.HEADER_SIZE == wire.HEADER.size == wire.OFFSETS["boot"] + 4 == 32
    assert [n for n, _ in wire.HEADER_FIELDS][-6:] == ["exp_next", "call_kind", "call", "session", "call_len", "boot"]
    assert {n: wire.OFFSETS[n] for n in ("call_kind", "call", "session", "call_len", "boot")} == dict(
        call_kind=17, call=18, session=20, call_len=24, boot=28)  # the v3 spec's offsets
    assert wire.MSG_NAMES[wire.MSG_ABORT] == "abort" and wire.MSG_NAMES[wire.MSG_HEARTBEAT] == "heartbeat"
    assert {wire.MSG_ABORT, wire.MSG_HEARTBEAT} <= set(wire.CONTROL_REQUESTS)
    for msg in (wire.MSG_ABORT, wire.MSG_HEARTBEAT):  # control requests: no codec, no element checks
        assert wire.unpack(wire.pack(msg, job=1, rank=2, session=3, call=4, payload=b"x" * (msg == wire.MSG_ABORT)))


def test_call_kinds():
    assert wire.call_kind("int32") == 1 and wire.call_kind("nc", sparse=True) == 3 | wire.CALL_SPARSE == 0x83
    assert {wire.call_kind(c) for c in wire.CALL_KINDS} == {1, 2, 3, 4}
    assert wire.describe_kind(wire.call_kind("dither")) == "codec dither"
    assert wire.describe_kind(wire.call_kind("fixed", True)) == "codec fixed sparse"
    assert wire.describe_kind(9) == "codec kind 9"


def test_call_mismatch_text_names_what_differs():
    """The switch's error text for each way two ranks' calls differ (the C core words it byte for byte the
    same); the call number is looked at first, then the kind, then the length."""
    a = (5, wire.call_kind("int32"), 200)
    assert wire.call_mismatch_text(1, 2, (6, a[1], 100), 0, a) == (
        "job 1: ranks out of step: rank 2 is at call 6, rank 0 at call 5")
    assert wire.call_mismatch_text(1, 2, (5, wire.call_kind("nc", True), 100), 0, a) == (
        "job 1 call 5: rank 2 called allreduce with codec nc sparse, rank 0 with codec int32")
    assert wire.call_mismatch_text(7, 0, (5, a[1], 100), 3, a) == (
        "job 7 call 5: rank 0 called allreduce with 100 elements, rank 3 with 200")
    assert len(wire.call_mismatch_text(0xFFFF, 63, (0xFFFF, 0xFF, 2**32 - 1), 63, (0, 0x84, 0))) <= wire.MAX_ERROR_TEXT


@pytest.mark.parametrize("code", sorted(set(wire.ERROR_NAMES) - {wire.ERR_NOT_MEMBER}))
def test_pack_unpack_error(code):
    data = wire.pack_error(code, "rank 1 aborted call 3: ünïcode", job=4, rank=2, subject=1, session=9, boot=0xB007)
    h = wire.unpack(data)
    assert (h.msg_type, h.job, h.rank, h.session, h.boot, h.codec, h.count) == (wire.MSG_ERROR, 4, 2, 9, 0xB007,
                                                                             wire.CODEC_NONE, 0)
    assert data[wire.HEADER_SIZE:wire.HEADER_SIZE + 2] == bytes([code, 1])
    assert wire.unpack_error(data) == (code, 1, "rank 1 aborted call 3: ünïcode")
    assert wire.unpack_error(wire.pack_error(code)) == (code, wire.NO_RANK, "")


def test_error_without_payload_is_not_member():
    """A header-only error (the switch's answer to a data packet of a generation it does not have) is
    ERR_NOT_MEMBER, and no larger than the smallest data packet it answers."""
    data = wire.pack(wire.MSG_ERROR, job=1, rank=3, session=0xABCD, boot=0x1234)
    assert len(data) == wire.HEADER_SIZE <= len(wire.pack(wire.MSG_UPDATE))
    assert wire.unpack_error(data) == (wire.ERR_NOT_MEMBER, wire.NO_RANK, "")
    assert wire.unpack_error(data + b"\x04") == (wire.ERR_NOT_MEMBER, wire.NO_RANK, "")  # a cut payload: none
    assert wire.ERROR_NAMES[wire.ERR_NOT_MEMBER] == "not_member"
    assert wire.ERROR_NAMES == {0: "not_member", 1: "rejected", 2: "rank_taken", 3: "call_mismatch", 4: "aborted",
                                5: "peer_dead", 6: "dropped", 7: "pool_full"}
    h = wire.unpack(data)
    assert (h.session, h.boot) == (0xABCD, 0x1234)


def test_error_text_is_cut_to_fit_the_join():
    long = "é" * wire.MAX_ERROR_TEXT  # 2 bytes each: cut to MAX_ERROR_TEXT bytes
    data = wire.pack_error(wire.ERR_REJECTED, long, subject=wire.NO_RANK)
    assert len(data) == wire.HEADER_SIZE + wire.ERROR_PAYLOAD.size + wire.MAX_ERROR_TEXT == wire.JOIN_SIZE
    code, rank, text = wire.unpack_error(data)
    assert (code, rank) == (wire.ERR_REJECTED, wire.NO_RANK) and text == "é" * (wire.MAX_ERROR_TEXT // 2)


POOL = wire.OFFSETS["pool"]


@pytest.mark.parametrize("mutate,reason", [
    (lambda b: b[:10], "truncated"),
    (lambda b: bytes([9]) + b[1:], "version"),
    (lambda b: b[:1] + bytes([200]) + b[2:], "message type"),
    (lambda b: b[:2] + bytes([9]) + b[3:], "codec"),
    (lambda b: b[:POOL] + bytes([b[POOL] | wire.POOL_RESERVED_BIT >> 8]) + b[POOL + 1:], "reserved"),
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
                     codec=wire.CODEC_NC8, exp_cur=-3, exp_next=9, flags=wire.FLAG_OVERFLOW, session=0xC0FFEE42,
                     call_kind=0x83, call=0xCA11, call_len=0x00ABCDEF, boot=0xB0071D01)
    expect = {"version": wire.VERSION, "msg_type": wire.MSG_RESULT, "codec": wire.CODEC_NC8,
              "flags": wire.FLAG_OVERFLOW, "job": 0x1234, "rank": 0x56, "exp_cur": (-3) & 0xFF,
              "packet_id": 0x789ABCDE, "pool_index": 0x8123, "count": 0, "exp_next": 9, "call_kind": 0x83,
              "call": 0xCA11, "session": 0xC0FFEE42, "call_len": 0x00ABCDEF, "boot": 0xB0071D01}
    assert set(fields) == set(expect)
    assert {("pool" if n == "pool_index" else n): o for n, (o, _) in fields.items()} == wire.OFFSETS
    for name, value in expect.items():
        off, size = fields[name]
        assert int.from_bytes(data[off:off + size], "big") == value, name
    assert max(o + s for o, s in fields.values()) == wire.HEADER_SIZE == len(data)
    assert re.search(rf"^#+ Header \({wire.HEADER_SIZE} bytes", DOC.read_text(), re.M)


def test_message_types_match_docs():
    """docs/protocol.md's message-type table has a row for every message type of wire.py, by its name."""
    table = DOC.read_text().split("<!-- BEGIN GENERATED: messages -->")[1].split("<!-- END")[0]
    rows = dict(re.findall(r"^\|\s*(\d+)\s*\|\s*(\w+)\s*\|", table, re.M))
    for code, name in wire.MSG_NAMES.items():
        assert rows.get(str(code)) == name, (code, name)


def test_scapy_layer_builds_the_same_bytes():
    scapy_layer = pytest.importorskip("hostlib.scapy_layer", reason="scapy is in the [test] extra")
    from scapy.all import IP, UDP, raw

    values = np.array([5, -7, 2**31 - 1], dtype=np.int64)
    kind = wire.call_kind("fixed")
    ours = wire.pack(wire.MSG_UPDATE, job=2, rank=1, packet_id=99, slot=7, set=1, count=3,
                     codec=wire.CODEC_INT32, exp_cur=-2, exp_next=5, payload=values.astype(">i4").tobytes(),
                     session=0x5E55, call_kind=kind, call=513, call_len=70000, boot=0xB0070001)
    theirs = raw(scapy_layer.INA(msg_type="update", job=2, rank=1, packet_id=99, slot=7, set=1, exp_cur=-2,
                                 exp_next=5, session=0x5E55, call_kind="fixed", call=513, call_len=70000,
                                 boot=0xB0070001) / scapy_layer.INAInt32(values=values.tolist()))
    assert theirs == ours
    assert len(scapy_layer.INA()) == wire.HEADER_SIZE
    # and a captured datagram on the INA port dissects back into fields
    pkt = IP(raw(IP(dst="127.0.0.1") / UDP(sport=40000, dport=wire.DEFAULT_PORT) / ours))
    ina = pkt[scapy_layer.INA]
    assert (ina.job, ina.rank, ina.slot, ina.set, ina.count) == (2, 1, 7, 1, 3)
    assert (ina.call_kind, ina.call, ina.call_len, ina.session, ina.boot) == (kind, 513, 70000, 0x5E55, 0xB0070001)
    assert ina.sprintf("%INA.call_kind%") == "fixed"
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
    empty = wire.pack_sparse(wire.MSG_SPARSE_RESULT, codec=wire.CODEC_NC8, next_block=5, call_kind=0x83, call=9,
                             call_len=1000, boot=3)
    ina = scapy_layer.INA(empty)
    assert ina[scapy_layer.INABlock].block == wire.BLOCK_NONE and ina[scapy_layer.INABlock].next_block == 5
    assert (ina.call_kind, ina.call, ina.call_len, ina.boot) == (0x83, 9, 1000, 3)
    assert ina.sprintf("%INA.call_kind%") == "nc sparse"


def test_scapy_layer_dissects_and_builds_errors_aborts_heartbeats():
    """v3 control messages: an error's payload (code, named rank, text), the header-only not-member error,
    an abort's reason, a heartbeat; built by scapy, the same bytes as wire.py's."""
    scapy_layer = pytest.importorskip("hostlib.scapy_layer", reason="scapy is in the [test] extra")
    from scapy.all import IP, UDP, raw

    INA, INAError, INAAbort = scapy_layer.INA, scapy_layer.INAError, scapy_layer.INAAbort
    ours = wire.pack_error(wire.ERR_CALL_MISMATCH, "job 3: ranks out of step", job=3, rank=1, subject=2,
                           session=0x77, boot=0xB007)
    theirs = raw(INA(job=3, rank=1, session=0x77, boot=0xB007)
                 / INAError(code="call_mismatch", rank=2, text=b"job 3: ranks out of step"))
    assert theirs == ours
    pkt = IP(raw(IP(dst="127.0.0.1") / UDP(sport=wire.DEFAULT_PORT, dport=40000) / ours))
    err = pkt[INAError]
    assert (err.code, err.rank, err.text) == (wire.ERR_CALL_MISMATCH, 2, b"job 3: ranks out of step")
    assert (pkt[INA].msg_type, pkt[INA].count, pkt[INA].boot) == (wire.MSG_ERROR, 0, 0xB007)
    assert err.sprintf("%INAError.code% %INAError.rank%") == "call_mismatch 2"
    rejected = INA(wire.pack_error(wire.ERR_REJECTED, "unknown job 9", job=9))
    assert rejected[INAError].sprintf("%INAError.code% %INAError.rank%") == "rejected none"
    # not a member: the header alone, no error layer (wire.unpack_error: ERR_NOT_MEMBER)
    not_member = wire.pack(wire.MSG_ERROR, job=3, rank=1, session=0x77, boot=0xB007)
    assert raw(INA(msg_type="error", codec="none", job=3, rank=1, session=0x77, boot=0xB007)) == not_member
    assert INAError not in INA(not_member) and len(INA(not_member)) == wire.HEADER_SIZE
    # abort: the call's identity in the header, the reason after it
    abort = wire.pack(wire.MSG_ABORT, job=3, rank=1, session=0x77, call=12, call_kind=wire.call_kind("nc"),
                      call_len=4096, boot=0xB007, payload=b"CUDA out of memory")
    built = INA(job=3, rank=1, session=0x77, call=12, call_kind="nc", call_len=4096, boot=0xB007) / INAAbort(
        reason=b"CUDA out of memory")
    assert raw(built) == abort and INA(abort)[INAAbort].reason == b"CUDA out of memory"
    assert INA(abort).call == 12
    heartbeat = wire.pack(wire.MSG_HEARTBEAT, job=3, rank=1, session=0x77, boot=0xB007)
    assert raw(INA(msg_type="heartbeat", codec="none", job=3, rank=1, session=0x77, boot=0xB007)) == heartbeat
    assert INA(heartbeat).sprintf("%INA.msg_type%") == "heartbeat"
    join = wire.pack_join(1, 0, 5, 2, 8)  # control messages built with count left out get count 0, as wire.pack
    assert raw(INA(msg_type="join", codec="none") / join[wire.HEADER_SIZE:]) == join


def test_block_extension_layout_matches_docs():
    rows = re.findall(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*u32\s*\|\s*`ext\.(\w+)`", DOC.read_text(), re.M)
    h = wire.HEADER_SIZE
    assert {name: (int(off), int(size)) for off, size, name in rows} == {"block": (h, 4), "next_block": (h + 4, 4)}
    data = wire.pack_sparse(wire.MSG_SPARSE_RESULT, count=1, block=0x01020304, next_block=0x05060708,
                            payload=bytes(4))
    assert data[h:h + 4] == b"\x01\x02\x03\x04" and data[h + 4:h + 8] == b"\x05\x06\x07\x08"
    assert wire.BLOCK_EXT_SIZE == wire.BLOCK_EXT.size == 8
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
    error = wire.pack_error(wire.ERR_REJECTED, "x" * (wire.MAX_ERROR_TEXT + 50), subject=0)
    assert max(len(ack), len(wait), len(error)) <= len(join)
    assert len(error) == len(join)  # the longest error fits exactly
    with pytest.raises(wire.WireError, match="join is"):
        wire.unpack(join[:-1])  # an unpadded join is malformed: it could be answered with more than it sent
