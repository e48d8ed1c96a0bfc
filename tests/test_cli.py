import json
import os
import subprocess
import sys

import pytest

from .conftest import ROOT


def switchsim(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "switchsim", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("codec,loss", [("int32", 0.02), ("fixed", 0.0), ("nc", 0.02)])
def test_demo_json_checks_against_numpy(codec, loss):
    r = switchsim("demo", "--workers", 3, "--size", 30000, "--codec", codec, "--loss", loss, "--json",
                  "--timeout", 30)
    assert r.returncode == 0, r.stdout + r.stderr
    s = json.loads(r.stdout)
    assert s["ok"] and s["identical_on_all_workers"] and s["check"]["ok"]
    assert s["switch"]["jobs"]["1"]["multicast"] > 0
    if codec == "int32":
        assert s["check"]["max_abs_error"] == 0
    if codec == "nc":
        assert s["bytes_ratio_vs_float32"] < 0.5
    if loss:
        assert s["retransmissions"] > 0


def test_demo_table_output():
    r = switchsim("demo", "--workers", 2, "--size", 5000, "--codec", "fixed")
    assert r.returncode == 0, r.stderr
    assert "bytes sent per worker" in r.stdout and "OK" in r.stdout


def test_serve_rejects_bad_configuration():
    r = switchsim("serve", "--workers", 100, "--port", 0, timeout=20)
    assert r.returncode == 2 and "world size 100" in r.stderr
    r = switchsim("serve", "--job", "x", "--port", 0, timeout=20)
    assert r.returncode != 0 and "ID:WORKERS" in r.stderr
    r = switchsim("serve", "--job", "1:2", "--pool", 64, "--port", 0, timeout=20)
    assert r.returncode == 2 and "shared switch's" in r.stderr
    r = switchsim("serve", "--admit", "keyed", "--port", 0, timeout=20)
    assert r.returncode == 2 and "--key-dir" in r.stderr


def test_keys_issued_and_revoked_for_a_keyed_shared_switch(tmp_path):
    keys = tmp_path / "keys"
    r = switchsim("key", "issue", "--key-dir", keys, "--job", 7, timeout=20)
    assert r.returncode == 0 and r.stdout.strip() == str(keys / "7.key")
    assert (keys / "7.key").stat().st_mode & 0o777 == 0o600 and len((keys / "7.key").read_text().strip()) == 64
    again = switchsim("key", "issue", "--key-dir", keys, "--job", 7, timeout=20)
    assert again.returncode == 1 and "has a key already" in again.stderr
    assert switchsim("key", "revoke", "--key-dir", keys, "--job", 7, timeout=20).returncode == 0
    assert not (keys / "7.key").exists()
    assert switchsim("key", "revoke", "--key-dir", keys, "--job", 7, timeout=20).returncode == 1


def test_stats_command(switch_process):
    sw = switch_process("--workers", 2)
    r = switchsim("stats", sw.address, timeout=20)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["jobs"]["1"]["world_size"] == 2 and "impairment" in s
    r = switchsim("stats", "127.0.0.1:9", "--timeout", 0.5, timeout=20)
    assert r.returncode == 1 and "no answer" in r.stderr


def test_bench_subcommands_take_only_their_flags(monkeypatch):
    """`switchsim bench NAME` parses NAME's flags only and hands inabench keyword arguments its function
    takes; `bench` and `bench all` run every benchmark with its defaults, as `bench` always did."""
    import inspect

    import inacli as cli
    from inabench import allreduce, bench, bench_sparse, convergence, micro

    functions = {"codecs": micro.bench_codecs, "switch": bench.bench_switch, "allreduce": allreduce.bench_allreduce,
                 "blocksparse": allreduce.bench_block_sparse, "sparse": bench_sparse.bench_sparse,
                 "sparcml": bench_sparse.bench_sparcml, "train": convergence.run}
    calls = []
    monkeypatch.setattr(bench, "run_benchmarks", lambda runs, **kw: calls.append((runs, kw)) or 0)
    for argv in (["bench"], ["bench", "all", "--json"], ["bench", "--json"]):
        assert cli.main(argv) == 0
        runs, kw = calls.pop()
        assert list(runs) == list(bench.BENCHMARKS) == list(functions) and kw["as_json"] == ("--json" in argv)
        for name, kwargs in runs.items():
            inspect.signature(functions[name]).bind(**kwargs)
    assert runs["train"]["workers"] == 4 and runs["switch"]["packets"] == 200_000
    cli.main(["bench", "blocksparse", "--sizes", "0.5", "--workers", "2", "--densities", "0.1,1", "--no-gloo",
              "--plot", "x.png"])
    runs, kw = calls.pop()
    assert runs == {"blocksparse": {"sizes_mib": [0.5], "workers_list": [2], "backends": ["python", "c"],
                                    "codecs": ["int32", "fixed", "nc"], "densities": [0.1, 1.0], "payload": 1024,
                                    "gloo": False}}
    assert kw == {"as_json": False, "plot_path": "x.png"}
    cli.main(["bench", "--json", "sparcml", "--workers", "2,4,8"])
    assert calls.pop() == ({"sparcml": {"ranks": [2, 4, 8], "densities": [0.001, 0.01, 0.1]}},
                           {"as_json": True, "plot_path": None})
    for wrong in (["bench", "codecs", "--workers", "2"], ["bench", "switch", "--mib", "1"],
                  ["bench", "sparse", "--plot", "x.png"], ["bench", "nothing"]):
        with pytest.raises(SystemExit) as e:
            cli.main(wrong)
        assert e.value.code == 2
    assert not calls


def test_bench_codecs_and_switch_print_ratios_and_plot(tmp_path):
    """The benchmark runs end to end on a small buffer (figures are not checked: benchmarks are not tests)."""
    pytest.importorskip("matplotlib", reason="matplotlib (the bench extra) is not installed")
    png = tmp_path / "bench.png"
    for what, extra in (("codecs", ["--mib", "1"]), ("switch", ["--packets", "2000"])):
        run = subprocess.run([sys.executable, "-m", "switchsim", "bench", what, *extra, "--json", "--plot", str(png)],
                             capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert run.returncode == 0, run.stderr
        rows = json.loads(run.stdout)[what]
        assert png.stat().st_size > 1000
        if what == "codecs":
            assert {"NC encode (numpy)", "NC decode (numpy)"} <= {r["what"] for r in rows}
            assert all(r["x copyto"] > 0 for r in rows)
        else:
            assert rows[0]["x python"] == 1.0 and all(r["packets/s"] > 0 for r in rows)


def test_bench_blocksparse_runs_both_modes_and_plots(tmp_path):
    """Small run of `switchsim bench blocksparse`: every row is a checked allreduce (demo's ok), the sparse
    one sends a fraction of the dense one's bytes; figures are not checked beyond that."""
    pytest.importorskip("matplotlib", reason="matplotlib (the bench extra) is not installed")
    png = tmp_path / "bs.png"
    run = subprocess.run([sys.executable, "-m", "switchsim", "bench", "blocksparse", "--sizes", "0.25", "--workers",
                          "2", "--backends", "c", "--codecs", "int32", "--densities", "0.05", "--json",
                          "--plot", str(png)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    rows = {r["backend"] if r["backend"] == "gloo" else r["mode"]: r for r in json.loads(run.stdout)["blocksparse"]}
    assert set(rows) == {"gloo", "dense", "block-sparse"} and not any("error" in r for r in rows.values())
    assert rows["block-sparse"]["bytes/worker x float32"] < 0.2 < rows["dense"]["bytes/worker x float32"]
    assert png.stat().st_size > 1000


def test_demo_block_sparse_reports_the_density(tmp_path):
    r = switchsim("demo", "--workers", 2, "--size", 20000, "--codec", "fixed", "--sparse", "--density", 0.1,
                  "--json", timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] and out["sparse"] and out["density"] == 0.1 and out["bytes_ratio_vs_float32"] < 0.3
    bad = switchsim("demo", "--density", 2, timeout=60)
    assert bad.returncode == 2 and "density" in bad.stderr


def test_keyed_job_through_the_cli(tmp_path, monkeypatch):
    """serve --key-file JOB:FILE; workers with the key ($INA_JOB_KEY) join and sum exactly, a worker
    with another key is refused with a clear error; a key file too short is a configuration error."""
    import numpy as np

    import hostlib

    from .conftest import SwitchProcess
    from .test_e2e import run_workers

    short = tmp_path / "short.key"
    short.write_bytes(b"tooshort")
    r = switchsim("serve", "--key-file", f"1:{short}", "--port", 0, timeout=20)
    assert r.returncode == 2 and "at least 16" in r.stderr
    key = tmp_path / "job1.key"
    key.write_bytes(b"correct horse battery staple\n")
    sw = SwitchProcess("--workers", 2, "--key-file", f"1:{key}", backend="c")
    try:
        with pytest.raises(hostlib.INAError, match="bad MAC"):
            hostlib.connect(sw.address, 0, 2, key=b"another key of 16+ bytes", timeout=3)
        monkeypatch.setenv("INA_JOB_KEY", "correct horse battery staple")
        xs = [np.arange(1000, dtype=np.int32) * (r + 1) for r in range(2)]
        outs, errors, _ = run_workers(sw.address, xs, "int32")
        assert errors == [None, None] and all(np.array_equal(o, np.arange(1000) * 3) for o in outs)
    finally:
        out = sw.stop()
    stats = json.loads(out[out.index("{"):])
    assert stats["dropped"]["bad_mac"] >= 1 and stats["jobs"]["1"]["keyed"]


NO_TORCH = '''import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, Block())
'''


@pytest.mark.parametrize("argv", [["bench", "ddp", "--workers", "2", "--iters", "2"],
                                  ["bench", "allreduce", "--sizes", "1K"], ["bench", "topo"]])
def test_a_command_that_needs_torch_says_which_extra_once_where_torch_is_missing(tmp_path, argv):
    """`make demo`'s environment has no torch: the command names the extra to install in one line, exit 2, no
    traceback (torch hidden by a sitecustomize on PYTHONPATH, as if it were not installed)."""
    (tmp_path / "sitecustomize.py").write_text(NO_TORCH)
    r = subprocess.run([sys.executable, "-m", "switchsim", *argv], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "needs torch" in lines[0] and "pip install -e '.[torch]'" in lines[0], r.stderr
    assert "Traceback" not in r.stdout + r.stderr
