"""One job of a shared switch as its own process: its ranks as threads, allreduce in a loop for --seconds, every
call checked exact; prints one JSON line (the calls made, exact or not). The shared-switch test kills one."""
import argparse
import json
import sys
import threading
import time

import numpy as np

import hostlib


class Rounds:
    """The ranks' threads agree before every call: on while time is left, decided once for all of them (a rank
    that stopped alone would leave its peers in a call)."""

    def __init__(self, world: int, seconds: float):
        self.end, self.go = time.monotonic() + seconds, True
        self.barrier = threading.Barrier(world, action=self._decide, timeout=60)  # a rank that never joined

    def _decide(self):
        self.go = time.monotonic() < self.end

    def next(self) -> bool:
        self.barrier.wait()
        return self.go


def rank_loop(switch: str, job: int, rank: int, world: int, rounds: Rounds, out: dict):
    comm = hostlib.connect(switch, rank, world, job=job, codec="int32")
    calls, exact = 0, True
    try:
        while rounds.next():
            n = 1000 + 997 * (calls % 50)  # sizes from one packet to many
            x = (np.arange(n, dtype=np.int32) + calls) * (rank + 1) * job
            got = comm.allreduce(x)
            exact &= bool(np.array_equal(got, (np.arange(n, dtype=np.int32) + calls) * job * world * (world + 1) // 2))
            calls += 1
    finally:
        comm.close()
    out[rank] = {"calls": calls, "exact": exact, "window": comm.window}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("switch")
    p.add_argument("--job", type=int, required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seconds", type=float, default=3.0)
    a = p.parse_args()
    out: dict = {}
    rounds = Rounds(a.world, a.seconds)
    threads = [threading.Thread(target=rank_loop, args=(a.switch, a.job, r, a.world, rounds, out))
               for r in range(a.world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"job": a.job, "ranks": out}), flush=True)
    return 0 if len(out) == a.world and all(r["exact"] for r in out.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
