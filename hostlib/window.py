"""How many packets a worker keeps in flight by default (auto_window: every rank computes the same), and what
a Communicator counts of its traffic (CommStats)."""
from __future__ import annotations

from dataclasses import dataclass, field

from inaproto import wire
from inaproto.net import SOCKET_BUFFER

# Bytes of packets one worker keeps in flight by default, measured on the current code (docs/performance.md, "The
# window"): 64 MiB calls, 4 workers and a C switch on loopback, both SIMD paths of a Xeon. A deeper pipeline keeps
# both cores busy while the switch works: NC with 1 KiB packets ran 13 % faster at 496 packets than at 160 and
# alike from 496 to 993; with 8 KiB packets 124 were 11-15 % faster than 62, and int32 with 8 KiB packets 10 %.
IN_FLIGHT_BYTES = 1 << 20
REPAIR_BINS = 32  # the C loop's INA_WK_REPAIR_BINS
AUTO_WINDOW_MAX = 1024
# ... and across a network, under a congestion policy: the lanes the congestion window moves in. More lanes than
# a path holds cost only a longer exponent-only start per call (a shared-scale codec sends D = W of them);
# 128 packets of 1 KiB are 1 Mbit: 100 Mbit/s x 10 ms, 10 Gbit/s x 100 us (bench ddp --topo, 4 hosts, 100 Mbit/s,
# 1 ms: the 480 of loopback were 9 % slower a step than 64 fixed lanes, docs/protocol.md "The worker's window")
NETWORK_WINDOW = 128


def auto_window(granted: int, payload: int, world_size: int, network: bool = False) -> int:
    """The window for packets of `payload` bytes: IN_FLIGHT_BYTES of packets, and no more than half the switch's
    socket buffer shared by every worker's window (past it, results are dropped and wait for a retransmission
    timeout); at least 4 packets, at most what the switch granted, and NETWORK_WINDOW across a network (network:
    a switch not on loopback, under a congestion policy). Ranks that ask differently get the smallest ask from the
    switch."""
    budget = min(IN_FLIGHT_BYTES, SOCKET_BUFFER // (2 * world_size))
    packets = budget // (wire.HEADER_SIZE + payload)
    if network:
        packets = min(packets, NETWORK_WINDOW)
    return max(1, min(granted, max(4, packets)))


@dataclass
class CommStats:
    """What one Communicator sent and received over its lifetime (all calls), for comparing codecs and
    backends by bytes on the wire rather than by time alone."""

    packets_sent: int = 0
    packets_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    retransmissions: int = 0
    spurious_retransmissions: int = 0  # resends answered within half a round trip: the original was late, not lost
    fast_retransmits: int = 0  # of the retransmissions, those before their timeout: at a gap (cc.DUPTHRESH), a probe
    # resent packets by how long their result took from the first send, in half smoothed round trips (the last
    # bin: REPAIR_BINS / 2 round trips or more; the C loop's repairs): how many round trips a loss costs
    repairs: list = field(default_factory=lambda: [0] * REPAIR_BINS)
    duplicate_results: int = 0
    stale_results: int = 0
    gso_sends: int = 0  # C loop: UDP GSO messages sent (each several same-size packets)
    gro_segments: int = 0  # C loop: results that came in coalesced UDP_GRO receives
    heartbeats: int = 0  # liveness messages to the switch (HEARTBEAT_EVERY; not in packets_sent)
    heartbeat_answers: int = 0  # the switch's answers to them (not in packets_received)
    switch_drops: int = 0  # the switch told this worker it dropped one of its packets (ERR_DROPPED)
    elements: int = 0
    allreduces: int = 0
    seconds: float = 0.0

    def called(self, seconds: float, elements: int, heartbeats: int):
        """A call that completed: its time and elements; the heartbeats sent so far."""
        self.seconds += seconds
        self.allreduces += 1
        self.elements += elements
        self.heartbeats = heartbeats

    @property
    def wire_bytes_sent(self) -> int:
        """bytes_sent plus the Ethernet/IPv4/UDP overhead per packet: what a link carries, so small packets
        are not flattered."""
        return self.bytes_sent + self.packets_sent * wire.WIRE_OVERHEAD

    def repair(self, seconds: float, srtt: float):
        """A resent packet's result came `seconds` after its first send."""
        self.repairs[min(int(2 * seconds / srtt), REPAIR_BINS - 1)] += 1

    @property
    def repair_rtts_p50(self) -> float | None:
        """The median repair in round trips (its bin's middle), or None when nothing was resent."""
        total, seen = sum(self.repairs), 0
        for i, n in enumerate(self.repairs):
            seen += n
            if total and 2 * seen >= total:
                return (i + 0.5) / 2
        return None

    def as_dict(self) -> dict:
        """Returns:
            The counters and wire_bytes_sent as a plain dict (JSON-ready, for reports and benchmarks).
        """
        d = dict(self.__dict__)
        d["wire_bytes_sent"] = self.wire_bytes_sent
        d["repairs"] = list(self.repairs)
        d["repair_rtts_p50"] = self.repair_rtts_p50
        return d
