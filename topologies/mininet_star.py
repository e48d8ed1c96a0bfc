"""The star as a mininet topology (Debian's mininet 2.3, run by the system Python that has it):

    /usr/bin/python3 topologies/mininet_star.py --python VENV_PYTHON --workers 4 --bw 100 --loss 0.05 \
        --delay-ms 1 --backend c --dir DIR [worker arguments ...]

Hosts h0..hN-1 and the switch host `ina` (10.0.0.254) on a `mininet.nodelib.LinuxBridge` with
`controller=None` (no kernel Open vSwitch datapath here), links `TCLink(bw=...)` for the rate (TCLink's
delay and loss need netem, which this kernel lacks: the project's own stages do them, nftables loss on each
worker's interface and the user-space delay stage inside each worker host). The INA switch and the workers
run under VENV_PYTHON in the mininet hosts; worker w reads DIR/in{w}.npy and writes DIR/out{w}.*
(topologies/worker.py). Prints one JSON line: per-link bytes, the switch's exit counters, the workers' exit
status. topologies/run.py's run_mininet drives it and checks the results (this file imports no numpy).
"""
import argparse
import json
import os
import re
import signal
import sys
import time

from mininet.link import TCLink
from mininet.log import setLogLevel
from mininet.net import Mininet
from mininet.nodelib import LinuxBridge
from mininet.topo import Topo

HERE = os.path.dirname(os.path.abspath(__file__))
STARTED = []  # every process started in a host: mininet's hosts have no named namespace to sweep
SWITCH_IP = "10.0.0.254"


class Star(Topo):
    def build(self, n: int, bw, tag: str):
        bridge = self.addSwitch(f"s{tag}")
        opts = {"bw": bw} if bw else {}
        self.addLink(self.addHost("ina", ip=f"{SWITCH_IP}/24"), bridge, **opts)
        for w in range(n):
            self.addLink(self.addHost(f"h{w}", ip=f"10.0.0.{w + 1}/24"), bridge, **opts)


def impair(host, loss: float, delay_ms: float, python: str):
    """Loss: nftables netdev hooks on the host's interface. Delay: the host's address moves to one end of a
    veth pair inside the host, and the delay stage forwards between its other end and the link."""
    dev = host.defaultIntf().name
    if delay_ms:
        ip = host.IP()
        for cmd in (f"ip link add {dev}-a type veth peer name {dev}-b", f"ip addr flush dev {dev}",
                    f"ip addr add {ip}/24 dev {dev}-a", f"ip link set {dev}-a up", f"ip link set {dev}-b up"):
            host.cmd(cmd)
        for d in (dev, f"{dev}-a", f"{dev}-b"):
            host.cmd(f"ethtool -K {d} tx off tso off gso off gro off")
        stage_py = os.path.join(os.path.dirname(HERE), "switchsim", "delay.py")
        stage = spawn(host, [python, stage_py, "--delay-ms", str(delay_ms), f"{dev}-b:{dev}"],
                           stdout=-1, stderr=-1, text=True)
        if not stage.stdout.readline().startswith("ready"):
            raise RuntimeError(f"delay stage in {host.name}: {stage.stderr.read()[-1000:]}")
        dev = f"{dev}-a"
    if loss:
        drop = f"meta protocol ip numgen random mod 10000 < {round(loss * 10000)} drop"
        rules = (f'table netdev ina_loss {{\n'
                 f'  chain rx {{ type filter hook ingress device "{dev}" priority 0; {drop}; }}\n'
                 f'  chain tx {{ type filter hook egress device "{dev}" priority 0; {drop}; }}\n}}\n')
        p = spawn(host, ["nft", "-f", "-"], stdin=-1, stdout=-1, stderr=-1, text=True)
        _, err = p.communicate(rules)
        if p.returncode:
            raise RuntimeError(f"nft in {host.name}: {err}")


def spawn(host, argv, **kw):
    p = host.popen(argv, **kw)
    STARTED.append(p)
    return p


def start_switch(host, python: str, backend: str, workers: int, log: str):
    out = open(log, "w")
    p = spawn(host, [python, "-m", "switchsim", "serve", "--backend", backend, "--workers", str(workers),
                    "--host", SWITCH_IP, "--json-stats", "--control", "10.0.0.1"], stdout=out, stderr=out,
                   cwd=os.path.dirname(HERE))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = re.search(r"listening on ([\d.]+:\d+)", open(log).read())
        if m:
            return p, m.group(1)
        if p.poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError(f"switch did not start: {open(log).read()[-1500:]}")


def main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--python", required=True)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--bw", type=float)
    ap.add_argument("--loss", type=float, default=0.0)
    ap.add_argument("--delay-ms", type=float, default=0.0)
    ap.add_argument("--backend", default="c")
    ap.add_argument("--codec", default="int32")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("worker_args", nargs="*")
    a = ap.parse_args(argv)
    setLogLevel("error")
    net = Mininet(topo=Star(a.workers, a.bw, f"{os.getpid() % 100000}"), switch=LinuxBridge, controller=None,
                  link=TCLink, autoSetMacs=True, waitConnected=False)
    report = {}
    try:
        net.start()
        hosts = [net.get(f"h{w}") for w in range(a.workers)]
        for h in hosts:
            impair(h, a.loss, a.delay_ms, a.python)
        if a.delay_ms:  # what reaches a delay stage must carry its checksums (no offload left to finish them)
            ina = net.get("ina")
            ina.cmd(f"ethtool -K {ina.defaultIntf().name} tx off tso off gso off")
        switch, address = start_switch(net.get("ina"), a.python, a.backend, a.workers, os.path.join(a.dir, "switch.log"))
        procs = [spawn(h, [a.python, os.path.join(HERE, "worker.py"), address, str(w), str(a.workers), a.codec,
                          os.path.join(a.dir, f"in{w}.npy"), os.path.join(a.dir, f"out{w}"), *a.worker_args],
                         stdout=open(os.path.join(a.dir, f"err{w}"), "w"), stderr=-2)
                 for w, h in enumerate(hosts)]
        deadline = time.monotonic() + a.timeout
        codes = []
        for p in procs:
            while p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            codes.append(p.poll())
        switch.send_signal(signal.SIGTERM)
        switch.wait(10)
        log = open(os.path.join(a.dir, "switch.log")).read()
        report = {"workers_exit": codes, "switch": json.loads(log[log.index("\n{") + 1:]) if "\n{" in log else {},
                  "links": [{"link": h.defaultIntf().name, **{k: int(h.cmd(f"cat /sys/class/net/{h.defaultIntf().name}"
                                                                          f"/statistics/{k}")) for k in ("tx_bytes", "rx_bytes")}}
                            for h in hosts]}
    finally:
        for p in STARTED:  # switch, workers, delay stages: by PID, before their hosts go
            if p.poll() is None:
                p.kill()
                p.wait()
        net.stop()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
