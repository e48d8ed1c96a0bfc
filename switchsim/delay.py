"""The delay stage of a link (this kernel has no netem): frames cross from one interface to its partner
`delay_ms` later, both ways, through AF_PACKET sockets in the host (namespace) that holds both.

    python -m switchsim.delay --delay-ms D [--rate-mbit R [--ecn-bytes K] [--limit-bytes L]] A:B [C:D ...]

prints "ready" once every socket is bound, then forwards until SIGTERM and prints its counters as JSON.
A constant delay keeps each direction first-in first-out: one ring per direction is the whole queue.
Frames beyond `--limit` waiting in one direction are dropped and counted (a queue, like a router's).
With `--rate-mbit` the stage is the whole link (this kernel has no RED): each direction is serialized at
the rate, a frame arriving while more than `--ecn-bytes` wait is marked CE if ECN-capable, one that would
overflow `--limit-bytes` is dropped, all counted.
The per-frame loop is C (csrc/ina_delay.c: recvmmsg/sendmmsg batches, ppoll until the next frame is due);
Python opens the sockets, calls it for 100 ms at a time so SIGTERM is seen, and reports.
"""
import argparse
import json
import os
import resource
import signal
import socket
import struct
import sys

try:
    from switchsim._native import ffi, lib  # absolute: netns.py runs this file as a script
except ImportError as e:  # not built (no compiler at install time)
    sys.exit(f"switchsim.delay: the C core is not built ({e}); reinstall with a C compiler: pip install -e .")

ETH_P_ALL = 0x0003
SOL_PACKET, PACKET_STATISTICS = 263, 6
SO_SNDBUFFORCE, SO_RCVBUFFORCE = 32, 33
BUFFER = 8 << 20
RUN_MS = 100  # how long one C call forwards: the latency of a stop


def open_port(ifname: str) -> socket.socket:
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    for forced, plain in ((SO_RCVBUFFORCE, socket.SO_RCVBUF), (SO_SNDBUFFORCE, socket.SO_SNDBUF)):
        try:  # root may go past net.core.rmem_max / wmem_max (212 KB: under a hundred frames in a burst)
            s.setsockopt(socket.SOL_SOCKET, forced, BUFFER)
        except PermissionError:
            s.setsockopt(socket.SOL_SOCKET, plain, BUFFER)
    s.bind((ifname, 0))
    s.setblocking(False)
    return s


def socket_drops(s: socket.socket) -> int:
    """Frames the kernel dropped because the socket's receive buffer was full (before the stage saw them)."""
    _, drops = struct.unpack("II", s.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8))
    return drops


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--delay-ms", type=float, required=True)
    ap.add_argument("--limit", type=int, default=100_000, help="frames waiting per direction before drops")
    ap.add_argument("--rate-mbit", type=float, default=0.0, help="serialize each direction at this rate (0: off)")
    ap.add_argument("--ecn-bytes", type=int, default=0, help="with --rate-mbit: mark CE above this queue (0: never)")
    ap.add_argument("--limit-bytes", type=int, default=0, help="with --rate-mbit: drop beyond this queue (0: no limit)")
    ap.add_argument("pairs", nargs="+", help="IF_A:IF_B")
    args = ap.parse_args(argv)
    if args.rate_mbit < 0 or not 0 <= args.ecn_bytes < 1 << 32 or not 0 <= args.limit_bytes < 1 << 32:
        ap.error("--rate-mbit must be >= 0, --ecn-bytes and --limit-bytes 0..2**32-1")
    if not 0 <= args.delay_ms <= 3_600_000 or not 0 <= args.limit < 1 << 32:
        ap.error("--delay-ms must be 0..3600000 and --limit 0..2**32-1")
    if any(":" not in p for p in args.pairs):
        ap.error("pairs are IF_A:IF_B")
    names = [name for p in args.pairs for name in p.split(":", 1)]
    socks = [open_port(name) for name in names]
    stage = lib.ina_delay_new([s.fileno() for s in socks], len(socks), args.delay_ms / 1000, args.limit)
    if stage == ffi.NULL:
        raise OSError(ffi.errno, os.strerror(ffi.errno))
    lib.ina_delay_link(stage, args.rate_mbit * 1e6, args.ecn_bytes, args.limit_bytes)
    running = True

    def stop(*_):
        nonlocal running
        running = False

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print("ready", flush=True)
    try:
        while running:
            if lib.ina_delay_run(stage, RUN_MS) < 0:
                raise OSError(ffi.errno, os.strerror(ffi.errno))
        c = lib.ina_delay_counters_of(stage)
        out = {k: getattr(c, k) for k in ("forwarded", "dropped", "send_errors", "received", "oversized",
                                          "send_blocked", "marked")}
        out["queue_ms_mean"] = round(c.queue_ns / 1e6 / max(1, c.forwarded), 3)  # link mode: waiting to be sent
        # direction "a>b": frames in on a, out of b
        out["queued"] = {f"{names[i]}>{names[i ^ 1]}": lib.ina_delay_queued(stage, i) for i in range(len(names))}
        out["max_queue"] = {f"{names[i]}>{names[i ^ 1]}": lib.ina_delay_queue_max(stage, i)
                            for i in range(len(names))}
    finally:
        lib.ina_delay_free(stage)
    out["socket_drops"] = sum(socket_drops(s) for s in socks)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["cpu_s"] = round(usage.ru_utime + usage.ru_stime, 3)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
