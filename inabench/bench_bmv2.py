"""`switchsim bench switch --backend bmv2`: the INA program's packet rate on BMv2 next to two references
compiled and run in the same invocation on the same BMv2 build — plain forwarding, and a bare per-lane
register add with as many lanes and no protocol — and next to the C core.

Traffic: the C blaster (csrc/ina_blast.c, `lib.ina_blast` of switchsim._native: sendmmsg / recvmmsg, ppoll,
no spinning) on the host end of each switch's veth pair. The three switches run side by side, each in its
namespace, and are measured one after the other, the order reversed every other repeat; each measurement
keeps `window` packets in flight (sent and not answered) for `seconds`, so it finds the rate BMv2 keeps up
with without losing packets. The references reflect each packet back; the INA switch serves one job of two
workers sending the same rounds, so every round is one packet written, one completing it (the lanes added
and the result written into it), and two results multicast back: one packet out per packet in.
"""
from __future__ import annotations

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
import socket
import subprocess
import tempfile

import numpy as np

from inaproto import gen_p4, wire

LANES = gen_p4.LANES
REFERENCE = """
#include <core.p4>
#include <v1model.p4>
header ethernet_t { bit<48> dst; bit<48> src; bit<16> ether_type; }
header ipv4_t { bit<64> a; bit<8> ttl; bit<8> protocol; bit<16> checksum; bit<32> src; bit<32> dst; }
header udp_t { bit<16> src_port; bit<16> dst_port; bit<16> length; bit<16> checksum; }
header ina_t { bit<@HEADER_BITS@> v; }
header lane_t { bit<32> v; }
struct headers_t { ethernet_t ethernet; ipv4_t ipv4; udp_t udp; ina_t ina; lane_t[@N@] lanes; }
struct meta_t { }
parser P(packet_in pkt, out headers_t hdr, inout meta_t m, inout standard_metadata_t sm) {
    state start { pkt.extract(hdr.ethernet); pkt.extract(hdr.ipv4); pkt.extract(hdr.udp); @PARSE@ transition accept; }
}
control N(inout headers_t hdr, inout meta_t m) { apply { } }
control I(inout headers_t hdr, inout meta_t m, inout standard_metadata_t sm) {
    @REGISTERS@
    action add() { bit<64> t; @ADDS@ }
    action reflect() {
        bit<48> mac = hdr.ethernet.dst; hdr.ethernet.dst = hdr.ethernet.src; hdr.ethernet.src = mac;
        bit<32> ip = hdr.ipv4.dst; hdr.ipv4.dst = hdr.ipv4.src; hdr.ipv4.src = ip;
        bit<16> port = hdr.udp.dst_port; hdr.udp.dst_port = hdr.udp.src_port; hdr.udp.src_port = port;
        hdr.udp.checksum = 0;
        sm.egress_spec = sm.ingress_port;
    }
    apply { @APPLY@ reflect(); }
}
control E(inout headers_t hdr, inout meta_t m, inout standard_metadata_t sm) { apply { } }
control D(packet_out pkt, in headers_t hdr) { apply { pkt.emit(hdr); } }
V1Switch(P(), N(), I(), E(), N(), D()) main;
"""
FORWARDING, BARE_ADD, INA = "forwarding", f"bare add x {LANES}", "INA program (2 workers, int32)"


def reference_program(lanes: int) -> str:
    """Plain forwarding (lanes 0: parse to UDP, reflect) or a bare add of `lanes` int32 lanes into
    registers, all in one action as the INA program's lanes are, then reflect."""
    parts = {"@N@": str(max(lanes, 1)), "@HEADER_BITS@": str(8 * wire.HEADER_SIZE), "@PARSE@": "",
             "@REGISTERS@": "", "@ADDS@": "", "@APPLY@": ""}
    if lanes:
        parts.update({
            "@PARSE@": "pkt.extract(hdr.ina); " + "pkt.extract(hdr.lanes.next); " * lanes,
            "@REGISTERS@": " ".join(f"register<bit<64>>(1) acc{i};" for i in range(lanes)),
            "@ADDS@": " ".join(f"acc{i}.read(t, 0); acc{i}.write(0, t + (bit<64>)hdr.lanes[{i}].v);"
                               for i in range(lanes)),
            "@APPLY@": "add();"})
    text = REFERENCE
    for key, value in parts.items():
        text = text.replace(key, value)
    return text


# ---------------------------------------------------------------- traffic (the C blaster)
def blast(socks, packets: list[tuple[int, bytes]], rate: float = 0, window: int = 0, seconds: float = 1.0,
          quiet: float = 0.2, expect: int = 0) -> dict:
    """Offer (socket index, datagram) packets on connected UDP sockets with csrc/ina_blast.c and count the
    datagrams that come back on them.

    Args:
        socks: connected UDP sockets (any blocking mode: the blaster never blocks on them).
        packets: what to send, in order.
        rate: packets per second (0: as fast as `window` allows).
        window: at most this many packets sent and not answered (0: no limit).
        seconds: stop sending after this long, packets left or not.
        quiet: stop receiving after this long without a packet once sending is done (and a full window
            that hears nothing this long counts its packets lost and goes on).
        expect: stop receiving once this many came back (0: wait for `quiet`).

    Returns:
        sent, send_errors, received, bytes_received, stalls, first_send, last_send, last_receive, elapsed
        (seconds from the call's start), and "pps": datagrams back per second from the first send to the
        last receive.

    Raises:
        RuntimeError: the C core is not built. OSError: the blaster failed (errno).
    """
    from switchsim import native

    native.require()
    ffi, lib = native.ffi, native.lib
    fds = ffi.new("int[]", [s.fileno() for s in socks])
    blob = b"".join(d for _, d in packets)
    lens = ffi.new("uint32_t[]", [len(d) for _, d in packets] or [0])
    which = ffi.new("uint8_t[]", [s for s, _ in packets] or [0])
    out = ffi.new("ina_blast_result *")
    if lib.ina_blast(fds, len(socks), blob, lens, which, len(packets), rate, window, seconds, quiet, expect, out):
        err = ffi.errno
        raise OSError(err, f"ina_blast: {os.strerror(err)}")
    r = {k: getattr(out, k) for k in ("sent", "send_errors", "received", "bytes_received", "stalls", "first_send",
                                      "last_send", "last_receive", "elapsed")}
    span = r["last_receive"] - r["first_send"]
    r["pps"] = r["received"] / span if r["received"] and span > 0 else 0.0
    return r


def connected_sockets(n: int, dst, bind_ip: str = "0.0.0.0") -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 22)
        s.bind((bind_ip, 0))
        s.connect(dst)
        socks.append(s)
    return socks


# ---------------------------------------------------------------- the switches under test
class Reference:
    """A reference program compiled and running on BMv2 in a namespace of its own; each packet is reflected."""

    def __init__(self, lanes: int, tmp: str):
        from switchsim import bmv2, p4rt

        self.name, self.proc, self.sw, self.socks = (BARE_ADD if lanes else FORWARDING), None, None, []
        src = os.path.join(tmp, f"reference{lanes}.p4")
        with open(src, "w") as f:
            f.write(reference_program(lanes))
        json_path, info_path = gen_p4.compile_p4(src, tmp)
        self.ns = bmv2.BMv2Namespace()
        if self.ns.error:
            raise RuntimeError(self.ns.error)
        try:
            self.proc = bmv2.BMv2Process([self.ns.switch_if], self.ns.ns)
            self.sw = p4rt.Switch(f"unix:{self.proc.socket}")
            self.sw.set_pipeline(p4rt.P4Info(info_path), json_path)
            subprocess.run(["ip", "neigh", "replace", self.ns.switch_ip, "lladdr", bmv2.SWITCH_MAC, "dev",
                            self.ns.worker_if], check=True)
            self.socks = connected_sockets(1, (self.ns.switch_ip, wire.DEFAULT_PORT))
        except BaseException:
            self.close()
            raise
        self.payload = bytes(wire.HEADER_SIZE) + np.arange(LANES, dtype=">i4").tobytes()

    def measure(self, seconds: float, window: int, rate: float = 0) -> dict:
        n = int(seconds * (rate or 150_000)) + 64
        return blast(self.socks, [(0, self.payload)] * n, rate, window, seconds)

    def close(self):
        for s in self.socks:
            s.close()
        if self.sw is not None:
            self.sw.close()
        if self.proc is not None:
            self.proc.stop()
        self.ns.close()


class InaSwitch:
    """`switchsim serve --backend bmv2` (the INA program and its controller): job 1 of two workers (two
    sockets) joined through the control plane; round q on slot q mod slots with packet id q div slots, one
    stream over every measurement (a measurement that stops between a round's two packets leaves the
    second to the next)."""

    name = INA

    def __init__(self, slots: int = 512):
        from .harness import SwitchProcess

        self.slots, self.next = slots, 0  # the stream's next packet: round next // 2, rank next % 2
        self.sp = SwitchProcess("--workers", 2, "--slots", slots, "--first-packet-id", 0, backend="bmv2")
        try:
            host, port = self.sp.address.split(":")
            self.socks = connected_sockets(2, (host, int(port)))
            self.session = _join(self.socks)
        except BaseException:
            self.sp.stop()
            raise
        self.payload = np.arange(LANES, dtype=">i4").tobytes()

    def packets(self, first: int, n: int) -> list[tuple[int, bytes]]:
        out = []
        for k in range(first, first + n):
            q, r = divmod(k, 2)
            use = q // self.slots
            out.append((r, wire.pack(wire.MSG_UPDATE, 1, r, use, q % self.slots, use & 1, LANES, wire.CODEC_INT32,
                                     0, 0, 0, self.payload, self.session)))
        return out

    def measure(self, seconds: float, window: int, rate: float = 0) -> dict:
        n = int(seconds * (rate or 150_000)) // 2 * 2 + 64
        r = blast(self.socks, self.packets(self.next, n), rate, window, seconds)
        self.next += r["sent"] + r["send_errors"]
        return r

    def close(self) -> dict:
        """Stop the switch; its counters (serve's --json-stats)."""
        for s in self.socks:
            s.close()
        return self.sp.stop_stats()


def _join(socks) -> int:
    import select

    joins = [wire.pack_join(1, r, 1000 + r, len(socks), 64) for r in range(len(socks))]
    for _ in range(50):
        for r, s in enumerate(socks):
            s.send(joins[r])
        ready, _, _ = select.select(socks, [], [], 0.2)
        for s in ready:
            data = s.recv(2048)
            if data[1] == wire.MSG_JOIN_WAIT:  # its cookie: the join counts once repeated with it
                joins[socks.index(s)] = wire.confirm_join(joins[socks.index(s)], data)
            if data[1] == wire.MSG_JOIN_ACK:
                while select.select(socks, [], [], 0.3)[0]:  # the other ack, and those of repeated joins
                    for other in socks:
                        try:
                            other.recv(2048, socket.MSG_DONTWAIT)
                        except BlockingIOError:
                            pass
                return wire.unpack(data).session
    raise TimeoutError("no join ack from the BMv2 switch")


# ---------------------------------------------------------------- the benchmark
def _summary(name: str, runs: list[dict], base: dict[str, float], lanes: int, window: int) -> dict:
    pps = [r["pps"] for r in runs]
    sent = sum(r["sent"] for r in runs)
    med = float(np.median(pps))
    row = {"what": name, "mode": f"{window} in flight", "packets/s": round(med), "min": round(min(pps)), "max": round(max(pps)),
           "spread %": round(100 * (max(pps) - min(pps)) / med, 1) if med else None,
           "loss": round(max(0.0, 1 - sum(r["received"] for r in runs) / sent), 4) if sent else None,
           "elements/s": round(med * lanes) if lanes else None}
    for ref in (BARE_ADD, FORWARDING):
        row[f"x {ref.split(' x ')[0]}"] = round(med / base[ref], 2) if base.get(ref) else None
    return row


def bench_bmv2(rates=(), seconds: float = 1.0, repeats: int = 3, window: int = 24, core: bool = True) -> list[dict]:
    """INA, bare add and forwarding from one invocation: each switch `repeats` times for `seconds` with
    `window` packets in flight, alternately (the order reversed every other repeat); a row per program with
    the median packets/s, its min, max and spread, the loss, and the ratio to the bare add's and to
    forwarding's medians. `rates`: then each program at each offered rate (paced, no window), a row each
    with its loss. `core`: a last row with the C core's packet rate on one core (inabench.micro)."""
    from .micro import bench_core

    with tempfile.TemporaryDirectory() as tmp:
        switches = []
        stats = {}
        try:
            switches.append(Reference(0, tmp))
            switches.append(Reference(LANES, tmp))
            switches.append(InaSwitch())
            for s in switches:  # warm up: ARP, caches, the first packets' allocations
                s.measure(0.2, window)
            measured = {s.name: [] for s in switches}
            for rep in range(max(1, repeats)):
                for s in switches if rep % 2 == 0 else switches[::-1]:
                    measured[s.name].append(s.measure(seconds, window))
            paced = []
            for rate in rates:
                for s in switches:
                    r = s.measure(seconds, 0, rate)
                    paced.append({"what": s.name, "mode": f"{rate} pps offered",
                                  "packets/s": round(r["sent"] / max(r["last_send"] - r["first_send"], 1e-9)),
                                  "loss": round(max(0.0, 1 - r["received"] / r["sent"]), 4) if r["sent"] else None})
        finally:
            for s in switches:
                got = s.close()
                if got:
                    stats = got
    base = {name: float(np.median([r["pps"] for r in runs])) for name, runs in measured.items()}
    rows = [_summary(name, measured[name], base, 0 if name == FORWARDING else LANES, window)
            for name in (INA, BARE_ADD, FORWARDING)]
    drops = {k: v for k, v in stats.get("dropped", {}).items() if v}
    rows[0]["INA drops"] = ", ".join(f"{k} {v}" for k, v in drops.items()) if drops else "none"
    rows += paced
    if core:
        for r in bench_core(20_000, 2):
            if r["what"].startswith("C core, one core") and "int32" in r["what"]:
                rows.append({"what": r["what"], "mode": "in memory", "packets/s": round(r["packets/s"]),
                             "x bare add": round(r["packets/s"] / base[BARE_ADD], 1)})
    return rows
