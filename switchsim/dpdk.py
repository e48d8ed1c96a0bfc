"""The C core behind a DPDK poll loop (csrc/ina_dpdk.c), with UDPServer's interface.

The EAL runs once per process, so a DPDK switch is its own process: `switchsim serve --backend dpdk`.
Defaults suit a machine without hugepages or NICs bound to DPDK (--no-huge --no-pci --no-shconf -m 256);
`--eal "..."` replaces them, e.g. for a real NIC: --eal "-l 1 -a 0000:3b:00.0 --in-memory".
"""
from __future__ import annotations

import ipaddress
import shlex
import threading
import time

from inaproto import net, wire

from .native import CoreSwitch, impairment_stats
from .server import check_probabilities

try:
    from ._dpdk import ffi, lib
except ImportError as e:
    ffi = lib = None
    IMPORT_ERROR = str(e)
else:
    IMPORT_ERROR = ""

DEFAULT_EAL = "--no-huge --no-pci --no-shconf --no-telemetry -m 256 --log-level=*:warning"
MASK64 = (1 << 64) - 1
_eal_lock = threading.Lock()
_eal_done = False


def available() -> bool:
    return lib is not None


def eal_args(eal: str | None, vdev: list[str] | None, iface: str | None) -> list[str]:
    args = shlex.split(DEFAULT_EAL if eal is None else eal)
    for v in vdev or []:
        args += ["--vdev", v]
    if iface:
        args += ["--vdev", f"net_af_packet0,iface={iface},qpairs=1,blocksz=4096,framesz=2048,framecnt=4096"]
    return args


def init_eal(args: list[str]) -> None:
    global _eal_done
    if lib is None:
        raise RuntimeError(f"the DPDK backend is not built ({IMPORT_ERROR}); install libdpdk-dev and "
                           "pkg-config, then pip install -e .")
    with _eal_lock:
        if _eal_done:
            raise RuntimeError("the DPDK EAL can start only once per process")
        argv_keep = [ffi.new("char[]", a.encode()) for a in ["switchsim", *args]]
        argv = ffi.new("char *[]", argv_keep)
        if lib.ina_dpdk_eal_init(len(argv_keep), argv) < 0:
            raise RuntimeError(f"rte_eal_init failed for EAL arguments {' '.join(args)!r}")
        _eal_done = True


class DPDKServer:
    """A switch on DPDK port `dpdk_port`, answering ARP and INA packets for host:port."""

    def __init__(self, config, host, port=wire.DEFAULT_PORT, *, loss=0.0, dup=0.0, reorder=0.0, eal=None,
                 vdev=None, iface=None, dpdk_port=0):
        check_probabilities(loss, dup, reorder)
        try:
            ip = int(ipaddress.IPv4Address(host))
        except ValueError:
            raise ValueError(f"--host must be the switch's IPv4 address on the DPDK port, got {host!r}") from None
        if not 1 <= port <= 65535:
            raise ValueError("the DPDK backend needs a fixed --port (it has no kernel to pick one)")
        init_eal(eal_args(eal, vdev, iface))
        self.switch = CoreSwitch(config, ffi=ffi, lib=lib)
        self.switch.control.stats = self.stats
        # its own data plane to `serve` (config, jobs); jobs is the core's dict, which a shared switch's
        # control plane changes in place (CoreSwitch.add_job / remove_job, between ina_dpdk_run calls)
        self.config, self.core, self.jobs = self.switch.config, self.switch.core, self.switch.jobs
        err = ffi.new("char[]", 256)
        self.loop = lib.ina_dpdk_new(self.core, dpdk_port, ip, port, loss, dup, reorder, config.seed & MASK64,
                                     err, 256)
        if self.loop == ffi.NULL:
            raise OSError(ffi.string(err).decode())
        mac = ffi.new("uint8_t[6]")
        lib.ina_dpdk_mac(self.loop, mac)
        self.mac = ":".join(f"{b:02x}" for b in mac)
        self.address = (host, port)
        self._stopped = threading.Event()
        self.started = time.monotonic()
        self.capturing = False

    def serve_forever(self):
        length, src = ffi.new("uint32_t *"), ffi.new("uint64_t *")
        while not self._stopped.is_set():
            n = lib.ina_dpdk_run(self.loop)  # releases the GIL; returns now and then and for control requests
            for i in range(n):
                data = bytes(ffi.buffer(lib.ina_dpdk_punt(self.loop, i, length, src), length[0]))
                for reply, dst in self.switch.control_request(data, self.switch.address(src[0])):
                    lib.ina_dpdk_send(self.loop, net.address_id(*dst), reply, len(reply))
            lib.ina_dpdk_punt_clear(self.loop)

    def stop(self):
        self._stopped.set()
        lib.ina_dpdk_stop(self.loop)

    def start_capture(self, path: str, max_mb: float):
        """As UDPServer.start_capture, written by the C loop (csrc/ina_capture.h).

        Raises:
            OSError: the file cannot be written.
        """
        if lib.ina_dpdk_capture(self.loop, path.encode(), int(max_mb * 2**20)):
            raise OSError(ffi.errno, f"cannot write the capture {path}")
        self.capturing = True

    def close(self):
        lib.ina_dpdk_capture_close(self.loop)  # the EAL and its port live as long as the process

    def stats(self, per_slot: bool = False) -> dict:
        s = self.switch.stats(per_slot)
        c = lib.ina_dpdk_counters_of(self.loop)
        s.update({"bytes_in": c.rx_bytes, "bytes_out": c.tx_bytes, "send_errors": c.tx_full,
                  "impairment": impairment_stats(c),
                  "dpdk": {"rx_packets": c.rx_packets, "tx_packets": c.tx_packets, "not_ina": c.not_ina,
                           "tx_no_peer": c.tx_no_peer,
                           "arp_replies": c.arp_replies, "punts_dropped": c.punts_dropped, "mac": self.mac},
                  "uptime_s": round(time.monotonic() - self.started, 3)})
        if self.capturing:
            s.update({"captured": c.captured, "capture_skipped": c.capture_skipped})
        return s
