"""`switchsim bench net`: INA as one flow among others on a bottleneck. A star of hosts around a C switch
on emulated links; worker 0's link carries the INA job's traffic and, beside it, one TCP bulk flow (worker
0 -> worker 1, as data loading or a checkpoint) and short request/response flows (worker 1 answers worker 0,
as RPCs). Four phases of `seconds` each, on a fresh topology each: short flows alone (their completion
time on an idle link), TCP alone, INA alone, all together; per INA congestion policy (`cc`; today "none",
SwitchML's fixed window) the last two are rows, and with `job2` a fifth: INA beside a second INA job of 2
ranks on workers 0 and 1 (their links shared), through the same switch. Per row: INA goodput (tensor bytes allreduced per second
per worker), TCP goodput, INA's share of the bottleneck and Jain's index of the two, short flows' completion
time p50/p99 (and as a multiple of the idle link's), INA retransmissions (spurious ones apart: answered within
half a round trip of the resend, so the original was late, not lost), the round trip of pings across the
link (queueing delay: above the idle one) and, with `ecn`, the packets the link's queue marked CE.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from hostlib.window import CommStats
from inabench.harness import ROOT
from topologies.run import Deployment, Member, Spec

TCP_PORT, RR_PORT = 5201, 5202
TCP_CC = "cubic"  # the bulk flow's congestion control: Linux's default, not the host's (BBR ignores ECN)
JOB2 = 2  # the second INA job's id (cross traffic)
START_LIMIT = 60.0  # seconds for the INA ranks to join and finish a first call


def mbit(nbytes: float, seconds: float) -> float:
    """Mbit/s of nbytes in seconds."""
    return 8 * nbytes / seconds / 1e6


def jain(xs: list[float]) -> float | None:
    """Jain's fairness index of the throughputs xs: 1 when equal, 1/n when one takes everything."""
    xs = [x for x in xs if x is not None]
    if not xs or not any(xs):
        return None
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


def _spawn(dep, host: str, argv: list, tmp: str, name: str) -> subprocess.Popen:
    return dep.topo.popen(host, [sys.executable, *map(str, argv)], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=open(os.path.join(tmp, f"{name}.err"), "w"), text=True)


def _ready(p: subprocess.Popen, what: str, tmp: str):
    line = p.stdout.readline()
    if not line.startswith("ready"):
        raise RuntimeError(f"bench net: {what} did not start: {open(os.path.join(tmp, what + '.err')).read()[-1500:]}")


def _last_json(p: subprocess.Popen, limit: float, what: str, tmp: str) -> dict:
    try:
        out, _ = p.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"bench net: {what} did not end within {limit:g} s") from None
    lines = [x for x in out.splitlines() if x.startswith("{")]
    if p.returncode or not lines:
        raise RuntimeError(f"bench net: {what} failed (exit {p.returncode}): "
                           f"{open(os.path.join(tmp, what + '.err')).read()[-1500:]}")
    return json.loads(lines[-1])


def _ina_start(dep, tmp: str, members: list, codec: str, elements: int, seconds: float, window: int | None,
               cc: str, name: str = "ina") -> list:
    """A loop_worker per member (topologies.run.Member), each (its Popen, its output file)."""
    kw = [f"timeout={json.dumps(30.0)}", f"cc={json.dumps(cc)}"] + ([f"window={window}"] if window else [])
    procs = []
    for w, m in enumerate(members):
        out = os.path.join(tmp, f"{name}{w}.json")
        procs.append((_spawn(dep, m.host, ["-m", "topologies.loop_worker", m.switch, m.rank, m.world, codec, elements,
                                           seconds, out, *kw, f"job={m.job}"], tmp, f"{name}{w}"), out))
    return procs


def _started(procs: list, tmp: str, name: str):
    """Each rank printed "started" (it joined and made a first call), else its error."""
    for w, (p, _) in enumerate(procs):
        if not p.stdout.readline().startswith("started"):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
            raise RuntimeError(f"bench net: INA rank {w} ({name}) failed: "
                               f"{open(os.path.join(tmp, f'{name}{w}.err')).read()[-1500:]}")


def _ina_wait(procs: list, tmp: str, limit: float, name: str = "ina") -> list[dict]:
    out = []
    for w, (p, path) in enumerate(procs):
        try:
            p.wait(limit)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"bench net: INA rank {w} ({name}) did not end") from None
        if p.returncode:
            raise RuntimeError(f"bench net: INA rank {w} ({name}) failed: "
                               f"{open(os.path.join(tmp, f'{name}{w}.err')).read()[-1500:]}")
        out.append(json.load(open(path)))
    return out


def _ping(dep, seconds: float):
    return dep.topo.popen(dep.topo.worker_ns[0], ["ping", "-n", "-i", "0.2", "-w", str(int(seconds)), dep.topo.switch_ip],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def _rtts(p) -> list[float]:
    try:
        out, _ = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        return []
    return [float(x.split("time=")[1].split()[0]) for x in out.splitlines() if "time=" in x]


def phase(spec: Spec, seconds: float, ina: bool, tcp: bool, short: bool, codec: str = "int32",
          elements: int = 1 << 20, window: int | None = None, cc: str = "none", short_rate: float = 50.0,
          short_kb: float = 16.0, job2: bool = False, tcp_cc: str = TCP_CC) -> dict:
    """One phase on a fresh topology: what each flow achieved over the same `seconds`; job2: a second INA
    job (2 ranks, on workers 0 and 1, the same policy) beside the first."""
    with tempfile.TemporaryDirectory() as tmp, Deployment(spec, tmp, {JOB2: 2} if job2 else None) as dep:
        w0, w1 = dep.topo.worker_ns[0], dep.topo.worker_ns[1]
        servers = []
        if tcp:
            servers.append(("sink", _spawn(dep, w1, ["-m", "topologies.traffic", "sink", TCP_PORT, seconds], tmp, "sink")))
        if short:
            servers.append(("rr-server", _spawn(dep, w1, ["-m", "topologies.traffic", "rr-server", RR_PORT, seconds],
                                                tmp, "rr-server")))
        for what, p in servers:
            _ready(p, what, tmp)
        inas = _ina_start(dep, tmp, dep.members, codec, elements, seconds + 1, window, cc) if ina else []
        second = [Member(dep.members[r].host, dep.members[r].switch, JOB2, r, 2) for r in range(2)] if job2 else []
        job2_procs = _ina_start(dep, tmp, second, codec, elements, seconds + 1, window, cc, "job2")
        _started(inas, tmp, "ina")  # every rank joined and made a first call: the others start now
        _started(job2_procs, tmp, "job2")
        start = time.monotonic()
        clients = []
        if tcp:
            clients.append(("bulk", _spawn(dep, w0, ["-m", "topologies.traffic", "bulk",
                                                     f"{dep.topo.worker_ips[1]}:{TCP_PORT}", seconds, tcp_cc],
                                           tmp, "bulk")))
        if short:
            clients.append(("rr-client", _spawn(dep, w0, ["-m", "topologies.traffic", "rr-client",
                                                          f"{dep.topo.worker_ips[1]}:{RR_PORT}", seconds, short_rate,
                                                          short_kb], tmp, "rr-client")))
        ping = _ping(dep, seconds)
        got = {what: _last_json(p, seconds + 30, what, tmp) for what, p in clients}
        for what, p in servers:  # their clients are done: the sink reports on its own, the rr-server when told
            if what == "rr-server":
                p.terminate()
            got[what] = _last_json(p, seconds + 30, what, tmp)
        ina_out = _ina_wait(inas, tmp, seconds + START_LIMIT)
        job2_out = _ina_wait(job2_procs, tmp, seconds + START_LIMIT, "job2")
        rtts = _rtts(ping)
        links = dep.topo.stage_counters()
    row = _summarize(start, seconds, got, ina_out, rtts, links)
    if job2_out:
        row["job2 Mbit/s"] = round(_goodput(job2_out, start, seconds), 2)
        row["job2 exact"] = all(o["exact"] is not False for o in job2_out)
        total = row["ina Mbit/s"] + row["job2 Mbit/s"]
        row["ina share"] = round(row["ina Mbit/s"] / total, 3) if total else None
        row["jain"] = round(jain([row["ina Mbit/s"], row["job2 Mbit/s"]]), 3)
    return row


def _goodput(outs: list[dict], start: float, seconds: float) -> float:
    """Mbit/s of tensor bytes allreduced inside [start, start + seconds], the slowest rank's. A call that
    crosses an edge counts for the share of its time inside: counting whole calls made one 4 MiB call 1.7
    Mbit/s of a 20 s phase at 100 Mbit/s."""
    end = start + seconds

    def calls_inside(o) -> float:
        return sum(max(0.0, min(t, end) - max(t - d, start)) / d if d > 0 else float(start <= t <= end)
                   for t, d in o["calls"])

    return min(mbit(o["bytes_per_call"] * calls_inside(o), seconds) for o in outs)


def _summarize(start: float, seconds: float, got: dict, ina_out: list, rtts: list, links: dict) -> dict:
    row = {"tcp Mbit/s": None, "ina Mbit/s": None, "retx": None, "spurious": None, "exact": None}
    if "sink" in got:
        bins = got["sink"]["bytes"]
        row["tcp Mbit/s"] = round(mbit(sum(bins[:int(seconds / got["sink"]["bin_s"])]), seconds), 2)
        row["tcp series"] = [round(mbit(b, got["sink"]["bin_s"]), 2) for b in bins]
    if ina_out:
        row["ina Mbit/s"] = round(_goodput(ina_out, start, seconds), 2)
        row["retx"] = sum(o["stats"]["retransmissions"] for o in ina_out)
        row["spurious"] = sum(o["stats"].get("spurious_retransmissions", 0) for o in ina_out)
        row["fast retx"] = sum(o["stats"].get("fast_retransmits", 0) for o in ina_out)
        repairs = [sum(b) for b in zip(*(o["stats"]["repairs"] for o in ina_out))]
        row["repair rtt p50"] = CommStats(repairs=repairs).repair_rtts_p50
        row["cuts"] = ina_out[0]["cc"]["reductions"]  # the same on every rank: the aggregate's marks
        row["cwnd"] = round(ina_out[0]["cc"]["cwnd"], 1)
        row["srtt ms"] = round(1000 * ina_out[0]["cc"]["srtt"], 2) if ina_out[0]["cc"]["srtt"] else None
        row["exact"] = all(o["exact"] is not False for o in ina_out)
        o = ina_out[0]
        row["ina series"] = [[round(c[0] - c[1] - start, 3), round(mbit(o["bytes_per_call"], c[1]), 2)]
                             for c in o["calls"] if c[0] >= start]
    if row["tcp Mbit/s"] is not None and row["ina Mbit/s"] is not None:
        total = row["tcp Mbit/s"] + row["ina Mbit/s"]
        row["ina share"] = round(row["ina Mbit/s"] / total, 3) if total else None
        row["jain"] = round(jain([row["tcp Mbit/s"], row["ina Mbit/s"]]), 3)
    if "rr-client" in got:
        fct = np.array(got["rr-client"]["fct_s"]) * 1000
        row["short flows"] = got["rr-client"]["flows"]
        row["short failed"] = got["rr-client"]["failed"]
        row["short p50 ms"] = round(float(np.percentile(fct, 50)), 2) if fct.size else None
        row["short p99 ms"] = round(float(np.percentile(fct, 99)), 2) if fct.size else None
    row["rtt p50 ms"] = round(float(np.median(rtts)), 3) if rtts else None
    row["marked"] = sum(c.get("marked", 0) for c in links.values()) if links else None
    row["dropped"] = sum(c.get("dropped", 0) for c in links.values()) if links else None
    return row


def bench_net(hosts: int = 4, bw: float = 100.0, delay_ms: float = 1.0, seconds: float = 20.0, ecn: bool = False,
              ccs=("none",), codec: str = "int32", elements: int = 1 << 20, window: int | None = None,
              short_rate: float = 50.0, short_kb: float = 16.0, backend: str = "c", progress=None,
              job2: bool = False, loss: float = 0.0, fixed_window: int | None = None,
              tcp_cc: str = TCP_CC) -> list[dict]:
    """Rows: the idle link's short flows, TCP alone, then per policy INA alone, INA beside TCP and the
    short flows, and with job2 INA beside a second INA job; each phase on a fresh topology. window: INA's
    (None: hostlib's); fixed_window: the "none" policy's where window is None (SwitchML's, set for the link)."""
    if hosts < 2:
        raise ValueError("bench net needs at least 2 hosts (TCP runs from worker 0 to worker 1)")
    spec = Spec(hosts, backend, bw, delay_ms, loss, ecn=ecn)
    common = dict(codec=codec, elements=elements, short_rate=short_rate, short_kb=short_kb, tcp_cc=tcp_cc)
    plan = [("idle (short flows)", "-", False, False, True), ("tcp alone", "-", False, True, False)]
    for cc in ccs:
        plan += [("ina alone", cc, True, False, False), ("ina + tcp + short", cc, True, True, True)]
        plan += [("ina + second job", cc, True, False, False)] if job2 else []
    rows = []
    for name, cc, ina, tcp, short in plan:
        if progress:
            progress(f"{name} (cc {cc})")
        r = phase(spec, seconds, ina, tcp, short, cc=cc if cc != "-" else "none", job2=name == "ina + second job",
                  window=window or (fixed_window if cc == "none" else None), **common)
        rows.append({"phase": name, "cc": cc, **r})
    idle = rows[0]
    for r in rows:
        for q in ("p50", "p99"):
            if r.get(f"short {q} ms") and idle.get(f"short {q} ms"):
                r[f"short {q} x idle"] = round(r[f"short {q} ms"] / idle[f"short {q} ms"], 2)
        if r.get("rtt p50 ms") is not None and idle.get("rtt p50 ms") is not None:
            r["queue ms"] = round(r["rtt p50 ms"] - idle["rtt p50 ms"], 3)
    return rows


COLUMNS = ("phase", "cc", "ina Mbit/s", "tcp Mbit/s", "job2 Mbit/s", "ina share", "jain", "short p50 ms", "short p99 ms",
           "short p99 x idle", "retx", "fast retx", "spurious", "repair rtt p50", "cuts", "cwnd", "srtt ms", "queue ms",
           "marked", "dropped", "exact")


def table_rows(rows: list[dict]) -> list[dict]:
    """The rows without their time series, in the table's column order."""
    return [{k: r.get(k) for k in COLUMNS} for r in rows]


def plot(rows: list[dict], path: str):
    """Goodput over time of INA and TCP in each "together" phase (one panel per policy)."""
    from inabench.report import pyplot

    plt = pyplot()
    both = [r for r in rows if r.get("tcp series") and r.get("ina series")]
    fig, axes = plt.subplots(1, max(1, len(both)), figsize=(6 * max(1, len(both)), 3.8), squeeze=False)
    for ax, r in zip(axes[0], both):
        tcp = r["tcp series"]
        ax.plot([0.1 * i for i in range(len(tcp))], tcp, label=f"TCP ({r['tcp Mbit/s']} Mbit/s)", lw=0.8)
        ina = r["ina series"]
        ax.step([t for t, _ in ina], [v for _, v in ina], where="post", label=f"INA ({r['ina Mbit/s']} Mbit/s)")
        ax.set(xlabel="seconds", ylabel="goodput (Mbit/s)", title=f"cc={r['cc']}: share {r.get('ina share')}, "
                                                                    f"Jain {r.get('jain')}")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
