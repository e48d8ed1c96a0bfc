"""`switchsim bench sparse`: DeepReduce codec combinations on a real gradient (an MLP on scikit-learn's
digits) and on a synthetic top-1 % of d = 25.5 M: bytes against dense float32 and against plain
(int32 index, float32 value) pairs, encode and decode time on one core, and the error ||x - x^|| / ||x||
against the sparse tensor that went in."""
from __future__ import annotations

import time

import numpy as np

COMBOS = [(i, "none") for i in ("delta", "golomb", "rle", "huffman", "bloom-naive", "bloom-p0", "bloom-p1",
                                  "bloom-p2")] + \
         [("delta", v) for v in ("deflate", "nc", "qsgd", "polyfit", "dexp")] + \
         [("bloom-p0", "qsgd"), ("bloom-p2", "polyfit"), ("golomb", "qsgd")]


def real_gradient() -> np.ndarray:
    """The flattened gradient of a 64-1024-1024-10 MLP on a batch of 256 digits (about 1.1 M entries)."""
    import torch

    from .convergence import load_data

    x, y, _, _ = load_data()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x[:256])), torch.from_numpy(y[:256]))
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()


def synthetic(d: int = 25_500_000) -> np.ndarray:
    return np.random.default_rng(0).standard_normal(d, dtype=np.float32)


def bench_tensor(name: str, x: np.ndarray, ratio: float = 0.01, combos=COMBOS) -> list[dict]:
    from hostlib import sparse

    idx, val = sparse.Sparsifier("topk", ratio, error_feedback=False)(x)
    truth = np.zeros(x.size, np.float32)
    truth[idx] = val
    norm = float(np.linalg.norm(val)) or 1.0
    rows = []
    for index, value in combos:
        dr = sparse.DeepReduce(index=index, value=value)
        t0 = time.perf_counter()
        blob = dr.encode(idx, val, x.size)
        t1 = time.perf_counter()
        i2, v2, _ = sparse.DeepReduce.decode(blob)
        t2 = time.perf_counter()
        rec = np.zeros(x.size, np.float32)
        rec[i2] = v2
        rows.append({"tensor": name, "d": x.size, "nnz": idx.size, "index": index, "value": value,
                     "x float32": len(blob) / (4 * x.size), "x pairs": len(blob) / (8 * idx.size),
                     "encode s": t1 - t0, "decode s": t2 - t1,
                     "rel error": float(np.linalg.norm(rec - truth)) / norm})
    return rows


def bench_sparse(d: int = 25_500_000) -> list[dict]:
    rows = []
    try:
        rows += bench_tensor("digits MLP gradient", real_gradient())
    except ImportError as e:  # torch/scikit-learn are in the bench extra
        print(f"bench sparse: no real gradient ({e}); pip install -e '.[bench]'")
    return rows + bench_tensor(f"synthetic N(0,1) d={d:,}", synthetic(d))


# ---------------------------------------------------------------- SparCML vs dense gloo
def _sparcml_worker(rank, world, port, size, densities, repeat, queue):
    import torch
    import torch.distributed as dist

    from hostlib.sparse import sparcml

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rows = []
    for density in densities:
        rs = np.random.default_rng(rank)
        idx = np.sort(rs.choice(size, max(1, int(density * size)), replace=False))
        val = rs.standard_normal(idx.size).astype(np.float32)
        dense = torch.zeros(size)
        dense[torch.from_numpy(idx)] = torch.from_numpy(val)

        def timed(fn):
            best = float("inf")
            for _ in range(repeat):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
            return best

        base = timed(lambda: dist.all_reduce(dense.clone()))
        rows.append({"ranks": world, "density": density, "algorithm": "gloo dense allreduce", "seconds": base,
                     "x gloo": 1.0, "bytes sent/rank": None})
        for algorithm in sparcml.ALGORITHMS:
            stats = {}
            secs = timed(lambda: sparcml.allreduce(idx, val, size, algorithm=algorithm, stats=stats))
            rows.append({"ranks": world, "density": density, "algorithm": algorithm, "seconds": secs,
                         "x gloo": secs / base, "bytes sent/rank": stats["bytes_sent"] // repeat})
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def bench_sparcml(ranks=(2, 4), densities=(0.001, 0.01, 0.1), size: int = 1 << 22, repeat: int = 3) -> list[dict]:
    """SparCML's algorithms against gloo's dense allreduce of the same vectors, by density and rank count."""
    from .harness import run_ranks

    rows = []
    for world in ranks:  # rank 0 reports the rows
        rows += run_ranks(_sparcml_worker, world, (size, densities, repeat), expect=1)[0]
    return rows
