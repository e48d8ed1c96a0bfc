"""`switchsim bench ddp --topo`: the DDP ranks on namespace hosts of a star (switchsim.netns through
topologies.run's Deployment), every link at --bw, --delay and --loss, the INA switch on its own host and
gloo's ring over the same links (the star's bridge, TCP with --tcp-cc: Linux's default CUBIC, whatever the
host's); next to each row, the projection model's step time
for the same links (compute measured by the 1-rank row, allreduce from inabench.projection)."""
from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile

from inabench import projection
from inabench.harness import ROOT, free_port

from .net import TCP_CC
from .run import Deployment, Spec

GLOO_PORT = 29500
ALLOWED = "/proc/sys/net/ipv4/tcp_allowed_congestion_control"


@contextlib.contextmanager
def _allowed(cc: str):
    """A namespace other than the host's may only default to a congestion control the host allows: cc is added
    to the host's list for as long as the namespaces take it, then the list is as it was (a namespace keeps
    its default)."""
    with open(ALLOWED) as f:
        was = f.read().split()
    if cc in was:
        yield
        return
    try:
        with open(ALLOWED, "w") as f:
            f.write(" ".join(was + [cc]))
    except OSError:
        pass  # not an algorithm this kernel has: the namespaces' sysctl names it
    try:
        yield
    finally:
        with open(ALLOWED, "w") as f:
            f.write(" ".join(was))


class Hosts:
    """A Placement (inabench.ddp) on a star of `world` hosts around a switch of `backend`."""

    def __init__(self, world: int, backend: str = "c", bw: float | None = None, delay_ms: float = 0.0,
                 loss: float = 0.0, ecn: bool = False, tcp_cc: str = TCP_CC):
        """tcp_cc: the worker hosts' TCP congestion control (gloo's ring): a new namespace takes the host's, and
        a host's BBR ignores loss, which a default Linux's CUBIC does not."""
        self._logs = tempfile.TemporaryDirectory()
        self.dep = Deployment(Spec(world, backend, bw, delay_ms, loss, ecn=ecn), self._logs.name)
        self.world = world
        try:
            with _allowed(tcp_cc):
                for ns in self.dep.topo.worker_ns:
                    r = self.dep.topo.run(ns, ["sysctl", "-q", "-w", f"net.ipv4.tcp_congestion_control={tcp_cc}"],
                                          capture_output=True, text=True)
                    if r.returncode:
                        raise ValueError(f"--tcp-cc {tcp_cc}: this kernel cannot set it ({r.stderr.strip()}; "
                                         f"net.ipv4.tcp_available_congestion_control lists those it can)")
        except BaseException:
            self.close()
            raise

    def master(self) -> str:
        return f"{self.dep.topo.worker_ips[0]}:{GLOO_PORT + free_port() % 1000}"

    def switch(self, world: int) -> str:
        if world != self.world:
            raise ValueError(f"this topology has {self.world} worker hosts, not {world}")
        return self.dep.members[0].switch

    def popen(self, rank: int, argv: list, env=None, **kw) -> subprocess.Popen:
        env = {**(env or os.environ), "GLOO_SOCKET_IFNAME": self.dep.topo.worker_ifs[rank]}
        return self.dep.topo.popen(self.dep.members[rank].host, argv, cwd=ROOT, env=env, **kw)

    def link_bytes(self) -> list[dict]:
        return self.dep.topo.link_bytes()[:self.world]

    def close(self):
        try:
            self.dep.close()
        finally:
            self._logs.cleanup()


def with_projection(rows: list[dict], bw: float, delay_ms: float, loss: float) -> list[dict]:
    """Each multi-rank row gets "model s/iter": the 1-rank row's p50 (compute) plus the projected allreduce
    of the gradient (ring for gloo, INA with the path's codec), and "model err" against the measured p50."""
    local = next((r for r in rows if r["path"] == "local" and "error" not in r), None)
    for r in rows:
        if r["workers"] < 2 or local is None or not bw or "error" in r:
            continue
        kind, _, codec = r["path"].partition(":")
        s = projection.Setting(r["workers"], r["grad MB"] * 1e6, bw * 1e6, codec=codec or "int32",
                               latency=delay_ms / 1000, loss=loss, alpha=2 * delay_ms / 1000)
        comm = projection.ring(s) if kind == "gloo" else projection.ina(s)
        r["model s/iter"] = round(local["sec/iter p50"] + comm["time_s"], 5)
        r["model err"] = round(r["sec/iter p50"] / r["model s/iter"] - 1, 3)
    return rows
