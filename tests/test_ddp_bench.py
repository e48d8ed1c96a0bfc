"""`switchsim bench ddp`: DDP steps per gradient path as PyTorch's DDP benchmark reports them, on loopback
and on namespace hosts; every run checks the ranks' parameters are bit-identical."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="torch (the torch extra) is not installed")

from inabench import ddp  # noqa: E402
from inabench.harness import ROOT  # noqa: E402
from switchsim.netns import Topology  # noqa: E402


def test_every_path_trains_the_same_parameters_on_every_rank_and_reports_percentiles():
    """Every path on loopback; a path that fails (the int32 hook refuses float gradients) is a row with its
    error, and the others still run."""
    rows = ddp.bench_ddp(workers=(2,), paths=("gloo", "ina:nc", "hook:nc", "hook:int32"), model="mlp", iters=4,
                         warmup=1, repeat=1)
    assert [(r["path"], r["workers"]) for r in rows] == [("local", 1), ("gloo", 2), ("ina:nc", 2), ("hook:nc", 2),
                                                          ("hook:int32", 2)]
    assert "integer gradients" in rows[-1]["error"]
    for r in rows[:-1]:
        assert r.get("params equal") is True, r  # a row with an error shows it
        assert 0 < r["sec/iter p50"] <= r["sec/iter p75"] <= r["sec/iter p90"] <= r["sec/iter p95"]
        assert r["examples/s p50"] == pytest.approx(32 * r["workers"] / r["sec/iter p50"], rel=0.01)
    by = {r["path"]: r for r in rows}
    assert by["gloo"]["x gloo"] == 1.0 and by["gloo"]["INA MB/rank/step"] is None
    # the switch carried the gradients, a byte per element (float32: four), headers included
    for path in ("ina:nc", "hook:nc"):
        assert 0.25 * by[path]["grad MB"] < by[path]["INA MB/rank/step"] < 0.5 * by[path]["grad MB"]


def test_a_row_of_sub_millisecond_steps_keeps_its_times_and_rates_consistent():
    """Step times keep their significant digits: a 0.732 ms step rounded to 10 us (0.73 ms) would put
    examples/s 1.2 % off the sec/iter beside it (seen on a fast machine)."""
    steps = [0.000732, 0.000731, 0.000733, 0.00074, 0.00075]
    reports = [{"steps": steps, "checksum": 7, "grad_bytes": 4000} for _ in range(2)]
    row = ddp.row_of("gloo", 2, "mlp", 32, [reports], steps=len(steps))
    assert row["sec/iter p50"] == pytest.approx(0.000733, rel=1e-4)
    assert row["examples/s p50"] == pytest.approx(64 / row["sec/iter p50"], rel=1e-3)
    assert row["sec/iter p50"] <= row["sec/iter p75"] <= row["sec/iter p90"] <= row["sec/iter p95"]


def test_time_to_accuracy_and_diff():
    assert ddp.time_to_accuracy([[1.0, 0.5], [2.0, 0.96], [3.0, 0.97]], 0.95) == (2, 2.0)
    assert ddp.time_to_accuracy([[1.0, 0.5]], 0.95) == (None, None)
    row = {"model": "wide", "workers": 4, "path": "ina:nc", "sec/iter p50": 0.2, "sec/iter p95": 0.4}
    out = ddp.diff({"ddp": [row]}, {"ddp": [{**row, "sec/iter p50": 0.1, "sec/iter p95": 0.5}]})
    assert out == [{"model": "wide", "workers": 4, "path": "ina:nc", "p50 a": 0.2, "p50 b": 0.1, "p50 b/a": 0.5,
                    "p95 a": 0.4, "p95 b": 0.5, "p95 b/a": 1.25}]


def test_the_command_prints_json_and_diffs_it_and_a_straggler_slows_every_step(tmp_path):
    cmd = [sys.executable, "-m", "switchsim", "bench", "ddp", "--json", "--workers", "2", "--paths", "gloo",
           "--model", "mlp", "--iters", "2", "--warmup", "1", "--repeat", "1", "--straggler", "1:80"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["ddp"]
    assert [r["path"] for r in rows] == ["local", "gloo"]
    assert rows[1]["sec/iter p50"] >= 0.08 > rows[0]["sec/iter p50"]  # rank 1's 80 ms hold every step back
    (tmp_path / "a.json").write_text(out.stdout)
    d = subprocess.run([sys.executable, "-m", "switchsim", "bench", "ddp", "--json", "--diff", tmp_path / "a.json",
                        tmp_path / "a.json"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert d.returncode == 0, d.stderr
    assert [r["p50 b/a"] for r in json.loads(d.stdout)["diff"]] == [1.0, 1.0]


@pytest.mark.skipif(bool(Topology.why_not(0.0, 1.0)), reason=Topology.why_not(0.0, 1.0) or "-")
def test_two_namespace_hosts_train_ddp_through_the_switch_and_gloo_over_the_same_links():
    from topologies.ddp import Hosts, with_projection

    rows = ddp.bench_ddp(workers=(2,), paths=("gloo", "ina:nc"), model="mlp", iters=3, warmup=1, repeat=1,
                         place_for=lambda world: Hosts(world, "c", bw=100, delay_ms=1.0))
    rows = with_projection(rows, 100, 1.0, 0.0)
    for r in rows:
        assert r["params equal"] is True, r
    gloo, ina = rows[1], rows[2]
    assert gloo["link MB/step"] > 0 and ina["link MB/step"] > 0  # the worker links carried the steps
    assert gloo["model s/iter"] > 0 and ina["model s/iter"] > 0


def test_the_topology_window_is_about_ten_ms_of_the_link():
    from topologies.cli import topo_window

    assert topo_window(100) == 117 and topo_window(1000) == 1024 and topo_window(1) == 16


@pytest.mark.skipif(bool(Topology.why_not(0.0, 1.0)), reason=Topology.why_not(0.0, 1.0) or "-")
def test_the_hosts_tcp_is_the_one_asked_and_a_missing_one_is_named():
    """gloo's TCP on the namespace hosts is --tcp-cc's (a new namespace takes the host's own, which may be BBR),
    and a congestion control the kernel lacks is a named error that leaves no namespace behind."""
    from topologies.ddp import Hosts

    hosts = Hosts(2, "c", bw=100, delay_ms=1.0, tcp_cc="reno")
    try:
        for ns in hosts.dep.topo.worker_ns:
            got = hosts.dep.topo.run(ns, ["sysctl", "-n", "net.ipv4.tcp_congestion_control"], capture_output=True,
                                     text=True).stdout.strip()
            assert got == "reno", ns
    finally:
        hosts.close()
    before = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    with pytest.raises(ValueError, match="--tcp-cc no-such-cc"):
        Hosts(2, "c", bw=100, delay_ms=1.0, tcp_cc="no-such-cc")
    assert set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()) <= before


def test_two_jobs_at_once_share_one_switch_and_each_trains_exactly():
    """--jobs 2: two DDP jobs at once on one shared switch (loopback), each through the switch, each job's
    ranks bit-identical."""
    place = ddp.Loopback("c", shared=True)
    try:
        reports = ddp.run_config(place, "ina:nc", 2, "mlp", 32, 1, 3, jobs=2)
    finally:
        place.close()
    assert sorted((r["job"], r["rank"]) for r in reports) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    for job in (1, 2):
        mine = [r for r in reports if r["job"] == job]
        assert len({r["checksum"] for r in mine}) == 1 and all(r["ina_bytes"] > 0 for r in mine), mine


def test_a_jobs_row_says_its_time_over_the_solo_row():
    steps = [0.010, 0.011, 0.012]
    solo = [{"steps": steps, "checksum": 1, "grad_bytes": 4000, "job": 1} for _ in range(2)]
    both = [{"steps": [2 * t for t in steps], "checksum": job, "grad_bytes": 4000, "job": job} for job in (1, 2)
            for _ in range(2)]  # each job's ranks agree; the jobs need not (their NC seeds differ)
    rows = [ddp.row_of("ina:nc", 2, "mlp", 32, [solo], 3), ddp.row_of("ina:nc", 2, "mlp", 32, [both], 3)]
    assert rows[1]["jobs"] == 2 and "jobs" not in rows[0] and rows[1]["params equal"] is True
    assert ddp._ratio(rows[1], rows, path="ina:nc") == 2.0
