"""The "ina" torch.distributed backend (hostlib.integrations.torch_backend): two ranks spawned with
MASTER_ADDR/PORT, RANK and WORLD_SIZE as torchrun sets them and a `switchsim serve` child; each collective,
DDP and FSDP2 against gloo in the same processes; the fallback to gloo when the switch dies, and the re-join
when it is back. One spawn per scenario and switch backend, checked by several tests."""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import re
from queue import Empty
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[torch]')")
import torch.distributed as dist  # noqa: E402

from inabench.harness import ROOT, SwitchProcess, free_port  # noqa: E402

from .scripts.ddp_compare import integer_model  # noqa: E402 - the comm hook's comparison uses the same model

BACKENDS = ["python", "c"]
RANK_ENV = {"INA_FAST": os.environ.get("INA_TEST_FAST", "1")}  # the C worker loop, as users get it (0: Python's)
STEPS = 6
KILL_AFTER = 2  # DDP steps through the switch before it is killed
RETRY_EVERY = 3


# ---------------------------------------------------------------- ranks (spawned)
def _init(rank, port, address, env=None):
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2",
                       "INA_SWITCH": address, **RANK_ENV, **(env or {})})
    import hostlib  # noqa: F401 - registers "ina"

    torch.set_num_threads(1)
    dist.init_process_group("ina")
    return dist.group.WORLD, dist.new_group(backend="gloo")


def _float_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))


def _loss(model, integer, g):
    if integer:
        x = torch.randint(-3, 4, (5, 8), generator=g).float()
        return (model(x) * torch.randint(-1, 2, (5, 4), generator=g).float()).sum()
    x = torch.randn(16, 20, generator=g)
    return model(x.to(next(model.parameters()).dtype)).float().pow(2).mean()


def _params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _ddp_run(group, rank, integer, steps, between=None, dtype=torch.float32):
    """DDP over `group`; between(step) runs before each step (the fallback test kills the switch there).
    Returns the final parameters and the seconds each step took."""
    model = (integer_model() if integer else _float_model()).to(dtype)
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=2.0 if integer else 0.1)
    g = torch.Generator().manual_seed(100 + rank)
    seconds = []
    for step in range(steps):
        if between is not None:
            between(step)
        t0 = time.perf_counter()
        loss = _loss(ddp, integer, g)
        opt.zero_grad()
        loss.backward()
        opt.step()
        seconds.append(time.perf_counter() - t0)
    return _params(model), seconds


def _fsdp_run(group, rank, steps=4):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, "cpu")
    model = _float_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        loss = _loss(model, False, g)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])


# dtype x op: what the switch carries, what gloo does (the README's table)
METRIC = [1e6, 1e-30, 3.0, 1e-3, -7.5e-12, 2.0**-140]  # one element each of very different magnitudes
OPS = ("SUM", "AVG", "MIN", "MAX", "PRODUCT")
EVERYDAY_DTYPES = ("float32", "bfloat16", "float16", "float64", "int32")


def _everyday(rank, gloo):
    """Each dtype x op on "ina" and on gloo, on 0-dim, 1-element, metric-sized and bucket-sized tensors:
    the parent compares them against the stated bounds. Also the paths ina_stats reports."""
    out = {}
    for dtype_name in EVERYDAY_DTYPES:
        dtype = getattr(torch, dtype_name)
        for op_name in OPS:
            op = getattr(dist.ReduceOp, op_name)
            if dtype == torch.int32 and op == dist.ReduceOp.AVG:
                continue  # gloo refuses AVG of integers
            for shape, values in (((), [2.5 + rank]), ((1,), [0.75 * (rank + 1)]),
                                  ((len(METRIC),), [v * (rank + 1) for v in METRIC]),
                                  ((300,), [((k * 7919) % 1000 - 500) / 64.0 + rank for k in range(300)])):
                if dtype == torch.int32:
                    values = [int(v * 4) for v in values]
                if dtype == torch.float16:
                    values = [v if abs(v) < 6e4 else 6e4 for v in values]
                got = {}
                for name, group in (("ina", None), ("gloo", gloo)):
                    t = torch.tensor(values, dtype=dtype).reshape(shape)
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        dist.all_reduce(t, op=op, group=group)
                    got[name] = (t.to(torch.float64).reshape(-1).numpy(), tuple(t.shape), str(t.dtype))
                out[(dtype_name, op_name, shape)] = got
    out["paths"] = dist.group.WORLD.ina_stats()["paths"]
    return out


def _ddp_nan(rank):
    """DDP where rank 1's batch has a NaN at step 1: every rank's backward raises; the next step trains."""
    model = _float_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    outcomes = []
    for step in range(3):
        x = torch.randn(16, 20, generator=torch.Generator().manual_seed(step))
        if step == 1 and rank == 1:
            x[0, 0] = float("nan")
        ddp.zero_grad(set_to_none=True)  # the failed step's NaN gradient would be summed again
        try:
            ddp(x).pow(2).mean().backward()
            outcomes.append("ok")
        except Exception as e:  # noqa: BLE001 - reported to the test
            outcomes.append((type(e).__name__, str(e)))
    return outcomes


def _inline_calls(pg, r):
    """The inline path (one contiguous float32 or int32 host tensor from the main thread): any shape, the
    same lane for the same memory as long as dtype and size match, the general path for a strided tensor; a
    synchronous call's Work is the group's shared one, an async_op call's its own, whose future holds the
    tensor."""
    m = torch.arange(12, dtype=torch.float32).reshape(3, 4) + r
    dist.all_reduce(m)
    two_d = m.tolist()
    buf = torch.full((100,), 1.5 + r)
    dist.all_reduce(buf)
    float_sum = buf.tolist()
    as_int = buf.view(torch.int32)  # the same memory, another dtype: another lane
    as_int.fill_(1000 + r)
    dist.all_reduce(as_int)
    strided = (torch.arange(16, dtype=torch.float32) + r)[::2]
    dist.all_reduce(strided)
    avg = torch.full((2, 50), 2.0 + 2 * r)
    dist.all_reduce(avg, op=dist.ReduceOp.AVG)
    averaged = avg.tolist()
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    shared = pg.allreduce([avg], opts) is pg._done
    work = dist.all_reduce(m, async_op=True)
    future = work.get_future().wait()
    lanes = {(n, str(dtype)) for (_, n, dtype) in pg.calls.lanes}
    return {"2d": two_d, "float": float_sum, "int32": as_int.tolist(), "async": m.tolist(),
            "strided": strided.tolist(), "avg": averaged, "shared": shared,
            "async own": work is not pg._done and future[0] is m, "lanes": sorted(lanes),
            "strided lane": (strided.data_ptr(), 8, torch.float32) in pg.calls.lanes}


def _caught(fn):
    """(exception class name, message) of fn(), or None if it returned."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported to the test
        return type(e).__name__, str(e)
    return None


def _collectives_rank(rank, port, address, queue):
    """Every collective once, DDP and FSDP2 against gloo: the results go to the parent."""
    try:
        pg, gloo = _init(rank, port, address)
        out = {"backend": dist.get_backend(), "group": type(pg).__name__}
        r = rank
        t = torch.arange(8, dtype=torch.float32) + r
        dist.all_reduce(t)
        out["sum"] = t.tolist()
        t = torch.arange(8, dtype=torch.float32) + r
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        out["avg"] = t.tolist()
        big = torch.arange(3000, dtype=torch.int32) * 300_001 + r  # beyond float32's 2^24: exact only as integers
        dist.all_reduce(big)
        out["int32"] = big.tolist()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for op in (dist.ReduceOp.MIN, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT):
                t = torch.tensor([r + 2.0, 5.0 - r])
                dist.all_reduce(t, op=op)
                out[f"op {op}"] = t.tolist()
            t = torch.tensor([2**40 + r])  # int64: gloo's
            dist.all_reduce(t)
            out["int64"] = t.tolist()
        out["warnings"] = [str(w.message) for w in caught]
        ts = [torch.ones(3) * (r + 1), torch.arange(5, dtype=torch.float32)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            dist.all_reduce_coalesced(ts)
            out["coalesced"] = [x.tolist() for x in ts]
            for name in ("reduce_scatter_tensor", "_reduce_scatter_base"):
                shard = torch.empty(4)
                getattr(dist, name)(shard, torch.arange(8, dtype=torch.float32) + 10 * r)
                out[name] = shard.tolist()
            shard = torch.empty(4)
            dist.reduce_scatter_tensor(shard, torch.arange(8, dtype=torch.float32) + 10 * r, op=dist.ReduceOp.AVG)
            out["reduce_scatter avg"] = shard.tolist()
        shard = torch.empty(3)
        dist.reduce_scatter(shard, [torch.full((3,), float(10 * r + k)) for k in range(2)])
        out["reduce_scatter list"] = shard.tolist()
        b = torch.full((3,), float(r))
        dist.broadcast(b, src=1)
        out["broadcast"] = b.tolist()
        gathered = [torch.empty(2) for _ in range(2)]
        dist.all_gather(gathered, torch.full((2,), float(r)))
        out["all_gather"] = [x.tolist() for x in gathered]
        flat = torch.empty(4)
        dist.all_gather_into_tensor(flat, torch.full((2,), float(r + 1)))
        out["all_gather_into_tensor"] = flat.tolist()
        dist.barrier()
        if r == 0:
            dist.send(torch.tensor([42.0]), dst=1)
        else:
            got = torch.empty(1)
            dist.recv(got, src=0)
            out["recv"] = got.tolist()
        a2a = torch.empty(2)
        dist.all_to_all_single(a2a, torch.tensor([10.0 * r, 10.0 * r + 1]))
        out["all_to_all_single"] = a2a.tolist()
        lists = [torch.empty(1) for _ in range(2)]
        dist.all_to_all(lists, [torch.tensor([float(10 * r + k)]) for k in range(2)])
        out["all_to_all"] = [x.tolist() for x in lists]
        works = [(k, torch.full((100,), float(k + r)), None) for k in range(8)]
        works = [(k, x, dist.all_reduce(x, async_op=True)) for k, x, _ in works]
        for _, _, w in reversed(works):  # waited in any order: each completes with its own sum
            w.wait()
        out["async"] = [x[0].item() - (2 * k + 1) for k, x, _ in works]
        out["mismatch"] = _caught(lambda: dist.all_reduce(torch.ones(10 if r == 0 else 20)))
        nan = torch.ones(10)
        nan[3] = float("nan") if r == 0 else 1.0
        out["nan"] = _caught(lambda: dist.all_reduce(nan))
        t = torch.ones(6)
        dist.all_reduce(t)
        out["after errors"] = t.tolist()
        out["inline"] = _inline_calls(pg, r)
        import torch.distributed._functional_collectives as funcol

        out["functional"] = funcol.all_reduce(torch.full((3,), r + 1.0), "sum", dist.group.WORLD).tolist()
        bad = torch.ones(3)
        bad[1] = float("inf") if r == 1 else 1.0
        out["functional inf"] = _caught(lambda: funcol.all_reduce(bad, "sum", dist.group.WORLD).tolist())
        out["everyday"] = _everyday(r, gloo)
        out["ddp nan"] = _ddp_nan(r)
        out["ddp bf16"] = [_ddp_run(g, r, False, 3, dtype=torch.bfloat16)[0] for g in (None, gloo)]
        sub = dist.new_group(backend="ina")
        t = torch.ones(4)
        dist.all_reduce(t, group=sub)
        out["subgroup"] = (t.tolist(), sub.ina_stats()["switch_calls"])
        ina_ddp, _ = _ddp_run(None, r, False, 4)
        gloo_ddp, _ = _ddp_run(gloo, r, False, 4)
        out["ddp"] = (ina_ddp, gloo_ddp, _params(_float_model()))
        before = pg.ina_stats()["switch_calls"]
        out["fsdp"] = (_fsdp_run(pg, r), _fsdp_run(gloo, r))
        out["fsdp switch calls"] = pg.ina_stats()["switch_calls"] - before
        out["stats"] = pg.ina_stats()
        dist.destroy_process_group()
        queue.put((rank, _portable(out)))
    except BaseException:  # noqa: BLE001 - the parent reports it
        queue.put((rank, traceback.format_exc()))


def _portable(obj):
    """Tensors as numpy arrays: a queue would pass a tensor as a file descriptor, gone once the rank exits."""
    if isinstance(obj, torch.Tensor):
        return obj.float().numpy() if obj.dtype in (torch.bfloat16, torch.float16) else obj.numpy()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_portable(v) for v in obj)
    if isinstance(obj, dict):
        return {k: _portable(v) for k, v in obj.items()}
    return obj


def _fallback_rank(rank, port, address, step_done, killed, want_restart, restarted, queue):
    """The switch dying as call 1 ends (injected: rank 0 misses the result, rank 1 fails on call 2), a
    re-join of the live switch, then DDP on an integer model: KILL_AFTER steps through the switch, the switch
    SIGKILLed by the parent, the rest through gloo; the same training on gloo alone; then the switch restarted on its port
    and the group back on it after RETRY_EVERY calls."""
    try:
        pg, gloo = _init(rank, port, address, {"INA_RETRY_EVERY": str(RETRY_EVERY)})
        out = {}
        t = torch.ones(4)
        dist.all_reduce(t)  # call 0: through the switch
        from hostlib import errors

        real = pg.calls._switch_sum

        def dies_as_call_1_ends(x, *lane):  # the switch "dies" as call 1 ends: rank 0 misses its result, rank 1
            n = pg.calls.number - 1  # has it (lane: the inline path's calls, dist.all_reduce from this thread)
            if rank == 0 and n == 1:
                real(x, *lane)
                raise errors.SwitchUnreachable("injected: the last result never came", switch=pg.switch)
            if rank == 1 and n == 2:
                raise errors.SwitchUnreachable("injected: the switch is gone", switch=pg.switch)
            return real(x, *lane)

        pg.calls._switch_sum = dies_as_call_1_ends
        t = torch.arange(5, dtype=torch.float32) * (rank + 1)
        dist.all_reduce(t)  # call 1: rank 0 recovers it from rank 1's kept result
        result = t.tolist()
        t = torch.full((3,), 1.0 + rank)
        dist.all_reduce(t)  # call 2: on gloo for both (rank 1 failed on it, rank 0 is down)
        out["end fault"] = (result, dict(pg.ina_stats()))
        out["after end fault"] = t.tolist()
        pg.calls._switch_sum = real
        for _ in range(RETRY_EVERY):  # calls 3, 4 on gloo; call 5 (2 + RETRY_EVERY) re-joins
            dist.all_reduce(torch.ones(4))
        out["rejoined live"] = dict(pg.ina_stats())

        def between(step):
            if step == KILL_AFTER:
                dist.barrier(group=gloo)
                if rank == 0:
                    step_done.set()
                assert killed.wait(30), "the parent did not kill the switch"

        ina, seconds = _ddp_run(None, rank, True, STEPS, between)
        out["kill"] = (ina, seconds, dict(pg.ina_stats()))
        out["gloo"] = _ddp_run(gloo, rank, True, STEPS)[0]
        dist.barrier(group=gloo)
        if rank == 0:
            want_restart.set()
        assert restarted.wait(30), "the parent did not restart the switch"
        before = pg.ina_stats()
        sums = []
        for k in range(2 * RETRY_EVERY):
            t = torch.full((64,), float(k + rank))
            dist.all_reduce(t)
            sums.append(t[0].item() - (2 * k + 1))
        out["restart"] = (before, dict(pg.ina_stats()), sums)
        # the switch "dies" as a call ends on rank 0 only; rank 1, with the result, makes no other call through
        # the switch but waits in a barrier of another group: its watcher joins rank 0's recovery
        real = pg.calls._switch_sum

        def last_result_lost(x, *lane):
            pg.calls._switch_sum = real
            real(x, *lane)
            raise errors.SwitchUnreachable("injected: the last result never came", switch=pg.switch)

        if rank == 0:
            pg.calls._switch_sum = last_result_lost
        t = torch.arange(4, dtype=torch.float32) * (rank + 1)
        dist.all_reduce(t)
        dist.barrier(group=gloo)
        out["idle ahead"] = (t.tolist(), pg.ina_stats())
        dist.destroy_process_group()
        queue.put((rank, _portable(out)))
    except BaseException:  # noqa: BLE001 - the parent reports it
        queue.put((rank, traceback.format_exc()))


def _landing_rank(rank, port, address, queue):
    """Sums land in place block by block; the switch "dies" (injected, after the real call) with some blocks
    landed: (a) on both ranks in the same call, different blocks on each; (b) rank 1 completed the call
    (keeping only the last blocks a window of 2 can leave missing) and fails on the next, rank 0 misses
    exactly those blocks. Both recoveries must give the exact sum on both ranks."""
    try:
        pg, gloo = _init(rank, port, address, {"INA_RETRY_EVERY": "1", "INA_FAST": "1"})  # the C loop lands blocks
        from hostlib import errors

        dist.all_reduce(torch.ones(4))
        real = pg.calls._switch_sum
        k = min(pg.calls.route(torch.ones(1000))[1], pg.comm.max_elements)
        n = 10 * k + 7  # 11 blocks, the last one short

        def values(r):
            return (torch.arange(n, dtype=torch.float32) % 97) * (r + 1)  # integers: any order sums exactly

        def lands(blocks, window=None):
            def call(x, *lane):
                pg.calls._switch_sum = real
                inline.append(bool(lane) and lane[0] is not None)
                before = x.clone()
                total, path = real(x, *lane)
                assert total.data_ptr() == x.data_ptr(), "the sum did not land in place"
                if window is not None:
                    pg.calls.landing = dataclasses.replace(pg.calls.landing, window=window)
                if blocks is None:
                    return total, path
                landed = np.zeros(11, dtype=bool)
                landed[blocks] = True
                per_element = torch.from_numpy(landed).repeat_interleave(k)[:n]
                x.view(-1)[~per_element] = before.view(-1)[~per_element]  # a block holds its input until it lands
                error = errors.SwitchUnreachable("injected: the switch died mid-call", switch=pg.switch)
                error.landed = landed
                raise error
            pg.calls._switch_sum = call

        out = {"exact": values(0) + values(1)}
        inline = out["inline"] = []  # per injected call: whether it came through the inline path (a lane)
        lands([0, 1, 2, 5] if rank == 0 else [1, 2, 3, 10])
        t = values(rank).reshape(1, n)  # any contiguous shape goes inline
        dist.all_reduce(t)
        t = t.reshape(-1)
        out["same call"] = (t, pg.ina_stats())
        t = values(rank)  # re-joins (INA_RETRY_EVERY=1), then rank 1 completes and rank 0 misses blocks 9, 10
        lands(list(range(9)) if rank == 0 else None, window=2)
        dist.all_reduce(t)
        out["ahead"] = (t, pg.ina_stats())
        if rank == 1:  # its next call fails (rank 0 is down already: it sums that call on gloo)
            pg.calls._switch_sum = lambda x, *lane: (_ for _ in ()).throw(errors.SwitchUnreachable("injected: gone",
                                                                                           switch=pg.switch))
        t = torch.full((5,), 2.0)
        dist.all_reduce(t)
        out["next call"] = (t, pg.ina_stats())
        dist.barrier(group=gloo)
        dist.destroy_process_group()
        queue.put((rank, _portable(out)))
    except BaseException:  # noqa: BLE001 - the parent reports it
        queue.put((rank, traceback.format_exc()))


# ---------------------------------------------------------------- the parent's side
def _start(target, *args):
    ctx = mp.get_context("spawn")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, *args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    return procs, queue


def _results(procs, queue, timeout=180) -> list[dict]:
    """Each rank's dict, in rank order; the first rank's traceback fails the test."""
    got, deadline = {}, time.monotonic() + timeout
    try:
        while len(got) < 2 and time.monotonic() < deadline:
            try:
                rank, out = queue.get(timeout=1)
            except Empty:  # are the ranks alive?
                if not any(p.is_alive() for p in procs):
                    break
                continue
            if isinstance(out, str):
                pytest.fail(f"rank {rank} failed:\n{out}")
            got[rank] = out
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert len(got) == 2, f"{len(got)} of 2 ranks reported within {timeout} s"
    return [got[0], got[1]]


def _reached(event, procs, timeout=120) -> bool:
    """Wait for the ranks to set event; False as soon as a rank is gone (its traceback is on the queue)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if event.wait(0.5):
            return True
        if not all(p.is_alive() for p in procs):
            return False
    return False


def _stopped_switch_rank(rank, port, address, ready, stopped, queue):
    """One call through the switch; then, the switch SIGSTOPped by the parent, a call that must end (on gloo)
    within seconds, not the communicator's 30 s timeout."""
    try:
        pg, gloo = _init(rank, port, address)
        dist.all_reduce(torch.ones(4))
        dist.barrier(group=gloo)
        if rank == 0:
            ready.set()
        stopped.wait(60)
        t = torch.arange(1 << 18, dtype=torch.float32)
        t0 = time.monotonic()
        dist.all_reduce(t)
        took = time.monotonic() - t0
        queue.put((rank, {"took": took, "exact": bool(torch.equal(t, 2 * torch.arange(1 << 18, dtype=torch.float32))),
                          "stats": pg.ina_stats()}))
        dist.barrier(group=gloo)
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test
        queue.put((rank, traceback.format_exc()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_stopped_switch_is_named_and_the_call_ends_on_gloo_within_5_s(backend):
    """SIGSTOP the switch: the next all_reduce names it (SwitchSilent) and ends on gloo within 5 s, exact."""
    ctx = mp.get_context("spawn")
    ready, stopped = ctx.Event(), ctx.Event()
    sw = SwitchProcess("--workers", 2, backend=backend)
    try:
        procs, queue = _start(_stopped_switch_rank, sw.address, ready, stopped)
        assert _reached(ready, procs)
        os.kill(sw.proc.pid, signal.SIGSTOP)
        stopped.set()
        outs = _results(procs, queue)
    finally:
        os.kill(sw.proc.pid, signal.SIGCONT)
        sw.stop()
    for out in outs:
        assert out["exact"] and out["took"] < 5.0, out
        assert out["stats"]["faults"] >= 1 and out["stats"]["last_fault"].startswith("SwitchSilent"), out["stats"]


@pytest.fixture(scope="module", params=BACKENDS)
def collectives(request):
    sw = SwitchProcess("--workers", 2, backend=request.param)
    try:
        procs, queue = _start(_collectives_rank, sw.address)
        return _results(procs, queue)
    finally:
        sw.stop()


@pytest.fixture(scope="module", params=BACKENDS)
def fallback(request):
    ctx = mp.get_context("spawn")
    events = [ctx.Event() for _ in range(4)]
    step_done, killed, want_restart, restarted = events
    sw = SwitchProcess("--workers", 2, backend=request.param)
    port = sw.address.rsplit(":", 1)[1]
    try:
        procs, queue = _start(_fallback_rank, sw.address, *events)
        if _reached(step_done, procs):
            os.kill(sw.proc.pid, signal.SIGKILL)
            sw.proc.wait()
            killed.set()
            if _reached(want_restart, procs):
                sw = SwitchProcess("--workers", 2, "--port", port, backend=request.param)
                restarted.set()
        results = _results(procs, queue)  # a rank's traceback, if one failed
        return results, sw.stop_stats()
    finally:
        sw.stop()


@pytest.fixture(scope="module")
def landing():
    sw = SwitchProcess("--workers", 2, backend="c")
    try:
        procs, queue = _start(_landing_rank, sw.address)
        return _results(procs, queue)
    finally:
        sw.stop()


# ---------------------------------------------------------------- the collectives
def test_backend_is_registered_by_hostlib_and_init_needs_only_the_environment(collectives):
    for out in collectives:
        assert out["backend"] == "ina" and out["group"] == "ProcessGroupINA"


def test_all_reduce_sums_through_the_switch(collectives):
    for r, out in enumerate(collectives):
        assert out["sum"] == [2.0 * k + 1 for k in range(8)]
        assert out["avg"] == [k + 0.5 for k in range(8)]
        assert out["int32"] == [2 * (k * 300_001) + 1 for k in range(3000)]  # exact (int32 codec)
        assert out["coalesced"] == [[3.0] * 3, [0.0, 2.0, 4.0, 6.0, 8.0]]
        assert out["async"] == [0.0] * 8
        assert out["stats"]["switch_calls"] > 10 and out["stats"]["gloo_calls"] == 0
        assert out["stats"]["faults"] == 0 and out["stats"]["comm"]["packets_sent"] > 0


def test_the_inline_path_takes_any_contiguous_shape_and_keys_lanes_by_memory_size_and_dtype(collectives):
    for out in collectives:
        got = out["inline"]
        want = (np.arange(12, dtype=np.float32).reshape(3, 4) * 2 + 1)
        assert got["2d"] == want.tolist() and got["async"] == (2 * want).tolist()
        assert got["float"] == [4.0] * 100 and got["int32"] == [2001] * 100
        assert got["strided"] == [2.0 * k + 1 for k in range(0, 16, 2)]
        assert got["avg"] == [[3.0] * 50] * 2
        assert got["shared"] and got["async own"]
        assert {(100, "torch.float32"), (100, "torch.int32"), (12, "torch.float32")} <= set(map(tuple, got["lanes"]))
        assert not got["strided lane"]


def test_other_ops_and_dtypes_are_delegated_to_gloo_with_a_warning(collectives):
    for r, out in enumerate(collectives):
        assert out["op RedOpType.MIN"] == [2.0, 4.0] and out["op RedOpType.MAX"] == [3.0, 5.0]
        assert out["op RedOpType.PRODUCT"] == [6.0, 20.0]
        assert out["int64"] == [2**41 + 1]
        assert any("MIN is not a sum: delegated to gloo" in w for w in out["warnings"])
        assert any("torch.int64 tensors are summed by gloo" in w for w in out["warnings"])


def test_reduce_scatter_gives_each_rank_its_shard_of_the_sum(collectives):
    total = [2.0 * k + 10 for k in range(8)]
    for r, out in enumerate(collectives):
        shard = total[4 * r: 4 * r + 4]
        assert out["reduce_scatter_tensor"] == shard and out["_reduce_scatter_base"] == shard
        assert out["reduce_scatter avg"] == [v / 2 for v in shard]
        assert out["reduce_scatter list"] == [10.0 + 2 * r] * 3


def test_delegated_collectives(collectives):
    for r, out in enumerate(collectives):
        assert out["broadcast"] == [1.0] * 3
        assert out["all_gather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert out["all_gather_into_tensor"] == [1.0, 1.0, 2.0, 2.0]
        assert out["all_to_all_single"] == [float(r), 10.0 + r]
        assert out["all_to_all"] == [[float(r)], [10.0 + r]]
    assert collectives[1]["recv"] == [42.0]


def test_collective_errors_raise_through_wait_and_the_next_call_is_exact(collectives):
    for out in collectives:
        assert out["mismatch"][0] == "CallMismatch" and re.search(r"rank 1 (called allreduce )?with 20( elements)?",
                                                                  out["mismatch"][1])
        assert out["nan"][0] == "ValueError" and "NaN" in out["nan"][1]
        assert out["after errors"] == [2.0] * 6
        assert out["stats"]["gloo_calls"] == 0  # an error is not a fault: nothing fell back


def test_functional_collectives_sum_and_raise_by_name(collectives):
    for out in collectives:
        assert out["functional"] == [3.0] * 3
        assert out["functional inf"][0] == "ValueError" and "NaN or Inf" in out["functional inf"][1]


def test_ddp_raises_a_nan_on_one_rank_as_valueerror_on_every_rank_and_trains_on(collectives):
    """The error reaches DDP's reducer as a C++ error (futures.ErrorFuture), not as a value: a Python
    exception from loss.backward(), never a signal (the ranks report at all)."""
    for out in collectives:
        ok, nan, after = out["ddp nan"]
        assert ok == "ok" and after == "ok"
        assert nan[0] == "ValueError" and "NaN" in nan[1], nan


def test_ddp_trains_a_bfloat16_model(collectives):
    start = collectives[0]["ddp"][2]
    for out in collectives:
        ina, gloo = out["ddp bf16"]
        assert _tracks(ina, gloo, start, tolerance=0.05)  # bf16 keeps 8 bits: both round as they train
    assert np.array_equal(collectives[0]["ddp bf16"][0], collectives[1]["ddp bf16"][0])


EPS = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}


def _inputs(values, dtype):
    return torch.tensor(values, dtype=getattr(torch, dtype)).to(torch.float64).reshape(-1).numpy()


def test_everyday_tensors_every_dtype_and_op(collectives):
    """The README's table: shape and dtype kept (0-dim too); float64, int32 and MIN/MAX/PRODUCT exactly
    gloo's; float32 sums of at most SMALL_ELEMENTS elements within float32 rounding per element (each
    element its own exponent: 1e-30 next to 1e6), larger ones within the codec's bound; 16-bit floats within
    their own rounding of the float32 path's sum."""
    for out in collectives:
        table = out["everyday"]
        paths = table.pop("paths")
        assert len(table) == 4 * len(EVERYDAY_DTYPES) * len(OPS) - 4
        for (dtype, op, shape), got in table.items():
            (ina, ina_shape, ina_dtype), (gloo, gloo_shape, gloo_dtype) = got["ina"], got["gloo"]
            where = (dtype, op, shape)
            assert ina_shape == gloo_shape == shape and ina_dtype == gloo_dtype == f"torch.{dtype}", where
            if dtype in ("float64", "int32") or op not in ("SUM", "AVG"):
                assert np.array_equal(ina, gloo, equal_nan=True), where
                continue
            largest = np.maximum(np.abs(gloo), np.abs(ina)) + 0.0
            size = ina.size
            if size <= 64:  # per element: quantization 2^-27 of the element's largest input, then rounding
                bound = 2.0**-26 * largest + 2 * EPS[dtype] * np.abs(gloo)
            else:  # the codec's block: 2^-27 of the block's largest input
                bound = 2.0**-26 * np.abs(gloo).max() * 2 + 2 * EPS[dtype] * np.abs(gloo)
            with np.errstate(invalid="ignore"):  # inf - inf: a float16 sum past 65504 is inf on both paths
                assert np.all((ina == gloo) | (np.abs(ina - gloo) <= bound)), (where, ina, gloo)
        small = [p for p in paths if p.startswith("float32 small -> switch (fixed, per element)")]
        assert small and paths.get("float64 -> gloo") and paths.get("bfloat16 small -> switch (fixed, per element)")


def test_a_subgroup_runs_on_gloo(collectives):
    for out in collectives:
        assert out["subgroup"] == ([2.0] * 4, 0)


def _tracks(got, want, start, tolerance=1e-5):
    """got is want within the fixed codec's rounding: a small part of how far training moved the parameters
    (fixed point rounds each value to 2^-31 of its block's largest)."""
    moved = float(np.linalg.norm(want - start))
    return moved > 0.01 and float(np.linalg.norm(got - want)) <= tolerance * moved


def test_ddp_trains_to_the_parameters_gloo_gives(collectives):
    for out in collectives:
        ina, gloo, start = out["ddp"]
        assert _tracks(ina, gloo, start)
    assert np.array_equal(collectives[0]["ddp"][0], collectives[1]["ddp"][0])


def test_fsdp2_trains_to_the_parameters_gloo_gives(collectives):
    start = collectives[0]["ddp"][2]
    for out in collectives:
        ina, gloo = out["fsdp"]
        assert out["fsdp switch calls"] >= 4  # the reduce-scatters went through the switch
        assert _tracks(ina, gloo, start)
        assert _tracks(ina, out["ddp"][1], start)  # and FSDP2 trains as DDP does
    assert np.array_equal(collectives[0]["fsdp"][0], collectives[1]["fsdp"][0])


# ---------------------------------------------------------------- the switch dies, and comes back
def test_a_switch_dying_as_a_call_ends_gives_every_rank_the_same_result_then_gloo(fallback):
    """Rank 1 got call 1's result and failed on call 2, rank 0 failed on call 1: rank 0 gets rank 1's kept
    result (the recovery), both sum call 2 on gloo, and re-join after RETRY_EVERY calls."""
    (outs, _) = fallback
    for r, out in enumerate(outs):
        result, stats = out["end fault"]
        assert result == [3.0 * k for k in range(5)]
        assert out["after end fault"] == [3.0] * 3
        assert stats["recoveries"] == 1 and stats["faults"] == 1 and not stats["connected"]
        assert stats["recovered_results"] == (1 if r == 0 else 0)
        assert out["rejoined live"]["rejoins"] == 1 and out["rejoined live"]["connected"]
        # calls 2, 3, 4 on gloo (rank 0's call 1 came from rank 1)
        assert out["rejoined live"]["gloo_calls"] == RETRY_EVERY


def test_training_goes_on_through_gloo_when_the_switch_is_killed(fallback):
    (outs, _) = fallback
    for out in outs:
        ina, seconds, stats = out["kill"]
        assert np.array_equal(ina, out["gloo"])  # integer gradients: exact through the switch and gloo alike
        assert sum(seconds[KILL_AFTER:]) < 10, seconds
        assert stats["faults"] == 2 and stats["gloo_calls"] > RETRY_EVERY
    assert np.array_equal(outs[0]["kill"][0], outs[1]["kill"][0])


def test_the_group_rejoins_a_restarted_switch_after_the_retry_interval(fallback):
    (outs, switch_stats) = fallback
    for out in outs:
        before, after, sums = out["restart"]
        assert sums == [0.0] * len(sums)
        assert after["rejoins"] == before["rejoins"] + 1 and after["connected"]
        assert after["switch_calls"] > before["switch_calls"]
    assert switch_stats.get("packets_in", 0) > 0  # the restarted switch summed the later calls


def test_a_switch_dying_mid_call_with_blocks_landed_on_every_rank_gives_the_exact_sum(landing):
    """Each block that landed on some rank comes from its lowest holder alone, the rest from the inputs."""
    for out in landing:
        t, stats = out["same call"]
        assert np.array_equal(t, out["exact"])
        assert stats["faults"] == 1 and stats["recoveries"] == 1 and stats["recovered_results"] == 0
        assert out["inline"] == [True, False]  # the first call inline; the second re-joins: the general path


def test_a_rank_missing_the_last_window_of_blocks_gets_them_from_a_rank_that_kept_them(landing):
    """Rank 1 kept only the blocks a window can leave missing (2 here) and hands rank 0 those."""
    for r, out in enumerate(landing):
        t, _ = out["ahead"]
        assert np.array_equal(t, out["exact"])
        t, stats = out["next call"]
        assert np.array_equal(t, np.full(5, 4.0))
        assert stats["faults"] == 2 and stats["rejoins"] == 1 and stats["recoveries"] == 2
        assert stats["recovered_results"] == (1 if r == 0 else 0)


# ---------------------------------------------------------------- two torchruns, a peer killed or stopped
def _jsonl(path):
    import json

    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def _wait_for(predicate, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.1)
    return None


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_two_torchruns_a_peer_killed_or_stopped_is_peerdead_on_the_survivor_within_5_s(how, tmp_path):
    """The multi-node case: two torchrun launchers (static rendezvous, one worker each) training DDP; rank 1's
    worker is SIGKILLed or SIGSTOPped: rank 0's backward raises PeerDead naming rank 1 within 5 s (the
    switch's 3 s of silence, then its notice), a Python exception, not a signal."""
    sw = SwitchProcess("--workers", 2, backend="c")
    port = free_port()
    env = {**os.environ, "INA_SWITCH": sw.address, "INA_TEST_OUT": str(tmp_path), "INA_TEST_SECONDS": "60",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    script = os.path.join(ROOT, "tests", "scripts", "ddp_liveness.py")
    runs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                              "--node-rank", str(r), "--master-addr", "127.0.0.1", "--master-port", str(port),
                              "--max-restarts", "0", script], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True) for r in range(2)]
    victim = None
    try:
        logs = [tmp_path / f"rank{r}.jsonl" for r in range(2)]
        assert _wait_for(lambda: all(any(n.get("step", 0) >= 20 for n in _jsonl(p)) for p in logs), 90), \
            [_jsonl(p) for p in logs]
        victim = next(n["pid"] for n in _jsonl(logs[1]) if "pid" in n)
        os.kill(victim, getattr(signal, how))
        killed_at = time.time()
        ended = _wait_for(lambda: [n for n in _jsonl(logs[0]) if "error" in n], 30)
        assert ended, _jsonl(logs[0])
        (end,) = ended
        assert end["error"] == "PeerDead" and "rank 1" in end["message"], end
        assert end["at"] - killed_at <= 5.0, end["at"] - killed_at
    finally:
        if victim is not None and how == "SIGSTOP":
            os.kill(victim, signal.SIGKILL)
        for run in runs:
            try:
                os.killpg(run.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            run.wait(10)
        sw.stop()


def test_a_rank_that_makes_no_further_call_joins_a_recovery_from_its_watcher(fallback):
    """Rank 1 completed the call and waits in a barrier of another group; rank 0 missed the result: rank 1's
    watcher (a store check every 0.2 s) joins the recovery and hands rank 0 the result, no deadlock."""
    (outs, _) = fallback
    for r, out in enumerate(outs):
        result, stats = out["idle ahead"]
        assert result == [0.0, 3.0, 6.0, 9.0]
        assert stats["recovered_results"] >= (1 if r == 0 else 0) and not stats["connected"]


# ---------------------------------------------------------------- in one process
def test_call_vote_agrees_and_keeps_the_store_small():
    """The vote on one store from two threads: any fault sends both to gloo, any error raises on both; the
    last voter of each call deletes the previous call's keys."""
    import threading

    from hostlib.integrations.torch_failover import CallVote

    store = dist.HashStore()
    votes = [CallVote(store, 2), CallVote(store, 2)]
    cases = [("ok", "ok", "ok"), ("ok", "fault", "fault"), ("fault", "fault", "fault"), ("ok", "error", "error"),
             ("ok", "ok", "ok")]
    for n, (a, b, want) in enumerate(cases):
        got = [None, None]
        threads = [threading.Thread(target=lambda i, o: got.__setitem__(i, votes[i](f"call/{n}", o)), args=(i, o))
                   for i, o in enumerate((a, b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert got == [want, want], (n, a, b)
        assert store.num_keys() <= 2  # this call's counter and verdict only


def test_importing_hostlib_does_not_import_torch_and_registers_after_torch():
    code = ("import sys, hostlib; assert 'torch' not in sys.modules; "
            "import torch.distributed as dist; print('INA' in dist.Backend._plugins)")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "True", run.stderr[-2000:]


def test_torch_autoload_entry_point_registers_without_importing_hostlib(tmp_path):
    """pyproject's "torch.backends" entry point, as an installed package's metadata gives it to torch."""
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    m = re.search(r'\[project\.entry-points\."torch\.backends"\]\s*\n(\w+)\s*=\s*"([^"]+)"', text)
    assert m, "no torch.backends entry point in pyproject.toml"
    info = tmp_path / "ina_autoload_check-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ina-autoload-check\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[torch.backends]\n{m.group(1)} = {m.group(2)}\n")
    code = "import torch.distributed as dist; print('INA' in dist.Backend._plugins)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT])}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 0 and run.stdout.strip().splitlines()[-1] == "True", run.stderr[-2000:]


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_unreachable_switch_at_init_starts_the_group_on_gloo_until_it_joins(backend, tmp_path, monkeypatch, caplog):
    """One rank: nothing listens at INA_SWITCH, so init_process_group warns and the calls go to gloo (a failed
    re-join at call 2 logs nothing new); a switch started there takes the calls from the next retry on. One
    log line per change of path: switch -> gloo, gloo -> switch."""
    import logging

    port = free_port()
    for var, value in {"INA_SWITCH": f"127.0.0.1:{port}", "INA_RETRY_EVERY": "2", **RANK_ENV}.items():
        monkeypatch.setenv(var, value)
    import hostlib  # noqa: F401

    sw = None
    caplog.set_level(logging.INFO, logger="hostlib.integrations.torch_backend")
    with pytest.warns(RuntimeWarning, match="failed .*no switch at"):
        dist.init_process_group("ina", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        pg = dist.group.WORLD
        t = torch.ones(3)
        for _ in range(3):  # calls 0, 1 on gloo, call 2 fails to re-join: gloo
            dist.all_reduce(t)
        assert t.tolist() == [1.0] * 3 and pg.ina_stats()["gloo_calls"] == 3 and pg.ina_stats()["faults"] == 1
        assert pg.ina_stats()["failed_rejoins"] == 1
        sw = SwitchProcess("--workers", 1, "--port", port, backend=backend)
        for _ in range(2):  # call 3 on gloo, call 4 joins
            dist.all_reduce(t)
        stats = pg.ina_stats()
        assert t.tolist() == [1.0] * 3 and stats["rejoins"] == 1 and stats["switch_calls"] == 1, stats
        assert stats["paths"] == {"float32 small -> gloo (switch down)": 4,
                                  "float32 small -> switch (fixed, per element)": 1}, stats["paths"]
        lines = [r.getMessage() for r in caplog.records if r.name == "hostlib.integrations.torch_backend"]
        assert len(lines) == 2 and "sums go through gloo" in lines[0] and "re-joined" in lines[1], lines
    finally:
        dist.destroy_process_group()
        if sw is not None:
            assert sw.stop_stats().get("packets_in", 0) > 0


@pytest.mark.parametrize("extension", [True, False], ids=["extension", "text"])
def test_ddp_backward_raises_a_call_error_as_an_exception_never_a_crash(extension, tmp_path, monkeypatch):
    """One rank, DDP, a NaN gradient: with the future-error extension backward raises the ValueError itself;
    without it (no compiler) a RuntimeError whose text names it. Work.wait() raises the ValueError either way."""
    from hostlib.integrations import futures

    sw = SwitchProcess("--workers", 1, backend="c")
    for var, value in {"INA_SWITCH": sw.address, **RANK_ENV}.items():
        monkeypatch.setenv(var, value)
    if not extension:
        monkeypatch.setattr(futures, "_module", None)
        monkeypatch.setattr(futures, "_tried", True)
    import hostlib  # noqa: F401

    dist.init_process_group("ina", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(_float_model())
        x = torch.randn(4, 20)
        x[0, 0] = float("nan")
        expected = (ValueError, "NaN") if extension else (RuntimeError, "ValueError: allreduce input contains NaN")
        with pytest.raises(expected[0], match=expected[1]):
            ddp(x).pow(2).mean().backward()
        work = dist.all_reduce(torch.tensor([float("inf"), 1.0]), async_op=True)
        with pytest.raises(ValueError, match="NaN or Inf"):
            work.wait()
        t = torch.tensor(2.5)
        dist.all_reduce(t)  # the next call is exact
        assert t.item() == 2.5 and t.shape == ()
        assert dist.group.WORLD.ina_stats()["future_errors"] == ("extension" if extension else "text")
    finally:
        dist.destroy_process_group()
        sw.stop()


@pytest.mark.parametrize("address", ["127.0.0.1:{port}", "no-such-switch.invalid:48864"])
def test_ina_strict_makes_a_switch_that_cannot_be_joined_fatal_at_init(address, tmp_path, monkeypatch):
    """INA_STRICT=1: nothing listening, or a host name that does not resolve (a typo), raises at
    init_process_group instead of training on gloo."""
    from hostlib import errors

    for var, value in {"INA_SWITCH": address.format(port=free_port()), "INA_STRICT": "1", **RANK_ENV}.items():
        monkeypatch.setenv(var, value)
    import hostlib  # noqa: F401

    with pytest.raises(errors.SwitchUnreachable, match="INA_STRICT=1"):
        dist.init_process_group("ina", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    if dist.is_initialized():
        dist.destroy_process_group()


def test_call_queue_runs_calls_in_order_on_the_waiting_thread_or_its_own():
    """A call nobody wakes the thread for runs on the thread that waits for it (with the calls queued
    before it, in order); a woken one on the queue's thread; drain runs what is left; a future's reader wakes
    the thread (futures.CallQueue, as FutureWork uses it)."""
    import threading

    from hostlib.integrations.futures import CallQueue

    queue, ran = CallQueue("test-queue"), []

    def call(k):
        ran.append((k, threading.current_thread().name))

    entries = [queue.submit(call, k, wake=False) for k in range(3)]
    queue.run_until(entries[1])  # runs 0 and 1 here, in order
    assert ran == [(0, "MainThread"), (1, "MainThread")] and queue.inline == 2
    done = threading.Event()
    queue.submit(lambda: (call(3), done.set()))
    assert done.wait(10)  # woken: the queue's thread ran 2, then 3
    assert [k for k, _ in ran] == [0, 1, 2, 3] and ran[3][1] == "test-queue"
    queue.submit(call, 4, wake=False)
    queue.drain()
    assert ran[-1][0] == 4
    done.clear()
    queue.submit(lambda: done.set(), wake=False)
    queue.wake()  # what FutureWork.get_future does
    assert done.wait(10)
    queue.close()
    assert not queue.thread.is_alive()



def test_a_call_waiting_for_a_synchronous_call_to_end_is_woken_when_it_ends():
    """try_run (the synchronous path) runs under the queue's bare lock and wakes callers waiting for the queue
    to be idle only when there are some: one waiting in run_until while it runs still gets to run its call."""
    import threading

    from hostlib.integrations.futures import CallQueue

    queue, ran = CallQueue("test-queue"), []
    release, started = threading.Event(), threading.Event()

    def synchronous():
        started.set()
        assert release.wait(10)
        ran.append("synchronous")

    runner = threading.Thread(target=lambda: ran.append(queue.try_run(synchronous)))
    runner.start()
    assert started.wait(10)
    assert not queue.try_run(lambda: ran.append("refused"))  # one runs: another is refused, not run
    entry = queue.submit(ran.append, "queued", wake=False)
    waiter = threading.Thread(target=queue.run_until, args=(entry,))
    waiter.start()
    time.sleep(0.2)
    assert ran == [] and waiter.is_alive()  # waiting for the synchronous call to end
    release.set()
    waiter.join(10)
    runner.join(10)
    queue.drain()  # the entry left the queue: run by the waiter, or taken by the queue's thread (woken too)
    assert not waiter.is_alive() and ran[:1] == ["synchronous"] and set(ran[1:]) == {True, "queued"} and len(ran) == 3
    queue.close()

def test_import_order_never_matters():
    """torch_backend before torch (which autoloads the entry point while torch_backend is half imported), torch
    first, hostlib first: "ina" registered, no warning."""
    for code in ("import hostlib.integrations.torch_backend; import torch.distributed as dist",
                 "import torch; import hostlib; import torch.distributed as dist",
                 "import hostlib; import torch.distributed as dist",
                 "import torch.distributed as dist"):
        run = subprocess.run([sys.executable, "-W", "error", "-c", f"{code}; print('INA' in dist.Backend._plugins)"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and run.stdout.strip() == "True" and not run.stderr.strip(), (code, run.stderr)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine (torch.cuda.is_available() "
                                                          "is False); the backend's CUDA path runs on a GPU machine")
def test_cuda_tensors_go_through_host_memory(tmp_path, monkeypatch):
    """One rank, CUDA tensors: all_reduce through the switch and back into the GPU tensor."""
    sw = SwitchProcess("--workers", 1, backend="python")
    for var, value in {"INA_SWITCH": sw.address, **RANK_ENV}.items():
        monkeypatch.setenv(var, value)
    import hostlib  # noqa: F401

    dist.init_process_group("ina", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        t = torch.arange(1000, dtype=torch.float32, device="cuda")
        dist.all_reduce(t)
        i = torch.arange(1000, dtype=torch.int32, device="cuda")
        dist.all_reduce(i)
        assert t.is_cuda and torch.allclose(t.cpu(), torch.arange(1000, dtype=torch.float32))
        assert torch.equal(i.cpu(), torch.arange(1000, dtype=torch.int32))
        assert dist.group.WORLD.ina_stats()["switch_calls"] == 2
    finally:
        dist.destroy_process_group()
        sw.stop()


def test_a_full_pool_puts_ddp_on_gloo_with_one_warning_and_it_moves_to_the_switch_when_slots_free(tmp_path, monkeypatch):
    """A shared switch whose pool another job holds: init_process_group("ina") warns once (PoolFull) and DDP
    trains on gloo; the other job closes, and the group re-joins within INA_RETRY_EVERY calls; the parameters
    are those of a gloo run (integer gradients: exact on every path)."""
    import hostlib

    sw = SwitchProcess("--pool", 64, "--max-jobs", 1, backend="c")  # one job's worth of slots
    holder = hostlib.connect(sw.address, 0, 1, job=9)  # holds the pool
    for var, value in {"INA_SWITCH": sw.address, "INA_RETRY_EVERY": "2", "INA_JOB": "1", **RANK_ENV}.items():
        monkeypatch.setenv(var, value)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dist.init_process_group("ina", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
            pg = dist.group.WORLD
            assert "PoolFull" in pg.ina_stats()["last_fault"] and pg.ina_stats()["faults"] == 1

            def free_the_pool(step):
                if step == 3:
                    holder.close()

            params, _ = _ddp_run(pg, 0, integer=True, steps=8, between=free_the_pool)
        stats = pg.ina_stats()
        # freed before call 3; retries at calls 2 (still full) and 4 (joined): one call per step, 8 steps
        assert stats["gloo_calls"] == 4 and stats["rejoins"] == 1 and stats["switch_calls"] == 4, stats
        said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "'ina'" in str(w.message)]
        assert len(said) == 1 and "no slots for this job" in said[0] and "pool is full" in said[0], said
        expected, _ = _ddp_run(dist.new_group(backend="gloo"), 0, integer=True, steps=8)
        assert torch.equal(params, expected)
    finally:
        dist.destroy_process_group()
        holder.close()
        sw.stop()


def test_the_extensions_inline_reads_equal_pythons():
    """inline_call.cpp reads a call's tensor and c10d options from their C++ objects; it gives what the Python
    reads give: the tensor's lane for a synchronous SUM where the lanes hold one, else (the key the lanes are
    kept under, avg, asyncOp), and None for what the inline path does not take: not one tensor, a strided view,
    a non-CPU layout, MAX, options of another class, a call from another thread or inside backward."""
    from hostlib.integrations import futures, torch_backend

    ext = futures.extension()
    if ext is None:
        pytest.skip("the torch extension could not be built here (no compiler or headers): Python's reads apply")
    base = torch.arange(12, dtype=torch.float32)
    tensors = [base, base.view(3, 4), torch.zeros(5, dtype=torch.int32), base.to(torch.float64), base[2:],
               base.view(3, 4).t(), base[::2], torch.tensor(2.5), base.to_sparse()]
    lane = object()
    lanes = {(base.data_ptr(), 12, torch.float32): lane, (base.data_ptr(), 12, torch.int32): object()}
    for t in tensors:
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT):
            for async_op in (False, True):
                opts = dist.AllreduceOptions()
                opts.reduceOp, opts.asyncOp = op, async_op
                for held in ({}, lanes, None):
                    want = torch_backend._python_reads([t], opts, held)
                    assert ext.inline_call([t], opts, held) == want, (t, op, async_op, held)
                    assert ext.inline_call((t,), opts, held) == torch_backend._python_reads((t,), opts, held)
                    if want is not None and want is not lane:
                        assert want[0] == (t.data_ptr(), t.numel(), t.dtype)
    sync_sum = dist.AllreduceOptions()
    sync_sum.asyncOp = False
    assert ext.inline_call([base], sync_sum, lanes) is lane  # the commonest call: its lane, nothing else made
    assert ext.inline_call([base.view(3, 4)], sync_sum, lanes) is lane  # the same memory, size and dtype
    kept = ext.inline_call([base], dist.AllreduceOptions(), lanes)
    assert kept == ((base.data_ptr(), 12, torch.float32), False, True)  # c10d's defaults: SUM, asyncOp
    for other in ([base, base], [], base, None):
        assert ext.inline_call(other, sync_sum, lanes) is None
        assert torch_backend._python_reads(other, sync_sum, lanes) is None
    assert ext.inline_call([base], dist.AllreduceCoalescedOptions(), lanes) is None  # a subclass: not read raw
    assert ext.inline_call([base], dist.BroadcastOptions(), lanes) is None
    assert ext.inline_call([base.numpy()], dist.AllreduceOptions(), lanes) is None
    # a call from another thread or inside backward is not run inline (it must progress with nobody waiting)
    opts, got = dist.AllreduceOptions(), []
    assert ext.inline_call([base], opts, lanes) is not None
    assert torch_backend._python_reads([base], opts, lanes) is not None
    other = threading.Thread(target=lambda: got.append((ext.inline_call([base], opts, lanes),
                                                        torch_backend._python_reads([base], opts, lanes))))
    other.start()
    other.join()

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):  # a CPU graph: on this (the main) thread
            got.append((ext.inline_call([base], opts, lanes), torch_backend._python_reads([base], opts, lanes)))
            return g

    Probe.apply(torch.ones(3, requires_grad=True)).sum().backward()
    assert got == [(None, None), (None, None)]
