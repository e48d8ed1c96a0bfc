"""UDP GSO sends and UDP_GRO receives in the C loops (csrc/ina_gso.h): the worker loop and the switch's UDP
loop take them on loopback, the results stay exact under loss, duplication and reordering, and INA_GSO=0
gives the same results with neither."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from hostlib import kernels
from inabench.harness import ROOT
from switchsim import native

from .test_e2e import run_workers


@pytest.fixture
def c_switch():
    """Factory: a C core under the C UDP loop in this process, on loopback, with impairments."""
    native.require()
    assert kernels.lib is not None, "every install builds the C worker loop (hostlib._kernels)"
    if not kernels.enabled():
        pytest.skip("INA_KERNELS=numpy turns the C worker loop (and its GSO sends) off")
    servers = []

    def start(world, **impairment):
        srv = native.CUDPServer(native.CoreSwitch({1: world}), "127.0.0.1", 0, **impairment)
        servers.append((srv, srv.start_thread()))
        return srv

    yield start
    for srv, th in servers:
        srv.stop()
        th.join(5)
        srv.close()


def allreduce_int32(srv, n, calls=2, size=40_000, seed=0):
    rs = np.random.default_rng(seed)
    xs = [rs.integers(-(2**20), 2**20, size).astype(np.int32) for _ in range(n)]
    outs, errors, stats = run_workers("%s:%d" % srv.address, xs, "int32", calls=calls, elements_per_packet=256,
                                      window=128, timeout=30, fast=True)
    assert errors == [None] * n
    exact = np.sum(np.array(xs, dtype=np.int64), axis=0)
    for o in outs:
        assert o.dtype == np.int32 and np.array_equal(o, exact)
    return stats


@pytest.mark.parametrize("n", [2, 3])
def test_gso_and_gro_are_taken_on_loopback(c_switch, n):
    srv = c_switch(n)
    stats = allreduce_int32(srv, n)
    for s in stats:
        assert s.gso_sends > 0, "the worker loop sent no GSO message"
        assert s.gro_segments > 0, "the worker loop got no coalesced receive"
        assert s.packets_received >= s.gro_segments
    sw = srv.stats()
    assert sw["gso_sends"] > 0 and sw["gro_segments"] > 0
    assert sw["send_errors"] == 0


IMPAIRED = [(0.05, 0.0, 0.0), (0.0, 0.05, 0.0), (0.0, 0.0, 0.05), (0.03, 0.03, 0.03)]


@pytest.mark.parametrize("loss,dup,reorder", IMPAIRED, ids=["loss", "dup", "reorder", "all"])
def test_results_exact_under_impairments_with_gso(c_switch, loss, dup, reorder):
    srv = c_switch(3, loss=loss, dup=dup, reorder=reorder, seed=7)
    stats = allreduce_int32(srv, 3, seed=1)
    assert sum(s.gso_sends for s in stats) > 0
    sw = srv.stats()
    assert sw["gso_sends"] > 0 and sw["gro_segments"] > 0
    imp = sw["impairment"]
    assert imp  # the impairments saw the datagrams one by one
    if loss:
        assert sum(s.retransmissions for s in stats) > 0


def test_nc_exact_agreement_with_gso(c_switch):
    """Every rank decodes the same NC sums, as without GSO (the codes are what the switch summed)."""
    srv = c_switch(2, loss=0.02, reorder=0.02, seed=3)
    rs = np.random.default_rng(5)
    xs = [rs.standard_normal(30_000).astype(np.float32) for _ in range(2)]
    outs, errors, stats = run_workers("%s:%d" % srv.address, xs, "nc", elements_per_packet=1024, window=64,
                                      timeout=30, fast=True)
    assert errors == [None, None]
    assert np.array_equal(outs[0], outs[1])
    exact = xs[0] + xs[1]
    assert np.corrcoef(outs[0], exact)[0, 1] > 0.9  # NC rounds each value to a power of two, unbiased
    assert abs(float(np.mean(outs[0] - exact))) < 0.05
    assert all(s.gso_sends > 0 for s in stats)


def test_gso_off_gives_the_same_results(c_switch, monkeypatch):
    monkeypatch.setenv("INA_GSO", "0")
    srv = c_switch(2)
    stats = allreduce_int32(srv, 2)
    assert all(s.gso_sends == 0 and s.gro_segments == 0 for s in stats)
    sw = srv.stats()
    assert sw["gso_sends"] == 0 and sw["gro_segments"] == 0


REFUSING_RUN = """
import json, sys
import numpy as np
from switchsim import native
from tests.test_e2e import run_workers

srv = native.CUDPServer(native.CoreSwitch({1: 3}), "127.0.0.1", 0)
th = srv.start_thread()
rs = np.random.default_rng(1)
xs = [rs.integers(-(2**20), 2**20, 40_000).astype(np.int32) for _ in range(3)]
outs, errors, stats = run_workers("%s:%d" % srv.address, xs, "int32", calls=2, elements_per_packet=256,
                                  window=128, timeout=30, fast=True)
srv.stop(); th.join(5)
exact = np.sum(np.array(xs, dtype=np.int64), axis=0)
print(json.dumps({"errors": [repr(e) for e in errors if e], "exact": all(np.array_equal(o, exact) for o in outs),
                  "worker_gso": [s.gso_sends for s in stats], "worker_gro": [s.gro_segments for s in stats],
                  "switch": {k: srv.stats()[k] for k in ("gso_sends", "send_errors", "packets_out")}}))
"""


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")
def test_a_kernel_that_refuses_gso_gets_datagrams(c_switch, tmp_path):
    """Under a shim that fails every UDP_SEGMENT send with EIO (csrc/tests/refuse_gso.c, LD_PRELOAD), both C
    loops turn GSO off after the first refusal and resend the batch as datagrams: exact results, no GSO send
    counted, no send error at the switch."""
    shim = tmp_path / "refuse_gso.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(shim), os.path.join(ROOT, "csrc/tests/refuse_gso.c"),
                    "-ldl"], check=True)
    env = dict(os.environ, LD_PRELOAD=str(shim), INA_GSO="1")
    run = subprocess.run([sys.executable, "-c", REFUSING_RUN], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["errors"] == [] and got["exact"]
    assert got["worker_gso"] == [0, 0, 0] and got["switch"]["gso_sends"] == 0
    assert got["switch"]["send_errors"] == 0 and got["switch"]["packets_out"] > 0
    refused = int(run.stderr.rsplit("refuse_gso: ", 1)[1].split()[0])
    assert refused >= 4  # each worker loop and the switch loop tried GSO (INA_GSO=1) and were refused once
