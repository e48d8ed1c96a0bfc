"""`serve --pcap FILE`: every packet a switch hears and says, as pcapng that tshark and Wireshark read.

The servers see INA packets on a UDP socket, not frames, so each record is an IPv4 + UDP header (built from
the peer's and the switch's addresses) around the INA packet, LINKTYPE_IPV4. The impairment's decision
(dropped, duplicated, held) is the packet comment, the direction the EPB flags (1 in, 2 out). The C loops
write the same bytes (csrc/ina_capture.h); tests/test_capture.py holds the two to it. Written by hand
rather than with scapy's PcapNgWriter, which dissects every packet (0.5 ms each) before writing it.
"""
from __future__ import annotations

import socket
import struct
import time

LINKTYPE_IPV4 = 228
DECIDE_DROP, DECIDE_DUP, DECIDE_HOLD = 1, 2, 4  # csrc/ina_impair.h INA_DECIDE_*
NOTES = {0: "", DECIDE_DUP: "duplicated", DECIDE_HOLD: "held", DECIDE_DUP | DECIDE_HOLD: "duplicated, held"}
DEFAULT_MAX_MB = 100


def _pad(n: int) -> int:
    return (n + 3) & ~3


def ip_udp(src: tuple[str, int], dst: tuple[str, int], length: int) -> bytes:
    """An IPv4 + UDP header for `length` bytes of INA packet (IPv4 checksum computed; UDP's 0 = none)."""
    ip = bytearray(struct.pack(">BBHHHBBH4s4s", 0x45, 0, 28 + length, 0, 0x4000, 64, 17, 0,
                               socket.inet_aton(src[0]), socket.inet_aton(dst[0])))
    total = sum(struct.unpack(">10H", ip))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    ip[10:12] = struct.pack(">H", ~total & 0xFFFF)
    return bytes(ip) + struct.pack(">HHHH", src[1], dst[1], 8 + length, 0)


def header_blocks() -> bytes:
    """Section header (byte order of this machine, as the C writer) and one IPv4 interface in microseconds."""
    shb = struct.pack("=IIIHHqI", 0x0A0D0D0A, 28, 0x1A2B3C4D, 1, 0, -1, 28)
    idb = struct.pack("=IIHHII", 1, 20, LINKTYPE_IPV4, 0, 0, 20)
    return shb + idb


def packet_block(inbound: bool, packet: bytes, note: str, when_us: int) -> bytes:
    """One enhanced packet block: an IPv4 packet, its comment (the impairment's decision) and direction."""
    opts = b""
    if note:
        text = note.encode()
        opts += struct.pack("=HH", 1, len(text)) + text.ljust(_pad(len(text)), b"\0")
    opts += struct.pack("=HHI", 2, 4, 1 if inbound else 2) + b"\0" * 4
    total = 28 + _pad(len(packet)) + len(opts) + 4
    return (struct.pack("=IIIIIII", 6, total, 0, when_us >> 32, when_us & 0xFFFFFFFF, len(packet), len(packet))
            + packet.ljust(_pad(len(packet)), b"\0") + opts + struct.pack("=I", total))


def note_of(decision: int) -> str:
    return "dropped" if decision & DECIDE_DROP else NOTES[decision & (DECIDE_DUP | DECIDE_HOLD)]


def capture_address(me: tuple[str, int]) -> tuple[str, int]:
    """The switch's address as a capture shows it (a wildcard bind shows as loopback)."""
    return (me[0] if me[0] not in ("", "0.0.0.0") else "127.0.0.1", me[1])


class Capture:
    """A pcapng file of one server's traffic, at most max_mb (past that, packets are counted, not written).

    Args:
        path: the file (truncated).
        me: the switch's (IPv4, port).
        max_mb: the file's size limit in MiB.

    Raises:
        OSError: the file cannot be written.
    """

    def __init__(self, path: str, me: tuple[str, int], max_mb: float = DEFAULT_MAX_MB):
        self.me = capture_address(me)
        self.max_bytes = int(max_mb * 2**20)
        self.file = open(path, "wb")
        head = header_blocks()
        self.file.write(head)
        self.bytes, self.packets, self.skipped = len(head), 0, 0

    def record(self, inbound: bool, peer: tuple[str, int], data: bytes, decision: int = 0):
        """One INA packet from (inbound) or to peer, and what the impairment decided for it."""
        src, dst = (peer, self.me) if inbound else (self.me, peer)
        self.write(inbound, ip_udp(src, dst, len(data)) + data, note_of(decision), time.time_ns() // 1000)

    def write(self, inbound: bool, packet: bytes, note: str, when_us: int):
        """One IPv4 packet as captured elsewhere (BMv2's own per-port captures, merged at close)."""
        block = packet_block(inbound, packet, note, when_us)
        if self.bytes + len(block) > self.max_bytes:
            self.skipped += 1
            return
        self.file.write(block)
        self.bytes += len(block)
        self.packets += 1

    def merge_bmv2(self, directory: str):
        """BMv2's per-port captures (simple_switch --pcap: PORT_in.pcap, PORT_out.pcap, Ethernet frames) as
        this file's IPv4 packets in time order, each noted with its port (BMv2 has no impairment stage)."""
        import glob
        import os

        from scapy.utils import RawPcapReader

        frames = []
        for path in glob.glob(os.path.join(directory, "*_in.pcap")) + glob.glob(os.path.join(directory, "*_out.pcap")):
            port, inbound = os.path.basename(path).rsplit("_", 1)[0], path.endswith("_in.pcap")
            for frame, meta in RawPcapReader(path):
                if len(frame) > 14 and frame[12:14] == b"\x08\x00":  # IPv4 (ARP is left out)
                    when = meta.sec * 1_000_000 + meta.usec
                    frames.append((when, inbound, frame[14:], f"port {port}"))
        for when, inbound, packet, note in sorted(frames, key=lambda f: f[0]):
            self.write(inbound, packet, note, when)

    def close(self):
        self.file.close()

    def stats(self) -> dict:
        return {"captured": self.packets, "capture_skipped": self.skipped}
