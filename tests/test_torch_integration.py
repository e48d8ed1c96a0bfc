"""The DDP communication hook under torchrun, against DDP's own allreduce hook."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[torch]')")
import torch.distributed as dist  # noqa: E402

from hostlib.integrations.torch import INAHookState, ina_hook  # noqa: E402
from inabench.harness import free_port  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def torchrun(script, args, env, nproc=2, timeout=240):
    torchrun_bin = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun_bin, "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), script, *args]
    return subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", **env}, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """One torchrun with 2 ranks training every mode; a C switch serving one job per INA mode."""
    from .conftest import SwitchProcess

    out = tmp_path_factory.mktemp("ddp")
    modes = ["default-int32", "ina-int32", "default-float", "ina-fixed", "ina-nc"]
    ina_jobs = [f"{j}:2" for j, m in enumerate(modes, start=1) if m.startswith("ina")]
    sw = SwitchProcess(*[a for j in ina_jobs for a in ("--job", j)], backend="c")
    try:
        run = torchrun(os.path.join(HERE, "scripts", "ddp_compare.py"), modes,
                       {"OUT": str(out), "INA_SWITCH": sw.address})
    finally:
        sw.stop()
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    def load(mode, rank):
        return torch.load(out / f"{mode}-{rank}.pt")

    return load


def test_int32_hook_gives_the_default_hooks_parameters_bit_for_bit(ddp_runs):
    for rank in (0, 1):
        want, got = ddp_runs("default-int32", rank), ddp_runs("ina-int32", rank)
        assert want["grad_max"] < 2**24  # float32 sums of these gradients are exact: the comparison is fair
        for a, b in zip(want["params"], got["params"]):
            assert torch.equal(a, b)
            assert torch.equal(b, torch.round(b))  # integers, as the set-up intends
    assert all(torch.equal(a, b) for a, b in zip(ddp_runs("ina-int32", 0)["params"], ddp_runs("ina-int32", 1)["params"]))


@pytest.mark.parametrize("codec,tolerance", [("fixed", 1e-5), ("nc", 0.5)])
def test_fixed_and_nc_hooks_track_the_default_hook(ddp_runs, codec, tolerance):
    """After the same steps, the parameters differ from DDP's own by a small part of how far training
    moved them: fixed point by its rounding (2^-31 of each block's max); NC by its stochastic rounding, whose
    variance is at most 1/8 of |x|^2 per compression (worker and switch), about 0.2 of the path here."""
    start = torch.cat([p.detach().reshape(-1) for p in _float_model_init()])
    for rank in (0, 1):
        want = torch.cat([p.reshape(-1) for p in ddp_runs("default-float", rank)["params"]])
        got = torch.cat([p.reshape(-1) for p in ddp_runs(f"ina-{codec}", rank)["params"]])
        moved = float((want - start).norm())
        assert moved > 0.01
        assert float((got - want).norm()) <= tolerance * moved, (float((got - want).norm()), moved)
    # every rank applies the same averaged gradient
    a, b = (torch.cat([p.reshape(-1) for p in ddp_runs(f"ina-{codec}", r)["params"]]) for r in (0, 1))
    assert torch.equal(a, b)


def _float_model_init():
    sys.path.insert(0, os.path.join(HERE, "scripts"))
    try:
        import ddp_compare
    finally:
        sys.path.pop(0)
    return list(ddp_compare.float_model().parameters())


def test_hook_surfaces_a_bad_gradient_as_an_error_in_backward(tmp_path):
    """codec int32 with non-integer gradients: DDP's backward raises the hook's ValueError itself (not
    "Unable to cast ... to Tensor": the future holds a C++ error, hostlib.integrations.futures)."""
    from .conftest import SwitchProcess

    sw = SwitchProcess("--workers", 1, backend="c")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        state = INAHookState(switch=sw.address, codec="int32")
        model.register_comm_hook(state, ina_hook)
        with pytest.raises(ValueError, match="integer gradients") as caught:
            model(torch.randn(3, 4)).sum().backward()
        assert "Unable to cast" not in str(caught.value)
        state.close()
    finally:
        dist.destroy_process_group()
        sw.stop()


def test_state_needs_a_switch_address(monkeypatch):
    for var in ("INA_SWITCH", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    state = INAHookState(codec="fixed")
    with pytest.raises(ValueError, match="INA_SWITCH"):
        state.connect(0, 1)
    with pytest.raises(ValueError, match="codec"):
        INAHookState(codec="zip")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    monkeypatch.setenv("INA_SWITCH_PORT", "5000")
    from hostlib.integrations.common import switch_address

    assert switch_address() == "10.0.0.7:5000"
    for bad in ({"codec": "int32", "block_topk": 0.1}, {"codec": "fixed", "block_topk": 0.0},
                {"codec": "topk", "block_topk": 0.5}):
        with pytest.raises(ValueError, match="block_topk"):
            INAHookState(**bad)




@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine (torch.cuda.is_available() "
                                                          "is False); the hook's CUDA path runs on a GPU machine")
def test_hook_averages_cuda_gradients(tmp_path):
    """One rank on a GPU: the hook hands back a CUDA tensor equal to the gradient (mean over one rank)."""
    from .conftest import SwitchProcess

    sw = SwitchProcess("--workers", 1, backend="c")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        plain = torch.nn.Linear(64, 8).cuda()
        hooked = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 8).cuda())
        hooked.module.load_state_dict(plain.state_dict())
        state = INAHookState(switch=sw.address, codec="fixed")
        hooked.register_comm_hook(state, ina_hook)
        x = torch.randn(16, 64, device="cuda")
        plain(x).pow(2).sum().backward()
        hooked(x).pow(2).sum().backward()
        for a, b in zip(plain.parameters(), hooked.module.parameters()):
            assert b.grad.is_cuda and torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6)
        state.close()
    finally:
        dist.destroy_process_group()
        sw.stop()


def test_state_pickles_without_its_connection_and_keeps_its_residuals():
    """Like PowerSGD's state: DDP may copy it; the connection, thread and group stay behind, the error
    feedback (the training's memory) goes along, and the copy reconnects on first use."""
    import pickle

    import numpy as np

    state = INAHookState(switch="127.0.0.1:9", codec="nc", rounding="deterministic")
    memory = state.reducer.strategy.memory
    assert memory.enabled  # deterministic NC: error feedback by default
    memory.update(3, np.arange(4, dtype=np.float32))
    copy = pickle.loads(pickle.dumps(state))
    assert copy.reducer.comm is None and copy.process_group is None
    assert np.array_equal(copy.reducer.strategy.memory.residuals[3], np.arange(4, dtype=np.float32))
    assert copy.reducer.allgather == copy._allgather_bytes and copy._executor.submit(lambda: 7).result() == 7
    state.close()
    copy.close()


def test_topk_state_pickles_with_its_step_counters():
    """codec="topk" with a stochastic value codec seeds each (step, rank, bucket) apart: a copied state
    goes on from the same step, so it draws what the original would have."""
    import pickle

    state = INAHookState(codec="topk", value="qsgd")
    strategy = state.reducer.strategy
    strategy.steps[3] = 5
    copy = pickle.loads(pickle.dumps(state)).reducer.strategy
    assert copy.steps == {3: 5}
    assert copy.container_for(5, 1, 3).value.seed == strategy.container_for(5, 1, 3).value.seed != \
        strategy.container_for(6, 1, 3).value.seed
    state.close()
