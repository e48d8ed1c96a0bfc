"""`switchsim bench ddp`: DDP training steps as PyTorch's DDP benchmark (benchmarks/distributed/ddp) reports
them: sec/iter and examples/s at p50, p75, p90 and p95 over the timed iterations, per world size (1: the
model alone, no DDP) and per gradient path: gloo's ring, the "ina" process group with each codec
(init_process_group("ina")), and the INA DDP comm hook on gloo. One step's time is the slowest rank's
(DDP's allreduce holds every rank to it). Every run checks that the ranks' parameters are bit-identical.

Ranks are processes of their own (inabench/ddp_rank.py), placed by a Placement: on loopback here
(`Loopback`), or on namespace hosts behind emulated links (topologies/ddp.py, `--topo`). Time to
accuracy (`--tta`) trains the digits MLP for whole epochs and reports when each path first reaches the
target test accuracy.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from .harness import ROOT, SwitchProcess, free_port

PATHS = ("gloo", "ina:fixed", "ina:nc", "hook:fixed", "hook:nc")
PERCENTILES = (50, 75, 90, 95)


class Loopback:
    """Ranks as processes on this host, the INA switch a switch process on loopback: one job's (`--workers`),
    or shared (jobs admitted as they join, `bench ddp --jobs`)."""

    def __init__(self, backend: str = "c", shared: bool = False):
        self.backend, self.shared, self._switch = backend, shared, None

    def master(self) -> str:
        return f"127.0.0.1:{free_port()}"

    def switch(self, world: int) -> str:
        """A fresh switch for a job of `world` ranks (a shared one: for any jobs); the previous one stops."""
        self.stop_switch()
        self._switch = SwitchProcess(*(() if self.shared else ("--workers", world)), backend=self.backend)
        return self._switch.address

    def stop_switch(self):
        if self._switch is not None:
            self._switch.stop()
            self._switch = None

    def popen(self, rank: int, argv: list, **kw) -> subprocess.Popen:
        return subprocess.Popen(argv, cwd=ROOT, **kw)

    def link_bytes(self) -> list | None:
        return None  # loopback has no links to count

    def close(self):
        self.stop_switch()


def run_config(place, path: str, world: int, model: str, batch: int, warmup: int, iters: int,
               straggler=None, bucket_mb: float = 2.0, epochs: int = 0, timeout: float = 600,
               window: int | None = None, jobs: int = 1) -> list[dict]:
    """One run of a path ("gloo", "ina:CODEC", "hook:CODEC", "local") with `world` ranks; each rank's report
    (its "job" in it). jobs > 1: that many independent jobs of `world` ranks at once (job ids 1..jobs, each
    with its own rendezvous), on one shared switch."""
    kind, _, codec = path.partition(":")
    switch = place.switch(world) if kind in ("ina", "hook") else None
    before = place.link_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for job in range(1, jobs + 1):
            env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                   "INA_JOB": str(job)}
            master = place.master()
            for rank in range(world):
                spec = {"rank": rank, "world": world, "master": master, "path": kind, "codec": codec or "fixed",
                        "switch": switch, "model": model, "batch": batch, "warmup": warmup, "iters": iters,
                        "bucket_mb": bucket_mb, "straggler": straggler, "epochs": epochs, "window": window,
                        "job": job, "out": os.path.join(tmp, f"out{job}.{rank}.json")}
                with open(os.path.join(tmp, f"spec{job}.{rank}.json"), "w") as f:
                    json.dump(spec, f)
                with open(os.path.join(tmp, f"err{len(procs)}"), "w") as err:  # the child keeps its own descriptor
                    procs.append(place.popen(rank, [sys.executable, "-m", "inabench.ddp_rank", f.name], env=env,
                                             stdout=subprocess.DEVNULL, stderr=err))
        _wait(procs, tmp, timeout)
        reports = [{**json.load(open(os.path.join(tmp, f"out{j}.{r}.json"))), "job": j}
                   for j in range(1, jobs + 1) for r in range(world)]
    if before is not None:  # per worker link: bytes sent + received during the run (set-up included)
        after = place.link_bytes()
        reports[0]["link_bytes"] = [a["tx_bytes"] + a["rx_bytes"] - b["tx_bytes"] - b["rx_bytes"]
                                    for a, b in zip(after, before)]
    return reports


def _wait(procs, tmp: str, timeout: float):
    """Every rank exits 0 within timeout, or all are killed and RuntimeError names the first that failed."""
    deadline = time.monotonic() + timeout
    try:
        for rank, p in enumerate(procs):
            rc = p.wait(max(1.0, deadline - time.monotonic()))
            if rc != 0:
                tail = open(os.path.join(tmp, f"err{rank}")).read()[-1500:]
                raise RuntimeError(f"ddp rank {rank} exited {rc}: {tail}")
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"ddp ranks did not finish within {timeout:g} s") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def step_times(reports: list[dict]) -> np.ndarray:
    """Per timed step, the slowest rank's seconds (the step ends when every rank's allreduce has)."""
    return np.max(np.array([r["steps"] for r in reports]), axis=0)


def row_of(path: str, world: int, model: str, batch: int, repeats: list[list[dict]], steps: int) -> dict:
    """One row from the repeats of one configuration (steps: per run, warm-up included): each percentile
    the median over repeats."""
    per_repeat = [np.percentile(step_times(reps), PERCENTILES) for reps in repeats]
    pct = np.median(np.array(per_repeat), axis=0)
    p50s = [p[0] for p in per_repeat]
    reps = repeats[-1]
    jobs = sorted({r.get("job", 1) for r in reps})
    row = {"model": model, "workers": world, "path": path, **({"jobs": len(jobs)} if len(jobs) > 1 else {})}
    # significant digits, not decimals: a sub-millisecond step rounded to 10 us would be off by over 1 %
    row.update({f"sec/iter p{q}": float(f"{v:.5g}") for q, v in zip(PERCENTILES, pct)})
    row["p50 spread"] = f"{min(p50s):.4f}..{max(p50s):.4f}"
    row["examples/s p50"] = round(batch * world / float(pct[0]), 1)
    row["params equal"] = all(len({r["checksum"] for r in reps if r.get("job", 1) == j}) == 1 for j in jobs)
    row["grad MB"] = round(reps[0]["grad_bytes"] / 1e6, 2)
    ina = [r["ina_bytes"] for r in reps if r.get("ina_bytes") is not None]
    row["INA MB/rank/step"] = round(max(ina) / steps / 1e6, 3) if ina else None  # wire bytes, headers too
    if reps[0].get("link_bytes"):  # emulated links: the busiest worker link, both directions
        row["link MB/step"] = round(max(reps[0]["link_bytes"]) / steps / 1e6, 3)
    return row


def bench_ddp(workers=(2, 4), paths=PATHS, model: str = "wide", batch: int = 32, iters: int = 20, warmup: int = 5,
              repeat: int = 3, straggler=None, bucket_mb: float = 2.0, backend: str = "c", place_for=None,
              progress=None, window: int | None = None, jobs: int = 1) -> list[dict]:
    """Rows: the model alone (1 rank, no DDP), then per world size every path, each with its time as a
    multiple of gloo's ("x gloo"). The configurations run in turn, `repeat` times (alternating, so a slow
    spell of the machine touches every one). place_for(world): where the ranks of a world size run (default
    Loopback(backend)); it is closed after each round of that size. jobs > 1: every path also as that many
    jobs at once on one shared switch (loopback), its row's "x solo" its p50 over the same path alone on
    that switch (a step's time there is the slowest job's)."""
    place_for = place_for or (lambda world: Loopback(backend, shared=jobs > 1))
    counts = (1, jobs) if jobs > 1 else (1,)
    groups = [(1, [("local", 1)])] + [(w, [(p, n) for p in paths for n in counts]) for w in workers]
    got: dict = {(p, w, n): [] for w, ps in groups for p, n in ps}
    for i in range(repeat):
        for world, group in groups:
            place = place_for(world) if world > 1 else Loopback(backend)
            try:
                for path, n in group:
                    if progress:
                        progress(f"repeat {i + 1}/{repeat}: {path} x{world}" + (f", {n} jobs" if n > 1 else ""))
                    try:
                        got[path, world, n].append(run_config(place, path, world, model, batch, warmup, iters,
                                                              straggler if world > 1 else None, bucket_mb,
                                                              window=window, jobs=n))
                    except RuntimeError as e:  # this configuration's row says why; the others still run
                        got[path, world, n].append(" ".join(str(e).split())[-300:])
            finally:
                place.close()
    rows = [row_of(p, w, model, batch, got[p, w, n], warmup + iters) if not any(isinstance(g, str) for g in got[p, w, n])
            else {"model": model, "workers": w, "path": p, **({"jobs": n} if n > 1 else {}),
                  "error": next(g for g in got[p, w, n] if isinstance(g, str))}
            for w, ps in groups for p, n in ps]
    for r in rows:
        r["x gloo"] = _ratio(r, rows, path="gloo")
        if r.get("jobs"):
            r["x solo"] = _ratio(r, rows, path=r["path"])
    return rows


def _ratio(row: dict, rows: list[dict], path: str) -> float | None:
    """row's p50 over that of `path`'s row of the same world size (and jobs: the solo row when path is the
    row's own), None where either failed."""
    jobs = row.get("jobs") if path != row["path"] else None
    base = next((b for b in rows if b["path"] == path and b["workers"] == row["workers"] and b.get("jobs") == jobs
                 and "error" not in b), None)
    return round(row["sec/iter p50"] / base["sec/iter p50"], 3) if base and "error" not in row else None


def time_to_accuracy(curve: list, target: float) -> tuple:
    """(epochs, seconds) when the test accuracy first reaches target, or (None, None)."""
    for epoch, (seconds, acc) in enumerate(curve, start=1):
        if acc >= target:
            return epoch, seconds
    return None, None


def bench_tta(workers: int = 4, paths=("gloo", "ina:fixed", "ina:nc", "hook:nc"), epochs: int = 30,
              target: float = 0.95, batch: int = 32, backend: str = "c", place=None, progress=None,
              window: int | None = None) -> dict:
    """Time to accuracy on digits (the MLP): per path, the epochs and seconds to `target` test accuracy
    (rank 0's model; every rank's parameters are checked equal), the final accuracy, and the curve."""
    place = place or Loopback(backend)
    rows, curves = [], {}
    try:
        for path in paths:
            if progress:
                progress(f"time to accuracy: {path} x{workers}")
            reps = run_config(place, path, workers, "mlp", batch, 0, 0, epochs=epochs, window=window)
            curve = reps[0]["curve"]
            ep, sec = time_to_accuracy(curve, target)
            rows.append({"path": path, "workers": workers, "target": target, "epochs to target": ep,
                         "seconds to target": None if sec is None else round(sec, 2),
                         "final accuracy": round(curve[-1][1], 4),
                         "params equal": len({r["checksum"] for r in reps}) == 1})
            curves[path] = curve
    finally:
        place.close()
    base = next((r for r in rows if r["path"] == "gloo"), None)
    for r in rows:
        ok = base and base["epochs to target"] and r["epochs to target"]
        r["epochs x gloo"] = round(r["epochs to target"] / base["epochs to target"], 3) if ok else None
    return {"rows": rows, "curves": curves}


def diff(a: dict, b: dict) -> list[dict]:
    """Two `bench ddp --json` outputs joined on (model, workers, path): p50 and p95 of each and b / a."""
    key = ("model", "workers", "path")
    before = {tuple(r[k] for k in key): r for r in a.get("ddp", [])}
    rows = []
    for r in b.get("ddp", []):
        old = before.get(tuple(r[k] for k in key))
        if old is None:
            continue
        rows.append({**{k: r[k] for k in key}, "p50 a": old["sec/iter p50"], "p50 b": r["sec/iter p50"],
                     "p50 b/a": round(r["sec/iter p50"] / old["sec/iter p50"], 3),
                     "p95 a": old["sec/iter p95"], "p95 b": r["sec/iter p95"],
                     "p95 b/a": round(r["sec/iter p95"] / old["sec/iter p95"], 3)})
    return rows


def plot_tta(result: dict, path: str):
    """Test accuracy against seconds, one line per path, the target dashed."""
    from .report import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, curve in result["curves"].items():
        ax.plot([c[0] for c in curve], [c[1] for c in curve], marker=".", label=name)
    target = result["rows"][0]["target"] if result["rows"] else None
    if target:
        ax.axhline(target, ls="--", color="#888", lw=0.8)
    ax.set(xlabel="seconds", ylabel="test accuracy", title="digits MLP under DDP: accuracy vs time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_steps(rows: list[dict], path: str):
    """sec/iter p50 (p95 as the bar's top) per path and world size."""
    from .report import pyplot

    plt = pyplot()
    rows = [r for r in rows if "error" not in r]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [f"{r['path']} x{r['workers']}" for r in rows]
    p50 = [r["sec/iter p50"] for r in rows]
    p95 = [r["sec/iter p95"] for r in rows]
    ax.bar(labels, p50, yerr=[np.zeros(len(p50)), np.subtract(p95, p50)], capsize=3)
    ax.set(ylabel="sec/iter (p50, bar to p95)", title=f"DDP step time, {rows[0]['model'] if rows else ''}")
    ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
