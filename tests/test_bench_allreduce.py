"""`switchsim bench allreduce` as nccl-tests reports it: the bandwidth arithmetic, the table's columns, the
#wrong checker, and no terminal codes when the output goes to a pipe."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from hostlib.codecs import natural
from inabench import allreduce as bench, report
from inabench.demo import make_input

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bandwidths_follow_nccl_tests():
    """nccl-tests (doc/PERFORMANCE.md): algbw = S/t; allreduce busbw = algbw * 2(n-1)/n."""
    algbw, busbw = bench.bandwidths(1 << 30, 0.5, 8)
    assert algbw == pytest.approx(2 * 1.073741824)  # GB = 1e9 bytes
    assert busbw == pytest.approx(algbw * 14 / 8)
    assert bench.bandwidths(4096, 1e-3, 2) == pytest.approx((4.096e-3, 4.096e-3))  # n=2: busbw = algbw
    assert bench.bandwidths(4096, 1e-3, 1)[1] == 0.0


def test_parse_size_units():
    assert [bench.parse_size(t) for t in ("1K", "64K", "1M", "256M", "4096", "2KiB", "1G")] == \
        [1024, 65536, 1 << 20, 256 << 20, 4096, 2048, 1 << 30]
    for bad in ("3", "0", "1.5"):
        with pytest.raises(ValueError):
            bench.parse_size(bad)


def _rows():
    """Rows as bench_allreduce makes them: two configurations, two sizes, plus the memory line."""
    reports = [(0, [1e-4, 2e-3], [0, 3]), (1, [3e-4, 4e-3], [None, None])]
    rows = bench._rows({"config": "c/int32 x2 1024 B", "backend": "c"}, [4096, 65536], reports, 2, "int32", False)
    rows += bench._rows({"config": "gloo x2", "backend": "gloo"}, [4096, 65536], reports, 2, "float", True)
    return rows


def test_table_has_nccl_columns_and_one_row_per_configuration_and_size():
    rows = _rows()
    assert rows[0]["time"] == pytest.approx(200.0)  # mean over ranks, in us
    assert rows[1]["#wrong"] == 3 and rows[0]["algbw"] == pytest.approx(4096 / 2e-4 / 1e9)
    text = report.nccl_table(rows)
    headers = [line.split() for line in text.splitlines() if line.startswith("#") and "redop" in line]
    assert headers == [["#", *report.NCCL_COLUMNS]] * 2
    data = [line.split() for line in text.splitlines() if line and not line.startswith("#")]
    assert len(data) == 4 and all(len(d) == len(report.NCCL_COLUMNS) for d in data)
    assert [d[0] for d in data] == ["4096", "65536"] * 2 and data[1][-1] == "3"
    assert "out of place" in text and "in place" in text


def test_wrong_is_zero_for_exact_int32_and_counts_corruption():
    xs = [make_input("int32", 5000, r) for r in range(3)]
    out = np.sum(xs, axis=0, dtype=np.int64).astype(np.int32)
    assert bench.count_wrong("int32", xs, out, 256) == 0
    out[[3, 77, 4999]] += 1
    assert bench.count_wrong("int32", xs, out, 256) == 3


def test_wrong_float32_bound_for_gloo():
    xs = [make_input("float32", 5000, r) for r in range(4)]
    out = (xs[0] + xs[1]) + (xs[2] + xs[3])  # float32, any order
    assert bench.count_wrong("float32", xs, out, 5000) == 0
    out[10] += 1e-3
    assert bench.count_wrong("float32", xs, out, 5000) == 1


def test_wrong_nc_accepts_every_level_rounding_and_flags_corruption():
    """The NC interval holds for results made by rounding the workers' codes' sum up or down (its two
    extremes) and stochastically; a value off the power-of-two grid or far out is counted."""
    k, xs = 1024, [make_input("nc", 4096, r) for r in range(2)]
    codes = [natural.encode(x, seed=r + 1) for r, x in enumerate(xs)]
    s = np.sum([natural.decode(c, np.float64) for c in codes], axis=0)
    mag, sign = np.abs(s), np.sign(s)
    m, e = np.frexp(mag)
    down = sign * np.where(mag > 0, np.ldexp(1.0, e - 1), 0.0)
    up = sign * np.where(mag > 0, np.ldexp(1.0, np.where(m == 0.5, e - 1, e)), 0.0)
    stochastic = natural.decode(natural.encode(s.astype(np.float32), seed=9))
    for out in (down, up, stochastic):
        assert bench.count_wrong("nc", xs, out.astype(np.float32), k) == 0
    bad = stochastic.copy()
    bad[5] = 0.75                       # not a power of two
    bad[6] = 2.0 ** 20                  # far beyond the sum of |x_i|
    bad[7] = -np.sign(s[7]) * 64.0      # the wrong sign and far out
    assert bench.count_wrong("nc", xs, bad, k) == 3


def _no_terminal_codes(run):
    assert run.returncode == 0, run.stderr
    for stream in (run.stdout, run.stderr):
        assert "\r" not in stream and "\x1b" not in stream


def test_demo_in_a_pipe_draws_no_progress_bar():
    run = subprocess.run([sys.executable, "-m", "switchsim", "demo", "--backend", "c", "--workers", "2",
                          "--size", "20000", "--codec", "int32"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    _no_terminal_codes(run)
    assert "result" in run.stdout and not run.stderr.strip()


def test_bench_allreduce_small_run_in_a_pipe():
    """One size, int32 on the C switch with gloo and the "ina" torch backend: the JSON rows and the table,
    without terminal codes."""
    cmd = [sys.executable, "-m", "switchsim", "bench", "allreduce", "--sizes", "4K", "--workers", "2",
           "--backends", "c", "--codecs", "int32,nc"]
    run = subprocess.run(cmd + ["--json"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    _no_terminal_codes(run)
    rows = {r["config"]: r for r in json.loads(run.stdout)["allreduce"]}
    assert set(rows) == {"np.copyto", "gloo x2", "torch ina c/int32 x2 1024 B", "c/int32 x2 1024 B",
                         "torch ina c/nc x2 1024 B", "c/nc x2 1024 B"}
    assert not [r for r in rows.values() if "error" in r]  # floats summed in place 100 times: renewed, finite
    assert rows["torch ina c/nc x2 1024 B"]["#wrong"] == 0 and rows["gloo x2"]["#wrong"] == 0
    torch_ina = rows["torch ina c/int32 x2 1024 B"]
    assert torch_ina["#wrong"] == 0 and torch_ina["in place"] and torch_ina["recoveries"] == 0
    assert 0.2 < torch_ina["x hostlib"] < 5  # paired with hostlib's calls in its own processes
    assert torch_ina["gloo calls"] == 0  # every call went through the switch
    ina = rows["c/int32 x2 1024 B"]
    assert ina["#wrong"] == 0 and ina["count"] == 1024 and ina["x gloo"] > 0 and rows["gloo x2"]["#wrong"] == 0
    assert ina["busbw"] == pytest.approx(ina["algbw"]) == pytest.approx(4096 / ina["time"] / 1e3)
    table = cmd[:-1] + ["int32", "--no-gloo", "--iters", "3"]  # the table, of one configuration
    run = subprocess.run(table, capture_output=True, text=True, timeout=300, cwd=ROOT)
    _no_terminal_codes(run)
    assert "#       size         count    type  redop" in run.stdout and "c/int32 x2 1024 B" in run.stdout


def test_bench_allreduce_sweeps_windows_on_shared_memory():
    """--windows: one configuration per window (the window item's sweep), each exact (--iters: calls timed); --backends shm serves
    the ranks through shared-memory rings."""
    cmd = [sys.executable, "-m", "switchsim", "bench", "allreduce", "--sizes", "64K", "--workers", "2",
           "--backends", "shm", "--codecs", "int32", "--windows", "4,32", "--iters", "3", "--no-gloo", "--json"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    _no_terminal_codes(run)
    rows = {r["config"]: r for r in json.loads(run.stdout)["allreduce"]}
    assert set(rows) == {"np.copyto", "shm/int32 x2 1024 B W=4", "shm/int32 x2 1024 B W=32"}
    for w in (4, 32):
        r = rows[f"shm/int32 x2 1024 B W={w}"]
        assert r["window"] == w and r["#wrong"] == 0 and r["time"] > 0


def test_plain_rows_pair_their_calls_with_out_in_the_same_processes():
    """--plain: `y = allreduce(x)` in batches alternating with `allreduce(x, out=y)` on the same connection;
    the row's x out is the median over pairs of plain over out= (rows of separate process sets, seconds apart,
    move by ±10 % on a shared VM), the result exact, and the table says it."""
    from inabench import allreduce

    assert allreduce.paired_ratio([[(2.0, 1.0), (3.0, 3.0), (1.0, 2.0)], [(2.0, 1.0), (3.0, 3.0), (1.0, 2.0)]]) == 1.0
    assert allreduce.paired_ratio([[(2.0, 1.0)], [(4.0, 1.0)]]) == 3.0  # the ranks' means, then the ratio
    cmd = [sys.executable, "-m", "switchsim", "bench", "allreduce", "--sizes", "4K,64K", "--workers", "2",
           "--backends", "c", "--codecs", "int32", "--plain", "--iters", "3", "--no-gloo"]
    run = subprocess.run(cmd + ["--json"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    _no_terminal_codes(run)
    rows = [r for r in json.loads(run.stdout)["allreduce"] if r["config"] == "c/int32 x2 1024 B plain"]
    assert [r["size"] for r in rows] == [4096, 65536]
    for r in rows:
        assert r["#wrong"] == 0 and 0.2 < r["x out"] < 5 and r["time"] > 0
    assert all("x out" not in r for r in json.loads(run.stdout)["allreduce"] if not r["config"].endswith("plain"))
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert "# c/int32 x2 1024 B plain: out of place; x out " in run.stdout


def test_timed_calls_cover_enough_bytes_and_at_least_four_calls_per_size():
    """Without --iters a size gets about TIMED_BYTES of calls within TIMED_CALLS: small calls are not timed over
    ~10 ms (20 calls of 1 KiB were), nor a 64 MiB row by a single call; --iters wins; as many warm-up calls
    as timed ones, at least WARMUP."""
    from inabench import allreduce

    lo, hi = allreduce.TIMED_CALLS
    assert allreduce._iterations(1024) == (hi, hi) == (100, 100)  # as many warm-up calls as timed ones
    assert allreduce._iterations(4 << 20) == (64, 64) and allreduce._iterations(64 << 20)[1] == lo == 4
    assert allreduce._iterations(1 << 30)[1] == 4 and allreduce._iterations(64 << 20, 7) == (7, 7)
    assert allreduce._iterations(1024, 1) == (allreduce.WARMUP, 1) == (2, 1)


def test_repeat_reports_medians_spread_and_ratio_to_gloos_median(monkeypatch):
    """--repeat R: every configuration runs R times in alternating order; a row is the median of its runs,
    with their min and max, and x gloo divides by gloo's median. Measured here with stand-in runs whose
    times are known, so the arithmetic and the order are checked, not the machine."""

    order, times = [], {"gloo": [30.0, 10.0, 20.0], "ina": [5.0, 7.0, 6.0]}

    def fake(label):
        def run():
            order.append(label)
            t = times[label][sum(x == label for x in order) - 1]
            return [{"config": label, "backend": label, "size": 4096, "count": 1024, "type": "int32",
                     "time": t, "algbw": 0.0, "busbw": 0.0, "#wrong": 0}]
        return run

    monkeypatch.setattr(bench, "_runs", lambda *a, **k: [("gloo", fake("gloo")), ("ina", fake("ina"))])
    monkeypatch.setattr(bench, "copyto_seconds", lambda size: 1e-6)
    rows = {r["config"]: r for r in bench.bench_allreduce([4096], [2], ["c"], ["int32"], repeat=3)}
    assert order == ["gloo", "ina", "ina", "gloo", "gloo", "ina"]  # reversed every other round
    assert (rows["gloo"]["time"], rows["gloo"]["min us"], rows["gloo"]["max us"]) == (20.0, 10.0, 30.0)
    assert (rows["ina"]["time"], rows["ina"]["min us"], rows["ina"]["max us"]) == (6.0, 5.0, 7.0)
    assert rows["ina"]["x gloo"] == pytest.approx(6.0 / 20.0) and rows["ina"]["repeat"] == 3
    assert "min" in report.nccl_table(list(rows.values())) and "x gloo" in report.nccl_table(list(rows.values()))


def test_profile_allreduce_reports_cpu_per_process_and_sorts_samples():
    """benchmarks/profile_allreduce.py on a small call without perf: the switch and every rank get CPU
    seconds of the timed calls, the wall time is positive, and perf's symbols fall in the named causes."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    try:
        import profile_allreduce as prof
    finally:
        sys.path.pop(0)
    r = prof.profile_ina("c", "nc", 2, 1 << 20, 8192, 1, 3, use_perf=False)
    assert set(r["cpu"]) == {"switch", "rank 0", "rank 1"} and r["perf"] == "--no-perf"
    assert r["wall s/call"] > 0 and r["elapsed s"] >= 3 * r["wall s/call"] * 0.5
    assert all(v["user s/call"] >= 0 and v["sys s/call"] >= 0 for v in r["cpu"].values())
    assert "rank 1" in prof.report(r)
    assert prof.categorise("nc_encode", "_kernels.abi3.so").startswith("encode")
    assert prof.categorise("nc_add_finish_avx512", "_native.abi3.so").startswith("switch aggregation")
    assert prof.categorise("_copy_from_iter", "[kernel.kallsyms]").startswith("kernel: network")
    assert prof.categorise("futex_wait", "[kernel.kallsyms]").startswith("kernel: scheduler")
    assert prof.categorise("pv_native_safe_halt", "[kernel.kallsyms]") == "idle"


def test_figures_take_ratios_within_an_invocation_then_medians_over_invocations():
    """benchmarks/allreduce_figures.py: x gloo, x out (plain over out=) and x hostlib (torch over hostlib) per
    invocation, then the median over invocations with the spread; a configuration's error row is left out."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import allreduce_figures as figures

    def invocation(gloo, out, plain, torch):
        return figures.ratios([
            {"config": "gloo x4", "backend": "gloo", "size": 1024, "time": gloo},
            {"config": "c/nc x4 1024 B", "backend": "c", "size": 1024, "time": out},
            {"config": "c/nc x4 1024 B plain", "backend": "c", "size": 1024, "time": plain},
            {"config": "torch ina c/nc x4 1024 B", "backend": "torch ina c", "size": 1024, "time": torch},
            {"config": "c/int32 x4 1024 B", "backend": "c", "size": 1024, "error": "refused"}])

    rows = {r["config"]: r for r in figures.summary([invocation(10, 2, 3, 4), invocation(20, 3, 3, 9),
                                                      invocation(12, 2, 2.2, 2)])}
    assert "c/int32 x4 1024 B" not in rows
    out = rows["c/nc x4 1024 B"]
    assert out["time"] == 2 and (out["time min"], out["time max"]) == (2, 3) and out["invocations"] == 3
    assert out["x gloo"] == pytest.approx(2 / 12) and out["x gloo spread"] == pytest.approx((0.15, 0.2))
    assert rows["c/nc x4 1024 B plain"]["x out"] == pytest.approx(1.1)  # median of 1.5, 1.0, 1.1
    assert rows["torch ina c/nc x4 1024 B"]["x hostlib"] == pytest.approx(2)  # median of 2, 3, 1
    assert "x out" not in out and "x hostlib" not in out
    paired = figures.ratios([{"config": "c/nc x4 1024 B", "backend": "c", "size": 1024, "time": 2.0},
                             {"config": "c/nc x4 1024 B plain", "backend": "c", "size": 1024, "time": 3.0,
                              "x out": 1.02}])
    assert paired["c/nc x4 1024 B plain", 1024]["x out"] == 1.02  # the row's own, paired in its processes
    torch = figures.ratios([{"config": "c/nc x4 1024 B", "backend": "c", "size": 1024, "time": 2.0},
                            {"config": "torch ina c/nc x4 1024 B", "backend": "torch ina c", "size": 1024,
                             "time": 3.0, "x hostlib": 1.07}])["torch ina c/nc x4 1024 B", 1024]
    assert torch["x hostlib"] == 1.07 and torch["x hostlib, rows"] == 1.5  # its own paired ratio, and the rows'
    table = figures.table(figures.summary([{("torch ina c/nc x4 1024 B", 1024): torch}]),
                          {"commit": "c0ffee", "changes": False, "cpu": "cpu", "cores": 2, "switch lanes": "avx2",
                           "worker kernels": "avx2"}, type("Args", (), {"invocations": 1, "repeat": 5}))
    assert "| x hostlib | x hostlib, rows |" in table and "| 1.07 (1.07-1.07) | 1.5 (1.5-1.5) |" in table


def test_figures_say_the_simd_paths_and_uncommitted_changes_they_ran_with(monkeypatch):
    """One CPU model name covers machines with and without AVX-512, whose switches sum NC rounds in other lanes:
    the header says which paths ran, and a tree that differs from its commit says so."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import allreduce_figures as figures

    from hostlib import kernels

    monkeypatch.setenv("INA_SWITCH_SIMD", "scalar")
    info = figures.machine()
    assert info["switch lanes"] == "scalar" and info["worker kernels"] == kernels.simd_path()
    header = figures.table([], {**info, "changes": True}, type("Args", (), {"invocations": 3, "repeat": 5}))
    assert "switch lanes scalar" in header and "with uncommitted changes" in header
    assert "uncommitted" not in figures.table([], {**info, "changes": False},
                                              type("Args", (), {"invocations": 3, "repeat": 5}))


def test_alternating_calls_peels_the_torch_path():
    """benchmarks/alternating_calls.py --layers: every variant, the torch path's layers too, times calls in turn
    on one group, each with its CPU, and none of them fell back to gloo."""
    pytest.importorskip("torch")
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "alternating_calls.py"), "--size", "1K",
                          "--workers", "2", "--codec", "int32", "--rounds", "2", "--batch", "3", "--layers", "--json"],
                         capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout)
    rows = {r["variant"]: r for r in got["rows"]}
    assert set(rows) == {"hostlib out=", "hostlib plain", "hostlib in place", "hostlib persistent",
                         "torch dist.all_reduce", "torch pg.allreduce, new options", "torch pg.allreduce",
                         "torch calls.sum"}
    assert got["gloo calls"] == 0 and rows["hostlib out="]["x hostlib out="] == pytest.approx(1.0)
    assert all(r["us per call"] > 0 and r["cpu us per call"] > 0 for r in rows.values())
