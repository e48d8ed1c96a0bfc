"""The P4 program (p4/ina.p4) against the one wire-format definition: generated, compiled and described
(P4Info) from it, with the control plane's messages built from that P4Info. Runs everywhere; the
recompile check needs p4c-bm2-ss. The program's behaviour on BMv2 is tested by the conformance,
adversarial and end-to-end suites (conftest.BACKENDS["bmv2"])."""
from __future__ import annotations

import re
import struct

import pytest

from inaproto import gen_p4, wire

p4rt = pytest.importorskip("switchsim.p4rt", reason="the p4 extra (p4runtime, grpcio) is not installed")


def p4_source() -> str:
    with open(gen_p4.PATH) as f:
        return f.read()


def test_generated_program_is_up_to_date():
    assert gen_p4.main(["--check"]) == 0, "run python -m inaproto.gen_p4 --compile"


def test_compiled_outputs_are_up_to_date():
    if gen_p4.find_p4c() is None:
        pytest.skip("p4c-bm2-ss not found ($P4C or PATH): cannot recompile p4/ina.p4")
    assert gen_p4.compiled_differs() == [], "run python -m inaproto.gen_p4 --compile"


def test_constants_match_the_wire_format():
    consts = {name: int(v) for name, v in re.findall(r"const \S+ (\w+) = (-?\d+);", p4_source())}
    for code, name in wire.MSG_NAMES.items():
        assert consts[f"MSG_{name.upper()}"] == code
    for i, reason in enumerate(wire.DROP_REASONS):
        assert consts[f"DROP_{reason.upper()}"] == i
    assert (consts["VERSION"], consts["HEADER_SIZE"], consts["BLOCK_NONE"]) == (wire.VERSION, wire.HEADER_SIZE,
                                                                               wire.BLOCK_NONE)
    assert consts["EXP_NONE"] == wire.EXP_NONE & 0xFF and consts["NC_SPAN"] == wire.NC_SPAN


def test_ina_header_has_the_wire_layout():
    """Field widths in order give the offsets of wire.OFFSETS, and the header is HEADER_SIZE bytes."""
    body = re.search(r"header ina_t \{.*?\n(.*?)\n\}", p4_source(), re.S).group(1)
    fields = re.findall(r"bit<(\d+)> (\w+);", body)
    offsets, bit = {}, 0
    for width, name in fields:
        offsets[name] = bit // 8
        bit += int(width)
    assert bit == wire.HEADER_SIZE * 8
    for name, off in wire.OFFSETS.items():
        assert offsets["set" if name == "pool" else name] == off, name


@pytest.fixture(scope="module")
def info():
    return p4rt.P4Info(gen_p4.P4INFO)


def test_p4info_describes_what_the_control_plane_writes(info):
    entry = info.table_entry("jobs", {"hdr.ina.job": 7}, "set_job", {
        "world": 4, "slots": 512, "max_elements": 64, "slot_base": 0, "session": 0xDEADBEEF, "first_id": 2,
        "group": 8, "index": 0, "failed": 1})
    assert entry.table_id == info.table_id("InaIngress.jobs")
    assert len(entry.action.action.params) == 9
    member = info.table_entry("members", {"hdr.ina.job": 7, "hdr.ina.rank": 3}, "set_member",
                              {"ip": 0x0A000001, "port": 40000, "index": 3})
    assert [m.exact.value for m in member.match] == [b"\x07", b"\x03"]
    with pytest.raises(ValueError):
        info.table_entry("members", {"hdr.ina.job": 7, "hdr.ina.rank": 256}, "set_member",
                         {"ip": 1, "port": 1, "index": 1})  # a rank is 8 bits
    replica = info.table_entry("replicas", {"hdr.ina.job": 7, "sm.egress_rid": 4}, "to_worker",
                               {"mac": 0x02494E410001, "ip": 0x0A000001, "port": 40000})
    assert replica.table_id == info.table_id("InaEgress.replicas")
    default = info.default_action("switch_config", "set_switch", {"mac": 1, "ip": 2, "port": wire.DEFAULT_PORT,
                                                                  "nc_det": 1, "boot": 0xFFFFFFFF})
    assert default.is_default_action
    for msg in (entry, member, replica, default):
        assert type(msg).FromString(msg.SerializeToString()) == msg


def test_p4info_sizes_follow_the_wire_format(info):
    counters = {c.preamble.name.split(".")[-1]: c.size for c in info.message.counters}
    assert counters["drops"] == len(wire.DROP_REASONS)
    assert counters["received"] == gen_p4.SLOT_CAPACITY
    names = [(name, width) for name, _, width in info.packet_metadata("packet_in")]
    # why a packet is punted, and a call mismatch's round: call fields as wide as the header's
    widths = dict(zip((n for n, _ in wire.HEADER_FIELDS), (struct.calcsize(">" + c) * 8 for _, c in wire.HEADER_FIELDS)))
    assert names == [("ingress_port", 9), ("pad", 7), ("punt", 8), ("writer", 8), ("call_kind", widths["call_kind"]),
                     ("call", widths["call"]), ("call_len", widths["call_len"])]


def test_every_header_field_type_has_a_p4_type():
    assert all(gen_p4.p4_type(code) for _, code in wire.HEADER_FIELDS)
    assert gen_p4.p4_type("3x") == "bit<24>" and gen_p4.p4_type("x") == "bit<8>"
    with pytest.raises(ValueError, match="P4_TYPES"):
        gen_p4.p4_type("q")


def test_punt_reasons_are_the_controllers():
    consts = {name: int(v) for name, v in re.findall(r"const \S+ (\w+) = (-?\d+);", p4_source())}
    for name in ("PUNT_CONTROL", "PUNT_CALL_MISMATCH", "PUNT_FAILED"):
        assert consts[name] == getattr(gen_p4, name)
    assert len({gen_p4.PUNT_CONTROL, gen_p4.PUNT_CALL_MISMATCH, gen_p4.PUNT_FAILED}) == 3


def test_told_drops_are_the_wires():
    """ERR_DROPPED in the data plane: the code, the reasons it tells (a bit per DROP_* index) and the text of
    each, the reason's name (the model's text up to its colon)."""
    src = p4_source()
    consts = {name: int(v) for name, v in re.findall(r"const \S+ (\w+) = (-?\d+);", src)}
    assert consts["ERR_DROPPED"] == wire.ERR_DROPPED and consts["ERROR_PAYLOAD_SIZE"] == wire.ERROR_PAYLOAD.size
    assert consts["TOLD_MASK"] == sum(1 << wire.DROP_REASONS.index(r) for r in wire.TOLD_DROPS)
    texts = re.findall(r"meta.reason == DROP_(\w+)\) \{ hdr.told_text.text = 0x([0-9a-f]+); meta.text_len = (\d+);",
                       src)
    assert {name.lower(): bytes.fromhex(text)[:int(n)].decode() for name, text, n in texts} == \
        {r: r for r in wire.TOLD_DROPS}
    width = int(re.search(r"header told_text_t \{ bit<(\d+)> text; \}", src).group(1))
    assert width == 8 * max(map(len, wire.TOLD_DROPS))


def _fake_switch(tmp_path, version_exit: int, said: str) -> str:
    """An executable standing in for simple_switch_grpc: `--version` exits version_exit, anything else
    prints `said` and exits 1 (a switch that cannot start)."""
    path = tmp_path / "simple_switch_grpc"
    path.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then echo "{said}" >&2; exit {version_exit}; fi\n'
                    f'echo "{said}"; exit 1\n')
    path.chmod(0o755)
    return str(path)


def test_a_bmv2_binary_that_cannot_run_is_named_missing_not_a_failed_switch(tmp_path, monkeypatch):
    """Found but unable to start (its shared libraries not installed): why_not() says so, and the BMv2 suites
    skip with that reason instead of failing at their first switch."""
    from switchsim import bmv2

    lib = "error while loading shared libraries: libgrpc++.so.1.51: cannot open shared object file"
    monkeypatch.setenv("SIMPLE_SWITCH_GRPC", _fake_switch(tmp_path, 127, lib))
    reason = bmv2.why_not()
    assert "does not run" in reason and "exit 127" in reason and "libgrpc++.so.1.51" in reason


def test_a_bmv2_switch_that_fails_to_start_says_what_it_printed(tmp_path, monkeypatch):
    from switchsim import bmv2

    monkeypatch.setenv("SIMPLE_SWITCH_GRPC", _fake_switch(tmp_path, 0, "Nanomsg returned a exception when trying "
                                                                         "to bind to address"))
    with pytest.raises(RuntimeError, match="did not start: Nanomsg returned a exception"):
        bmv2.BMv2Process([], timeout=10)
