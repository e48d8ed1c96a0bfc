"""One rank in a process of its own, for tests that kill ranks: joins, does CALLS int32 allreduces of
ones(SIZE), prints one JSON line per call ({"call": i, "ok": sum[0]} or {"call": i, "error": cause}),
then sleeps (or, with LINGER_CALL=1, starts one more call that never completes: a lingering member).
With HOLD_GIL=S, before every call but the first it holds the GIL for S seconds in one native call (libc's
sleep through ctypes.PyDLL, which does not release it): a busy rank, alive but unable to run Python.

    python tests/scripts/ina_rank.py ADDRESS RANK WORLD CALLS [SIZE] [TIMEOUT]
"""
import ctypes
import json
import os
import sys
import time

import numpy as np

import hostlib


def main():
    address, rank, world, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    size = int(sys.argv[5]) if len(sys.argv) > 5 else 1000
    timeout = float(sys.argv[6]) if len(sys.argv) > 6 else 60.0
    comm = hostlib.connect(address, rank, world, codec="int32", timeout=timeout, join_timeout=timeout)
    print(json.dumps({"joined": rank, "generation": comm.gen.number}), flush=True)
    hold = int(os.environ.get("HOLD_GIL", "0"))
    for i in range(calls + int(os.environ.get("LINGER_CALL", "0"))):
        if hold and i:
            ctypes.PyDLL(None).sleep(hold)
        try:
            out = comm.allreduce(np.ones(size, np.int32))
            print(json.dumps({"call": i, "ok": int(out[0])}), flush=True)
        except hostlib.INAError as e:
            print(json.dumps({"call": i, "error": e.cause, "rank": e.rank, "text": str(e)}), flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
