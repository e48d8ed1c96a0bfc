"""The Horovod integration under horovodrun (2 ranks, gloo), against Horovod's own DistributedOptimizer.
`make test` builds Horovod 0.28.1 for torch 2.13 (tools/install-horovod.sh, cached between runs)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[torch]')")
pytest.importorskip("horovod.torch", reason="horovod is not installed: tools/install-horovod.sh .venv/bin/python "
                                            "builds it (make test does)")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@pytest.fixture(scope="module")
def hvd_runs(tmp_path_factory):
    from .conftest import SwitchProcess

    out = tmp_path_factory.mktemp("hvd")
    modes = ["hvd-int32", "ina-int32", "hvd-float", "ina-fixed", "ina-topk", "ina-blocktopk"]
    jobs = [a for j, m in enumerate(modes, start=1) if m in ("ina-int32", "ina-fixed", "ina-blocktopk")
            for a in ("--job", f"{j}:2")]
    sw = SwitchProcess(*jobs, backend="c")
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    env = {**os.environ, "OUT": str(out), "INA_SWITCH": sw.address, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([os.path.join(HERE, "scripts"), ROOT])}
    try:
        run = subprocess.run([horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
                              os.path.join(HERE, "scripts", "horovod_compare.py"), *modes],
                             env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    finally:
        sw.stop()
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return lambda mode, rank: torch.load(out / f"{mode}-{rank}.pt")


def test_int32_through_the_switch_equals_horovods_allreduce(hvd_runs):
    for rank in (0, 1):
        want, got = hvd_runs("hvd-int32", rank), hvd_runs("ina-int32", rank)
        for a, b in zip(want["params"], got["params"]):
            assert torch.equal(a, b)
        assert got["stats"]["packets_sent"] > 0 and got["stats"]["allreduces"] == 4  # one stream per step


def test_fixed_point_tracks_horovods_allreduce(hvd_runs):
    for rank in (0, 1):
        want = torch.cat([p.reshape(-1) for p in hvd_runs("hvd-float", rank)["params"]])
        got = torch.cat([p.reshape(-1) for p in hvd_runs("ina-fixed", rank)["params"]])
        assert float((got - want).norm()) <= 1e-5 * float(want.norm())


def test_sparse_path_under_horovod(hvd_runs):
    """codec='topk': every rank applies the same averaged sparse gradient, moved from the start, and sent
    a fraction of the dense bytes."""
    a, b = (torch.cat([p.reshape(-1) for p in hvd_runs("ina-topk", r)["params"]]) for r in (0, 1))
    from .test_torch_integration import _float_model_init

    start = torch.cat([p.detach().reshape(-1) for p in _float_model_init()])
    assert torch.equal(a, b) and torch.isfinite(a).all() and float((a - start).norm()) > 0.01
    dense_bytes = 4 * a.numel() * 4  # float32, 4 steps
    assert 0 < hvd_runs("ina-topk", 0)["stats"]["bytes_sent"] < 0.5 * dense_bytes


def test_block_topk_through_the_switch_under_horovod(hvd_runs):
    """block_topk: each rank's top blocks travel by block-sparse INA; both ranks apply the same average."""
    from .test_torch_integration import _float_model_init

    a, b = (torch.cat([p.reshape(-1) for p in hvd_runs("ina-blocktopk", r)["params"]]) for r in (0, 1))
    start = torch.cat([p.detach().reshape(-1) for p in _float_model_init()])
    assert torch.equal(a, b) and torch.isfinite(a).all() and float((a - start).norm()) > 0.01
    stats = hvd_runs("ina-blocktopk", 0)["stats"]
    assert stats["allreduces"] > 0 and stats["packets_sent"] > 0
