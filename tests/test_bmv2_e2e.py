"""End to end on BMv2, PTF-style: p4/ina.p4 on simple_switch_grpc with one port per worker, each worker a
process alone in its own network namespace on its own veth pair (switchsim.netns.Star), so hostlib's
allreduce crosses real links into the P4 data plane; lossy links drop UDP both ways (nftables, see Star)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from hostlib.codecs import fixed, natural
from inabench.harness import ROOT, SwitchProcess
from switchsim.netns import Star

WORKER = os.path.join(ROOT, "topologies", "worker.py")
K = 64  # BMv2's lanes: the switch caps elements per packet at 64 in its join ack


def missing(loss: float = 0.0) -> str:
    from switchsim import bmv2

    return bmv2.why_not() or Star.why_not(loss)


pytestmark = pytest.mark.skipif(bool(missing()), reason=missing() or "-")


def summary(report: dict) -> dict:
    """The switch's counters without the per-slot arrays (for failure messages)."""
    jobs = {j: {k: v for k, v in job.items() if k != "per_slot"} for j, job in report.get("jobs", {}).items()}
    return {**{k: v for k, v in report.items() if k != "jobs"}, "jobs": jobs}


def switch_stats(star: Star, address: str) -> dict:
    """The running switch's counters, asked from worker 0's namespace (a control host: serve --control);
    {} if it does not answer in three tries (a lossy link may drop a try). Read before stopping it:
    `serve --backend bmv2` prints none on SIGTERM (it reads them after stopping BMv2)."""
    for _ in range(3):
        r = star.run(0, [sys.executable, "-m", "switchsim", "stats", address, "--timeout", "3"], cwd=ROOT,
                     capture_output=True, text=True, timeout=30)
        if r.returncode == 0:
            return json.loads(r.stdout)
    return {}


def allreduce_on_bmv2(xs, codec, loss=0.0, deadline_s=40.0, **kw):
    """Rank r allreduces xs[r] once in worker namespace r against a BMv2 switch serving them all;
    returns (each rank's result, each rank's CommStats as a dict, the switch's counters)."""
    n = len(xs)
    if missing(loss):
        pytest.skip(missing(loss))
    kw = {"window": 8, "timeout": 10, "join_timeout": 15, **kw}  # BMv2 takes ~30-packet bursts
    with tempfile.TemporaryDirectory() as tmp, Star(n, loss) as star:
        serve = [sys.executable, "-m", "switchsim", "serve", "--backend", "bmv2", "--iface", ",".join(star.switch_ifs),
                 "--host", star.switch_ip, "--port", "0", "--control", star.worker_ips[0]]
        sw = SwitchProcess("--workers", n, cmd=star.command("switch", serve))
        errors, report = [], {}
        try:
            procs = []
            for r, x in enumerate(xs):
                np.save(os.path.join(tmp, f"in{r}.npy"), x)
                argv = [sys.executable, WORKER, sw.address, r, n, codec, os.path.join(tmp, f"in{r}.npy"),
                        os.path.join(tmp, f"out{r}"), *(f"{k}={json.dumps(v)}" for k, v in kw.items())]
                procs.append(star.popen(r, argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        text=True))
            end = time.monotonic() + deadline_s
            for r, p in enumerate(procs):
                try:
                    _, err = p.communicate(timeout=max(0.1, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    err = f"killed after {deadline_s} s\n{p.communicate()[1]}"
                if p.returncode:
                    errors.append(f"rank {r}: {err[-1500:]}")
            report = switch_stats(star, sw.address)
        finally:
            sw.stop()
        assert not errors, "\n".join(errors) + f"\nswitch: {json.dumps(summary(report))}"
        outs = [np.load(os.path.join(tmp, f"out{r}.npy")) for r in range(n)]
        stats = []
        for r in range(n):
            with open(os.path.join(tmp, f"out{r}.json")) as f:
                stats.append(json.load(f))
    return outs, stats, report


def int_inputs(n, seed, size=20000):
    rs = np.random.default_rng(seed)
    return [rs.integers(-(2**20), 2**20, size).astype(np.int32) for _ in range(n)]


def check_exact(xs, outs, report):
    exact = np.sum(np.array(xs, dtype=np.int64), axis=0)
    for r, o in enumerate(outs):
        assert o.dtype == np.int32, f"rank {r}: {o.dtype}"
        wrong = np.flatnonzero(o != exact)
        assert wrong.size == 0, (f"rank {r}: {wrong.size} wrong elements, first at {wrong[:5]}: "
                                 f"{o[wrong[:5]]} vs {exact[wrong[:5]]}; switch: {json.dumps(summary(report))}")
    assert report, "the switch did not answer a stats request"
    assert report["jobs"]["1"]["multicast"] >= -(-xs[0].size // K)  # a result per packet's worth


@pytest.mark.parametrize("n", [2, 3, 4])
def test_int32_exact(n):
    xs = int_inputs(n, n)
    outs, stats, report = allreduce_on_bmv2(xs, "int32")
    check_exact(xs, outs, report)
    assert all(s["elements"] == xs[0].size for s in stats)


def test_int32_exact_under_loss():
    """5 % of UDP packets dropped on each link in each direction: retransmissions recover them all."""
    n = 3
    xs = int_inputs(n, 7)
    outs, stats, report = allreduce_on_bmv2(xs, "int32", loss=0.05)
    check_exact(xs, outs, report)
    assert sum(s["retransmissions"] for s in stats) > 0, stats


def test_fixed_within_proven_bound():
    n, size = 2, 20000
    rs = np.random.default_rng(11)
    xs = [(rs.standard_normal(size) * 10.0 ** rs.integers(-3, 3, size)).astype(np.float32) for _ in range(n)]
    outs, _, report = allreduce_on_bmv2(xs, "fixed")
    exact = np.sum(np.array(xs, dtype=np.float64), axis=0)
    bound = fixed.allreduce_error_bound(xs, K, exact)
    for o in outs:
        assert o.dtype == np.float32
        assert np.all(np.abs(o - exact) <= bound), f"{np.sum(np.abs(o - exact) > bound)} beyond the bound"
        assert np.array_equal(o, outs[0])


def test_nc_unbiased_with_the_predicted_error():
    n, size = 2, 20000
    rs = np.random.default_rng(12)
    xs = [rs.standard_normal(size).astype(np.float32) for _ in range(n)]
    outs, _, report = allreduce_on_bmv2(xs, "nc")
    exact = np.sum(np.array(xs, dtype=np.float64), axis=0)
    err = outs[0].astype(np.float64) - exact
    expected = natural.allreduce_expected_sq_error(xs, exact)
    assert float(err @ err) <= 1.2 * expected, (float(err @ err), expected)
    assert abs(err.mean()) < 5 * np.sqrt(expected / exact.size / exact.size)  # unbiased
    assert all(np.array_equal(o, outs[0]) for o in outs)


def test_int32_lanes_reuse_a_slot_exactly():
    """The int32 lanes (two to a 64-bit slot of two wide registers, gen_p4.I32_CONSTANTS) on a switch of two
    slots, so each (slot, set) is reused: a round that overflows, then rounds without elements on the same
    cells (they never write the lanes: no stale overflow), then short rounds and their resends, exact."""
    import select

    from inabench.bench_bmv2 import InaSwitch
    from inaproto import wire

    sw = InaSwitch(slots=2)

    def get(sock):
        assert select.select([sock], [], [], 3)[0], "no answer"
        data = sock.recv(4096)
        return wire.unpack(data), data[wire.HEADER_SIZE:]

    def send(q, r, lanes):
        use = q // 2
        sw.socks[r].send(wire.pack(wire.MSG_UPDATE, 1, r, use, q % 2, use & 1, len(lanes), wire.CODEC_INT32, 0, 0,
                                   0, np.array(lanes, dtype=">i4").tobytes(), sw.session))

    try:
        rs = np.random.default_rng(5)
        rounds = [[2**30] * 64] * 4 + [[]] * 4 + [list(rs.integers(-2**31, 2**31, n)) for n in (7, 40, 63, 1, 64, 33)]
        for q, lanes in enumerate(rounds):
            other = [(-v - 1) if q % 3 else v for v in lanes]  # some sums in range, some out
            send(q, 0, lanes)
            send(q, 1, other)
            sums = np.array(lanes, dtype=np.int64) + np.array(other, dtype=np.int64)
            overflow = bool(np.any((sums < -2**31) | (sums >= 2**31)))
            results = [get(s) for s in sw.socks]
            send(q, 1, other)  # a duplicate: the stored result again
            results.append(get(sw.socks[1]))
            for h, payload in results:
                assert (h.msg_type, h.count, bool(h.flags & wire.FLAG_OVERFLOW)) == (wire.MSG_RESULT, len(lanes), overflow), q
                assert np.array_equal(np.frombuffer(payload, dtype=">i4"), sums.astype(np.int32)), q
    finally:
        sw.close()
