"""A network namespace holding the switch's end of a veth pair, for the DPDK backend on one machine.

The caller (workers, tests) keeps the other end in its own namespace with WORKER_IP; a DPDK switch drives
its end with net_af_packet and answers ARP for switch_ip. Needs root and iproute2; `close()` removes both.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys


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
