"""What would INA give on a cluster? An analytic model of allreduce time for INA (SwitchML's protocol) and
for NCCL's ring and tree, calibrated from this emulator's own measurements and checked against them
(`switchsim model`, `switchsim bench model`).

INA, per worker (SwitchML semantics: a window of W slots, each self-clocked: a slot's next packet leaves
when its result comes back; one result multicast per slot):
- link: every packet goes up once and its result comes down once, so each direction of a worker's link
  carries rounds x (frame) bytes: t_link = rounds * frame * 8 / B (no 2(N-1)/N factor: that is the point);
- switch: N * rounds packets through one switch: t_switch = N * rounds / switch_pps;
- window: each slot runs rounds / W rounds of one round trip each: t_window = rounds / W * rtt;
- host CPU (for the emulator itself): t_cpu = N * rounds * cpu_per_packet / cores;
- loss: a round of a slot is lost when any of its 2N packets is (q = 1 - (1 - p)^2N: a lost update stalls
  every worker of the slot, a lost result the one worker, whose next update the slot then waits for); the
  slot waits a retransmission timeout, and the allreduce ends with its slowest slot: the expected maximum,
  over the W slots, of the timeouts each met (a negative binomial per slot), times the timeout (calibrated:
  topologies/validate.py). Retransmissions: every worker resends a round whose update was lost, one worker
  one whose result was. This holds because the workers run their slots independently, as SwitchML's do;
  while the emulator's workers ran one sliding window (a lane waiting for a loss held back the others) and
  sampled peers' recoveries into their RTT, 8 workers at 5 % loss took 3x the time this predicts.
time = max(t_link, t_switch, t_window, t_cpu) + rtt + stall, with rtt = 2 * latency + the two frames'
serialisation. With p = 0 and a window that covers the link it reduces to bytes/B + rtt.

Ring and tree are NCCL's cost models: ring 2(N-1)/N * S/B + 2(N-1) * alpha, tree 2 * S/B +
2 * log2(N) * alpha; algbw = S / t and busbw = algbw * 2(N-1)/N, as nccl-tests define them for allreduce.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from inaproto import wire

FRAMING = 14 + 20 + 8  # Ethernet, IPv4, UDP headers: what a link carries around each INA packet
ETHERNET_PHY = 8 + 12 + 4  # preamble, inter-frame gap and FCS: a real Ethernet link's cost per frame beyond
# what Linux counts (a veth and tc tbf charge none of it, so the emulator's settings leave it out)
CODEC_BYTES = {"int32": 4, "fixed": 4, "nc": 1}  # bytes per element on the wire


@dataclass
class Setting:
    """One allreduce on one network. Sizes in bytes of float32 tensor; rates in bits/s; times in seconds."""

    workers: int
    size: float  # S: bytes of float32 per worker
    link_bps: float  # B: every worker link's rate, each direction
    codec: str = "int32"  # int32 | fixed | nc
    payload: int = 1024  # INA payload bytes per packet
    window: int = 64  # W: slots per worker
    latency: float = 1e-6  # one way, worker to switch (link + switch pipeline)
    switch_pps: float = math.inf  # packets/s the switch aggregates (a Tofino: line rate)
    loss: float = 0.0  # per packet and direction, every link
    rto: float = 0.03  # what a lost round costs its slot (the worker's retransmission timeout)
    density: float = 1.0  # block-sparse INA: fraction of each worker's blocks that are non-zero
    alpha: float = 5e-6  # ring/tree: per-step latency (NCCL's alpha)
    cpu_per_packet: float = 0.0  # host CPU seconds per packet and worker (the emulator's own cost)
    cores: int = 1 << 30  # cores that CPU is spread over
    burst: float = 0.0  # bytes a link sends ahead of its rate (the emulator's tc tbf bucket starts full)
    phy: int = 0  # bytes per frame a link spends beyond the frame (real Ethernet: ETHERNET_PHY)

    def __post_init__(self):
        if self.workers < 1 or self.size < 0 or self.link_bps <= 0 or self.window < 1:
            raise ValueError("workers >= 1, size >= 0, link rate > 0 and window >= 1")
        if self.codec not in CODEC_BYTES:
            raise ValueError(f"codec must be one of {sorted(CODEC_BYTES)}, not {self.codec!r}")
        if not 0 <= self.loss < 1 or not 0 < self.density <= 1:
            raise ValueError("loss in [0, 1) and density in (0, 1]")


def bus_bw(alg_bw: float, workers: int) -> float:
    """nccl-tests' bus bandwidth of an allreduce: algbw * 2(n-1)/n (the per-link rate a ring needs)."""
    return alg_bw * 2 * (workers - 1) / workers if workers > 1 else alg_bw


def _result(name: str, s: Setting, seconds: float, **extra) -> dict:
    alg = s.size / seconds if seconds > 0 else math.inf
    return {"algorithm": name, "workers": s.workers, "size": s.size, "time_s": seconds, "algbw_Bps": alg,
            "busbw_Bps": bus_bw(alg, s.workers), **extra}


def ring(s: Setting) -> dict:
    """NCCL's ring allreduce: reduce-scatter + allgather, 2(N-1) steps of S/N bytes each."""
    n = s.workers
    t = 2 * (n - 1) / n * s.size * 8 / s.link_bps + 2 * (n - 1) * s.alpha if n > 1 else 0.0
    return _result("ring", s, t)


def tree(s: Setting) -> dict:
    """NCCL's (double binary) tree allreduce: reduce up and broadcast down, pipelined, 2 log2 N latency steps."""
    n = s.workers
    t = 2 * s.size * 8 / s.link_bps + 2 * math.log2(n) * s.alpha if n > 1 else 0.0
    return _result("tree", s, t)


def ina(s: Setting) -> dict:
    """SwitchML-style INA (see the module docstring); also returns each bound and the expected
    retransmissions, so a reader sees what limits the time."""
    k = max(1, s.payload // CODEC_BYTES[s.codec])  # elements per packet
    blocks = math.ceil(s.size / 4 / k)
    rounds = blocks if s.density >= 1 else math.ceil(blocks * (1 - (1 - s.density) ** s.workers))
    frame = FRAMING + s.phy + wire.HEADER_SIZE + s.payload
    up = rounds * (FRAMING + s.phy + wire.HEADER_SIZE) + min(rounds, math.ceil(blocks * s.density)) * s.payload
    t_link = max(0.0, max(up, rounds * frame) - s.burst) * 8 / s.link_bps
    service = 1 / s.switch_pps if s.switch_pps < math.inf else 0.0
    rtt = 2 * s.latency + 2 * frame * 8 / s.link_bps + service
    t_switch = s.workers * rounds * service
    w = min(s.window, rounds) or 1
    t_window = math.ceil(rounds / w) * rtt
    t_cpu = s.workers * rounds * s.cpu_per_packet / min(s.cores, s.workers + 1)
    q = 1 - (1 - s.loss) ** (2 * s.workers)
    stall = s.rto * expected_max_losses(math.ceil(rounds / w), q, w) if q else 0.0
    bounds = {"link": t_link, "switch": t_switch, "window": t_window, "cpu": t_cpu}
    t = max(bounds.values()) + rtt + stall
    per_round = s.workers * (1 - (1 - s.loss) ** s.workers) + s.workers * s.loss  # lost updates, lost results
    retx = rounds * per_round / (1 - q)
    return _result("ina", s, t, bound=max(bounds, key=bounds.get), rtt_s=rtt, stall_s=stall,
                   retransmissions=retx, packets_per_worker=rounds, link_bytes_per_worker=rounds * frame,
                   **{f"t_{k}": v for k, v in bounds.items()})


def expected_max_losses(rounds: int, q: float, slots: int) -> float:
    """E[max over `slots` slots of the lost rounds each met], each slot running `rounds` rounds that are
    lost with probability q (again on every retry): a negative binomial per slot, independent slots."""
    if rounds <= 0 or q <= 0:
        return 0.0
    # P(X <= m) for X ~ NegBin(rounds successes, failure probability q), by the pmf's recurrence
    pmf = (1 - q) ** rounds
    cdf, expect, m = pmf, 0.0, 0
    while cdf < 1 - 1e-12 and m < 100_000:
        expect += 1 - cdf ** slots
        m += 1
        pmf *= (rounds + m - 1) / m * q
        cdf += pmf
    return expect


def project(workers: list[int], size: float, link_bps: float, **kw) -> list[dict]:
    """INA, ring and tree for each worker count; INA's time as a multiple of ring's in the same row."""
    rows = []
    for n in workers:
        s = Setting(n, size, link_bps, **kw)
        r, t, i = ring(s), tree(s), ina(s)
        rows.append({"workers": n, "codec": s.codec, "size_MiB": size / 2**20, "ina_s": i["time_s"],
                     "ring_s": r["time_s"], "tree_s": t["time_s"], "ina_algbw_Gbps": i["algbw_Bps"] * 8e-9,
                     "ring_algbw_Gbps": r["algbw_Bps"] * 8e-9, "ring_busbw_Gbps": r["busbw_Bps"] * 8e-9,
                     "ina_bound": i["bound"], "ina_retx": round(i["retransmissions"], 1),
                     "ina/ring": i["time_s"] / r["time_s"] if r["time_s"] else None})
    return rows


# What SwitchML's authors published for 100 Gbps RDMA workers, 1 KiB payloads (p4app-switchML,
# docs/img/benchmark.png: "aggregated elements per second", read off the bars to about +-30 M/s; its README:
# "more than 2x speedup over NCCL when using RDMA" and "constant with any number of workers"). The NSDI'21
# text's own figures were not at hand; these are the public repository's, for the same system.
PUBLISHED_SWITCHML = {"source": "p4app-switchML docs/img/benchmark.png (100 Gbps, RDMA, bars read by eye)",
                      "ideal_Gelem_s": 2.89,  # its "Max RDMA goodput" line
                      "switchml_Gelem_s": {4: 2.83, 8: 2.82, 16: 2.81},
                      "nccl_rdma_Gelem_s": {4: 1.38, 8: 1.26, 16: 0.97}}


def switchml_shape(workers=(2, 4, 8, 16, 32, 64, 128, 256), link_gbps: float = 100.0, size: float = 100 * 2**20,
                   payloads=(256, 1024)) -> list[dict]:
    """SwitchML's setting (NSDI'21: 100 Gbps, 256 B and 1 KiB payloads, a Tofino at line rate): INA's
    aggregation rate (elements of the tensor per second, per worker) stays flat in N, ring's falls like
    N / (2(N-1)). Rows at 1 KiB for the worker counts SwitchML published carry its figures beside the model's."""
    rows = []
    for payload in payloads:
        for n in workers:
            s = Setting(n, size, link_gbps * 1e9, "int32", payload, window=128, latency=1e-6, alpha=5e-6,
                        phy=ETHERNET_PHY)
            i, r = ina(s), ring(s)
            row = {"payload_B": payload, "workers": n, "ina_Gbps": size * 8 / i["time_s"] * 1e-9,
                   "ring_Gbps": size * 8 / r["time_s"] * 1e-9, "ina/ring speedup": r["time_s"] / i["time_s"],
                   "ina_goodput_share": s.payload / (s.payload + FRAMING + ETHERNET_PHY + wire.HEADER_SIZE),
                   "ina_Gelem_s": size / 4 / i["time_s"] * 1e-9, "ring_Gelem_s": size / 4 / r["time_s"] * 1e-9}
            published = PUBLISHED_SWITCHML["switchml_Gelem_s"].get(n) if payload == 1024 else None
            if published and link_gbps == 100.0:
                row["switchml_published_Gelem_s"] = published
                row["nccl_rdma_published_Gelem_s"] = PUBLISHED_SWITCHML["nccl_rdma_Gelem_s"][n]
            rows.append(row)
    return rows


def settings_dict(s: Setting) -> dict:
    return asdict(s)


def with_calibration(s: Setting, calibration: dict) -> Setting:
    """s with the emulator's measured costs (calibrate()'s output) filled in."""
    return replace(s, **{k: v for k, v in calibration.items() if k in ("cpu_per_packet", "rto", "latency", "cores")})


def plot(rows: list[dict], path: str):
    """Time vs workers for INA, ring and tree (project()'s rows), log-log."""
    from .report import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    n = [r["workers"] for r in rows]
    for key, label in (("ina_s", f"INA ({rows[0]['codec']})"), ("ring_s", "ring (NCCL model)"), ("tree_s", "tree")):
        ax.plot(n, [r[key] for r in rows], "o-", label=label)
    ax.set(xscale="log", yscale="log", xlabel="workers", ylabel="allreduce time (s)",
           title=f"{rows[0]['size_MiB']:g} MiB per worker")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
