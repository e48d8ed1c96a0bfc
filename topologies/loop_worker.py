"""One rank of an INA job that allreduces in a loop for a while, for `switchsim bench net` (a training job's
steady gradient traffic beside other flows):

    python -m topologies.loop_worker SWITCH RANK WORLD CODEC ELEMENTS SECONDS OUT.json [KEY=JSON ...]

connects to SWITCH as RANK of WORLD with hostlib.connect(..., KEY=value), allreduces ELEMENTS int32 (or
float32) elements again and again for SECONDS, checks every int32 result against the exact sum (every rank
contributes rank + 1, so the sum is known; the last element carries whether each rank goes on, so all stop
after the same call), and writes OUT.json: each call's end time since the first
call's end (time.monotonic(), the same clock in every namespace), its seconds, the tensor's bytes, the CommStats,
the congestion window as the last call left it, and whether every result was exact.
"""
import json
import sys
import time

import numpy as np

import hostlib


STOP = 1 << 20  # a stopping rank's last element, negative: larger than any sum of the others' rank + 1


def main(argv):
    switch, rank, world, codec, elements, seconds, out = argv[:7]
    kw = {k: json.loads(v) for k, v in (a.split("=", 1) for a in argv[7:])}
    rank, world, elements, seconds = int(rank), int(world), int(elements), float(seconds)
    dtype = np.int32 if codec == "int32" else np.float32
    x = np.full(elements, rank + 1, dtype)
    want = world * (world + 1) // 2
    calls, exact = [], True
    with hostlib.connect(switch, rank, world, codec=codec, **kw) as comm:
        comm.allreduce(x)  # the join and the first call's start-up are not the steady state
        print("started", flush=True)
        t0 = time.monotonic()
        going = True
        while going:
            # the last element says whether this rank goes on after this call (negative: it stops), so every
            # rank makes the same calls: a rank that stopped on its own clock left a peer in a call alone
            x[-1] = rank + 1 if time.monotonic() - t0 < seconds else -STOP
            t = time.monotonic()
            y = comm.allreduce(x)
            calls.append([time.monotonic(), time.monotonic() - t])
            going = bool(y[-1] > 0)
            if codec == "int32":
                exact = exact and bool(np.all(y[:-1] == want)) and bool(y[-1] == want or y[-1] < 0)
        stats = comm.stats.as_dict()
        window = {k: getattr(comm.cc, k) for k in ("cwnd", "base_rtt", "reductions", "marks", "delay_signals")}
        window["srtt"] = comm.rtt.srtt
    with open(out, "w") as f:
        json.dump({"calls": calls, "bytes_per_call": int(x.nbytes), "exact": exact if codec == "int32" else None,
                   "stats": stats, "cc": window}, f)


if __name__ == "__main__":
    main(sys.argv[1:])
