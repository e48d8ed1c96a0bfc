"""`switchsim topo run`: build a star (switchsim.netns.Star), start a switch of any backend on its switch
host, run one allreduce with a worker process in every worker host, check it, report, tear down."""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import numpy as np

from inabench.harness import ROOT, SwitchProcess
from inaproto import wire
from switchsim.netns import Star

WORKER = os.path.join(ROOT, "topologies", "worker.py")


def inputs(codec: str, n: int, size: int, seed: int) -> list[np.ndarray]:
    rs = np.random.default_rng(seed)
    if codec == "int32":
        return [rs.integers(-(2**20), 2**20, size).astype(np.int32) for _ in range(n)]
    return [rs.standard_normal(size).astype(np.float32) for _ in range(n)]


def switch_command(star: Star, backend: str, workers: int) -> list[str]:
    """`switchsim serve` on the switch host: on the bridge's address (python, c) or the links as ports (bmv2)."""
    argv = [sys.executable, "-m", "switchsim", "serve", "--backend", backend, "--workers", workers,
            "--host", star.switch_ip, "--port", wire.DEFAULT_PORT, "--control", star.worker_ips[0]]
    if backend == "bmv2":
        argv += ["--iface", ",".join(star.switch_ifs)]
    return star.command("switch", argv)


def run_star(workers: int = 4, backend: str = "python", bw: float | None = None, loss: float = 0.0,
             codec: str = "int32", size: int = 1 << 16, window: int = 32, timeout: float = 60.0,
             seed: int = 0) -> dict:
    """One allreduce over a star of `workers` hosts; the report `topo run --json` prints.

    Args:
        bw: every link's rate in Mbit/s (None: the veth's own speed); loss: per packet and direction.
        window, timeout: the workers' hostlib.connect arguments.

    Returns:
        The setup, "seconds" (the slowest worker's allreduce), "exact" (int32: equal to the int64 sum;
        other codecs: None and "rel_error"), "retransmissions", per-link bytes and the switch's drops.
    """
    star = Star(workers, loss, rate_mbit=bw, bridge=backend != "bmv2")
    sw = None
    try:
        sw = SwitchProcess(cmd=switch_command(star, backend, workers))
        with tempfile.TemporaryDirectory() as tmp:
            xs = inputs(codec, workers, size, seed)
            procs = []
            for r, x in enumerate(xs):
                np.save(os.path.join(tmp, f"in{r}.npy"), x)
                procs.append(star.popen(r, [sys.executable, WORKER, sw.address, r, workers, codec,
                                            os.path.join(tmp, f"in{r}.npy"), os.path.join(tmp, f"out{r}"),
                                            f"window={window}", f"timeout={json.dumps(timeout)}"],
                                        cwd=ROOT, stderr=open(os.path.join(tmp, f"err{r}"), "w")))
            _wait(procs, tmp, timeout * 2 + 30)
            outs = [np.load(os.path.join(tmp, f"out{r}.npy")) for r in range(workers)]
            stats = [json.load(open(os.path.join(tmp, f"out{r}.json"))) for r in range(workers)]
        report = _check(codec, xs, outs)
        counters = sw.stop_stats()
        sw = None
        return {"workers": workers, "backend": backend, "bw_mbit": bw, "loss": loss, "codec": codec, "size": size,
                "seconds": max(s["seconds"] for s in stats), **report,
                "retransmissions": sum(s["retransmissions"] for s in stats),
                "bytes_sent": sum(s["bytes_sent"] for s in stats), "links": star.link_bytes(),
                "switch_dropped": {k: v for k, v in counters.get("dropped", {}).items() if v}}
    finally:
        if sw is not None:
            sw.stop()
        star.close()


def _wait(procs, tmp: str, limit: float):
    """Every worker exits 0 within limit seconds, else RuntimeError with the first failure's stderr."""
    deadline = time.monotonic() + limit
    for r, p in enumerate(procs):
        try:
            rc = p.wait(max(0.1, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - TimeoutExpired: Star.close() ends it
            raise RuntimeError(f"worker {r} did not finish within {limit:g} s") from None
        if rc:
            with open(os.path.join(tmp, f"err{r}")) as f:
                raise RuntimeError(f"worker {r} failed (exit {rc}): {f.read()[-2000:]}")


def _check(codec: str, xs, outs) -> dict:
    exact = np.sum(np.array(xs, dtype=np.float64 if codec != "int32" else np.int64), axis=0)
    if codec == "int32":
        return {"exact": all(np.array_equal(o.astype(np.int64), exact) for o in outs)}
    err = max(float(np.linalg.norm(o.astype(np.float64) - exact)) for o in outs)
    return {"exact": None, "rel_error": err / (float(np.linalg.norm(exact)) or 1.0),
            "same_everywhere": all(np.array_equal(o, outs[0]) for o in outs)}
