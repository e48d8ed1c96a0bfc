"""`switchsim bench train`: data-parallel training of a small MLP on scikit-learn's digits (a real dataset
inside the wheel, no download) with N workers under DDP, once per gradient path: gloo's allreduce (DDP's
default hook) and the INA hook with each codec. Reports test accuracy, bytes each worker sent, and the NC
exponent histogram of the real gradients (the NC paper's Fig. 7)."""
from __future__ import annotations

import gc
import time

import numpy as np

MODES = ("gloo", "fixed", "nc", "topk:delta:none", "topk:golomb:qsgd", "blocktopk:fixed:0.25", "blocktopk:nc:0.1")


def load_data(seed: int = 0):
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = x[order], y[order]
    cut = int(0.8 * len(y))
    mean, std = x[:cut].mean(0), x[:cut].std(0) + 1e-3
    return (x[:cut] - mean) / std, y[:cut], (x[cut:] - mean) / std, y[cut:]


def _worker(rank, world, port, switch, modes, epochs, lr, batch, queue):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hostlib.integrations.torch import INAHookState, ina_hook

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    xtr, ytr, xte, yte = (torch.from_numpy(a) for a in load_data())
    shard = slice(rank, None, world)
    xtr, ytr = xtr[shard], ytr[shard]
    for job, mode in enumerate(modes, start=1):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
        ddp = DDP(model)
        state = None
        if mode.startswith("topk"):  # topk:<index>:<value>: top-1 % with DeepReduce codecs, by allgather
            _, index, value = (mode.split(":") + ["delta", "none"])[:3]
            codec, kw = "topk", {"ratio": 0.01, "index": index, "value": value}
        elif mode.startswith("blocktopk"):  # blocktopk:<codec>:<ratio>: top blocks by block-sparse INA
            _, codec, ratio = (mode.split(":") + ["fixed", "0.25"])[:3]
            kw = {"block_topk": float(ratio)}
        elif mode != "gloo":
            codec, _, rounding = mode.partition("-")
            kw = {"rounding": rounding} if rounding else {}
        if mode != "gloo":
            state = INAHookState(switch=switch, codec=codec, job=job, **kw)
            ddp.register_comm_hook(state, ina_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
        g = torch.Generator().manual_seed(rank)
        curve, exponents, steps = [], np.zeros(256, np.int64), 0
        t0 = time.perf_counter()
        for _ in range(epochs):
            perm = torch.randperm(len(ytr), generator=g)
            for i in range(0, len(ytr) - batch + 1, batch):
                idx = perm[i:i + batch]
                loss = torch.nn.functional.cross_entropy(ddp(xtr[idx]), ytr[idx])
                opt.zero_grad()
                loss.backward()
                if rank == 0 and mode == "gloo":
                    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()
                    nz = grads[grads != 0]
                    e = np.frexp(np.abs(nz))[1] - 1  # 2^e <= |g| < 2^(e+1)
                    exponents += np.bincount(e + 128, minlength=256)
                opt.step()
                steps += 1
            with torch.no_grad():
                curve.append(float((model(xte).argmax(1) == yte).float().mean()))
        seconds = time.perf_counter() - t0
        params = sum(p.numel() for p in model.parameters())
        if state is not None:
            sent = state.bytes_sent
            state.close()
        else:  # gloo's ring allreduce: 2 (n-1)/n of the float32 gradient per step, plus headers (not counted)
            sent = int(steps * 2 * (world - 1) / world * 4 * params)
        queue.put({"rank": rank, "mode": mode, "accuracy": curve[-1], "curve": curve, "bytes_sent": sent,
                   "float32_bytes": steps * 4 * params, "seconds": seconds,
                   "exponents": exponents.tolist() if rank == 0 and mode == "gloo" else None})
        dist.barrier()
    del ddp  # its reducer holds the group: the group's threads end at destroy, not in finalization
    gc.collect()
    dist.destroy_process_group()


def run(workers: int = 4, modes=MODES, epochs: int = 30, lr: float = 0.05, batch: int = 32,
        backend: str = "c") -> dict:
    """Train once per mode; returns {"rows": [...], "exponents": histogram (index e + 128)}."""
    from .harness import SwitchProcess, run_ranks

    sw = SwitchProcess(*[a for j in range(1, len(modes) + 1) for a in ("--job", f"{j}:{workers}")], backend=backend)
    try:
        reports = run_ranks(_worker, workers, (sw.address, list(modes), epochs, lr, batch),
                            expect=workers * len(modes), timeout=60 * len(modes) * max(1, epochs // 10))
    finally:
        sw.stop()
    rows, hist = [], None
    for mode in modes:
        rs = [r for r in reports if r["mode"] == mode]
        r0 = next(r for r in rs if r["rank"] == 0)
        rows.append({"mode": mode, "workers": workers, "epochs": epochs, "accuracy": r0["accuracy"],
                     "bytes/worker": max(r["bytes_sent"] for r in rs),
                     "x float32": max(r["bytes_sent"] for r in rs) / r0["float32_bytes"],
                     "seconds": max(r["seconds"] for r in rs), "curve": r0["curve"]})
        hist = hist or r0["exponents"]
    base = rows[0]["accuracy"] if modes[0] == "gloo" else None
    for r in rows:
        r["points vs gloo"] = None if base is None else round(100 * (r["accuracy"] - base), 2)
    return {"rows": rows, "exponents": hist}


def plot(result: dict, path: str):
    from .report import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    for r in result["rows"]:
        axes[0].plot(range(1, len(r["curve"]) + 1), r["curve"], label=r["mode"])
        axes[1].scatter(r["bytes/worker"], r["accuracy"], label=r["mode"])
        axes[1].annotate(r["mode"], (r["bytes/worker"], r["accuracy"]))
    axes[0].set(xlabel="epoch", ylabel="test accuracy", title="digits MLP, data parallel")
    axes[0].legend()
    axes[1].set(xscale="log", xlabel="bytes sent per worker", ylabel="final test accuracy", title="accuracy vs bytes")
    hist = np.array(result["exponents"] or [0] * 256)
    e = np.nonzero(hist)[0]
    if e.size:
        lo, hi = e.min(), e.max() + 1
        axes[2].bar(np.arange(lo, hi) - 128, hist[lo:hi] / hist.sum())
    axes[2].set(xlabel="exponent e (2^e <= |g| < 2^(e+1))", ylabel="fraction of gradient entries",
                title="NC exponents of real gradients")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main_rows(result: dict) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "curve"} for r in result["rows"]]

