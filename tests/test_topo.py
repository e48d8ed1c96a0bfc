"""`switchsim topo run`: a star of network namespaces on real links (veth pairs with tc rates and nftables
loss) around a switch on its own host; the allreduce is exact for int32 under loss, runs at the link's
rate, and nothing of the star is left afterwards."""
from __future__ import annotations

import os
import subprocess

import pytest

from switchsim.netns import Star
from topologies.run import run_star


def namespaces() -> set[str]:
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return {line.split()[0] for line in r.stdout.splitlines() if line.strip()}


def ours() -> set[str]:
    return {ns for ns in namespaces() if ns.startswith(f"ina-{os.getpid():x}")}


pytestmark = pytest.mark.skipif(bool(Star.why_not(0.05)), reason=Star.why_not(0.05) or "-")


@pytest.mark.parametrize("backend", ["python", "c"])
def test_four_workers_exact_under_loss_on_every_link(backend):
    r = run_star(4, backend, loss=0.05, codec="int32", size=30_000, window=16, timeout=30)
    assert r["exact"] is True
    assert r["retransmissions"] > 0  # the links did lose packets, and the protocol recovered them
    assert len(r["links"]) == 4 and all(link["tx_bytes"] > 30_000 * 4 for link in r["links"])
    assert not ours()


def test_allreduce_runs_at_the_links_rate():
    """100 Mbit/s links: the allreduce takes at least the time the bytes need on a worker's link, and not
    much more (a star: every worker's link carries its own packets up and the results down)."""
    size, mbit = 400_000, 100
    r = run_star(2, "c", bw=mbit, codec="int32", size=size, window=64, timeout=30)
    assert r["exact"] is True
    up = max(link["tx_bytes"] for link in r["links"])
    bound = up * 8 / (mbit * 1e6)
    assert 0.9 * bound <= r["seconds"] <= 3 * bound + 0.2, (r["seconds"], bound)
    assert not ours()


def test_a_failed_run_leaves_nothing_behind():
    with pytest.raises(RuntimeError):
        run_star(2, "python", codec="int32", size=1000, window=0, timeout=5)  # window 0: the workers refuse
    assert not ours()
