"""UDP GSO sends and UDP_GRO receives in the C loops (csrc/ina_gso.h): the worker loop and the switch's UDP
loop take them on loopback, the results stay exact under loss, duplication and reordering, and INA_GSO=0
gives the same results with neither."""
from __future__ import annotations

import numpy as np
import pytest

from hostlib import kernels
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
