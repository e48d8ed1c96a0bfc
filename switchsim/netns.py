"""Network namespaces: the one-link setups of the DPDK and BMv2 backends, and topologies of hosts and links.

`VethNamespace`: the switch's end of one veth pair in a namespace; the caller (workers, tests) keeps the
other end in its own namespace with WORKER_IP; the switch drives its end and answers ARP for switch_ip.
`Topology`: hosts (namespaces) joined by links with rate, loss and delay; `Star` (N workers around one switch)
and `Tree` (leaves of workers around a root) are built of it.
All need root and iproute2; `close()` removes what they made.
"""
from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time


_TAGS = itertools.count()  # namespaces made by this process: each its own name and /24


class VethNamespace:
    prefix = "10.213"  # the pair's /24 is PREFIX.tag.0
    kind = "d"  # in the names: ina-d<tag>, inawd<tag>, inasd<tag>

    def __init__(self, tag: int | None = None):
        self.up, self.ns, self.worker_if, self.switch_if, self.worker_ip, self.switch_ip = False, None, None, None, None, None
        self.error = self._why_not()
        if self.error:
            return
        try:
            tag = self._claim(tag)
            self.worker_ip, self.switch_ip = f"{self.prefix}.{tag}.1", f"{self.prefix}.{tag}.2"
            subprocess.run(["ip", "link", "del", self.worker_if], capture_output=True)  # a crashed owner's leftover
            for cmd in (f"ip link add {self.worker_if} type veth peer name {self.switch_if}",
                        f"ip link set {self.switch_if} netns {self.ns}",
                        f"ip addr add {self.worker_ip}/24 dev {self.worker_if}", f"ip link set {self.worker_if} up",
                        f"ip netns exec {self.ns} ip link set {self.switch_if} up"):
                subprocess.run(cmd.split(), check=True, capture_output=True, text=True)
            self.up = True
        except subprocess.CalledProcessError as e:
            self.error = f"cannot create a network namespace ({' '.join(e.cmd)}: {e.stderr.strip()})"
            self.close()

    def _claim(self, tag: int | None) -> int:
        """A tag (1..250) no live namespace of this kind holds: `ip netns add` is the lock, so two processes
        (a test session's DPDK namespace and a switch's BMv2 one, pids alike or not) or a crashed run's
        leftover never share a name or a subnet."""
        start = (os.getpid() + next(_TAGS)) % 250 if tag is None else tag - 1
        for i in range(1 if tag is not None else 250):
            t = (start + i) % 250 + 1
            self.ns, self.worker_if, self.switch_if = f"ina-{self.kind}{t}", f"inaw{self.kind}{t}", f"inas{self.kind}{t}"
            r = subprocess.run(["ip", "netns", "add", self.ns], capture_output=True, text=True)
            if r.returncode == 0:
                return t
            if "File exists" not in r.stderr:
                raise subprocess.CalledProcessError(r.returncode, r.args, r.stdout, r.stderr)
        self.ns = None
        raise subprocess.CalledProcessError(1, ["ip", "netns", "add", f"ina-{self.kind}*"], "", "every tag is taken")

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
        if self.ns:
            subprocess.run(["ip", "link", "del", self.worker_if], capture_output=True)
            subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
            self.ns = None
        self.up = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Topology:
    """Hosts (network namespaces) joined by links (veth pairs), each link with an optional rate, loss and
    delay; the base of Star and Tree.

    - Rate: `tc tbf` on the egress of both ends (a burst of 10 ms of traffic, at least 4 frames).
    - Loss (probability per packet and direction): nftables (`nft`, Debian's nftables package) on one end: a
      netdev table whose ingress and egress hooks drop IPv4 at random (`numgen random`), ARP untouched. Not
      iptables' `-m statistic`: a DROP in OUTPUT fails the sender's own send() with EPERM instead of losing
      the packet on the wire, and a switch's end cannot filter either (BMv2 and DPDK read their ports through
      packet sockets, which see frames before netfilter). The egress hook needs Linux >= 5.16.
    - Delay (per direction): this kernel has no netem (and no fq for timestamp pacing), so the link is cut
      in two on its far end's host and a user-space forwarding stage (switchsim/delay.py, AF_PACKET sockets)
      holds every frame `delay_ms` before passing it on. The link's veths then compute checksums and
      segment in software (ethtool -K ... off): a frame leaves the stage as it will be read.
    - ECN (`ecn`): this kernel has no RED either, so with ecn the stage is the link (delay 0 included): it
      serializes each direction at the link's rate itself (no tbf then: its queue is the bottleneck), marks
      CE on ECN-capable IPv4 packets that arrive while more than `ecn_bytes` wait, drops beyond 100 ms of
      queue, and counts both; TCP in every host negotiates ECN (net.ipv4.tcp_ecn=1).

    Names carry this process's id and a counter (an interface name has at most 15 characters). `close()`
    also ends whatever still runs in the namespaces (which would keep them and their veths alive), so a
    failed test leaves nothing behind.
    """

    _seq = itertools.count()

    def __init__(self, rate_mbit: float | None = None, loss: float = 0.0, delay_ms: float = 0.0, ecn: bool = False):
        if ecn and not rate_mbit:
            raise ValueError("ECN marks at a rate-limited link's queue: give the links a rate (--bw)")
        if rate_mbit is not None and rate_mbit <= 0:
            raise ValueError(f"link rate must be > 0 Mbit/s, not {rate_mbit}")
        if not 0.0 <= loss < 1.0:
            raise ValueError(f"link loss must be in [0, 1), not {loss}")
        if delay_ms < 0:
            raise ValueError(f"link delay must be >= 0 ms, not {delay_ms}")
        reason = self.why_not(loss, delay_ms, ecn)
        if reason:
            raise RuntimeError(reason)
        self.rate_mbit, self.loss, self.delay_ms, self.ecn = rate_mbit, loss, delay_ms, ecn
        self.staged = bool(delay_ms) or ecn  # the links are cut for a stage (switchsim/delay.py)
        self.tag = f"{os.getpid():x}{next(Topology._seq) % 16:x}"  # <= 7 characters
        self.made: list[str] = []  # namespaces created so far: what close() removes
        self.procs: list[subprocess.Popen] = []
        self.stages: dict[str, list[str]] = {}  # namespace -> the delay stage's "a:b" interface pairs
        self.stage_procs: dict[str, subprocess.Popen] = {}  # namespace -> its running stage
        self._links = 0

    @staticmethod
    def why_not(loss: float = 0.0, delay_ms: float = 0.0, ecn: bool = False) -> str:
        """Why this machine cannot build the topology ("" if it can)."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        for tool, what in (("ip", "iproute2's ip"), ("tc", "iproute2's tc")):
            if not shutil.which(tool):
                return f"network namespaces need {what} command"
        if loss and not shutil.which("nft"):
            return "lossy links need nftables' nft command (apt-get install nftables)"
        if (delay_ms or ecn) and not shutil.which("ethtool"):
            return "delayed links need the ethtool command (apt-get install ethtool)"
        return ""

    # ------------------------------------------------------------------ building blocks
    def _ip(self, *args: str):
        try:
            subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"topology: {' '.join(e.cmd)}: {e.stderr.strip()}") from None

    def _must(self, ns: str, argv: list, what: str, **kw):
        r = self.run(ns, argv, capture_output=True, text=True, **kw)
        if r.returncode:
            raise RuntimeError(f"topology: {what} in {ns}: {r.stderr.strip()}")

    def add_host(self, ns: str) -> str:
        self._ip("netns", "add", ns)
        self.made.append(ns)
        self._ip("-n", ns, "link", "set", "lo", "up")
        # no IPv6 chatter (router solicitations, MLD) on the links
        self.run(ns, ["sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6; "
                                  "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6"
                                  + ("; echo 1 > /proc/sys/net/ipv4/tcp_ecn" if self.ecn else "")], capture_output=True)
        return ns

    def add_link(self, a: str, a_if: str, b: str, b_if: str, a_ip: str | None = None):
        """A link from host a (interface a_if, address a_ip/24) to host b (b_if, no address: a bridge's or
        a switch's port). Loss is applied on a's end; delay by a stage on b's host."""
        self._links += 1
        if self.staged:
            x, y = f"dx{self.tag}-{self._links}", f"dy{self.tag}-{self._links}"
            self._ip("link", "add", a_if, "netns", a, "type", "veth", "peer", "name", x, "netns", b)
            self._ip("link", "add", y, "netns", b, "type", "veth", "peer", "name", b_if, "netns", b)
            self.stages.setdefault(b, []).append(f"{x}:{y}")
            ends = [(a, a_if), (b, x), (b, y), (b, b_if)]
        else:
            self._ip("link", "add", a_if, "netns", a, "type", "veth", "peer", "name", b_if, "netns", b)
            ends = [(a, a_if), (b, b_if)]
        if a_ip:
            self._ip("-n", a, "addr", "add", f"{a_ip}/24", "dev", a_if)
        for ns, dev in ends:
            self._ip("-n", ns, "link", "set", dev, "up")
            if self.staged:
                self.run(ns, ["ethtool", "-K", dev, "tx", "off", "tso", "off", "gso", "off", "gro", "off"],
                         capture_output=True)
        if self.loss:
            self._lossy(a, a_if)
        if self.rate_mbit and not self.ecn:  # with ecn the stage serializes at the rate: its queue is the link's
            self._shape(a, a_if)
            self._shape(b, b_if)

    def add_bridge(self, ns: str, ports: list[str], ip: str | None):
        """A Linux bridge br0 in ns over ports, holding ip/24 (a switch on a kernel socket listens there)."""
        self._ip("-n", ns, "link", "add", "br0", "type", "bridge")
        for port in ports:
            self._ip("-n", ns, "link", "set", port, "master", "br0")
        if ip:
            self._ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "br0")
        self._ip("-n", ns, "link", "set", "br0", "up")

    @staticmethod
    def burst_bytes(rate_mbit: float) -> int:
        """A link's tbf bucket: 10 ms of traffic at its rate, at least 4 frames."""
        return max(4 * 1514, int(rate_mbit * 1e6 / 8 / 100))

    def _shape(self, ns: str, dev: str):
        burst = self.burst_bytes(self.rate_mbit)
        self._must(ns, ["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{self.rate_mbit}mbit",
                        "burst", str(burst), "latency", "100ms"], "tc")

    def _lossy(self, ns: str, dev: str):
        cut = round(self.loss * 10000)
        drop = f"meta protocol ip numgen random mod 10000 < {cut} drop"
        rules = (f'table netdev ina_loss {{\n'
                 f'  chain rx {{ type filter hook ingress device "{dev}" priority 0; {drop}; }}\n'
                 f'  chain tx {{ type filter hook egress device "{dev}" priority 0; {drop}; }}\n}}\n')
        self._must(ns, ["nft", "-f", "-"], "nft", input=rules)

    def start_stages(self):
        """The delay stages, one process per host that holds cut links (after the links are up)."""
        from . import delay

        link = ["--rate-mbit", self.rate_mbit, "--ecn-bytes", self.ecn_bytes(self.rate_mbit),
                "--limit-bytes", self.queue_bytes(self.rate_mbit)] if self.ecn else []
        for ns, pairs in self.stages.items():
            p = self.popen(ns, [sys.executable, delay.__file__, "--delay-ms", self.delay_ms, *link, *pairs],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            line = p.stdout.readline()  # "ready" once its sockets are bound: no frame is lost before
            if not line.startswith("ready"):
                raise RuntimeError(f"topology: delay stage in {ns} failed: {p.stderr.read()[-1000:]}")
            self.stage_procs[ns] = p

    @staticmethod
    def ecn_bytes(rate_mbit: float) -> int:
        """The queue above which a link marks CE: 2.4 ms at 100 Mbit/s (30 KB, DCTCP's K at 1 Gbit/s), 1 ms of
        the rate above 240 Mbit/s."""
        return max(30_000, int(rate_mbit * 1e6 / 8 / 1000))

    @staticmethod
    def queue_bytes(rate_mbit: float) -> int:
        """A staged link's queue: 100 ms of its rate (as tbf's latency), at least 64 frames."""
        return max(64 * 1514, int(rate_mbit * 1e6 / 8 / 10))

    def stage_counters(self) -> dict:
        """Stop the stages; per namespace what each forwarded, marked and dropped (its exit line)."""
        out = {}
        for ns, p in self.stage_procs.items():
            if p.poll() is None:
                p.terminate()
            try:
                text, _ = p.communicate(timeout=10)
                out[ns] = json.loads([x for x in text.splitlines() if x.startswith("{")][-1])
            except (subprocess.TimeoutExpired, IndexError, ValueError):
                out[ns] = {}
        self.stage_procs = {}
        return out

    # ------------------------------------------------------------------ running things inside
    def command(self, ns: str, argv: list) -> list[str]:
        """argv run inside namespace ns (`ip netns exec` execs it: the process keeps the PID)."""
        return ["ip", "netns", "exec", ns, *map(str, argv)]

    def run(self, ns: str, argv: list, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        """subprocess.run of argv inside namespace ns, bounded by timeout."""
        return subprocess.run(self.command(ns, argv), timeout=timeout, **kw)

    def popen(self, ns: str, argv: list, **kw) -> subprocess.Popen:
        """subprocess.Popen of argv inside namespace ns; close() ends it if it still runs."""
        p = subprocess.Popen(self.command(ns, argv), **kw)
        self.procs.append(p)
        return p

    def iface_bytes(self, ns: str, dev: str) -> dict:
        r = self.run(ns, ["cat", f"/sys/class/net/{dev}/statistics/tx_bytes",
                          f"/sys/class/net/{dev}/statistics/rx_bytes"], capture_output=True, text=True)
        tx, rx = (int(v) for v in r.stdout.split())
        return {"link": dev, "tx_bytes": tx, "rx_bytes": rx}

    def close(self):
        """End what still runs in the namespaces (our popen children first), then remove them; their veths,
        qdiscs and nftables rules go with them. Safe to call twice and after a partial build."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        remove_namespaces(self.made)
        self.made, self.procs = [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def remove_namespaces(names: list[str]):
    """SIGTERM, then SIGKILL, every process inside each namespace (e.g. a switch's own children,
    simple_switch_grpc, orphaned by a kill), then delete it; its veths, qdiscs and rules go with it."""
    for ns in names:
        _end(ns)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _end(ns: str, grace: float = 3.0):
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


class Star(Topology):
    """A star of N links: worker i alone in namespace `worker_ns[i]` with `worker_ifs[i]` at `worker_ips[i]`
    (PREFIX.i+1/24), its link's far end `switch_ifs[i]` in `switch_ns`, where a switch serves `switch_ip`
    (PREFIX.254). Every host is a namespace of its own, so the traffic crosses the links for real and a
    worker sees only its own link's loss, rate and delay."""

    prefix = "10.215.0"

    def __init__(self, n: int, loss: float = 0.0, rate_mbit: float | None = None, bridge: bool | str = False,
                 delay_ms: float = 0.0, ecn: bool = False):
        """n workers; loss per packet and direction; rate_mbit: every link's rate both ways; delay_ms: every
        link's delay each way; bridge: join the switch's ends in a Linux bridge holding switch_ip (a switch on
        a kernel socket, python or c: worker-to-worker traffic such as gloo's crosses it too), else they stay
        separate ports (BMv2); bridge="port": the bridge holds no address, and one more veth pair joins it,
        whose far end `switch_port` a switch that drives one interface (DPDK's net_af_packet) takes."""
        if not 1 <= n <= 253:
            raise ValueError(f"a star has 1..253 workers, not {n}")
        super().__init__(rate_mbit, loss, delay_ms, ecn)
        tag = self.tag
        self.n, self.bridge = n, bridge
        self.switch_ns, self.worker_ns = f"ina-{tag}-s", [f"ina-{tag}-w{i}" for i in range(n)]
        self.switch_ifs, self.worker_ifs = [f"is{tag}-{i}" for i in range(n)], [f"iw{tag}-{i}" for i in range(n)]
        self.switch_ip, self.worker_ips = f"{self.prefix}.254", [f"{self.prefix}.{i + 1}" for i in range(n)]
        try:
            for ns in (self.switch_ns, *self.worker_ns):
                self.add_host(ns)
            for ns, wif, sif, ip in zip(self.worker_ns, self.worker_ifs, self.switch_ifs, self.worker_ips):
                self.add_link(ns, wif, self.switch_ns, sif, ip)
            self.switch_port = f"ip{tag}" if bridge == "port" else None
            if self.switch_port:
                self._ip("link", "add", f"ib{tag}", "netns", self.switch_ns, "type", "veth", "peer", "name",
                         self.switch_port, "netns", self.switch_ns)
                for dev in (self.switch_port, f"ib{tag}"):
                    self._ip("-n", self.switch_ns, "link", "set", dev, "up")
                self.add_bridge(self.switch_ns, [*self.switch_ifs, f"ib{tag}"], None)
            elif bridge:
                self.add_bridge(self.switch_ns, self.switch_ifs, self.switch_ip)
            self.start_stages()
        except BaseException:
            self.close()
            raise

    def namespace(self, i: int | str) -> str:
        """Worker i's namespace, or the switch's for "switch" (a namespace name passes through)."""
        if i == "switch":
            return self.switch_ns
        return self.worker_ns[i] if isinstance(i, int) else i

    def command(self, i: int | str, argv: list) -> list[str]:
        return super().command(self.namespace(i), argv)

    def link_bytes(self) -> list[dict]:
        """Per link: bytes the worker sent (tx) and received (rx), from its interface's counters."""
        return [self.iface_bytes(ns, dev) for ns, dev in zip(self.worker_ns, self.worker_ifs)]


class Tree(Topology):
    """Two-level aggregation: `leaves` leaf hosts, each with `per_leaf` worker hosts on links of their own
    (10.217.L.i+1/24 around the leaf's bridge at 10.217.L.254), and one root host whose bridge holds
    10.216.0.254 with every leaf's uplink at 10.216.0.L+1. Every link (worker-leaf and leaf-root) has the
    same rate, loss and delay. Worker w is worker w % per_leaf of leaf w // per_leaf. The root routes each
    leaf's subnet to its uplink: a leaf's switch joins the root from the address its workers know."""

    def __init__(self, leaves: int, per_leaf: int, loss: float = 0.0, rate_mbit: float | None = None,
                 delay_ms: float = 0.0, ecn: bool = False):
        if not (1 <= leaves <= 32 and 1 <= per_leaf <= 32):
            raise ValueError(f"a tree has 1..32 leaves of 1..32 workers, not {leaves} x {per_leaf}")
        super().__init__(rate_mbit, loss, delay_ms, ecn)
        tag = self.tag
        self.leaves, self.per_leaf, self.n = leaves, per_leaf, leaves * per_leaf
        self.root_ns, self.root_ip = f"ina-{tag}-r", "10.216.0.254"
        self.leaf_ns = [f"ina-{tag}-l{j}" for j in range(leaves)]
        self.uplink_ips = [f"10.216.0.{j + 1}" for j in range(leaves)]
        self.leaf_ips = [f"10.217.{j}.254" for j in range(leaves)]
        self.worker_ns = [f"ina-{tag}-w{w}" for w in range(self.n)]
        self.worker_ips = [f"10.217.{w // per_leaf}.{w % per_leaf + 1}" for w in range(self.n)]
        self.worker_ifs = [f"iw{tag}-{w}" for w in range(self.n)]
        self.uplink_ifs = [f"iu{tag}-{j}" for j in range(leaves)]
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self):
        for ns in (self.root_ns, *self.leaf_ns, *self.worker_ns):
            self.add_host(ns)
        root_ports = [f"ir{self.tag}-{j}" for j in range(self.leaves)]
        for j, ns in enumerate(self.leaf_ns):
            self.add_link(ns, self.uplink_ifs[j], self.root_ns, root_ports[j], self.uplink_ips[j])
            ports = [f"il{self.tag}-{i}" for i in range(self.per_leaf)]
            for i, port in enumerate(ports):
                w = j * self.per_leaf + i
                self.add_link(self.worker_ns[w], self.worker_ifs[w], ns, port, self.worker_ips[w])
            self.add_bridge(ns, ports, self.leaf_ips[j])
        self.add_bridge(self.root_ns, root_ports, self.root_ip)
        for j in range(self.leaves):  # a leaf's switch answers from its own subnet's address
            self._ip("-n", self.root_ns, "route", "add", f"10.217.{j}.0/24", "via", self.uplink_ips[j])
        self.start_stages()

    def link_bytes(self) -> list[dict]:
        """Per link: bytes sent and received by its lower end (a worker, or a leaf's uplink)."""
        return ([self.iface_bytes(ns, dev) for ns, dev in zip(self.worker_ns, self.worker_ifs)]
                + [self.iface_bytes(ns, dev) for ns, dev in zip(self.leaf_ns, self.uplink_ifs)])
