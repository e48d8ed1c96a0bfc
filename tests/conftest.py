"""Shared fixtures. `switch_backend` is the one parameter a new backend (C core, DPDK, BMv2) adds itself to."""
from __future__ import annotations

import os
import select
import socket
import tempfile
import time
from types import SimpleNamespace

import pytest

from inabench.harness import ROOT, SwitchProcess  # noqa: F401 - the tests' switch processes
from inaproto import auth, wire
from switchsim import native
from switchsim.server import query_stats
from switchsim.model import Switch
from switchsim.netns import VethNamespace
from switchsim.server import UDPServer

STAMPED = (wire.MSG_UPDATE, wire.MSG_SPARSE_UPDATE, wire.MSG_LEAVE)


def spoof_udp(src: tuple[str, int], dst: tuple[str, int], payload: bytes):
    """One UDP datagram with a forged IPv4 source (a raw socket: root), as an attacker on the same host or
    network sends it. Tests call it on loopback only."""
    import socket
    import struct

    if os.geteuid() != 0:
        pytest.skip("forging a source address needs a raw socket (root)")
    udp = struct.pack(">HHHH", src[1], dst[1], 8 + len(payload), 0) + payload  # checksum 0: none (IPv4)
    ip = struct.pack(">BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, socket.IPPROTO_UDP, 0,
                     socket.inet_aton(src[0]), socket.inet_aton(dst[0]))  # the kernel fills in the checksum
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW) as s:
        s.sendto(ip + udp, (dst[0], 0))


def confirmed_join(process, join: bytes, src) -> list:
    """In-process switch (process(data, src) -> [(data, dst)]): a join, then again with its join_wait's cookie,
    as a worker sends them (the join counts then); everything it was answered."""
    out = process(join, src)
    waits = [d for d, _ in out if d[1] == wire.MSG_JOIN_WAIT]
    return out + (process(wire.confirm_join(join, waits[-1]), src) if waits else [])


class Harness:
    """What every harness shares: rank r of the first job sends from port r (rank r of another job j from
    port 1000 j + r), and every job is joined at the start, as workers would (join=False: not).
    send(port, data) stamps a data packet built with session 0 with its job's session, as the worker
    library does; any other packet goes out as it is (attack tests send wrong sessions explicitly)."""

    def port_of(self, job: int, rank: int) -> int:
        return rank if job == min(self.jobs) else 1000 * job + rank

    def join_packet(self, job: int, rank: int, nonce: int, window: int = 64) -> bytes:
        """A join as the worker library sends it (with the job key's MAC where the job has one)."""
        n, key = self.jobs[job], self.keys.get(job)
        mac = auth.join_mac(key, job, rank, nonce, n, window) if key else bytes(wire.JOIN_MAC_SIZE)
        return wire.pack_join(job, rank, nonce, n, window, mac)

    def confirm(self, port: int, join: bytes) -> list[tuple[int, bytes]]:
        """Send a join as a worker does: once, then again with the cookie of the switch's join_wait (the join
        then counts); everything that came back. Without a join_wait (an ack, an error) it is not repeated."""
        echo, out = wire.JOIN_PAYLOAD.unpack_from(join, wire.HEADER_SIZE)[0] & wire.PACKET_ID_MASK, []
        for _ in range(5):  # a slow switch (BMv2's first packet waits for ARP) may answer after `quiet`: again
            out += self.send(port, join)
            mine = [d for p, d in out if p == port and wire.unpack(d).packet_id == echo]
            if mine:
                break
        waits = [d for d in mine if d[1] == wire.MSG_JOIN_WAIT]
        return out + (self.send(port, wire.confirm_join(join, waits[-1])) if waits else [])

    def send_from(self, pairs: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        """Each (port, packet) sent, then everything that came back (a served switch: awaited once)."""
        return [o for port, data in pairs for o in self.send(port, data)]

    def join_all(self, nonce: int = 1, window: int = 64, proven: bool = False):
        """Join every rank of every job as workers do, all at once (rank r with nonce + r): each join, then
        again with the cookie of its join_wait (the switch counts a join then); proven: the first joins carry
        the job's current session, as members re-joining do. Returns {job: session}."""
        for job in self.jobs:
            self.join_job(job, nonce, window, proven)
        return self.sessions

    def join_job(self, job: int, nonce: int = 1, window: int = 64, proven: bool = False) -> int:
        """Join every rank of one job (join_all's way); returns its session."""
        n = self.jobs[job]
        joins = {self.port_of(job, r): self.join_packet(job, r, nonce + r, window) for r in range(n)}
        if proven:
            joins = {p: wire.confirm_join(j, wire.pack(wire.MSG_JOIN_WAIT, session=self.sessions[job]))
                     for p, j in joins.items()}
        waits: dict = {}
        for _ in range(5):  # a slow switch (BMv2's first packet waits for ARP) may answer after `quiet`
            out = self.send_from([(p, j) for p, j in joins.items() if p not in waits])
            waits.update((p, d) for p, d in out if p in joins and d[1] == wire.MSG_JOIN_WAIT)
            if len(waits) == n:
                break
        confirmed = {p: wire.confirm_join(j, waits[p]) if p in waits else j for p, j in joins.items()}
        acks: dict = {}
        deadline = time.monotonic() + 2.0  # a loaded machine may deliver the last acks after `quiet`
        while True:  # as workers do, a rank without its ack repeats its join (the switch acks a member again)
            out = self.send_from([(p, j) for p, j in confirmed.items() if p not in acks])
            acks.update((p, wire.unpack(d)) for p, d in out if p in joins and d[1] == wire.MSG_JOIN_ACK)
            if len(acks) == n or time.monotonic() >= deadline:
                break
        assert len(acks) == n, f"job {job}: {len(acks)} join acks for {n} ranks"
        self.sessions[job] = next(iter(acks.values())).session
        return self.sessions[job]

    @property
    def session(self) -> int:
        return self.sessions[min(self.jobs)]

    def stamp(self, data: bytes) -> bytes:
        if len(data) >= wire.HEADER_SIZE and data[1] in STAMPED and data[wire.OFFSETS["session"]:][:4] == bytes(4):
            job = int.from_bytes(data[wire.OFFSETS["job"]:][:2], "big")
            s = self.sessions.get(job, 0).to_bytes(4, "big")
            return data[:wire.OFFSETS["session"]] + s + data[wire.OFFSETS["session"] + 4:]
        return data

    def blast(self, port: int, packets: list[bytes]) -> list[tuple[int, bytes]]:
        """Send many packets from one port; everything that came back."""
        return [o for p in packets for o in self.send(port, p)]

    def untold(self, out: list) -> list:
        """The answers but the switch's informational ERR_DROPPED ones (a member told once why its packet was
        dropped), which go to self.told: the suites compare results, tests of the telling read self.told."""
        keep = []
        for port, data in out:
            if data[1:2] == bytes([wire.MSG_ERROR]) and wire.unpack_error(data)[0] == wire.ERR_DROPPED:
                self.told.append((port, data))
            else:
                keep.append((port, data))
        return keep

    def start(self, jobs, join, keys=None):
        self.jobs, self.sessions, self.keys, self.told = dict(jobs), {}, dict(keys or {}), []
        if join:
            self.join_all()


def served(jobs: dict, kw: dict) -> tuple[dict, dict]:
    """(the jobs a switch is built with, its keywords): a shared switch (shared=True) starts with none, and
    its `keys` are only the harness's (the MACs of its joins; the switch reads the ones it issued from
    key_dir)."""
    kw.setdefault("first_packet_id", 0)  # the tests spell packet ids out from 0
    if kw.get("shared"):
        return {}, {k: v for k, v in kw.items() if k != "keys"}
    return jobs, kw


class ModelHarness(Harness):
    """Drives the reference model in-process; a 'port' is just an int address."""

    switch_class = Switch

    def __init__(self, jobs, join=True, **kw):
        jobs_served, options = served(jobs, kw)
        self.switch = self.switch_class(jobs_served, **options)
        self.start(jobs, join, kw.get("keys"))

    def send(self, port: int, data: bytes) -> list[tuple[int, bytes]]:
        return self.untold([(dst, pkt) for pkt, dst in self.switch.process(self.stamp(data), port)])

    def stats(self):
        return self.switch.stats()

    def close(self):
        pass


class UDPHarness(Harness):
    """Drives a switch served over UDP on loopback; port k is a UDP socket of its own."""

    switch_class, server_class = Switch, UDPServer
    bind_ip = "127.0.0.1"
    quiet = 0.05  # a reply never takes longer than this on loopback; also how long "nothing" is awaited
    settle = None  # once something came back: how long the rest of its burst may take (None: the full quiet)

    def __init__(self, jobs, join=True, **kw):
        jobs_served, options = served(jobs, kw)
        self.server = self.server_class(self.switch_class(jobs_served, **options), "127.0.0.1", 0)
        self.thread = self.server.start_thread()
        self.socks: dict[int, socket.socket] = {}
        self.start(jobs, join, kw.get("keys"))

    def _sock(self, port):
        if port not in self.socks:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind((self.bind_ip, 0))
            s.setblocking(False)
            self.socks[port] = s
        return self.socks[port]

    def send(self, port, data):
        return self.blast(port, [data])

    def send_from(self, pairs):
        for port, data in pairs[:-1]:
            self._emit(port, data)
        return self.blast(pairs[-1][0], [pairs[-1][1]]) if pairs else []

    def _emit(self, port, data):
        self._sock(port).sendto(self.stamp(data), self.server.address)

    def blast(self, port, packets):
        for data in packets:
            self._emit(port, data)
        out, deadline = [], time.monotonic() + self.quiet
        by_fd = {s.fileno(): p for p, s in self.socks.items()}
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select(list(self.socks.values()), [], [], left)
            for s in ready:
                out.append((by_fd[s.fileno()], s.recv(65536)))
            if ready and self.settle is not None:  # the answers of one burst come together: no full quiet
                deadline = min(deadline, time.monotonic() + self.settle)
        return self.untold(out)

    def stats(self):
        return self.server.backend.stats()

    def close(self):
        self.server.stop()
        self.thread.join(5)
        self.server.close()
        for s in self.socks.values():
            s.close()


class CoreHarness(ModelHarness):
    """The C core in-process, through cffi."""

    switch_class = native.CoreSwitch


class CUDPHarness(UDPHarness):
    """The C core under the C recvmmsg/sendmmsg loop."""

    switch_class, server_class = native.CoreSwitch, native.CUDPServer


class CShmHarness(UDPHarness):
    """The C core on the shared-memory transport (serve --shm): port k is a shared-memory port of its own."""

    switch_class = native.CoreSwitch
    made = 0

    def __init__(self, jobs, join=True, **kw):
        CShmHarness.made += 1
        self.name = f"conformance-{os.getpid()}-{CShmHarness.made}"
        jobs_served, options = served(jobs, kw)
        self.server = native.CShmServer(self.switch_class(jobs_served, **options), self.name, ports=256)
        self.thread = self.server.start_thread()
        self.socks = {}
        self.start(jobs, join, kw.get("keys"))

    def _sock(self, port):
        from hostlib.shm import ShmSocket

        if port not in self.socks:
            self.socks[port] = ShmSocket(self.name)
        return self.socks[port]

    def _emit(self, port, data):
        try:
            self._sock(port).send(self.stamp(data))
        except BlockingIOError:
            pass  # a full ring: lost, as a datagram to a full socket buffer

    def blast(self, port, packets):
        for data in packets:
            self._emit(port, data)
        out, buf, deadline = [], bytearray(1 << 17), time.monotonic() + self.quiet
        while time.monotonic() < deadline:
            got = 0
            for p, s in list(self.socks.items()):
                while True:
                    try:
                        n = s.recv_into(buf)
                    except BlockingIOError:
                        break
                    out.append((p, bytes(buf[:n])))
                    got += 1
            if not got:
                time.sleep(0.001)
        return self.untold(out)


class DPDKNet(VethNamespace):
    """The test session's namespace for DPDK switches, each on a port of its own."""

    next_port = 41000

    def port(self):
        self.next_port += 1
        return self.next_port

    def serve_args(self, port):
        return self.serve_command(port)


_dpdk_net = None


def dpdk_net() -> DPDKNet:
    global _dpdk_net
    if _dpdk_net is None:
        _dpdk_net = DPDKNet()
    if _dpdk_net.error:
        pytest.skip(_dpdk_net.error)
    return _dpdk_net


def pytest_sessionfinish(session, exitstatus):
    if _dpdk_net is not None and _dpdk_net.up:
        _dpdk_net.close()


class ServedHarness(UDPHarness):
    """A `switchsim serve` process (dpdk, bmv2) with the job, key and switch flags of the other harnesses;
    subclasses say how to start it (`serve`) and what to do before the joins (`warm`)."""

    quiet = 0.1
    max_elements = 1024

    def __init__(self, jobs, join=True, slots=512, max_elements=None, nc_rounding="stochastic", seed=0, keys=None,
                 shared=False, pool=None, min_slots=None, admit="open", key_dir=None, peer_silent=None):
        args = [a for j, n in jobs.items() for a in ("--job", f"{j}:{n}")] if not shared else []
        self.keydir = tempfile.TemporaryDirectory()
        for j, key in (keys or {}).items() if not shared else ():
            path = os.path.join(self.keydir.name, f"job{j}.key")
            with open(path, "wb") as f:
                f.write(key)
            args += ["--key-file", f"{j}:{path}"]
        for flag, value in (("--pool", pool), ("--min-slots", min_slots), ("--key-dir", key_dir),
                            ("--peer-silent", peer_silent)):
            args += [flag, value] if value is not None else []
        args += ["--admit", admit] if shared else []
        args += ["--slots", slots, "--elements-per-packet", max_elements or self.max_elements,
                 "--nc-rounding", nc_rounding, "--seed", seed, "--first-packet-id", 0]
        self.proc = self.serve(args)
        host, port = self.proc.address.split(":")
        self.server = SimpleNamespace(address=(host, int(port)))
        self.socks = {}
        try:
            self.warm()
            self.start(jobs, join, keys)
        except BaseException:
            self.close()  # the fixture only closes harnesses that were made
            raise

    def serve(self, args) -> SwitchProcess:
        raise NotImplementedError

    def warm(self):
        pass

    def stats(self):
        return query_stats(self.server.address)

    def close(self):
        self.proc.stop()
        self.keydir.cleanup()
        for s in self.socks.values():
            s.close()


class DPDKHarness(ServedHarness):
    """The C core on DPDK (af_packet on a veth), in its own process inside the test's namespace."""

    def serve(self, args):
        net = dpdk_net()
        self.bind_ip = net.worker_ip
        return SwitchProcess(*args, cmd=net.serve_args(net.port()))


class BMv2Harness(ServedHarness):
    """p4/ina.p4 on simple_switch_grpc: `switchsim serve --backend bmv2` makes its namespace and veth pair;
    the sockets here reach it through the veth (the kernel picks the source address)."""

    max_elements = 64  # the program's lanes
    bind_ip = "0.0.0.0"

    def serve(self, args):
        return SwitchProcess(*args, backend="bmv2")

    def warm(self):
        query_stats(self.server.address, timeout=10)  # the first packet waits for ARP: not a test's

    def blast(self, port, packets):
        """Control requests go up to the controller over P4Runtime and back: wait longer for them."""
        control = any(len(p) > 1 and p[1] in wire.CONTROL_REQUESTS for p in packets)
        if len(packets) > 16:  # BMv2 takes bursts of ~30 packets: a flood arrives at ~1000 packets/s
            for p in packets[:-1]:
                self._sock(port).sendto(self.stamp(p), self.server.address)
                time.sleep(0.001)
            packets = packets[-1:]
        # the controller answers a punt in ~10 ms, a burst of them within one another's 0.25 s
        self.quiet, self.settle = (1.0, 0.25) if control else (BMv2Harness.quiet, None)
        try:
            return super().blast(port, packets)
        finally:
            self.quiet, self.settle = BMv2Harness.quiet, None


def bmv2_missing() -> str:
    from switchsim import bmv2

    return bmv2.why_not()


BACKENDS = {"model": ModelHarness, "udp": UDPHarness, "c": CoreHarness, "c-udp": CUDPHarness, "c-shm": CShmHarness,
            "dpdk": DPDKHarness, "bmv2": BMv2Harness}
NEEDS_NATIVE = {"c", "c-udp", "c-shm"}


@pytest.fixture(params=sorted(BACKENDS))
def switch_backend(request):
    """Factory: switch_backend(jobs={1: n}, **switch_kwargs) -> harness with send(port, bytes)."""
    if request.param in NEEDS_NATIVE:
        native.require()  # every install builds the C core: a missing one is a failure, not a skip
    if request.param == "dpdk":
        dpdk_net()
    if request.param == "bmv2" and bmv2_missing():
        pytest.skip(bmv2_missing())
    made = []

    def make(jobs, **kw):
        h = BACKENDS[request.param](jobs, **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


SERVE_BACKENDS = ("python", "c", "dpdk")


@pytest.fixture(params=SERVE_BACKENDS)
def switch_process(request):
    """Factory: start `switchsim serve ARGS --backend B` for each serve backend B (dpdk: in the test's
    namespace, reached through the veth)."""
    if request.param == "c":
        native.require()
    net = dpdk_net() if request.param == "dpdk" else None
    started = []

    def start(*args):
        if net:
            sp = SwitchProcess(*args, cmd=net.serve_args(net.port()))
        else:
            sp = SwitchProcess(*args, backend=request.param)
        started.append(sp)
        return sp

    yield start
    for sp in started:
        sp.stop()
