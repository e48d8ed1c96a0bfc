"""`switchsim bench topo`: allreduce time on emulated links, INA (int32, fixed, nc) against torch gloo's ring
run across the same namespaces and links, vs link rate and vs loss. On equal links, per-worker bytes decide:
INA sends each element up once and receives the sum once; a ring sends and receives 2(N-1)/N of the tensor,
in float32."""
from __future__ import annotations

import json
import os
import sys
import tempfile

from inabench.harness import ROOT
from switchsim.netns import Star
from topologies.run import Spec, run, wait_workers

GLOO = os.path.join(ROOT, "topologies", "gloo_worker.py")


def gloo_run(workers: int, bw: float | None, loss: float, delay_ms: float, size: int, timeout: float,
             ecn: bool = False) -> dict:
    """gloo's allreduce of size float32 per worker across a star's bridge (worker to worker over two links)."""
    with Star(workers, loss, bw, bridge=True, delay_ms=delay_ms, ecn=ecn) as star, tempfile.TemporaryDirectory() as tmp:
        master = f"{star.worker_ips[0]}:29500"
        procs = [star.popen(w, [sys.executable, GLOO, master, w, workers, size, os.path.join(tmp, f"{w}.json")],
                            env={**os.environ, "GLOO_SOCKET_IFNAME": star.worker_ifs[w]}, cwd=ROOT,
                            stderr=open(os.path.join(tmp, f"err{w}"), "w"))
                 for w in range(workers)]
        wait_workers(procs, tmp, timeout)
        out = [json.load(open(os.path.join(tmp, f"{w}.json"))) for w in range(workers)]
        links = star.link_bytes()
    return {"seconds": max(o["seconds"] for o in out), "wrong": sum(o["wrong"] for o in out), "links": links}


def median(runs: list[dict]) -> dict:
    """The run with the median time."""
    return sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]


def _row(bw, loss, config, r, workers) -> dict:
    link = max(x["tx_bytes"] + x["rx_bytes"] for x in r["links"][:workers])
    ok = r.get("wrong", 0) == 0 if config == "gloo" else (
        r["exact"] if r["exact"] is not None else f"rel err {r['rel_error']:.3f}")
    return {"bw Mbit/s": bw, "loss": loss, "config": config, "time s": round(r["seconds"], 4),
            "MB per worker link": round(link / 1e6, 3), "retx": r.get("retransmissions"), "correct": ok}


def bench_topo(workers: int = 4, size: int = 1 << 18, rates=(10, 100, 1000, 10000), losses=(0, 0.01, 0.05, 0.1),
               loss_rate: float = 100, codecs=("int32", "fixed", "nc"), backend: str = "c", delay_ms: float = 0.0,
               timeout: float = 300, repeat: int = 3, progress=None, ecn: bool = False) -> list[dict]:
    """Rows: every (rate, loss 0) and (loss_rate, loss) setting, each codec's INA and gloo, with the time as a
    multiple of gloo's in the same setting ("x gloo"); a lossy setting's row is the median of `repeat` runs."""
    settings = [(bw, 0.0) for bw in rates] + [(loss_rate, p) for p in losses if p]
    rows = []
    for bw, loss in settings:
        n = repeat if loss else 1  # under loss one run's time is one draw of a wide distribution (TCP's too)
        base = median([gloo_run(workers, bw, loss, delay_ms, size, timeout, ecn and bw is not None) for _ in range(n)])
        got = [_row(bw, loss, "gloo", base, workers)]
        for codec in codecs:
            if progress:
                progress(f"{bw} Mbit/s, loss {loss}: {codec}")
            r = median([run(Spec(workers, backend, bw, delay_ms, loss, ecn=ecn and bw is not None), codec, size,
                             window=64, timeout=timeout / 2)
                         for _ in range(n)])
            got.append(_row(bw, loss, f"ina-{codec}", r, workers))
        for g in got:
            g["x gloo"] = round(g["time s"] / got[0]["time s"], 3)
        rows += got
    return rows


def plot(rows: list[dict], path: str):
    from inabench.report import pyplot

    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    for c in configs:
        by_rate = [r for r in rows if r["config"] == c and r["loss"] == 0]
        a.plot([r["bw Mbit/s"] for r in by_rate], [r["time s"] for r in by_rate], "o-", label=c)
        loss_bw = max((r["bw Mbit/s"] for r in rows if r["loss"]), default=None)
        by_loss = [r for r in rows if r["config"] == c and r["bw Mbit/s"] == loss_bw]
        b.plot([100 * r["loss"] for r in by_loss], [r["time s"] for r in by_loss], "o-", label=c)
    a.set(xscale="log", yscale="log", xlabel="link rate (Mbit/s)", ylabel="allreduce time (s)",
          title="time vs link rate (no loss)")
    b.set(yscale="log", xlabel="loss per packet and direction (%)", ylabel="allreduce time (s)",
          title=f"time vs loss ({loss_bw} Mbit/s)")
    for ax in (a, b):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
