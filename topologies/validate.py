"""The projection model (inabench/projection.py) against this emulator: calibrate its host costs from a few
runs on a namespace star, then compare predicted and measured allreduce times over worker counts, codecs
and losses on rate-limited links (`switchsim bench model`)."""
from __future__ import annotations

import os

from inabench import projection
from switchsim.netns import Topology
from topologies.bench import median
from topologies.run import Spec, run

ELEMENTS = {"int32": 256, "fixed": 256, "nc": 1024}  # hostlib's default elements per packet (1 KiB payloads)
MODELLED = "none"  # the model's protocol is SwitchML's: W self-clocked slots, a timeout per loss (hostlib cc="none")


def setting(workers: int, size_elems: int, bw_mbit: float | None, codec: str, loss: float, window: int,
            calibration: dict) -> projection.Setting:
    """The model's Setting for one emulator run (float32 tensor of size_elems; a veth is ~unlimited)."""
    payload = ELEMENTS[codec] * projection.CODEC_BYTES[codec]
    burst = Topology.burst_bytes(bw_mbit) if bw_mbit else 0.0  # the links' tbf bucket starts full
    s = projection.Setting(workers, size_elems * 4, (bw_mbit or 1e6) * 1e6, codec, payload, window, loss=loss,
                           burst=burst)
    return projection.with_calibration(s, calibration)


def calibrate(codec: str = "int32", size: int = 1 << 18, window: int = 64, bw_mbit: float = 100.0,
              loss: float = 0.05, backend: str = "c") -> dict:
    """The emulator's own costs, from three runs with 2 workers: CPU seconds per packet and worker (links
    unlimited, so the hosts are the bound), the one-way latency (the workers' smoothed round trip / 2, no
    load), and, given a loss, what a lost round costs its slot (the time that loss adds on bw_mbit links,
    over the model's expected stalls; two runs more)."""
    cores = os.cpu_count() or 1
    fast = run(Spec(2, backend), codec, size, window, cc=MODELLED)
    probe = setting(2, size, None, codec, 0.0, window, {"cores": cores})
    rounds = projection.ina(probe)["packets_per_worker"]
    small = run(Spec(2, backend), codec, ELEMENTS[codec] * 32, 2, cc=MODELLED)  # 32 packets, 2 in flight: no queue
    latency = small["rtt_ms"] / 2000
    cpu = max(0.0, fast["seconds"] - 2 * latency) * min(cores, 3) / (2 * rounds)
    cal = {"cores": cores, "latency": latency, "cpu_per_packet": cpu}
    if not loss:
        return cal
    clean = run(Spec(2, backend, bw_mbit), codec, size, window, cc=MODELLED)
    lossy = _median_run(Spec(2, backend, bw_mbit, loss=loss), codec, size, window, 3)
    s = setting(2, size, bw_mbit, codec, loss, window, cal)
    w = min(window, rounds)
    q = 1 - (1 - loss) ** 4
    stalls = projection.expected_max_losses(-(-rounds // w), q, w)
    cal["rto"] = max(0.0, lossy["seconds"] - clean["seconds"]) / stalls if stalls else s.rto
    return cal


def _median_run(spec: Spec, codec: str, size: int, window: int, repeat: int) -> dict:
    """The run with the median time of `repeat` (under loss one run's time is one draw of a wide distribution)."""
    return median([run(spec, codec, size, window, cc=MODELLED) for _ in range(repeat)])


def validate(workers=(2, 3, 4, 6, 8), codecs=("int32", "fixed", "nc"), losses=(0.0, 0.05), size: int = 1 << 18,
             bw_mbit: float = 100.0, window: int = 64, backend: str = "c", calibration: dict | None = None,
             progress=None) -> list[dict]:
    """Rows of predicted vs measured seconds for every (codec, loss, workers), a lossy one the median of 3
    runs; each codec calibrated once (with 2 workers) unless calibration (codec -> calibrate()'s dict) is
    given."""
    rows = []
    for codec in codecs:
        cal = (calibration or {}).get(codec) or calibrate(codec, size, window, bw_mbit, max(losses), backend)
        for loss in losses:
            for n in workers:
                if progress:
                    progress(f"{codec} loss {loss} workers {n}")
                m = _median_run(Spec(n, backend, bw_mbit, loss=loss), codec, size, window, 3 if loss else 1)
                p = projection.ina(setting(n, size, bw_mbit, codec, loss, window, cal))
                rows.append({"codec": codec, "loss": loss, "workers": n, "measured_s": round(m["seconds"], 4),
                             "predicted_s": round(p["time_s"], 4), "error": round(p["time_s"] / m["seconds"] - 1, 3),
                             "bound": p["bound"], "retx measured": m["retransmissions"],
                             "retx predicted": round(p["retransmissions"])})
    return rows


def plot(rows: list[dict], path: str):
    from inabench.report import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 5))
    for (codec, loss) in dict.fromkeys((r["codec"], r["loss"]) for r in rows):
        sel = [r for r in rows if (r["codec"], r["loss"]) == (codec, loss)]
        ax.scatter([r["measured_s"] for r in sel], [r["predicted_s"] for r in sel], label=f"{codec}, loss {loss}")
    lo = min(min(r["measured_s"], r["predicted_s"]) for r in rows) * 0.8
    hi = max(max(r["measured_s"], r["predicted_s"]) for r in rows) * 1.2
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="predicted = measured")
    ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="grey", alpha=0.2, label="±15 %")
    ax.set(xscale="log", yscale="log", xlabel="measured allreduce time (s)", ylabel="predicted (s)",
           title="projection model vs the emulator on namespace links")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
