"""`serve --pcap`: every packet in and out of a switch, on every serve backend, with the impairment's decision
in each packet's comment; the Python and C writers give the same bytes; the file stays within its size."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess

import numpy as np
import pytest
from scapy.layers.inet import IP, UDP  # noqa: F401 - rdpcap decodes LINKTYPE_IPV4 with them
from scapy.utils import rdpcap

from inabench.harness import SwitchProcess
from inaproto import wire
from switchsim import bmv2, capture
from tests.test_e2e import run_workers

NOTES = ("dropped", "duplicated", "held")


def blocks(path):
    """(type, body) of every pcapng block, read by hand: what the writers produce, byte for byte."""
    data = open(path, "rb").read()
    out, i = [], 0
    while i < len(data):
        kind, total = struct.unpack_from("=II", data, i)
        assert total % 4 == 0 and i + total <= len(data), "a damaged block"
        assert struct.unpack_from("=I", data, i + total - 4)[0] == total
        out.append((kind, data[i:i + total]))
        i += total
    return out


def options(opts):
    """(comment, epb_flags) of an EPB's options."""
    note, flags, i = "", None, 0
    while i < len(opts):
        code, length = struct.unpack_from("=HH", opts, i)
        if code == 0:
            break
        value = opts[i + 4:i + 4 + length]
        note = value.decode() if code == 1 else note
        flags = struct.unpack("=I", value)[0] if code == 2 else flags
        i += 4 + ((length + 3) & ~3)
    return note, flags


def noted(packets, direction, word):
    return sum(1 for p in packets if p.direction == direction and word in b"".join(p.comments or []).decode())


def run_captured(switch_process, path, n=3, size=6000, *flags):
    sw = switch_process("--workers", n, "--loss", 0.05, "--dup", 0.05, "--reorder", 0.05, "--seed", 7,
                        "--pcap", path, *flags)
    rs = np.random.default_rng(3)
    xs = [rs.integers(-(2**20), 2**20, size).astype(np.int32) for _ in range(n)]
    outs, errors, _ = run_workers(sw.address, xs, "int32", elements_per_packet=64, window=16, timeout=30)
    assert errors == [None] * n
    assert all(np.array_equal(o, np.sum(xs, axis=0)) for o in outs)
    return sw, json.loads(sw.stop())


def test_every_packet_with_the_impairments_decision(switch_process, tmp_path):
    path = str(tmp_path / "switch.pcapng")
    sw, report = run_captured(switch_process, path)
    packets = rdpcap(path)
    assert report["captured"] == len(packets) > 0 and report["capture_skipped"] == 0
    rx, tx = report["impairment"]["rx"], report["impairment"]["tx"]
    for direction, side in ((1, rx), (2, tx)):
        assert noted(packets, direction, "dropped") == side["dropped"]
        assert noted(packets, direction, "duplicated") == side["duplicated"]
        assert noted(packets, direction, "held") == side["reordered"]
    assert rx["dropped"] + tx["dropped"] > 0 and rx["duplicated"] + tx["duplicated"] > 0
    host, port = sw.address.split(":")
    for p in packets:
        ip, udp = p["IP"], p["UDP"]
        switch_end = (ip.dst, udp.dport) if p.direction == 1 else (ip.src, udp.sport)
        assert switch_end == (host, int(port))
        h = wire.unpack(bytes(udp.payload))
        assert h.version == wire.VERSION and h.job == 1
        if p.direction == 1:
            assert h.msg_type in (wire.MSG_UPDATE, *wire.CONTROL_REQUESTS)  # heartbeats too (v3)
    kinds = {wire.unpack(bytes(p["UDP"].payload)).msg_type for p in packets}
    assert {wire.MSG_JOIN, wire.MSG_JOIN_ACK, wire.MSG_UPDATE, wire.MSG_RESULT} <= kinds
    if shutil.which("tshark"):
        r = subprocess.run(["tshark", "-r", path, "-T", "fields", "-e", "frame.comment"], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert len(r.stdout.splitlines()) == len(packets)
        assert sum(line.startswith("dropped") for line in r.stdout.splitlines()) == rx["dropped"] + tx["dropped"]


def test_python_and_c_write_the_same_bytes(tmp_path):
    """Every block of a C capture, rebuilt by switchsim/capture.py from its packet, comment, direction and
    time, is the same bytes; the header blocks too."""
    from switchsim import native

    native.require()
    path = str(tmp_path / "c.pcapng")
    sp = SwitchProcess("--workers", 2, "--loss", 0.1, "--dup", 0.1, "--pcap", path, backend="c")
    xs = [np.arange(3000, dtype=np.int32) * (r + 1) for r in range(2)]
    _, errors, _ = run_workers(sp.address, xs, "int32", elements_per_packet=64, window=8, timeout=30)
    sp.stop()
    assert errors == [None] * 2
    got = blocks(path)
    assert b"".join(b for _, b in got[:2]) == capture.header_blocks()
    notes = set()
    for kind, block in got[2:]:
        assert kind == 6
        _, total, _, hi, lo, caplen, _ = struct.unpack_from("=IIIIIII", block)
        packet = block[28:28 + caplen]
        note, flags = options(block[28 + ((caplen + 3) & ~3):total - 4])
        inbound = flags == 1
        notes.add(note)
        assert capture.packet_block(inbound, packet, note, hi << 32 | lo) == block
    assert {"", "dropped", "duplicated"} <= notes


def test_the_file_stays_within_its_size(switch_process, tmp_path):
    path = str(tmp_path / "small.pcapng")
    _, report = run_captured(switch_process, path, 2, 20000, "--pcap-max-mb", 0.02)
    assert os.path.getsize(path) <= 0.02 * 2**20
    assert report["capture_skipped"] > 0 and report["captured"] == len(rdpcap(path)) > 0


def test_bmv2_capture_merges_its_ports(tmp_path):
    """BMv2 captures with its own --pcap; the file holds what entered and left its port, in time order."""
    if bmv2.why_not():
        pytest.skip(bmv2.why_not())
    path = str(tmp_path / "bmv2.pcapng")
    sp = SwitchProcess("--workers", 2, "--pcap", path, backend="bmv2")
    try:
        xs = [np.arange(640, dtype=np.int32) * (r + 1) for r in range(2)]
        outs, errors, _ = run_workers(sp.address, xs, "int32", elements_per_packet=64, window=4, timeout=60)
    finally:
        report = json.loads(sp.stop())
    assert errors == [None] * 2 and np.array_equal(outs[0], xs[0] * 3)
    packets = rdpcap(path)
    assert report["captured"] == len(packets)
    updates = [p for p in packets if p.direction == 1 and p.haslayer("UDP")
               and wire.unpack(bytes(p["UDP"].payload)).msg_type == wire.MSG_UPDATE]
    results = [p for p in packets if p.direction == 2 and p.haslayer("UDP")
               and wire.unpack(bytes(p["UDP"].payload)).msg_type == wire.MSG_RESULT]
    assert len(updates) >= 2 * 10 and len(results) >= 2 * 10  # 10 blocks of 64, from and to both workers
    assert all(b"".join(p.comments).startswith(b"port ") for p in packets)
    times = [float(p.time) for p in packets]
    assert times == sorted(times)
