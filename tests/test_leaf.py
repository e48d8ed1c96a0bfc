"""Two-level aggregation on loopback (switchsim/leaf.py): leaf switches aggregate their workers and send
partial sums up to a root as one rank each; results come down through the leaves. Exact for int32 under
loss, duplication and reordering at every switch; the leaf trusts only its root for results."""
from __future__ import annotations

import concurrent.futures
import socket
import subprocess
import sys

import numpy as np
import pytest

import hostlib
from inaproto import wire
from switchsim.config import SwitchConfig
from switchsim.leaf import LeafSwitch, make_leaf
from switchsim.model import Switch
from switchsim.server import UDPServer

NET = dict(loss=0.05, dup=0.02, reorder=0.02)


@pytest.fixture
def tree():
    """A root with 2 leaves of 2 workers each, every server impaired; yields the leaves' addresses."""
    root = UDPServer(Switch(SwitchConfig({1: 2}, slots=64)), "127.0.0.1", 0, seed=1, **NET)
    threads = [root.start_thread()]
    root_at = "%s:%d" % root.address
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # each leaf's join waits for the other
        made = list(pool.map(lambda j: make_leaf(SwitchConfig({1: 2}, slots=64), UDPServer, "127.0.0.1", 0,
                                                 root_at, j, 2, 20.0, seed=10 + j, **NET), range(2)))
    servers = [server for _, server in made]
    threads += [s.start_thread() for s in servers]
    yield [s.address for s in servers], [leaf for leaf, _ in made], root
    for s in [root, *servers]:
        s.stop()
    for t in threads:
        t.join(5)
    for s in [root, *servers]:
        s.close()


def allreduce_all(leaves, xs, codec):
    def one(w):
        host, port = leaves[w // 2]
        with hostlib.connect(f"{host}:{port}", w % 2, 2, codec=codec, timeout=20, window=16) as c:
            return c.allreduce(xs[w])

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, range(4)))


def test_int32_exact_through_two_levels_under_impairments(tree):
    leaves, models, root = tree
    rs = np.random.default_rng(3)
    xs = [rs.integers(-(2**24), 2**24, 50_000).astype(np.int32) for _ in range(4)]
    outs = allreduce_all(leaves, xs, "int32")
    exact = np.sum(np.array(xs, dtype=np.int64), axis=0)
    assert all(np.array_equal(o.astype(np.int64), exact) for o in outs)
    assert all(m.up_sent >= 50_000 // 1024 and m.down >= 50_000 // 1024 for m in models)
    assert root.backend.stats()["jobs"]["1"]["received"] >= 2 * (50_000 // 1024)  # only partials reach it


def test_nc_through_two_levels_is_the_same_everywhere_and_unbiased_enough(tree):
    leaves, _, _ = tree
    rs = np.random.default_rng(4)
    xs = [rs.standard_normal(20_000).astype(np.float32) for _ in range(4)]
    outs = allreduce_all(leaves, xs, "nc")
    exact = np.sum(np.array(xs, dtype=np.float64), axis=0)
    assert all(np.array_equal(o, outs[0]) for o in outs)
    assert abs(float(np.mean(outs[0] - exact))) < 0.05  # unbiased: the mean error of 20k elements is ~0
    assert np.linalg.norm(outs[0] - exact) / np.linalg.norm(exact) < 1.0


def test_only_the_root_is_heard_for_results(tree):
    """A result from anyone but the root (even a copy of the root's own packet) is dropped and counted."""
    leaves, models, _ = tree
    leaf = models[0]
    forged = wire.pack(wire.MSG_RESULT, job=1, rank=0, packet_id=0, slot=0, set=0, count=4,
                       codec=wire.CODEC_INT32, payload=bytes(16), session=leaf.uplink.session)
    before = leaf.drops["malformed"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _ in range(5):
            s.sendto(forged, leaves[0])
    rs = np.random.default_rng(5)
    xs = [rs.integers(-100, 100, 3000).astype(np.int32) for _ in range(4)]
    outs = allreduce_all(leaves, xs, "int32")  # still exact: the forged results changed nothing
    assert all(np.array_equal(o, np.sum(xs, axis=0)) for o in outs)
    assert leaf.drops["malformed"] >= before + 5


def test_a_leaf_needs_its_root_and_the_reference_model():
    r = subprocess.run([sys.executable, "-m", "switchsim", "serve", "--backend", "c", "--port", "0",
                        "--uplink", "127.0.0.1:9"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "--backend python" in r.stderr
    r = subprocess.run([sys.executable, "-m", "switchsim", "serve", "--port", "0", "--uplink", "127.0.0.1:9",
                        "--uplink-timeout", "1"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "unreachable" in r.stderr


def test_leaf_serves_exactly_its_uplinks_job():
    class Up:
        job = 2

    with pytest.raises(ValueError, match="exactly its uplink's job"):
        LeafSwitch(SwitchConfig({1: 2}), Up())
