"""Network namespaces for switches that own their ports (DPDK, BMv2) on one machine.

`VethNamespace`: the switch's end of one veth pair in a namespace; the caller (workers, tests) keeps the
other end in its own namespace with WORKER_IP; the switch drives its end and answers ARP for switch_ip.
`Star`: a switch namespace and N worker namespaces, one veth pair (link) each, optionally lossy.
Both need root and iproute2; `close()` removes what they made.
"""
from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import time


class VethNamespace:
    prefix = "10.213"  # the pair's /24 is PREFIX.(tag % 250).0

    def __init__(self, tag: int | None = None):
        tag = os.getpid() % 100000 if tag is None else tag
        self.ns, self.worker_if, self.switch_if = f"ina-{tag}", f"inaw{tag}", f"inas{tag}"
        self.worker_ip, self.switch_ip = f"{self.prefix}.{tag % 250}.1", f"{self.prefix}.{tag % 250}.2"
        self.up = False
        self.error = self._why_not()
        if self.error:
            return
        try:
            for cmd in (f"ip netns add {self.ns}", f"ip link add {self.worker_if} type veth peer name {self.switch_if}",
                        f"ip link set {self.switch_if} netns {self.ns}",
                        f"ip addr add {self.worker_ip}/24 dev {self.worker_if}", f"ip link set {self.worker_if} up",
                        f"ip netns exec {self.ns} ip link set {self.switch_if} up"):
                subprocess.run(cmd.split(), check=True, capture_output=True, text=True)
            self.up = True
        except subprocess.CalledProcessError as e:
            self.error = f"cannot create a network namespace ({' '.join(e.cmd)}: {e.stderr.strip()})"
            self.close()

    @staticmethod
    def _why_not() -> str:
        from . import dpdk

        if not dpdk.available():
            return f"the DPDK backend is not built ({dpdk.IMPORT_ERROR}); install libdpdk-dev, then pip install -e ."
        if os.geteuid() != 0:
            return "the DPDK backend on one machine needs root to create a network namespace and a veth pair"
        if not shutil.which("ip"):
            return "the DPDK backend on one machine needs iproute2's ip command"
        return ""

    def serve_command(self, port: int) -> list[str]:
        """`switchsim serve` on the switch's end; add job and switch options."""
        return ["ip", "netns", "exec", self.ns, sys.executable, "-m", "switchsim", "serve", "--backend", "dpdk",
                "--iface", self.switch_if, "--host", self.switch_ip, "--port", str(port), "--control", self.worker_ip]

    def close(self):
        subprocess.run(["ip", "link", "del", self.worker_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
        self.up = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Star:
    """A star of N links: worker i alone in namespace `worker_ns[i]` with `worker_ifs[i]` at `worker_ips[i]`
    (PREFIX.i+1/24), its veth peer `switch_ifs[i]` in `switch_ns`, where a switch (any backend that takes
    interfaces as ports) serves `switch_ip` (PREFIX.254). Every host is a namespace of its own, so the
    traffic crosses the links for real and a worker sees only its own link's loss.

    Loss (`loss`: probability per packet and direction) is nftables (`nft`, Debian's nftables package;
    1.0.6 on the machine this was written on) in each worker's namespace: a netdev table whose ingress and
    egress hooks on the worker's interface drop UDP at random (`numgen random`), ARP untouched. Not
    iptables' `-m statistic` (that machine has iptables 1.8.9 too): a DROP in OUTPUT fails the worker's
    own send() with EPERM instead of losing the packet on the wire (hostlib raises PermissionError), and
    the switch's end cannot filter either: BMv2 and DPDK read their ports through packet sockets, which see
    frames before netfilter. The egress hook needs Linux >= 5.16.

    Names carry this process's id and a counter (an interface name has at most 15 characters). Usable as a
    context manager; `close()` also ends whatever still runs in the namespaces (which would keep them and
    their veths alive), so a failed test leaves nothing behind.
    """

    prefix = "10.215.0"
    _seq = itertools.count()

    def __init__(self, n: int, loss: float = 0.0, rate_mbit: float | None = None, bridge: bool = False):
        """n workers; loss per packet and direction; rate_mbit: every link's rate both ways (tc tbf on both
        ends); bridge: join the switch's ends in a Linux bridge holding switch_ip (a switch on a kernel
        socket, python or c), else they stay separate ports (BMv2, DPDK)."""
        if not 1 <= n <= 253:
            raise ValueError(f"a star has 1..253 workers, not {n}")
        if rate_mbit is not None and rate_mbit <= 0:
            raise ValueError(f"link rate must be > 0 Mbit/s, not {rate_mbit}")
        reason = self.why_not(loss)
        if reason:
            raise RuntimeError(reason)
        tag = f"{os.getpid():x}{next(Star._seq) % 16:x}"  # <= 7 characters
        self.n, self.loss, self.rate_mbit, self.bridge = n, loss, rate_mbit, bridge
        self.switch_ns, self.worker_ns = f"ina-{tag}-s", [f"ina-{tag}-w{i}" for i in range(n)]
        self.switch_ifs, self.worker_ifs = [f"is{tag}-{i}" for i in range(n)], [f"iw{tag}-{i}" for i in range(n)]
        self.switch_ip, self.worker_ips = f"{self.prefix}.254", [f"{self.prefix}.{i + 1}" for i in range(n)]
        self.made: list[str] = []  # namespaces created so far: what close() removes
        self.procs: list[subprocess.Popen] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def why_not(loss: float = 0.0) -> str:
        """Why this machine cannot build a star ("" if it can); with loss, nftables is needed too."""
        if os.geteuid() != 0:
            return "a star of network namespaces needs root"
        if not shutil.which("ip"):
            return "a star of network namespaces needs iproute2's ip command"
        if not shutil.which("tc"):
            return "link rates need iproute2's tc command"
        if loss and not shutil.which("nft"):
            return "lossy links need nftables' nft command (apt-get install nftables)"
        return ""

    def _ip(self, *args: str):
        try:
            subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"star: {' '.join(e.cmd)}: {e.stderr.strip()}") from None

    def _build(self):
        for ns in (self.switch_ns, *self.worker_ns):
            self._ip("netns", "add", ns)
            self.made.append(ns)
            self._ip("-n", ns, "link", "set", "lo", "up")
            # no IPv6 chatter (router solicitations, MLD) on the switch's ports
            self.run(ns, ["sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6; "
                                      "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6"], capture_output=True)
        for ns, wif, sif, ip in zip(self.worker_ns, self.worker_ifs, self.switch_ifs, self.worker_ips):
            # made inside both namespaces at once: nothing ever appears in the caller's
            self._ip("link", "add", wif, "netns", ns, "type", "veth", "peer", "name", sif, "netns", self.switch_ns)
            self._ip("-n", ns, "addr", "add", f"{ip}/24", "dev", wif)
            self._ip("-n", ns, "link", "set", wif, "up")
            self._ip("-n", self.switch_ns, "link", "set", sif, "up")
            if self.loss:
                self._lossy(ns, wif)
            if self.rate_mbit:
                self._shape(ns, wif)
                self._shape(self.switch_ns, sif)
        if self.bridge:
            self._ip("-n", self.switch_ns, "link", "add", "br0", "type", "bridge")
            for sif in self.switch_ifs:
                self._ip("-n", self.switch_ns, "link", "set", sif, "master", "br0")
            self._ip("-n", self.switch_ns, "addr", "add", f"{self.switch_ip}/24", "dev", "br0")
            self._ip("-n", self.switch_ns, "link", "set", "br0", "up")

    def _shape(self, ns: str, dev: str):
        """A token bucket at the link's rate on dev's egress (a burst of 10 ms of traffic, at least 4 frames)."""
        burst = max(4 * 1514, int(self.rate_mbit * 1e6 / 8 / 100))
        r = self.run(ns, ["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{self.rate_mbit}mbit",
                          "burst", str(burst), "latency", "100ms"], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"star: tc in {ns}: {r.stderr.strip()}")

    def link_bytes(self) -> list[dict]:
        """Per link: bytes the worker sent (tx) and received (rx), from its interface's counters."""
        out = []
        for ns, dev in zip(self.worker_ns, self.worker_ifs):
            r = self.run(ns, ["cat", f"/sys/class/net/{dev}/statistics/tx_bytes",
                              f"/sys/class/net/{dev}/statistics/rx_bytes"], capture_output=True, text=True)
            tx, rx = (int(v) for v in r.stdout.split())
            out.append({"link": dev, "tx_bytes": tx, "rx_bytes": rx})
        return out

    def _lossy(self, ns: str, dev: str):
        cut = round(self.loss * 10000)
        drop = f"meta protocol ip ip protocol udp numgen random mod 10000 < {cut} drop"
        rules = (f'table netdev ina_loss {{\n'
                 f'  chain rx {{ type filter hook ingress device "{dev}" priority 0; {drop}; }}\n'
                 f'  chain tx {{ type filter hook egress device "{dev}" priority 0; {drop}; }}\n}}\n')
        r = self.run(ns, ["nft", "-f", "-"], input=rules, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"star: nft in {ns}: {r.stderr.strip()}")

    def namespace(self, i: int | str) -> str:
        """Worker i's namespace, or the switch's for "switch" (a namespace name passes through)."""
        if i == "switch":
            return self.switch_ns
        return self.worker_ns[i] if isinstance(i, int) else i

    def command(self, i: int | str, argv: list) -> list[str]:
        """argv run inside namespace i (`ip netns exec` execs it: the process keeps the PID)."""
        return ["ip", "netns", "exec", self.namespace(i), *map(str, argv)]

    def run(self, i: int | str, argv: list, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        """subprocess.run of argv inside namespace i, bounded by timeout."""
        return subprocess.run(self.command(i, argv), timeout=timeout, **kw)

    def popen(self, i: int | str, argv: list, **kw) -> subprocess.Popen:
        """subprocess.Popen of argv inside namespace i; close() ends it if it still runs."""
        p = subprocess.Popen(self.command(i, argv), **kw)
        self.procs.append(p)
        return p

    def close(self):
        """End what still runs in the namespaces (our popen children first), then remove them; their veths
        and nftables rules go with them. Safe to call twice and after a partial build."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for ns in self.made:  # e.g. a switch's own children (simple_switch_grpc), orphaned by a kill
            self._end(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.made, self.procs = [], []

    @staticmethod
    def _end(ns: str, grace: float = 3.0):
        """SIGTERM, then SIGKILL, every process inside ns (only ours can be there: the name is this process's)."""
        def pids():
            r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
            return [int(p) for p in r.stdout.split()]

        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 1.0)):
            left = pids()
            for pid in left:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while left and time.monotonic() < deadline:
                time.sleep(0.05)
                left = pids()
            if not left:
                return

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
