"""switchsim/p4rt.py, the P4Runtime client: message building against a committed P4Info (no switch needed),
and a live run on simple_switch_grpc in a network namespace of its own (skips, naming what is missing,
without the BMv2 toolchain or root).

tests/data/p4rt_test.p4 is the program; tests/data/p4rt_test.p4info.txtpb is p4c-bm2-ss's P4Info for it
(ids below checked by hand against that file; test_committed_p4info_is_current recompiles and compares).
Live test: as root with simple_switch_grpc and p4c-bm2-ss found by switchsim.p4rt.find_tool
($SIMPLE_SWITCH_GRPC / $P4C, PATH, or ../shared/p4-toolchain/bin):
    .venv/bin/python -m pytest -q tests/test_p4rt.py -k live
"""
from __future__ import annotations

import ctypes
import os
import select
import shutil
import socket
import subprocess
import tempfile
import time

import pytest

from inaproto import gen_p4

pytest.importorskip("p4.v1.p4runtime_pb2", reason="needs the p4 extra (p4runtime, protobuf 3.20, grpcio)")

import grpc  # noqa: E402
from google.protobuf import any_pb2  # noqa: E402
from google.rpc import code_pb2, status_pb2  # noqa: E402
from p4.config.v1 import p4info_pb2  # noqa: E402
from p4.v1 import p4runtime_pb2  # noqa: E402

from switchsim import p4rt  # noqa: E402

DATA = os.path.join(os.path.dirname(__file__), "data")
PROGRAM = os.path.join(DATA, "p4rt_test.p4")
P4INFO = os.path.join(DATA, "p4rt_test.p4info.txtpb")

# Ids as p4c assigned them (tests/data/p4rt_test.p4info.txtpb).
FWD, ACL, ROUTE = 40024191, 44559125, 46274675
SET_PORT, FLOOD, TO_CPU, DROP, SET_DST, NO_ACTION = 23870541, 27121270, 21401355, 22571166, 25181678, 21257015
PORT_COUNT, CPU_METER, LAST_PORT = 317464143, 348326192, 370000904


@pytest.fixture(scope="module")
def info():
    return p4rt.P4Info(P4INFO)


def roundtrip(message):
    """Serialise and parse back as an Entity (or the message's own type): must be equal."""
    wrapped = p4rt.entity(message) if message.DESCRIPTOR.full_name in p4rt._ENTITY_FIELDS else message
    back = type(wrapped).FromString(wrapped.SerializeToString())
    assert back == wrapped
    return back


# ---------------------------------------------------------------------------------------------- names
def test_lookups_by_full_and_short_name(info):
    assert info.table_id("TIngress.fwd") == info.table_id("fwd") == FWD
    assert (info.table_id("acl"), info.table_id("route")) == (ACL, ROUTE)
    assert info.action_id("TIngress.set_port") == info.action_id("set_port") == SET_PORT
    assert info.action_id("NoAction") == NO_ACTION
    assert info.counter_id("port_count") == info.counter_id("TIngress.port_count") == PORT_COUNT
    assert info.meter_id("cpu_meter") == CPU_METER
    assert info.register_id("last_port") == LAST_PORT
    assert info.name(FWD) == "TIngress.fwd"


@pytest.mark.parametrize("lookup, name, kind", [("table_id", "nope", "table"), ("counter_id", "fwd", "counter"),
                                                ("action_id", "TEgress.set_port", "action"),
                                                ("meter_id", "port_count", "meter")])
def test_missing_name_is_a_key_error_naming_it(info, lookup, name, kind):
    with pytest.raises(KeyError, match=f"no {kind} named '{name}'"):
        getattr(info, lookup)(name)


def test_ambiguous_short_name():
    msg = p4info_pb2.P4Info()
    for i, full in enumerate(("A.t", "B.t")):
        msg.tables.add().preamble.MergeFrom(p4info_pb2.Preamble(id=i + 1, name=full, alias=full))
    two = p4rt.P4Info(msg)
    assert two.table_id("B.t") == 2
    with pytest.raises(KeyError, match="ambiguous"):
        two.table_id("t")


# ---------------------------------------------------------------------------------------------- encoding
@pytest.mark.parametrize("value, width, expect", [
    (0, 9, b"\x00"), (1, 9, b"\x01"), (255, 9, b"\xff"), (256, 9, b"\x01\x00"), (511, 9, b"\x01\xff"),
    (0x0A000001, 32, b"\x0a\x00\x00\x01"), (0x0000_0000_00AB, 48, b"\xab"), (2**48 - 1, 48, b"\xff" * 6),
    (b"\x00\x00\x05", 16, b"\x05"), (b"\x00", 8, b"\x00"), (b"", 8, b"\x00"), (1, 1, b"\x01")])
def test_canonical_encoding(value, width, expect):
    assert p4rt.encode(value, width) == expect
    assert p4rt.decode(expect) == p4rt._int(value, "v")


@pytest.mark.parametrize("value, width", [(512, 9), (256, 8), (2, 1), (b"\x02\x00", 9), (2**48, 48)])
def test_value_too_wide(value, width):
    with pytest.raises(ValueError, match=f"does not fit in {width} bits"):
        p4rt.encode(value, width, "f")


def test_negative_and_wrong_types():
    with pytest.raises(ValueError, match="negative"):
        p4rt.encode(-1, 8)
    with pytest.raises(TypeError):
        p4rt.encode("1", 8)


# ---------------------------------------------------------------------------------------------- table entries
def test_exact_entry(info):
    e = roundtrip(info.table_entry("fwd", {"sm.ingress_port": 0}, "set_port", {"port": 1})).table_entry
    assert e.table_id == FWD and e.priority == 0 and not e.is_default_action
    assert [(m.field_id, m.exact.value) for m in e.match] == [(1, b"\x00")]
    assert e.action.action.action_id == SET_PORT
    assert [(p.param_id, p.value) for p in e.action.action.params] == [(1, b"\x01")]
    assert info.table_entry("fwd", {"ingress_port": 0}, "set_port", {"port": 1}) == e  # short field name


def test_ternary_entry(info):
    e = roundtrip(info.table_entry("acl", {"etherType": (0x0800, 0xFF00), "srcAddr": 0x02_0000_0000_01},
                                   "drop", priority=7)).table_entry
    assert (e.table_id, e.priority, e.action.action.action_id) == (ACL, 7, DROP)
    (t, x) = e.match
    assert (t.field_id, t.ternary.value, t.ternary.mask) == (1, b"\x08\x00", b"\xff\x00")
    assert (x.field_id, x.exact.value) == (2, b"\x02\x00\x00\x00\x00\x01")
    full = info.table_entry("acl", {"etherType": 0x88B5, "srcAddr": 1}, "NoAction", priority=1)
    assert full.match[0].ternary.mask == b"\xff\xff"  # a plain int matches all bits
    dont_care = info.table_entry("acl", {"etherType": (0, 0), "srcAddr": 1}, "drop", priority=1)
    assert [m.field_id for m in dont_care.match] == [2]  # mask 0 is left out, as P4Runtime requires


def test_ternary_errors(info):
    with pytest.raises(ValueError, match="priority"):
        info.table_entry("acl", {"etherType": (1, 1)}, "drop")
    with pytest.raises(ValueError, match="outside mask"):
        info.table_entry("acl", {"etherType": (0x0801, 0xFF00)}, "drop", priority=1)
    with pytest.raises(ValueError, match="takes no priority"):
        info.table_entry("fwd", {"ingress_port": 1}, "drop", priority=1)


def test_lpm_entry(info):
    e = roundtrip(info.table_entry("route", {"dstAddr": (0x0A00_0000_0000, 8)}, "set_dst", {"mac": 0})).table_entry
    (m,) = e.match
    assert (e.table_id, m.field_id, m.lpm.value, m.lpm.prefix_len) == (ROUTE, 1, b"\x0a\x00\x00\x00\x00\x00", 8)
    assert e.action.action.params[0].value == b"\x00"
    assert info.table_entry("route", {"dstAddr": 5}, "NoAction").match[0].lpm.prefix_len == 48
    assert not info.table_entry("route", {"dstAddr": (0, 0)}, "NoAction").match  # /0: left out
    with pytest.raises(ValueError, match="not a prefix"):
        info.table_entry("route", {"dstAddr": (0x0A01_0000_0000, 8)}, "NoAction")
    with pytest.raises(ValueError, match="not a prefix"):
        info.table_entry("route", {"dstAddr": (0, 49)}, "NoAction")


def test_action_errors(info):
    with pytest.raises(ValueError, match="not an action of table TIngress.fwd"):
        info.table_entry("fwd", {"ingress_port": 1}, "set_dst", {"mac": 1})
    with pytest.raises(ValueError, match="needs parameter 'port'"):
        info.table_entry("fwd", {"ingress_port": 1}, "set_port")
    with pytest.raises(KeyError, match="no parameter 'prot'"):
        info.table_entry("fwd", {"ingress_port": 1}, "set_port", {"port": 1, "prot": 2})
    with pytest.raises(ValueError, match=r"TIngress.set_port\(port\): 512 does not fit in 9 bits"):
        info.table_entry("fwd", {"ingress_port": 1}, "set_port", {"port": 512})
    with pytest.raises(ValueError, match="sm.ingress_port: 512 does not fit"):
        info.table_entry("fwd", {"ingress_port": 512}, "drop")
    with pytest.raises(KeyError, match="no match field named 'dstAddr' in table TIngress.fwd"):
        info.table_entry("fwd", {"dstAddr": 1}, "drop")


def test_key_only_entry_and_default_action(info):
    key = roundtrip(info.table_entry("fwd", {"ingress_port": 3})).table_entry
    assert key.table_id == FWD and not key.HasField("action")
    d = roundtrip(info.default_action("fwd", "set_port", {"port": 2})).table_entry
    assert d.is_default_action and not d.match and d.action.action.action_id == SET_PORT


# ---------------------------------------------------------------------------------------------- other entities
def test_multicast_group():
    pre = p4rt.multicast_group(5, [(1, 7), (2, 8)])
    assert p4rt.Switch.multicast_group(5, [(1, 7), (2, 8)]) == pre
    back = roundtrip(pre).packet_replication_engine_entry.multicast_group_entry
    assert back.multicast_group_id == 5
    assert [(r.egress_port, r.instance) for r in back.replicas] == [(1, 7), (2, 8)]


def test_entity_wrapping():
    c = p4runtime_pb2.CounterEntry(counter_id=PORT_COUNT)
    assert p4rt.entity(c).WhichOneof("entity") == "counter_entry"
    assert p4rt.entity(p4rt.entity(c)) == p4rt.entity(c)
    with pytest.raises(TypeError, match="not a P4Runtime entity"):
        p4rt.entity(p4runtime_pb2.Uint128())


def test_packet_metadata_and_packet_out(info):
    assert info.packet_metadata("packet_out") == [("egress_port", 1, 9), ("pad", 2, 7)]
    assert info.packet_metadata("packet_in") == [("ingress_port", 1, 9), ("pad", 2, 7)]
    out = roundtrip(info.packet_out(b"\x01\x02frame", egress_port=256))
    assert out.payload == b"\x01\x02frame"
    assert [(m.metadata_id, m.value) for m in out.metadata] == [(1, b"\x01\x00"), (2, b"\x00")]
    msg = roundtrip(p4runtime_pb2.StreamMessageRequest(packet=out))
    assert msg.WhichOneof("update") == "packet"
    with pytest.raises(ValueError, match="packet_out.egress_port: 512 does not fit in 9 bits"):
        info.packet_out(b"", egress_port=512)
    with pytest.raises(KeyError, match="no field 'port'"):
        info.packet_out(b"", port=1)
    with pytest.raises(KeyError, match="controller_packet_metadata named 'digest'"):
        info.packet_metadata("digest")


def test_parse_packet_in(info):
    pin = p4runtime_pb2.PacketIn(payload=b"abc")
    pin.metadata.add(metadata_id=1, value=b"\x01\x01")
    pin.metadata.add(metadata_id=2, value=b"\x00")
    pin.metadata.add(metadata_id=9, value=b"\x05")
    assert info.parse_packet_in(pin) == (b"abc", {"ingress_port": 257, "pad": 0, 9: 5})


# ---------------------------------------------------------------------------------------------- errors, tools
class FakeRpcError(grpc.RpcError):
    def __init__(self, code, details, trailing=()):
        self._c, self._d, self._t = code, details, trailing

    def code(self):
        return self._c

    def details(self):
        return self._d

    def trailing_metadata(self):
        return self._t


def test_write_error_names_each_failed_update(info):
    req = p4runtime_pb2.WriteRequest()
    for port in (0, 1):
        req.updates.add(type=p4runtime_pb2.Update.INSERT,
                        entity=p4rt.entity(info.table_entry("fwd", {"ingress_port": port}, "drop")))
    status = status_pb2.Status(code=code_pb2.UNKNOWN)
    for code, message in ((code_pb2.OK, ""), (code_pb2.ALREADY_EXISTS, "Match entry exists")):
        detail = any_pb2.Any()
        detail.Pack(p4runtime_pb2.Error(canonical_code=code, message=message))
        status.details.append(detail)
    err = p4rt.P4RuntimeError("Write", FakeRpcError(grpc.StatusCode.UNKNOWN, "",
                                                    (("grpc-status-details-bin", status.SerializeToString()),)), req)
    assert err.code == grpc.StatusCode.UNKNOWN
    assert err.errors == [(1, "ALREADY_EXISTS", "Match entry exists")]
    text = str(err)
    assert "update 1 INSERT table_entry" in text and "ALREADY_EXISTS: Match entry exists" in text
    assert "update 0" not in text
    plain = p4rt.P4RuntimeError("Read", FakeRpcError(grpc.StatusCode.UNIMPLEMENTED, "not yet"))
    assert str(plain) == "Read failed: UNIMPLEMENTED: not yet" and plain.errors == []


def test_find_tool(tmp_path, monkeypatch):
    def tool(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
        return str(path)

    env, on_path, home, shared = (tool(tmp_path / d / "bin" / "simple_switch_grpc")
                                  for d in ("env", "path", "home", "shared"))
    monkeypatch.setattr(gen_p4, "TOOLCHAIN_BINS", [os.path.dirname(shared)])  # where find_tool lives
    monkeypatch.setenv("SIMPLE_SWITCH_GRPC", env)
    monkeypatch.setenv("PATH", os.path.dirname(on_path))
    monkeypatch.setenv("P4_TOOLCHAIN_HOME", str(tmp_path / "home"))
    assert p4rt.find_tool("simple_switch_grpc") == env
    monkeypatch.setenv("SIMPLE_SWITCH_GRPC", str(tmp_path / "missing"))  # not executable: looked past
    assert p4rt.find_tool("simple_switch_grpc") == on_path
    monkeypatch.setenv("PATH", "/nonexistent")
    assert p4rt.find_tool("simple_switch_grpc") == home
    monkeypatch.delenv("P4_TOOLCHAIN_HOME")
    assert p4rt.find_tool("simple_switch_grpc") == shared
    assert p4rt.find_tool("p4c-bm2-ss") is None


def test_no_server_is_a_timeout(tmp_path):
    start = time.monotonic()
    with pytest.raises(p4rt.SwitchUnavailable, match="no P4Runtime server") as got:
        p4rt.Switch(f"unix:{tmp_path}/none.sock", timeout=0.5)
    assert isinstance(got.value, TimeoutError) and isinstance(got.value, ConnectionError)
    assert time.monotonic() - start < 5


def compile_program(out_dir: str) -> tuple[str, str]:
    """p4rt_test.p4 with p4c-bm2-ss; inaproto.gen_p4.compile_p4 copes with a toolchain copy whose p4include
    symlink became a plain file."""
    from inaproto.gen_p4 import compile_p4

    return compile_p4(PROGRAM, out_dir, p4rt.find_tool("p4c-bm2-ss"))


def test_committed_p4info_is_current(tmp_path):
    if p4rt.find_tool("p4c-bm2-ss") is None:
        pytest.skip("p4c-bm2-ss not found ($P4C, PATH, ../shared/p4-toolchain/bin)")
    _, fresh = compile_program(str(tmp_path))
    assert p4rt.P4Info(fresh).message == p4rt.P4Info(P4INFO).message, \
        "tests/data/p4rt_test.p4info.txtpb is stale: recompile tests/data/p4rt_test.p4"


# ---------------------------------------------------------------------------------------------- live switch
def live_missing() -> str:
    for tool in ("simple_switch_grpc", "p4c-bm2-ss"):
        if p4rt.find_tool(tool) is None:
            return f"{tool} not found (${p4rt.TOOL_ENV[tool]}, PATH, {', '.join(p4rt.TOOLCHAIN_BINS)})"
    if os.geteuid() != 0:
        return "the live P4Runtime test needs root (network namespace, veth pairs, raw sockets)"
    if shutil.which("ip") is None:
        return "the live P4Runtime test needs iproute2's ip command"
    return ""


def _in_netns(ns: str, fn):
    """Run fn with this thread in network namespace ns (sockets made there stay there)."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open("/proc/thread-self/ns/net") as home, open(f"/run/netns/{ns}") as target:
        if libc.setns(target.fileno(), 0x40000000):  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns {ns}")
        try:
            return fn()
        finally:
            libc.setns(home.fileno(), 0x40000000)


class Live:
    """simple_switch_grpc in namespace p4rt<pid>: port 0 = veth0 (peer veth1), port 1 = veth2 (peer veth3),
    CPU port 255, P4Runtime on a unix socket. Everything is removed by close(), whatever got made."""

    def __init__(self, tmp: str):
        self.ns, self.tmp, self.proc, self.sw, self.socks, self.log = f"p4rt{os.getpid()}", tmp, None, None, [], None
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self):
        self.json, p4info = compile_program(self.tmp)
        self.info = p4rt.P4Info(p4info)
        ns = self.ns
        self._ip("netns", "add", ns)
        self._ip("netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
                 "net.ipv6.conf.default.disable_ipv6=1")  # no router solicitations into the counters
        self._ip("-n", ns, "link", "set", "lo", "up")
        for a, b in (("veth0", "veth1"), ("veth2", "veth3")):
            self._ip("-n", ns, "link", "add", a, "type", "veth", "peer", "name", b)
        for i in range(4):
            self._ip("-n", ns, "link", "set", f"veth{i}", "up")
        self.tx, self.rx1 = self._socket("veth1"), self._socket("veth3")
        sock = os.path.join(self.tmp, "p4rt.sock")
        self.log = open(os.path.join(self.tmp, "switch.log"), "w+")
        self.proc = subprocess.Popen(["ip", "netns", "exec", ns, p4rt.find_tool("simple_switch_grpc"), "--no-p4",
                                      "-i", "0@veth0", "-i", "1@veth2", "--", "--grpc-server-addr",
                                      f"unix:{sock}", "--cpu-port", "255"], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while not os.path.exists(sock):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("simple_switch_grpc did not start (missing libraries? run "
                                   f"/work/shared/p4-toolchain/install-deps):\n{self.output()}")
            time.sleep(0.05)
        self.sw = p4rt.Switch(f"unix:{sock}", timeout=10)
        self.sw.set_pipeline(self.info, self.json)

    def _ip(self, *args):
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)

    def _socket(self, iface: str) -> socket.socket:
        s = _in_netns(self.ns, lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3)))
        self.socks.append(s)
        s.bind((iface, 0))
        return s

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()[-3000:]

    def send(self, frame: bytes):
        self.tx.send(frame)

    def frames(self, rx: socket.socket, tag: bytes, want: int = 1, timeout: float = 3.0) -> list[bytes]:
        """Frames holding `tag` that arrive on rx (not the ones sent from it) within timeout."""
        got, deadline = [], time.monotonic() + timeout
        while len(got) < want and time.monotonic() < deadline:
            if select.select([rx], [], [], max(0.0, deadline - time.monotonic()))[0]:
                data, addr = rx.recvfrom(65535)
                if addr[2] != socket.PACKET_OUTGOING and tag in data:
                    got.append(data)
        return got

    def close(self):
        if self.sw is not None:
            self.sw.close()
        for s in self.socks:
            s.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, timeout=20)  # takes the veths
        if self.log is not None:
            self.log.close()


@pytest.fixture(scope="module")
def live():
    reason = live_missing()
    if reason:  # the missing binary, privilege or command, named
        pytest.skip(f"live P4Runtime test: {reason}")
    tmp = tempfile.mkdtemp(prefix="p4rt-test-")
    try:
        env = Live(tmp)  # removes what it made if it fails
        try:
            yield env
        finally:
            env.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def frame(tag: bytes) -> bytes:
    return (bytes.fromhex("020000000002" "020000000001") + b"\x88\xb5" + tag).ljust(60, b"\x00")


def put(sw, entry):
    """Insert, or modify where the entry exists (tests may run alone or in any order)."""
    try:
        sw.insert(entry)
    except p4rt.P4RuntimeError as e:
        if [c for _, c, _ in e.errors] != ["ALREADY_EXISTS"]:
            raise
        sw.modify(entry)


def drain(sw):
    while sw.packet_in(timeout=0.2) is not None:
        pass


def test_live_forward_and_count(live):
    sw, info = live.sw, live.info
    put(sw, info.table_entry("fwd", {"ingress_port": 0}, "set_port", {"port": 1}))
    before = sw.read_counter("port_count", 0)[0]
    tag, sent = os.urandom(8).hex().encode(), 0
    for _ in range(3):  # the first frames after start-up may be lost while BMv2 opens its ports
        live.send(frame(tag))
        sent += 1
        if live.frames(live.rx1, tag):
            break
    else:
        pytest.fail(f"frame did not arrive on switch port 1\n{live.output()}")
    deadline = time.monotonic() + 3
    while sw.read_counter("port_count", 0)[0][1] < before[1] + sent and time.monotonic() < deadline:
        time.sleep(0.05)
    after = sw.read_counter("port_count", 0)[0]
    assert after == (before[0] + 60 * sent, before[1] + sent)
    counts = sw.read_counter("port_count")
    assert sorted(counts) == list(range(16)) and counts[1] == (0, 0)


def test_live_write_error_details(live):
    sw, info = live.sw, live.info
    put(sw, info.table_entry("fwd", {"ingress_port": 0}, "set_port", {"port": 1}))
    try:
        sw.delete(info.table_entry("fwd", {"ingress_port": 1}))  # absent unless an earlier test left it
    except p4rt.P4RuntimeError:
        pass
    with pytest.raises(p4rt.P4RuntimeError) as got:
        sw.insert(info.table_entry("fwd", {"ingress_port": 1}, "drop"),
                  info.table_entry("fwd", {"ingress_port": 0}, "drop"))
    assert got.value.errors[0][:2] == (1, "ALREADY_EXISTS")
    assert "update 1 INSERT table_entry" in str(got.value)
    assert len(sw.read(p4runtime_pb2.TableEntry(table_id=FWD))) == 2  # update 0 went through
    sw.delete(info.table_entry("fwd", {"ingress_port": 1}))
    with pytest.raises(p4rt.P4RuntimeError, match="INSERT for default entry"):
        sw.insert(info.default_action("fwd", "drop"))
    sw.modify(info.default_action("fwd", "drop"))


def test_live_packet_out_and_in(live):
    sw, info = live.sw, live.info
    tag = os.urandom(8).hex().encode()
    sw.packet_out(frame(tag), egress_port=1)
    assert live.frames(live.rx1, tag), "packet-out did not leave switch port 1"
    drain(sw)
    put(sw, info.table_entry("fwd", {"ingress_port": 0}, "to_cpu"))
    live.send(frame(tag))
    got = sw.packet_in(timeout=3)
    assert got is not None, f"no packet-in\n{live.output()}"
    payload, metadata = got
    assert tag in payload and payload.startswith(bytes.fromhex("020000000002"))
    assert metadata == {"ingress_port": 0, "pad": 0}
    assert not sw.stream_errors


def test_live_multicast(live):
    sw, info = live.sw, live.info
    try:
        sw.insert(sw.multicast_group(5, [(1, 7), (1, 8)]))
    except p4rt.P4RuntimeError:
        sw.modify(sw.multicast_group(5, [(1, 7), (1, 8)]))
    put(sw, info.table_entry("fwd", {"ingress_port": 0}, "flood", {"group": 5}))
    tag = os.urandom(8).hex().encode()
    live.send(frame(tag))
    copies = live.frames(live.rx1, tag, want=2)
    assert sorted(f[6:12] for f in copies) == [bytes(5) + b"\x07", bytes(5) + b"\x08"]  # egress wrote each rid


def test_live_meter_limits_packet_ins(live):
    sw, info = live.sw, live.info
    put(sw, info.table_entry("fwd", {"ingress_port": 0}, "to_cpu"))
    sw.set_meter("cpu_meter", 0, cir=1, cburst=1, pir=1, pburst=1)  # 1 packet/s, bursts of 1
    (cfg,) = [e.meter_entry.config for e in sw.read(p4runtime_pb2.MeterEntry(meter_id=CPU_METER))
              if e.meter_entry.index.index == 0]
    assert (cfg.cir, cfg.cburst, cfg.pir, cfg.pburst) == (1, 1, 1, 1)
    drain(sw)
    tag = os.urandom(8).hex().encode()
    for _ in range(10):
        live.send(frame(tag))
    got = []
    while (p := sw.packet_in(timeout=1.0)) is not None:
        got.append(p)
    assert 1 <= len(got) <= 3, f"{len(got)} of 10 packet-ins through a 1 packet/s meter"
    unset = p4runtime_pb2.MeterEntry(meter_id=CPU_METER)
    unset.index.index = 0
    sw.modify(unset)  # no config: back to the default (every packet green)
    for _ in range(5):
        live.send(frame(tag))
    got = [p for p in iter(lambda: sw.packet_in(timeout=1.0), None)]
    assert len(got) == 5
