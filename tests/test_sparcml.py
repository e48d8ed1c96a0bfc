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


# --- Issue 18: SparCML against the paper (QSGD stage, index width, allgather latency, bucket top-k) ---

QSGD_SIZE, QSGD_LEVELS, QSGD_CALLS = 2048, 2, 300
BIG = 2**31 + 2**20  # indices past int32
WIDTH_SIZES = {200: 1, 256: 1, 257: 2, 5000: 2, 65536: 2, 65537: 3, 2**24 + 1: 4, BIG: 4, 2**40: 5}


def qsgd_input(rank):
    rs = np.random.default_rng(7 + rank)
    idx = np.sort(rs.choice(QSGD_SIZE, QSGD_SIZE // 2, replace=False))
    return idx, rs.integers(-100, 100, idx.size).astype(np.float32)


def big_input(rank, world):
    """A few indices near the top of a 2^31 + 2^20 vector (one shared by all ranks): the result stays sparse."""
    idx = np.array([rank, 2**31 + 10 + rank, 2**31 + 1000, BIG - 1 - rank], np.int64)
    return idx, np.arange(1, 5, dtype=np.float32) * (rank + 1)


def _qsgd_runs(rank, world):
    def call(seed):
        return sparcml.allreduce(*qsgd_input(rank), QSGD_SIZE, algorithm="dsar_split_allgather",
                                 qsgd_levels=QSGD_LEVELS, seed=seed).to_dense().copy()

    outs = np.stack([call(seed) for seed in range(QSGD_CALLS)])
    return {"qsgd": outs, "qsgd_seed0_again": call(0), "qsgd_fresh": np.stack([call(None), call(None)])}


def _split_runs(rank, world):
    res = {}
    for algorithm in ("ssar_split_allgather", "dsar_split_allgather"):
        idx, val = rank_input(rank, 0.02, 3)
        stats = {}
        got = sparcml.allreduce(idx, val, SIZE, algorithm=algorithm, stats=stats).to_dense()
        dense = torch.zeros(SIZE)
        dense[torch.from_numpy(idx)] = torch.from_numpy(val)
        dist.all_reduce(dense)
        res[("messages", algorithm)] = stats["messages"]
        res[("exact", algorithm)] = bool(np.array_equal(got, dense.numpy()))
    return res


def _wide_runs(rank, world):
    res = {}
    for algorithm in ("ssar_recursive_double", "ssar_split_allgather"):
        out = sparcml.allreduce(*big_input(rank, world), BIG, algorithm=algorithm)
        res[("big", algorithm)] = (out.dense is None, out.indices, out.values)
    if world == 2:  # one send per rank: the bytes are exactly its own pairs
        for size in WIDTH_SIZES:
            stats = {}
            idx = np.array([0, size // 3 + rank, size - 1 - rank], np.int64)
            sparcml.allreduce(idx, np.ones(3, np.float32), size, algorithm="ssar_recursive_double", stats=stats)
            res[("bytes", size)] = stats["bytes_sent"]
    return res


def _run_paper_checks(rank, world, store, out):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    results = {**_qsgd_runs(rank, world), **_split_runs(rank, world), **_wide_runs(rank, world)}
    torch.save(results, os.path.join(out, f"{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 3, 4])
def paper_runs(request, tmp_path_factory):
    world, tmp = request.param, tmp_path_factory.mktemp(f"sparcml{request.param}")
    mp.start_processes(_run_paper_checks, args=(world, str(tmp / "store"), str(tmp)), nprocs=world, join=True,
                       start_method="spawn")
    return world, [torch.load(tmp / f"{rank}.pt", weights_only=False) for rank in range(world)]


def test_dsar_qsgd_gives_every_rank_the_same_vector(paper_runs):
    world, res = paper_runs
    for rank in range(1, world):  # the owner of a range keeps its quantized values, not its exact sum
        assert np.array_equal(res[rank]["qsgd"], res[0]["qsgd"]), rank
        assert np.array_equal(res[rank]["qsgd_fresh"], res[0]["qsgd_fresh"]), rank


def test_dsar_qsgd_is_fresh_per_seed_and_reproducible(paper_runs):
    _, res = paper_runs
    outs = res[0]["qsgd"]
    assert len({o.tobytes() for o in outs[:12]}) == 12  # seeds 0..11: 12 different quantizations
    assert np.array_equal(res[0]["qsgd_seed0_again"], outs[0])  # a seed repeats exactly
    assert not np.array_equal(*res[0]["qsgd_fresh"])  # no seed: fresh randomness per call


def test_dsar_qsgd_is_unbiased(paper_runs):
    """Each output value is norm / levels * (floor(y) or floor(y) + 1) of its range's bucket norm, so the mean
    of M calls lies within w * sqrt(ln(2n / delta) / (2M)) of the exact sum (Hoeffding, w = norm / levels,
    union over the n values), with delta = 1e-9; one fixed seed (the mean of one draw) lands far outside."""
    world, res = paper_runs
    exact = np.zeros(QSGD_SIZE)
    for rank in range(world):
        idx, val = qsgd_input(rank)
        exact[idx] += val
    w = np.zeros(QSGD_SIZE)
    bounds = [QSGD_SIZE * j // world for j in range(world + 1)]
    for lo, hi in zip(bounds, bounds[1:]):
        for b in range(lo, hi, 512):
            e = min(b + 512, hi)
            w[b:e] = np.linalg.norm(exact[b:e]) / QSGD_LEVELS
    tol = w * np.sqrt(np.log(2 * QSGD_SIZE / 1e-9) / (2 * QSGD_CALLS)) + 1e-5 * np.abs(exact)
    err = np.abs(res[0]["qsgd"].astype(np.float64).mean(axis=0) - exact)
    assert np.all(err <= tol), (err / np.maximum(tol, 1e-12)).max()
    single = np.abs(res[0]["qsgd"][0] - exact)
    assert np.any(single > tol)  # the test can tell one draw from the mean of many


def test_split_allgather_sends_log2p_allgather_messages(paper_runs):
    """The paper's L2(P) = (P - 1) alpha (split) + L1(P) = log2(P) alpha (allgather), in messages per rank."""
    world, res = paper_runs
    expect = (world - 1) + int(np.ceil(np.log2(world)))
    for r in res:
        for algorithm in ("ssar_split_allgather", "dsar_split_allgather"):
            assert r[("exact", algorithm)], (world, algorithm)
            assert r[("messages", algorithm)] == expect, (world, algorithm, r[("messages", algorithm)])


def test_indices_past_int32_come_back_exactly(paper_runs):
    world, res = paper_runs
    want = {}
    for rank in range(world):
        for i, v in zip(*big_input(rank, world)):
            want[int(i)] = want.get(int(i), 0.0) + float(v)
    keys = np.array(sorted(want), np.int64)
    for r in res:
        for algorithm in ("ssar_recursive_double", "ssar_split_allgather"):
            sparse, idx, val = r[("big", algorithm)]
            assert sparse, algorithm
            assert np.array_equal(idx, keys), (algorithm, idx[idx < 0], sorted(set(keys) - set(idx)))
            assert np.array_equal(val, np.array([want[int(k)] for k in keys], np.float32)), algorithm


def test_index_bytes_on_the_wire_are_the_papers_width(paper_runs):
    """c = ceil(log2 N / 8) bytes per index (SparCML, section 5.2), plus 4 per float32 value; the bytes a rank
    sent are one stream's only at P = 2 (one send per rank)."""
    world, res = paper_runs
    for size, c in WIDTH_SIZES.items():
        assert sparcml.index_width(size) == c
        for r in res if world == 2 else ():
            assert r[("bytes", size)] == 3 * (c + 4), (size, r[("bytes", size)])
        s = sparcml.Stream(size, np.array([0, size - 1], np.int64), np.ones(2, np.float32))
        assert len(sparcml.encode_record(s)) == 32 + 2 * (c + 4)  # what the byte buffer really carries
        back = sparcml.decode_records(sparcml.encode_record(s))[0]
        assert np.array_equal(back.indices, s.indices)


def test_malformed_message_raises():
    s = sparcml.Stream(5000, np.array([1, 4999], np.int64), np.ones(2, np.float32))
    rec = sparcml.encode_record(s)
    for bad in (rec[:-1], rec[:20], rec + b"\0"):
        with pytest.raises(ValueError):
            sparcml.decode_records(bad)
    with pytest.raises(ValueError, match="index outside"):
        sparcml.pack_indices(np.array([5000]), 5000)


@pytest.mark.parametrize("n", [512 * 3 + 100, 512 * 2 + 5, 300])
@pytest.mark.parametrize("k", [1, 16, 512])
def test_bucket_topk_keeps_k_largest_per_512_bucket(n, k):
    from hostlib.sparse.sparsify import Sparsifier, bucket_topk

    x = np.random.default_rng(n + k).integers(-6, 7, n).astype(np.float32)  # many ties
    idx = bucket_topk(x, k)
    assert np.all(np.diff(idx) > 0)
    for b in range(0, n, 512):
        mag = np.abs(x[b:b + 512])
        kept = np.zeros(mag.size, bool)
        kept[idx[(idx >= b) & (idx < b + 512)] - b] = True
        assert kept.sum() == min(k, mag.size), (b, kept.sum())
        if kept.all():
            continue
        assert mag[kept].min() >= mag[~kept].max(), b
        tie = mag == mag[kept].min()  # among equal magnitudes at the cut the lower indices win
        assert not np.any(np.flatnonzero(tie & ~kept)[:, None] < np.flatnonzero(tie & kept)[None, :])
    sp = Sparsifier("buckettopk", ratio=k / 512, bucket=512, error_feedback=False)
    got, vals = sp(x)
    assert np.array_equal(got, idx) and np.array_equal(vals, x[idx])
    with pytest.raises(ValueError):
        bucket_topk(np.array([1.0, np.nan]), 1)
