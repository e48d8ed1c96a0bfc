"""Topologies of network namespaces (switchsim.netns, topologies/): a star or two-level tree of hosts on
links with rate, delay and loss around switches on their own hosts. The allreduce is exact for int32 under
loss on every link, runs at the links' rate, sees the links' delay, keeps jobs apart, and nothing of a
topology is left afterwards."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from switchsim.netns import Star, Topology
from topologies.run import Spec, mininet_why_not, run, run_mininet, run_star

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def namespaces() -> set[str]:
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return {line.split()[0] for line in r.stdout.splitlines() if line.strip()}


def leftovers() -> list[str]:
    """This process's namespaces, interfaces in the root namespace and child processes that still exist."""
    tag = f"{os.getpid():x}"
    left = [ns for ns in namespaces() if ns.startswith(f"ina-{tag}")]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    left += [line.split(":")[1].strip() for line in links.splitlines() if tag in line]
    kids = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(os.getpid())], capture_output=True, text=True)
    left += [p.strip() for p in kids.stdout.splitlines() if "ps -o" not in p and "resource_tracker" not in p]
    return left


pytestmark = pytest.mark.skipif(bool(Topology.why_not(0.05, 1.0)), reason=Topology.why_not(0.05, 1.0) or "-")


@pytest.fixture(autouse=True)
def nothing_left_behind():
    before = set(leftovers())  # e.g. multiprocessing's resource tracker, started by an earlier test
    yield
    assert not set(leftovers()) - before


def _dpdk_missing() -> str:
    from switchsim import dpdk

    return "" if dpdk.available() else f"the DPDK backend is not built ({dpdk.IMPORT_ERROR})"


@pytest.mark.parametrize("backend", ["python", "c", pytest.param("dpdk", marks=pytest.mark.skipif(
    bool(_dpdk_missing()), reason=_dpdk_missing() or "-"))])
def test_four_workers_exact_under_loss_on_every_link(backend):
    r = run_star(4, backend, loss=0.05, codec="int32", size=30_000, window=16, timeout=30)
    assert r["exact"] is True
    assert r["retransmissions"] > 0  # the links did lose packets, and the protocol recovered them
    assert len(r["links"]) == 4 and all(link["tx_bytes"] > 30_000 * 4 for link in r["links"])


def test_two_jobs_on_one_star_stay_apart():
    """Workers 0-1 are job 1 and 2-3 job 2, with different inputs, at once, under loss: each job gets its
    own sum (a packet of one job counted in the other would break exactness), and the switch saw both."""
    r = run(Spec(workers=4, backend="c", loss=0.05, jobs=2), "int32", size=20_000, window=16, timeout=30)
    assert r["exact"] is True
    jobs = r["switch_jobs"]["switch"]
    assert set(jobs) == {"1", "2"} and all(j["received"] > 2 * 20_000 / 1024 for j in jobs.values())


def test_allreduce_runs_at_the_links_rate():
    """100 Mbit/s links: the allreduce takes at least the time the bytes need on a worker's link, and not
    much more (a star: every worker's link carries its own packets up and the results down)."""
    size, mbit = 400_000, 100
    r = run_star(2, "c", bw=mbit, codec="int32", size=size, window=64, timeout=30)
    assert r["exact"] is True
    up = max(link["tx_bytes"] for link in r["links"])
    bound = up * 8 / (mbit * 1e6)
    assert 0.9 * bound <= r["seconds"] <= 3 * bound + 0.2, (r["seconds"], bound)


def test_link_delay_is_seen_by_the_workers():
    """A delay of d on every link, each way: the workers' measured round trip to the switch is >= 2d."""
    d = 5.0
    r = run_star(2, "c", codec="int32", size=20_000, window=8, timeout=30, delay_ms=d)
    assert r["exact"] is True
    assert r["rtt_ms"] >= 2 * d, r["rtt_ms"]
    assert r["seconds"] >= 2 * d / 1000


def test_delay_stage_with_ping():
    """The stage forwards both ways, ARP included: worker to worker crosses two links (4 one-way delays)."""
    with Star(2, bridge=True, delay_ms=3.0) as star:
        p = star.run(0, ["ping", "-c", "3", "-i", "0.2", "-W", "2", star.worker_ips[1]], capture_output=True,
                     text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    rtts = [float(x.split("time=")[1].split()[0]) for x in p.stdout.splitlines() if "time=" in x]
    assert len(rtts) == 3 and min(rtts) >= 12.0, rtts


def test_two_level_aggregation_exact_under_loss():
    """2 leaves x 2 workers, 5 % loss on every link (worker-leaf and leaf-root): exact int32; the leaves
    really sent partial sums up (the root saw only its 2 leaves' packets)."""
    r = run(Spec(workers=4, leaves=2, backend="c", loss=0.05), "int32", size=30_000, window=16, timeout=30)
    assert r["exact"] is True
    assert set(r["switch_dropped"]) <= {"root", "leaf0", "leaf1"} and len(r["links"]) == 6
    root = r["switch_jobs"]["root"]["1"]
    leaves = [r["switch_jobs"][f"leaf{j}"]["1"] for j in range(2)]
    assert root["received"] >= 2 * -(-30_000 // 1024) and all(leaf["received"] > root["received"] / 2 for leaf in leaves)


def test_two_level_nc_is_the_same_everywhere():
    r = run(Spec(workers=4, leaves=2, backend="python"), "nc", size=20_000, window=16, timeout=30)
    assert r["same_everywhere"] is True and r["rel_error"] < 1.0


def test_a_failed_run_leaves_nothing_behind():
    with pytest.raises(RuntimeError):
        run_star(2, "python", codec="int32", size=1000, window=0, timeout=5)  # window 0: the workers refuse


def test_topology_file_and_flags(tmp_path):
    f = tmp_path / "t.toml"
    f.write_text('workers = 2\nbackend = "c"\n[links]\nloss = 0.02\ndelay_ms = 1.5\n')
    s = Spec.load(str(f), loss=0.0, workers=None)
    assert (s.workers, s.backend, s.loss, s.delay_ms) == (2, "c", 0.0, 1.5)
    f.write_text("workers = 2\n[links]\nrate = 100\n")
    with pytest.raises(ValueError, match="unknown keys"):
        Spec.load(str(f))


def test_up_status_exec_down(tmp_path):
    """A star that outlives the command: up, a worker run through `topo exec`, status, then down removes it."""
    env = {**os.environ, "INA_TOPO_STATE": str(tmp_path)}

    def topo(*args, check=True):
        r = subprocess.run([sys.executable, "-m", "switchsim", "topo", *map(str, args)], capture_output=True,
                           text=True, env=env, cwd=ROOT, timeout=120)
        assert not check or r.returncode == 0, r.stderr
        return r

    name = f"t{os.getpid()}"
    try:
        up = json.loads(topo("up", name, "--workers", 1, "--backend", "c", "--json").stdout)
        ns = json.load(open(tmp_path / f"{name}.json"))["namespaces"]
        assert set(ns) <= namespaces() and len(ns) == 2
        status = json.loads(topo("status", name, "--json").stdout)[name]
        assert status["hosts_up"] == 2 and status["switches"]["switch"]["running"]
        switch = up["switches"]["switch"]["address"]
        code = ("import hostlib, numpy as np; c = hostlib.connect('%s', 0, 1, timeout=10); "
                "print(int(c.allreduce(np.arange(5, dtype=np.int32)).sum()))" % switch)
        r = topo("exec", name, "w0", "--", sys.executable, "-c", code)
        assert r.stdout.strip() == "10"
        assert topo("up", name, "--workers", 1, check=False).returncode == 2  # the name is taken
    finally:
        topo("down", name, check=False)
    assert not set(ns) & namespaces()
    assert "no topology" in topo("status").stdout


def mininet_leftovers() -> list[str]:
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [line.split(":")[1].strip() for line in links.splitlines() if "-eth" in line.split(":")[1]]


@pytest.mark.skipif(bool(mininet_why_not()), reason=mininet_why_not() or "-")
def test_mininet_star_exact_under_loss_and_delay():
    """The same allreduce from mininet hosts (LinuxBridge, TCLink rate; the project's loss and delay)."""
    before = mininet_leftovers()
    r = run_mininet(Spec(workers=3, backend="c", bw_mbit=100, loss=0.05, delay_ms=1.0), "int32", size=20_000,
                    window=16, timeout=30)
    assert r["exact"] is True and r["retransmissions"] > 0
    assert r["seconds"] >= 0.002 and len(r["links"]) == 3
    assert mininet_leftovers() == before  # the bridge and its veths are gone


def test_bench_topo_rows_against_gloo_on_the_same_links():
    """bench topo: gloo's ring and INA over the same lossy links, both correct; with 3 workers a ring moves
    2(N-1)/N = 4/3 of the tensor each way per worker link, INA one tensor (plus headers)."""
    pytest.importorskip("torch", reason="the gloo baseline needs torch (pip install -e '.[torch]')")
    from topologies.bench import bench_topo

    rows = bench_topo(workers=3, size=50_000, rates=(1000,), losses=(0.02,), loss_rate=1000, codecs=("int32",), repeat=1)
    assert [(r["bw Mbit/s"], r["loss"], r["config"]) for r in rows] == [
        (1000, 0.0, "gloo"), (1000, 0.0, "ina-int32"), (1000, 0.02, "gloo"), (1000, 0.02, "ina-int32")]
    assert all(r["correct"] is True for r in rows)
    assert rows[0]["x gloo"] == 1.0 and rows[1]["x gloo"] == round(rows[1]["time s"] / rows[0]["time s"], 3)
    assert rows[1]["MB per worker link"] < rows[0]["MB per worker link"]
