"""Training through the INA hook on a real dataset converges like training through gloo."""
from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[torch]')")
pytest.importorskip("sklearn", reason="scikit-learn is not installed (pip install -e '.[bench]')")

from inabench import convergence  # noqa: E402


def test_digits_mlp_with_fixed_and_nc_matches_gloo(tmp_path):
    res = convergence.run(workers=2, modes=("gloo", "fixed", "nc", "topk:golomb:qsgd", "blocktopk:nc:0.1"), epochs=4)
    rows = {r["mode"]: r for r in res["rows"]}
    assert rows["gloo"]["accuracy"] > 0.9
    assert abs(rows["fixed"]["accuracy"] - rows["gloo"]["accuracy"]) <= 0.01
    assert abs(rows["nc"]["accuracy"] - rows["gloo"]["accuracy"]) <= 0.03
    # bytes: NC sends a quarter of float32 plus headers; fixed point about float32's size
    assert 0.2 < rows["nc"]["x float32"] < 0.4 and 0.95 < rows["fixed"]["x float32"] < 1.3
    # the sparse path (top-1 %, Golomb positions, QSGD values, by allgather) learns too, from ~1 % of the bytes
    assert rows["topk:golomb:qsgd"]["accuracy"] > 0.85 and rows["topk:golomb:qsgd"]["x float32"] < 0.02
    # block top-10 % through the switch's block-sparse INA (NC codes): learns from a fraction of the bytes
    assert rows["blocktopk:nc:0.1"]["accuracy"] > 0.9 and rows["blocktopk:nc:0.1"]["x float32"] < 0.1
    hist = res["exponents"]
    assert sum(hist) > 0 and len(hist) == 256
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install -e '.[bench]')")
    convergence.plot(res, str(tmp_path / "train.png"))
    assert (tmp_path / "train.png").stat().st_size > 10_000
