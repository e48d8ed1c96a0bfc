"""Fault injection for the torch "ina" backend's agreement (issue 37): the switch SIGKILLed at random
instants of a 4-rank DDP run, restarted on its port at once, again and again; every rank must end with the
parameters of the same training on gloo alone (an integer model: every gradient is an integer, exact through
the switch and through gloo), and no step may be lost or done twice.

    python benchmarks/torch_switch_faults.py --kills 200 --workers 4 [--backend c] [--json]

Kills land between calls, in a call and between a call's last result packets, by chance: the delay before
each is uniform in [0, --gap-ms]. The ranks re-join every --retry-every calls (INA_RETRY_EVERY). Reported:
kills, the faults and recoveries the ranks saw, results handed over by a recovery (a rank that missed the
last result of a call gets it from one that has it), sums from landed blocks (the switch died mid-call with
some blocks' sums already in the ranks' tensors: each comes from its lowest holder, the rest is summed on
gloo from the inputs), ranks whose parameters diverge from each other or from
gloo's (must be 0), lost steps (must be 0), and the stall per fault (the run's seconds minus the gloo run's,
per kill).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from inabench.harness import SwitchProcess, free_port, run_ranks  # noqa: E402


def _rank(rank, world, port, address, retry_every, started, stop, out):
    """DDP steps on the integer model until the parent sets `stop` (all ranks stop at the same step: a MAX
    over gloo each step), then the same steps on gloo alone from the same start."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      INA_SWITCH=address, INA_RETRY_EVERY=str(retry_every))
    import warnings

    import torch
    import torch.distributed as dist

    import hostlib  # noqa: F401

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("ina")
    gloo = dist.new_group(backend="gloo")

    def integer_model():
        """Two bias-free layers side by side, integer weights: each gradient is t^T x, an integer that does
        not depend on the weights, so thousands of steps stay exact in float32 (a deep model's grow)."""
        g = torch.Generator().manual_seed(0)
        model = torch.nn.ModuleList([torch.nn.Linear(8, 4, bias=False), torch.nn.Linear(8, 4, bias=False)])
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randint(-2, 3, p.shape, generator=g).float())
        return model

    class Side(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = integer_model()

        def forward(self, x):
            return [layer(x) for layer in self.layers]

    def batch_loss(ddp, g):
        x = torch.randint(-3, 4, (5, 8), generator=g).float()
        t = torch.randint(-1, 2, (5, 4), generator=g).float()
        return sum((y * t).sum() for y in ddp(x))

    def train(group, steps=None):
        model = Side()
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.0001)
        opt = torch.optim.SGD(ddp.parameters(), lr=1.0)
        n, start = 0, time.perf_counter()
        while True:
            if steps is None:
                flag = torch.tensor([1.0 if stop.is_set() else 0.0])
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=gloo)
                if flag.item():
                    break
            elif n == steps:
                break
            g = torch.Generator().manual_seed(1000 * n + rank)
            opt.zero_grad()
            batch_loss(ddp, g).backward()
            opt.step()
            n += 1
            if rank == 0 and steps is None:
                started.set()
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        return n, params, time.perf_counter() - start

    steps, ina, seconds = train(None)
    stats = dist.group.WORLD.ina_stats()
    _, reference, gloo_seconds = train(gloo, steps)
    everyone = [torch.empty_like(ina) for _ in range(world)]
    dist.all_gather(everyone, ina, group=gloo)
    out.put((rank, {"steps": steps, "equal_gloo": bool(torch.equal(ina, reference)),
                    "equal_ranks": all(torch.equal(ina, p) for p in everyone), "seconds": seconds,
                    "gloo_seconds": gloo_seconds, "faults": stats["faults"], "recoveries": stats["recoveries"],
                    "recovered_results": stats["recovered_results"], "landed_sums": stats["landed_sums"],
                    "switch_calls": stats["switch_calls"],
                    "gloo_calls": stats["gloo_calls"], "rejoins": stats["rejoins"]}))
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=200)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--backend", default="c", choices=["python", "c"])
    ap.add_argument("--gap-ms", type=float, default=600.0, help="the delay before each kill: uniform in [0, GAP]")
    ap.add_argument("--retry-every", type=int, default=4)
    ap.add_argument("--loss", type=float, default=0.0, help="the switch's loss rate (serve --loss): a rank that "
                    "waits for a lost result when the switch dies is one the others must hand the result to")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import multiprocessing as mp
    import threading

    rnd = random.Random(args.seed)
    port = str(free_port())
    serve = ["--workers", args.workers, "--port", port, "--loss", args.loss]
    sw = SwitchProcess(*serve, backend=args.backend)
    started, stop = mp.get_context("spawn").Event(), mp.get_context("spawn").Event()
    kills = [0]

    def killer():
        nonlocal sw
        if not started.wait(300):  # the ranks start, join and train
            return
        while kills[0] < args.kills:
            time.sleep(rnd.uniform(0, args.gap_ms / 1000))
            os.kill(sw.proc.pid, signal.SIGKILL)
            sw.proc.wait()
            kills[0] += 1
            sw = SwitchProcess(*serve, backend=args.backend)
        time.sleep(1.0)
        stop.set()

    thread = threading.Thread(target=killer, daemon=True)
    start = time.perf_counter()
    thread.start()
    try:
        reports = dict(run_ranks(_rank, args.workers, (sw.address, args.retry_every, started, stop),
                                 expect=args.workers, timeout=3600))
    finally:
        stop.set()
        thread.join(30)
        sw.stop()
    ranks = [reports[r] for r in range(args.workers)]
    steps = {r["steps"] for r in ranks}
    row = {"kills": kills[0], "workers": args.workers, "backend": args.backend, "loss": args.loss,
           "steps": max(steps),
           "faults": max(r["faults"] for r in ranks), "recoveries": max(r["recoveries"] for r in ranks),
           "recovered_results": sum(r["recovered_results"] for r in ranks),
           "landed_sums": max(r["landed_sums"] for r in ranks),
           "switch_calls": ranks[0]["switch_calls"], "gloo_calls": ranks[0]["gloo_calls"],
           "rejoins": ranks[0]["rejoins"],
           "divergent": sum(not (r["equal_gloo"] and r["equal_ranks"]) for r in ranks),
           "lost_steps": max(steps) - min(steps),
           "stall_per_fault_s": (max(r["seconds"] for r in ranks) - max(r["gloo_seconds"] for r in ranks))
           / max(1, kills[0]), "wall_s": time.perf_counter() - start}
    if args.json:
        print(json.dumps(row))
    else:
        print("| kills | workers | loss | steps | faults | recoveries | results handed over | sums from landed blocks "
              "| divergent | lost steps | stall per fault |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        print(f"| {row['kills']} | {row['workers']} | {row['loss']:g} | {row['steps']} | {row['faults']} | "
              f"{row['recoveries']} | "
              f"{row['recovered_results']} | {row['landed_sums']} | {row['divergent']} | {row['lost_steps']} | "
              f"{row['stall_per_fault_s']:.2f} s |")
    return 0 if row["divergent"] == 0 and row["lost_steps"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
