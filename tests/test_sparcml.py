"""SparCML sparse allreduce over torch.distributed (gloo) equals a dense allreduce exactly on integers."""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[torch]')")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from hostlib.sparse import sparcml  # noqa: E402

SIZE = 5000
DENSITIES = (0.001, 0.02, 0.3)  # sparse result, mixed, densified on the way


def rank_input(rank, density, seed):
    rs = np.random.default_rng(seed * 100 + rank)
    idx = np.sort(rs.choice(SIZE, max(1, int(density * SIZE)), replace=False))
    return idx, rs.integers(-1000, 1000, idx.size).astype(np.float32)


def _run(rank, world, store, out):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    results = {}
    for algorithm in sparcml.ALGORITHMS:
        for density in DENSITIES:
            idx, val = rank_input(rank, density, 1)
            got = sparcml.allreduce(idx, val, SIZE, algorithm=algorithm).to_dense()
            dense = torch.zeros(SIZE)
            dense[torch.from_numpy(idx)] = torch.from_numpy(val)
            dist.all_reduce(dense)
            results[(algorithm, density)] = bool(np.array_equal(got, dense.numpy()))
    idx, val = rank_input(rank, 0.3, 2)
    stats = {}
    q = sparcml.allreduce(idx, val, SIZE, algorithm="dsar_split_allgather", qsgd_levels=255, stats=stats).to_dense()
    dense = torch.zeros(SIZE)
    dense[torch.from_numpy(idx)] = torch.from_numpy(val)
    dist.all_reduce(dense)
    results["qsgd_rel_error"] = float(np.linalg.norm(q - dense.numpy()) / np.linalg.norm(dense.numpy()))
    results["qsgd_bytes"] = stats["bytes_sent"]
    torch.save(results, os.path.join(out, f"{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_sparse_allreduce_equals_dense_allreduce_on_integers(tmp_path, world):
    mp.start_processes(_run, args=(world, str(tmp_path / "store"), str(tmp_path)), nprocs=world, join=True,
                       start_method="spawn")
    for rank in range(world):
        res = torch.load(tmp_path / f"{rank}.pt")
        for key, ok in res.items():
            if isinstance(key, tuple):
                assert ok, (world, rank, key)
        assert res["qsgd_rel_error"] < 0.05  # the dense stage quantized to 255 levels per 512-value bucket
