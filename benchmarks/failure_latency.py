"""How fast a failed call fails, by cause (protocol v3): seconds from the call to the named error on the
ranks that did nothing wrong, median and range over repeated runs, on the C switch with the C worker loop.

    python benchmarks/failure_latency.py [--repeat 5] [--backend c]

Causes: the ranks' lengths differ (CallMismatch), a rank's input is bad (CallAborted on the peer), the
switch is SIGKILLed (SwitchUnreachable), the switch restarts (SwitchRestarted), a peer process is SIGKILLed
(PeerDead). The baseline is the generic timeout every one of these was before (30 s by default)."""
from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

import hostlib
from inabench.harness import ROOT, SwitchProcess

TIMEOUT = 30.0  # hostlib.connect's default: what every one of these failures took before protocol v3


def two_ranks(address, plans):
    """Ranks 0 and 1 in threads, each running its plan(comm) -> seconds until its error (None: no error)."""
    out = [None, None]

    def work(r):
        with hostlib.connect(address, r, 2, codec="int32", timeout=TIMEOUT) as comm:
            out[r] = plans[r](comm)

    ts = [threading.Thread(target=work, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    return out


def timed_error(comm, x):
    t = time.monotonic()
    try:
        comm.allreduce(x)
    except Exception:  # noqa: BLE001 - the error is what is timed
        return time.monotonic() - t
    return None


def mismatch(backend):
    sw = SwitchProcess("--workers", 2, backend=backend)
    try:
        res = two_ranks(sw.address, [lambda c: timed_error(c, np.ones(1 << 20, np.int32)),
                                     lambda c: timed_error(c, np.ones(2 << 20, np.int32))])
        return max(res)
    finally:
        sw.stop()


def abort(backend):
    sw = SwitchProcess("--workers", 2, backend=backend)
    try:
        res = two_ranks(sw.address, [lambda c: timed_error(c, np.ones(1000, np.float32)),  # TypeError on int32
                                     lambda c: timed_error(c, np.ones(1000, np.int32))])
        return res[1]
    finally:
        sw.stop()


def switch_killed(backend):
    sw = SwitchProcess("--workers", 1, backend=backend)
    with hostlib.connect(sw.address, 0, 1, codec="int32", timeout=TIMEOUT) as comm:
        comm.allreduce(np.ones(10, np.int32))
        os.kill(sw.proc.pid, signal.SIGKILL)
        sw.proc.wait()
        return timed_error(comm, np.ones(1 << 16, np.int32))


def switch_restarted(backend):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sw = SwitchProcess("--workers", 1, "--port", port, backend=backend)
    again = None
    try:
        with hostlib.connect(sw.address, 0, 1, codec="int32", timeout=TIMEOUT) as comm:
            comm.allreduce(np.ones(10, np.int32))
            os.kill(sw.proc.pid, signal.SIGKILL)
            sw.proc.wait()
            again = SwitchProcess("--workers", 1, "--port", port, backend=backend)
            return timed_error(comm, np.ones(1 << 16, np.int32))
    finally:
        if again:
            again.stop()


def peer_killed(backend):
    sw = SwitchProcess("--workers", 2, backend=backend)
    peer = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "scripts", "ina_rank.py"), sw.address, "1",
                             "2", "1"], stdout=subprocess.DEVNULL)
    try:
        with hostlib.connect(sw.address, 0, 2, codec="int32", timeout=TIMEOUT) as comm:
            comm.allreduce(np.ones(1000, np.int32))  # the peer's one call (ina_rank.py: 1000 elements)
            time.sleep(0.5)
            peer.kill()
            peer.wait()
            return timed_error(comm, np.ones(1000, np.int32))
    finally:
        peer.kill()
        sw.stop()


CAUSES = {"lengths differ": mismatch, "a peer's bad input": abort, "switch SIGKILLed": switch_killed,
          "switch restarted": switch_restarted, "peer SIGKILLed": peer_killed}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--backend", default="c", choices=("c", "python"))
    args = ap.parse_args()
    print(f"# seconds from the call to the named error, {args.repeat} runs each, switch backend {args.backend}; "
          f"before protocol v3 each was the {TIMEOUT:g} s timeout")
    print(f"{'cause':<20} {'median':>8} {'min':>8} {'max':>8} {'x timeout':>10}")
    for name, run in CAUSES.items():
        secs = [run(args.backend) for _ in range(args.repeat)]
        ok = [s for s in secs if s is not None]
        if len(ok) < len(secs):
            print(f"{name:<20} {len(secs) - len(ok)} runs raised nothing")
            continue
        med = statistics.median(ok)
        print(f"{name:<20} {med:>8.3f} {min(ok):>8.3f} {max(ok):>8.3f} {med / TIMEOUT:>10.3f}")


if __name__ == "__main__":
    main()
