"""One rank of `switchsim bench ddp`, in a process of its own (on loopback or in a namespace host):

    python -m inabench.ddp_rank SPEC.json

SPEC (written by inabench/ddp.py): rank, world, master (HOST:PORT of the rendezvous), path ("local": no
DDP, one process; "gloo"; "ina": init_process_group("ina"); "hook": gloo with the INA DDP comm hook), codec,
switch, window (INA slots per worker; null: hostlib's default), model, batch, warmup, iters, bucket_mb,
straggler ([rank, ms] or null), epochs and target (time to accuracy), out (where the JSON report goes). The report: every timed step's seconds, the parameters'
checksum (equal on every rank, or the run is wrong), bytes this rank's INA connection sent, and for a
time-to-accuracy run the test accuracy after each epoch with its time.
"""
from __future__ import annotations

import faulthandler
import gc
import hashlib
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

MODELS = ("mlp", "wide", "cnn")  # digits MLP (accuracy); 8.4 MB MLP and 4.3 MB CNN of gradients (speed)


def make_model(name: str) -> tuple[torch.nn.Module, tuple, int]:
    """(model, one example's shape, classes)."""
    nn = torch.nn
    if name == "mlp":
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)), (64,), 10
    if name == "wide":
        return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                             nn.Linear(1024, 10)), (1024,), 10
    if name == "cnn":
        return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                             nn.Linear(64 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10)), (3, 32, 32), 10
    raise ValueError(f"unknown model {name!r} (one of {', '.join(MODELS)})")


def _group(spec: dict):
    """The process group of spec's path (None for "local"), and the hook state to close at the end."""
    path, world = spec["path"], spec["world"]
    if path == "local":
        return None
    init = f"tcp://{spec['master']}"
    if path == "ina":
        os.environ["INA_SWITCH"] = spec["switch"]
        options = {"codec": spec["codec"], "strict": True}
        if spec.get("window"):
            options["window"] = spec["window"]
        dist.init_process_group("ina", init_method=init, rank=spec["rank"], world_size=world, pg_options=options)
    else:
        dist.init_process_group("gloo", init_method=init, rank=spec["rank"], world_size=world)
    return dist.group.WORLD


def _wrap(model, spec: dict):
    """model under DDP (with the INA hook for "hook"), or as it is ("local"); the hook's state or None."""
    if spec["path"] == "local":
        return model, None
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, bucket_cap_mb=spec["bucket_mb"])
    if spec["path"] != "hook":
        return ddp, None
    from hostlib.integrations.torch import INAHookState, ina_hook

    window = {"window": spec["window"]} if spec.get("window") else {}
    state = INAHookState(switch=spec["switch"], codec=spec["codec"], job=spec.get("job", 1), **window)
    ddp.register_comm_hook(state, ina_hook)
    return ddp, state


def _data(spec: dict, shape, classes: int):
    """Training (and test) tensors: digits for "mlp" (this rank's shard), synthetic otherwise."""
    if spec["model"] == "mlp":
        from .convergence import load_data

        xtr, ytr, xte, yte = (torch.from_numpy(a) for a in load_data())
        shard = slice(spec["rank"], None, spec["world"])
        return xtr[shard], ytr[shard], xte, yte
    g = torch.Generator().manual_seed(1000 + spec["rank"])
    n = spec["batch"] * 8
    return torch.randn(n, *shape, generator=g), torch.randint(0, classes, (n,), generator=g), None, None


def _checksum(model) -> str:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    return hashlib.sha256(flat.tobytes()).hexdigest()[:16]


def run(spec: dict) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, shape, classes = make_model(spec["model"])
    _group(spec)
    net, state = _wrap(model, spec)
    xtr, ytr, xte, yte = _data(spec, shape, classes)
    opt = torch.optim.SGD(net.parameters(), lr=spec.get("lr", 0.05), momentum=0.9)
    lag = spec["straggler"][1] / 1000 if spec["straggler"] and spec["straggler"][0] == spec["rank"] else 0.0
    g = torch.Generator().manual_seed(spec["rank"])
    batch, steps, curve, t_start = spec["batch"], [], [], None

    def step(idx):
        loss = torch.nn.functional.cross_entropy(net(xtr[idx]), ytr[idx])
        if lag:
            time.sleep(lag)  # a slow host: its backward (and its gradients' allreduce) starts late
        opt.zero_grad()
        loss.backward()
        opt.step()

    if spec.get("epochs"):  # time to accuracy: whole epochs, the test accuracy after each
        t_start = time.perf_counter()
        for _ in range(spec["epochs"]):
            perm = torch.randperm(len(ytr), generator=g)
            for i in range(0, len(ytr) - batch + 1, batch):
                step(perm[i:i + batch])
            with torch.no_grad():
                curve.append([time.perf_counter() - t_start, float((model(xte).argmax(1) == yte).float().mean())])
    else:
        for i in range(spec["warmup"] + spec["iters"]):
            idx = torch.randint(0, len(ytr), (batch,), generator=g)
            t0 = time.perf_counter()
            step(idx)
            if i >= spec["warmup"]:
                steps.append(time.perf_counter() - t0)
    report = {"rank": spec["rank"], "steps": steps, "curve": curve, "checksum": _checksum(model),
              "grad_bytes": 4 * sum(p.numel() for p in model.parameters()), "ina_bytes": None}
    if state is not None:
        report["ina_bytes"] = state.bytes_sent
        state.close()
    if spec["path"] == "ina":
        stats = dist.group.WORLD.ina_stats()
        report["ina_bytes"] = stats.get("comm", {}).get("wire_bytes_sent")
        report["paths"] = stats["paths"]
    if spec["path"] != "local":
        dist.barrier()
        # DDP's reducer holds the group: drop it first, so that the group's threads end here, in order, and
        # not in the interpreter's finalization (where gloo's threads can abort the process after the run)
        del net, step
        gc.collect()
        dist.destroy_process_group()
    return report


def main(argv) -> int:
    with open(argv[0]) as f:
        spec = json.load(f)
    report = run(spec)
    with open(spec["out"], "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    faulthandler.enable()  # an abort in torch's C++ (SIGABRT) leaves the Python stacks in the error tail
    np.seterr(all="ignore")
    sys.exit(main(sys.argv[1:]))
