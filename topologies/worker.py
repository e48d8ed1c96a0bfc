"""One rank of an allreduce in a process of its own, for tests that put each worker in its own network
namespace (switchsim topo run, tests/test_bmv2_e2e.py):

    python -m topologies.worker SWITCH RANK WORLD CODEC IN.npy OUT [KEY=JSON ...]

connects to SWITCH (HOST:PORT) as RANK of WORLD with hostlib.connect(..., KEY=value), allreduces the array
in IN.npy once, and writes OUT.npy (the result) and OUT.json (its CommStats, the allreduce's seconds and the smoothed round trip, srtt); on failure the traceback goes
to stderr and the exit status is 1.
"""
import json
import sys
import time

import numpy as np

import hostlib


def main(argv):
    switch, rank, world, codec, src, out = argv[:6]
    kw = {k: json.loads(v) for k, v in (a.split("=", 1) for a in argv[6:])}
    x = np.load(src)
    with hostlib.connect(switch, int(rank), int(world), codec=codec, **kw) as comm:
        t0 = time.perf_counter()
        y = comm.allreduce(x)
        stats = {**comm.stats.as_dict(), "seconds": time.perf_counter() - t0, "srtt": comm.rtt.srtt}
    np.save(out + ".npy", y)
    with open(out + ".json", "w") as f:
        json.dump(stats, f)


if __name__ == "__main__":
    main(sys.argv[1:])
