"""The Wireshark dissector (inaproto/ina.lua, `python -m inaproto.gen_lua`): it is the generator's output for
the wire.py of this tree, and tshark, reading a capture of real allreduces (int32 and NC, dense and
block-sparse, and every control message), shows each field of each packet as the scapy layer reads it from
the same file. Captured twice: on lo with dumpcap (needs root or CAP_NET_RAW) and by `serve --pcap`."""
from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time

import numpy as np
import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw
from scapy.utils import rdpcap, wrpcap

from hostlib.codecs import natural
from inabench.harness import SwitchProcess
from inaproto import gen_lua, wire
from inaproto.scapy_layer import INA, INAAbort, INABlock, INAError, INAInt32, INANC8
import inacli as cli
from switchsim.server import query_stats
from tests.test_e2e import run_workers

TSHARK, DUMPCAP = shutil.which("tshark"), shutil.which("dumpcap")
needs_tshark = pytest.mark.skipif(TSHARK is None, reason="tshark not on PATH (apt-get install tshark)")
# every field the generator declares, with its ProtoField type; FT_NONE ones (subtrees) carry no value
FIELDS = {key: re.match(r"ProtoField\.(\w+)", decl).group(1) for key, decl in gen_lua.fields()}
VALUED = [key for key, kind in FIELDS.items() if kind != "none"]
LISTS = ("elem", "nc.code", "nc.value")  # one occurrence per element
EXPERTS = ("malformed", "bad_code", "overflow", "nonfinite")  # expert infos, filterable as ina.malformed...
# the header's fields as the scapy layer has them (the pool index is three fields there)
HEADER_NAMES = [n for n, _ in wire.HEADER_FIELDS if n != "pool"] + ["set", "pool_reserved", "slot"]
ABORT_REASON = "ina-dissector-test: the rank's call failed before it was sent"


def test_generated_dissector_is_up_to_date():
    """inaproto/ina.lua is generated from wire.py (python -m inaproto.gen_lua); a stale copy fails."""
    with open(gen_lua.PATH) as f:
        assert f.read() == gen_lua.render(), "run: python -m inaproto.gen_lua"
    assert gen_lua.main(["--check"]) == 0


def test_cli_prints_the_installed_path(capsys):
    assert cli.main(["dissector", "--path"]) == 0
    path = capsys.readouterr().out.strip()
    assert os.path.isabs(path) and os.path.samefile(path, gen_lua.PATH)
    assert cli.main(["dissector"]) == 0
    assert capsys.readouterr().out == open(gen_lua.PATH).read()


@functools.lru_cache(maxsize=None)
def lua_fields() -> tuple[str, ...]:
    """The ina.* fields tshark registers with the dissector loaded; skip where tshark runs no Lua (a build
    without it, or as root where init.lua sets run_user_scripts_when_superuser = false)."""
    r = subprocess.run([TSHARK, "-G", "fields", "-X", f"lua_script:{gen_lua.PATH}"], capture_output=True,
                       text=True, timeout=60)
    assert "Lua: Error" not in r.stderr, r.stderr
    fields = tuple(line.split("\t")[2] for line in r.stdout.splitlines() if "\tina." in line)
    if not fields:
        pytest.skip("tshark loaded no Lua dissector (built without Lua, or Lua off for root in its init.lua)")
    return fields


@needs_tshark
def test_tshark_registers_every_generated_field():
    assert set(lua_fields()) == {f"ina.{k}" for k in FIELDS} | {f"ina.{e}" for e in EXPERTS}


def tshark(pcap: str, *args: str) -> str:
    """tshark with the dissector on a capture file; its stdout. No Lua error, on stderr or in the tree."""
    lua_fields()
    r = subprocess.run([TSHARK, "-X", f"lua_script:{gen_lua.PATH}", "-r", pcap, *args], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "Lua" not in r.stderr, r.stderr
    assert "Lua Error" not in r.stdout
    return r.stdout


@functools.lru_cache(maxsize=None)
def claimed_udp_ports() -> frozenset[int]:
    """UDP ports other dissectors claim: a worker's port below the switch's would win (tshark tries the
    lower port first), so the test decodes such a port as ina explicitly (-d), as a user would."""
    out = subprocess.run([TSHARK, "-G", "decodes"], capture_output=True, text=True, timeout=60).stdout
    return frozenset(int(p) for t, p, *_ in (line.split("\t") for line in out.splitlines()) if t == "udp.port")


def tshark_fields(pcap: str, ports: set[int], switch_port: int | None = None) -> dict[int, dict[str, str]]:
    """frame number -> ina field -> tshark's text, for the frames `-Y ina` keeps (to or from switch_port only,
    if given: lo may carry another switch's packets, which the dissector reads as well)."""
    keys = VALUED + list(EXPERTS)
    shown = "ina" if switch_port is None else f"ina && udp.port == {switch_port}"
    out = tshark(pcap, *decode_as_ina(ports), "-Y", shown, "-T", "fields", "-E", "separator=/t", "-e", "frame.number",
                 *(a for k in keys for a in ("-e", f"ina.{k}")))
    rows = {}
    for line in out.splitlines():
        number, *values = line.split("\t")
        rows[int(number)] = dict(zip(keys, values, strict=True))
    return rows


def decode_as_ina(ports: set[int]) -> list[str]:
    """tshark's -d arguments that decode as ina those of these UDP ports another dissector claims."""
    return [a for p in sorted(ports & claimed_udp_ports()) for a in ("-d", f"udp.port=={p},ina")]


def parse(key: str, text: str):
    """One field of tshark's -T fields output as the value the scapy side is given in."""
    if key in LISTS:
        return [float(v) if key == "nc.value" else int(v, 0) for v in text.split(",")] if text else []
    if not text:
        return None
    kind = FIELDS.get(key, "bool")
    if kind == "bool":
        return text in ("1", "True")
    if kind == "bytes":
        return text.replace(":", "")
    if key == "stats":
        return json.loads(text)
    return text if kind == "string" else int(text, 0)


def scapy_fields(ina: INA) -> dict:
    """What the scapy layer reads from one INA packet, under the dissector's field names; control payloads
    (raw bytes to scapy) through wire.py's structs."""
    out = dict.fromkeys(VALUED + list(EXPERTS))
    out.update({k: [] for k in LISTS})
    flags = int(ina.flags)
    out.update({k: getattr(ina, k) for k in HEADER_NAMES})
    out.update({"flags": flags, "pool": ina.set << 15 | ina.pool_reserved << 14 | ina.slot})
    out.update({f"flags.{name}": bool(flags & bit) for bit, name in gen_lua.FLAGS})
    out["overflow"] = True if flags & wire.FLAG_OVERFLOW else None
    out["nonfinite"] = True if wire.EXP_NONFINITE in (ina.exp_cur, ina.exp_next) else None
    if INABlock in ina:
        out.update(block=ina[INABlock].block, next_block=ina[INABlock].next_block)
    if INAInt32 in ina:
        out["elem"] = list(ina[INAInt32].values)
    if INANC8 in ina:
        out["nc.code"] = list(ina[INANC8].codes)
        out["nc.value"] = list(natural.decode(np.array(out["nc.code"], np.uint8), np.float64))
    raw, name = bytes(ina.payload), wire.MSG_NAMES[ina.msg_type]
    if ina.msg_type == wire.MSG_ERROR:  # code, named rank, text; no payload: not_member (a generated field)
        if INAError in ina:
            e = ina[INAError]
            out.update({"error.code": e.code, "error.rank": e.rank, "error": e.text.decode() or None})
        else:
            assert raw == b""
            out["error.code"] = wire.ERR_NOT_MEMBER
    elif ina.msg_type in gen_lua.PAYLOADS:
        s, names = gen_lua.PAYLOADS[ina.msg_type]
        values = [v.hex() if isinstance(v, bytes) else v for v in s.unpack_from(raw)]
        out.update({f"{name}.{n}": v for n, v in zip(names, values, strict=True)})
    if INAAbort in ina:
        out["abort"] = ina[INAAbort].reason.decode()
    if ina.msg_type == wire.MSG_STATS:
        out["stats"] = json.loads(raw)
    return out


def free_udp_port(inside: bool) -> int:
    """A free loopback UDP port in the dissector's range (inside) or outside it."""
    lo, hi = gen_lua.PORTS
    for port in (range(lo, hi + 1) if inside else [0] * 20):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = s.getsockname()[1]
            if inside or not lo <= port <= hi:
                return port
    pytest.skip(f"no free UDP port {'in' if inside else 'outside'} {lo}..{hi} on loopback")


def wait_in_file(path: str, proc, port: int, token: bytes, timeout: float = 15.0):
    """Send `token` to a closed port until dumpcap has written it: capture is running (at the start), or
    every packet before it is in the file (at the end)."""
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        while time.monotonic() < deadline and proc.poll() is None:
            s.sendto(token, ("127.0.0.1", port))
            time.sleep(0.05)
            if os.path.exists(path) and token in open(path, "rb").read():
                return
    if proc.poll() is not None:
        return
    raise TimeoutError(f"dumpcap wrote no {token!r} within {timeout} s")


@contextlib.contextmanager
def dumpcap(path: str, port: int):
    """dumpcap on lo for the switch's UDP port, from its first captured packet to the last one sent in the
    with block. Skips where capturing needs privileges this process lacks. Always stops dumpcap."""
    if DUMPCAP is None:
        pytest.skip("dumpcap not on PATH (apt-get install tshark)")
    probe = free_udp_port(inside=False)
    err = path + ".err"
    with open(err, "w") as stderr:
        proc = subprocess.Popen([DUMPCAP, "-q", "-i", "lo", "-P", "-w", path, "-f",
                                 f"udp port {port} or udp port {probe}"], stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        wait_in_file(path, proc, probe, b"ina-dissector-test-start")
        if proc.poll() is not None:
            pytest.skip(f"dumpcap cannot capture on lo (root or CAP_NET_RAW needed): {open(err).read().strip()}")
        yield
        wait_in_file(path, proc, probe, b"ina-dissector-test-end")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_traffic(address: str):
    """Two ranks: int32 and NC allreduces, dense and block-sparse; a join that waits, a join that fails,
    and two stats requests (one for per-slot counters)."""
    rs = np.random.default_rng(20)
    ints = [rs.integers(-1000, 1000, 200).astype(np.int32) for _ in range(2)]
    floats = [rs.standard_normal(200).astype(np.float32) for _ in range(2)]
    keep = [np.repeat(rs.random(13) < 0.3, 16)[:200] for _ in range(2)]  # a third of the 16-element blocks
    runs = [("int32", ints, False), ("nc", floats, False), ("int32", [x * k for x, k in zip(ints, keep)], True),
            ("nc", [x * k for x, k in zip(floats, keep)], True)]
    for codec, xs, sparse in runs:
        _, errors, _ = run_workers(address, xs, codec, sparse=sparse, elements_per_packet=16, window=4, timeout=20)
        assert errors == [None, None], (codec, sparse)
    host, port = address.split(":")
    switch = (host, int(port))
    control_traffic(switch)
    query_stats(switch)
    query_stats(switch, per_slot=True)


def control_traffic(switch):
    """Job 9's two ranks from two sockets, by hand: joins (waits, then acks), a heartbeat (and its answer), an abort (the
    switch fails the generation: an `aborted` error to both ranks), an update into the failed generation
    (the error again, as a reply), an update with a wrong session (a header-only `not_member` error); and a
    join of an unknown job (a `rejected` error)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
    try:
        for s in socks:
            s.settimeout(5)
            s.bind(("127.0.0.1", 0))
        acks = {}
        for r, s in enumerate(socks):
            join = wire.pack_join(9, r, 1234 + r, 2, 8)
            s.sendto(join, switch)
            s.sendto(wire.confirm_join(join, s.recv(1 << 16)), switch)  # confirmed with its join_wait's cookie
        for r, s in enumerate(socks):
            while r not in acks:
                data = s.recv(1 << 16)
                if wire.unpack(data).msg_type == wire.MSG_JOIN_ACK:
                    acks[r] = data
        h = wire.unpack(acks[0])
        session, boot, first_id = h.session, h.boot, wire.JOIN_ACK_PAYLOAD.unpack_from(acks[0], wire.HEADER_SIZE)[4]
        call = dict(call=1, call_kind=wire.call_kind("nc"), call_len=200, boot=boot)
        socks[0].sendto(wire.pack(wire.MSG_HEARTBEAT, 9, 0, session=session, boot=boot), switch)
        answer = wire.unpack(socks[0].recv(1 << 16))  # the switch answers a member's heartbeat
        assert (answer.msg_type, answer.session) == (wire.MSG_HEARTBEAT, session)
        socks[1].sendto(wire.pack(wire.MSG_ABORT, 9, 1, session=session, payload=ABORT_REASON.encode(), **call), switch)
        for s in socks:
            assert wire.unpack_error(s.recv(1 << 16))[:2] == (wire.ERR_ABORTED, 1)
        update = dict(packet_id=first_id, count=1, codec=wire.CODEC_INT32, payload=bytes(4), **call)
        socks[0].sendto(wire.pack(wire.MSG_UPDATE, 9, 0, session=session, **update), switch)
        assert wire.unpack_error(socks[0].recv(1 << 16))[:2] == (wire.ERR_ABORTED, 1)
        socks[0].sendto(wire.pack(wire.MSG_UPDATE, 9, 0, session=session ^ 1, **update), switch)
        assert wire.unpack_error(socks[0].recv(1 << 16)) == (wire.ERR_NOT_MEMBER, wire.NO_RANK, "")
        socks[0].sendto(wire.pack_join(77, 0, 1, 2, 8), switch)
        assert wire.unpack_error(socks[0].recv(1 << 16))[:2] == (wire.ERR_REJECTED, wire.NO_RANK)
    finally:
        for s in socks:
            s.close()


@pytest.fixture(scope="module", params=["dumpcap on lo", "serve --pcap"])
def capture(request, tmp_path_factory):
    """(pcap path, the switch's port): the traffic of run_traffic through a Python switch."""
    path = str(tmp_path_factory.mktemp("dissector") / "capture.pcap")
    port = free_udp_port(inside=True)
    pcap = ("--pcap", path) if request.param == "serve --pcap" else ()
    # on lo a UDP GSO send is captured as one super-packet before the kernel cuts it into datagrams: the
    # wire capture is taken with GSO off (README "Seeing the packets"); serve --pcap records datagrams
    gso = os.environ.get("INA_GSO")
    os.environ["INA_GSO"] = "0" if not pcap else (gso or "auto")
    try:
        with dumpcap(path, port) if not pcap else contextlib.nullcontext():
            sw = SwitchProcess("--job", "1:2", "--job", "9:2", "--port", port, *pcap)
            try:
                run_traffic(sw.address)
            finally:
                sw.stop()
    finally:
        os.environ.pop("INA_GSO") if gso is None else os.environ.update(INA_GSO=gso)
    return path, port


@needs_tshark
def test_tshark_reads_what_scapy_reads(capture):
    """Every ina field of every packet of the capture, as tshark shows it, equals what the scapy layer (and
    wire.py's structs, hostlib's NC table) read from the same file; every message type is in it."""
    path, port = capture
    frames = {i + 1: p for i, p in enumerate(rdpcap(path)) if UDP in p and port in (p[UDP].sport, p[UDP].dport)}
    assert len(frames) > 100
    rows = tshark_fields(path, {p[UDP].sport ^ p[UDP].dport ^ port for p in frames.values()}, port)  # the peers' ports
    assert sorted(rows) == sorted(frames), "tshark's ina frames are not the switch's packets"
    seen, codes = set(), set()
    for number, pkt in frames.items():
        raw = bytes(pkt[UDP].payload)
        wire.unpack(raw)  # all well formed: no expert info expected
        want, got = scapy_fields(INA(raw)), {k: parse(k, v) for k, v in rows[number].items()}
        assert np.allclose(got.pop("nc.value"), want.pop("nc.value"), rtol=1e-13, atol=0), number
        assert got == want, f"frame {number}: " + ", ".join(f"{k}: tshark {got[k]!r}, scapy {want[k]!r}"
                                                            for k in want if got[k] != want[k])
        seen.add((want["msg_type"], want["codec"]))
        codes.add(want["error.code"])
    assert {m for m, _ in seen} == set(wire.MSG_NAMES)
    assert {wire.ERR_NOT_MEMBER, wire.ERR_REJECTED, wire.ERR_ABORTED} <= codes
    assert {(m, c) for m in wire.DATA_MESSAGES for c in (wire.CODEC_INT32, wire.CODEC_NC8)} <= seen


@needs_tshark
def test_tshark_names_the_v3_fields_and_error_codes(capture):
    """On the real capture, tshark's tree names the v3 header fields (call kind, call, call length, the
    switch's boot id), the abort and heartbeat messages, and each error's code by name with the rank it
    names and its text; the not-member error (no payload) shows a generated code; the Info column too."""
    path, port = capture
    packets = [p for p in rdpcap(path) if UDP in p and port in (p[UDP].sport, p[UDP].dport)]
    ports = {p[UDP].sport ^ p[UDP].dport ^ port for p in packets}
    sent = [INA(bytes(p[UDP].payload)) for p in packets if p[UDP].sport == port]
    boots = {ina.boot for ina in sent if ina.msg_type != wire.MSG_STATS}  # what it sends its workers
    assert len(boots) == 1 and 0 not in boots, "everything a switch sends its workers carries its one boot id"
    shown = "ina.error.code || ina.msg_type == 11 || ina.msg_type == 12 || ina.call_len == 200"
    tree = tshark(path, *decode_as_ina(ports), "-Y", shown, "-V")
    lines = {line.strip() for line in tree.splitlines()}
    for line in ("Message type: abort (11)", "Message type: heartbeat (12)", "Error code: aborted (4)",
                 "Error code: rejected (1)", "[Error code: not_member (0)]", "Rank named: 1", "Rank named: 255 (none)",
                 "Call kind: nc (0x03)", "Call number: 1", "Call length (elements): 200",
                 f"Switch boot id: 0x{boots.pop():08x}", f"Reason: {ABORT_REASON}"):
        assert line in lines, line
    assert any(line.startswith("Reason: ") and line.endswith(ABORT_REASON) and line != f"Reason: {ABORT_REASON}"
               for line in lines), "the aborted error quotes the abort's reason"
    info = set(tshark(path, *decode_as_ina(ports), "-Y", "ina", "-T", "fields", "-e", "_ws.col.Info").splitlines())
    for text in ("abort job=9 rank=1 call=1", "heartbeat job=9 rank=0", "error job=9 rank=0 aborted (rank 1)",
                 "error job=9 rank=1 aborted (rank 1)", "error job=9 rank=0 not_member",
                 "error job=77 rank=0 rejected"):
        assert text in info, (text, sorted(i for i in info if "error" in i or "abort" in i))


def expert_cases() -> list[tuple[bytes, set[str]]]:
    """INA packets and the expert infos each should show besides ina.malformed, which goes with every packet
    wire.unpack rejects (each way it rejects one is here)."""
    ok = wire.pack(wire.MSG_UPDATE, job=1, count=2, codec=wire.CODEC_INT32, payload=bytes(8))
    sparse = wire.Header(wire.MSG_SPARSE_UPDATE, job=1, count=1, codec=wire.CODEC_NC8, block=5, next_block=9)
    reserved = bytearray(ok)
    reserved[wire.OFFSETS["pool"]] |= wire.POOL_RESERVED_BIT >> 8
    data = [
        ok,
        ok[:10],  # truncated header
        b"\x01" + ok[1:],  # version 1
        ok[:1] + b"\x63" + ok[2:],  # message type 99
        bytes(reserved),  # the reserved pool-index bit
        ok[:-1],  # a byte short of count elements
        ok[:wire.HEADER_SIZE + 4],  # an element short
        wire.pack(wire.MSG_UPDATE, count=1, codec=7, payload=bytes(4)),  # unknown codec
        sparse.pack(bytes([0x41])),
        sparse.pack(bytes([0x41, 0x42])),  # one code more than count
        wire.pack_sparse(wire.MSG_SPARSE_RESULT, count=0, block=3),  # a block without elements
        wire.pack_sparse(wire.MSG_SPARSE_RESULT, count=1, block=3, next_block=3, payload=bytes(4)),  # next <= block
        wire.pack_join(1, 0, 5, 2, 8)[:100],  # a short join
        wire.pack(wire.MSG_ABORT, job=1, call=2, call_kind=wire.call_kind("int32"), call_len=9, payload=b"why"),
        wire.pack(wire.MSG_HEARTBEAT, job=1, session=5, boot=6),
        wire.pack_error(wire.ERR_PEER_DEAD, "rank 1 is silent", job=1, subject=1, boot=6),
        wire.pack(wire.MSG_ERROR, job=1, boot=6),  # not a member: no payload, and nothing malformed
    ]
    return [(d, set()) for d in data] + [
        (wire.pack(wire.MSG_RESULT, count=2, codec=wire.CODEC_NC8, payload=bytes([0x80, 0xC1])), {"bad_code"}),
        (wire.pack(wire.MSG_RESULT, count=1, codec=wire.CODEC_INT32, flags=wire.FLAG_OVERFLOW,
                   exp_next=wire.EXP_NONFINITE, payload=bytes(4)), {"overflow", "nonfinite"}),
        (wire.pack(wire.MSG_JOIN_ACK, payload=bytes(4)), {"malformed"}),  # wire.unpack leaves payloads to callers
        (wire.pack(wire.MSG_ERROR, payload=b"\x03"), {"malformed"}),  # a code without the rank it names
    ]


@needs_tshark
def test_malformed_packets_get_expert_info_not_lua_errors(tmp_path):
    """Each packet wire.unpack rejects shows ina.malformed with wire.unpack's own message; 0x80 shows
    ina.bad_code, OVERFLOW and a NaN/Inf exponent their notes; no Lua error on any of them."""
    cases = expert_cases()
    path = str(tmp_path / "malformed.pcap")
    wrpcap(path, [Ether() / IP(dst="127.0.0.1") / UDP(sport=40000, dport=gen_lua.PORTS[1]) / Raw(d) for d, _ in cases])
    out = tshark(path, "-Y", "ina", "-T", "fields", "-E", "separator=/t", "-E", "aggregator=|", "-e", "frame.number",
                 "-e", "_ws.expert.message", *(a for e in EXPERTS for a in ("-e", f"ina.{e}")))
    rows = {int(n): (msg.split("|"), {e for e, v in zip(EXPERTS, flags, strict=True) if v})
            for n, msg, *flags in (line.split("\t") for line in out.splitlines())}
    assert sorted(rows) == list(range(1, len(cases) + 1))
    for i, (data, experts) in enumerate(cases, 1):
        messages, shown = rows[i]
        try:
            wire.unpack(data)
        except wire.WireError as e:
            experts = experts | {"malformed"}
            assert str(e) in messages, (i, str(e), messages)
        assert shown == experts, (i, messages)
    assert "Lua Error" not in tshark(path, "-V")
