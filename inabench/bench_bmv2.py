"""`switchsim bench switch --backend bmv2`: the INA program's packet rate and loss on BMv2 at several offered
rates, next to two references compiled and run in the same run on the same BMv2 — plain forwarding, and a
bare per-lane register add with as many lanes and no protocol — and next to the C core.

Traffic: a paced sender and a counting receiver (separate processes) on the host end of the switch's veth
pair. The references reflect each packet back; the INA switch serves one job of two workers sending the
same rounds, so every round is one packet added, one completing it, and two results back.
"""
from __future__ import annotations

import multiprocessing as mp
import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # gRPC warns at every fork of the paced sender's receiver
import socket
import subprocess
import tempfile
import time

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


# ---------------------------------------------------------------- traffic
def _receive(socks, counts, quiet: float, stop_at):
    """Count packets per socket until nothing came for `quiet` seconds after the sender is done."""
    import select

    last = time.monotonic()
    while True:
        ready, _, _ = select.select(socks, [], [], 0.05)
        for i, s in enumerate(socks):
            if s in ready:
                while True:
                    try:
                        s.recv(2048)
                    except BlockingIOError:
                        break
                    counts[i] += 1
                last = time.monotonic()
        if stop_at.value and time.monotonic() - max(last, stop_at.value) > quiet:
            return


def offer(socks, packets: list[tuple[int, bytes]], dst, rate: float, quiet: float = 0.5) -> tuple[int, float]:
    """Send (socket index, bytes) packets at `rate` per second; (replies counted, seconds sent over)."""
    ctx = mp.get_context("fork")
    counts = ctx.Array("q", len(socks), lock=False)
    stop_at = ctx.Value("d", 0.0, lock=False)
    child = ctx.Process(target=_receive, args=(socks, counts, quiet, stop_at), daemon=True)
    child.start()
    t0 = time.perf_counter()
    batch = max(1, int(rate // 2000))
    for i in range(0, len(packets), batch):
        due = t0 + i / rate
        while (wait := due - time.perf_counter()) > 0:
            time.sleep(min(wait, 0.001))
        for s, data in packets[i:i + batch]:
            try:
                socks[s].sendto(data, dst)
            except BlockingIOError:
                pass
    seconds = time.perf_counter() - t0
    stop_at.value = time.monotonic()
    child.join(30)
    return sum(counts), seconds


def _sockets(n: int, bind_ip: str = "0.0.0.0"):
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
        s.bind((bind_ip, 0))
        s.setblocking(False)
        socks.append(s)
    return socks


# ---------------------------------------------------------------- the switches
def _reference_rows(kind: str, lanes: int, rates, seconds: float) -> list[dict]:
    """Compile a reference, run it on BMv2 in a namespace, reflect packets at each rate."""
    from switchsim import bmv2, p4rt

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, f"reference{lanes}.p4")
        with open(src, "w") as f:
            f.write(reference_program(lanes))
        json_path, info_path = gen_p4.compile_p4(src, tmp)
        ns = bmv2.BMv2Namespace()
        if ns.error:
            raise RuntimeError(ns.error)
        proc = sw = None
        try:
            proc = bmv2.BMv2Process([ns.switch_if], ns.ns)
            sw = p4rt.Switch(f"unix:{proc.socket}")
            sw.set_pipeline(p4rt.P4Info(info_path), json_path)
            subprocess.run(["ip", "neigh", "replace", ns.switch_ip, "lladdr", bmv2.SWITCH_MAC, "dev", ns.worker_if],
                           check=True)
            socks = _sockets(1)
            payload = bytes(wire.HEADER_SIZE) + np.arange(LANES, dtype=">i4").tobytes()
            rows = []
            for rate in rates:
                n = max(100, int(rate * seconds))
                got, t = offer(socks, [(0, payload)] * n, (ns.switch_ip, wire.DEFAULT_PORT), rate)
                rows.append(_row(kind, rate, n, got, t, lanes))
            for s in socks:
                s.close()
            return rows
        finally:
            if sw is not None:
                sw.close()
            if proc is not None:
                proc.stop()
            ns.close()


def _ina_rows(rates, seconds: float, slots: int = 512) -> list[dict]:
    """The INA program: job 1 of two workers (two sockets) joined through the control plane."""
    from .harness import SwitchProcess

    sp = SwitchProcess("--workers", 2, "--slots", slots, "--first-packet-id", 0, backend="bmv2")
    try:
        host, port = sp.address.split(":")
        dst = (host, int(port))
        socks = _sockets(2)
        session = _join(socks, dst)
        rows = []
        first_round = 0
        for rate in rates:
            n = max(100, int(rate * seconds)) // 2 * 2
            packets = _rounds(first_round, n // 2, slots, session)
            first_round += n // 2
            got, t = offer(socks, packets, dst, rate)
            rows.append(_row("INA program (2 workers, int32)", rate, n, got, t, LANES))
            time.sleep(0.5)
        for s in socks:
            s.close()
        return rows
    finally:
        sp.stop()


def _join(socks, dst) -> int:
    import select

    for _ in range(50):
        for r, s in enumerate(socks):
            s.sendto(wire.pack_join(1, r, 1000 + r, len(socks), 64), dst)
        ready, _, _ = select.select(socks, [], [], 0.2)
        for s in ready:
            data = s.recv(2048)
            if data[1] == wire.MSG_JOIN_ACK:
                for other in socks:  # drain the other ack
                    select.select([other], [], [], 0.2)
                    try:
                        other.recv(2048)
                    except BlockingIOError:
                        pass
                return wire.unpack(data).session
    raise TimeoutError(f"no join ack from the BMv2 switch at {dst}")


def _rounds(first: int, rounds: int, slots: int, session: int) -> list[tuple[int, bytes]]:
    """Rounds first.. of job 1, both workers, on slot q mod slots with packet id q div slots."""
    payload = np.arange(LANES, dtype=">i4").tobytes()
    out = []
    for q in range(first, first + rounds):
        use = q // slots
        for r in (0, 1):
            out.append((r, wire.pack(wire.MSG_UPDATE, 1, r, use, q % slots, use & 1, LANES, wire.CODEC_INT32,
                                     0, 0, 0, payload, session)))
    return out


def _row(kind, rate, sent, got, seconds, lanes) -> dict:
    achieved = sent / seconds
    loss = max(0.0, 1 - got / sent)
    return {"program": kind, "offered pps": rate, "sent pps": round(achieved), "loss": round(loss, 4),
            "elements/s": round(achieved * (1 - loss) * lanes)}


def bench_bmv2(rates=(2000, 5000, 10000, 20000, 40000), seconds: float = 1.0) -> list[dict]:
    """Rows for the forwarding and lane-add references and the INA program, each at every rate, then
    the loss-free rate of each (the highest offered rate with < 1 % loss) as a ratio to the bare add's."""
    from . import bench

    rows = _reference_rows("forwarding", 0, rates, seconds)
    rows += _reference_rows(f"bare add x {LANES}", LANES, rates, seconds)
    rows += _ina_rows(rates, seconds)
    best = {}
    for r in rows:
        if r["loss"] < 0.01:
            best[r["program"]] = max(best.get(r["program"], 0), r["sent pps"])
    add = best.get(f"bare add x {LANES}") or float("nan")
    summary = [{"program": k, "loss-free pps": v, "x bare add": round(v / add, 2)} for k, v in best.items()]
    core = [r for r in bench.bench_switch(20_000, 2) if r["what"].startswith("C core, one core, int32")]
    for r in core:
        summary.append({"program": r["what"], "loss-free pps": round(r["packets/s"]),
                        "x bare add": round(r["packets/s"] / add, 1)})
    return rows + summary
