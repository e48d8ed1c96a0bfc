"""Liveness that load and strangers cannot fake (protocol v3.1), measured on real processes.

    python benchmarks/liveness.py busy   --workers 16 --calls 20 --hold 10 [--kill] [--python-heartbeat] [--json]
    python benchmarks/liveness.py floods --backends python,c --seconds 10 [--json]

busy: WORKERS rank processes on a C switch that drops, duplicates and reorders (--loss 0.05 --dup 0.01
--reorder 0.05); before each of CALLS int32 allreduces, a random quarter of the ranks hold the GIL for HOLD
seconds in one native call (libc's sleep through ctypes.PyDLL: alive, unable to run Python) after some numpy
work. Counts the calls that were exact on every rank and the false PeerDead (a live rank named dead). With
--kill, after call CALLS // 2 one rank that holds nothing is SIGKILLed: the seconds until each survivor raises
PeerDead naming it. --python-heartbeat sends heartbeats from a Python thread (INA_NATIVE_HEARTBEAT=0), the
design before v3.1, for the comparison.

floods: for each backend, keyless and keyed, and each shape of control datagram (heartbeat, join, abort,
leave, stats), one process floods the switch from 16 source addresses as fast as it can (the C packet
blaster) for 2 x SECONDS: during the first half the ranks sit between calls, during the second they call.
Every call is checked exact; any error is a failure of the rule "a stranger's flood has no effect".

Every process is stopped by PID at the end; everything talks to loopback only.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import signal
import socket
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from inabench.harness import SwitchProcess  # noqa: E402
from inaproto import wire  # noqa: E402
from inaproto.net import parse_address  # noqa: E402

SHAPES = ("heartbeat", "join", "abort", "leave", "stats")
KEY = b"liveness-benchmark-key-0123456789"


# ---------------------------------------------------------------- busy ranks


def holders(seed: int, world: int, calls: int) -> list[set]:
    """Per call, the ranks that hold the GIL before it: a random quarter, the same on every rank."""
    rs = np.random.default_rng(seed)
    return [set(rs.choice(world, max(1, world // 4), replace=False).tolist()) for _ in range(calls)]


def busy_rank(address, rank, world, calls, hold, seed, kill_after, victim, env, out):
    os.environ.update(env)
    import hostlib

    plan = holders(seed, world, calls)
    x = np.arange(65536, dtype=np.int32) + rank
    want = world * np.arange(65536, dtype=np.int64) + world * (world - 1) // 2
    sleep = ctypes.PyDLL(None).sleep  # a native call that keeps the GIL
    comm = hostlib.connect(address, rank, world, codec="int32", timeout=60, join_timeout=120)
    out.put(("joined", rank, time.time()))
    for i in range(calls):
        if rank in plan[i] and i != kill_after + 1:
            np.sort(np.random.default_rng(i).random(1 << 20))  # some work, then the GIL held
            sleep(hold)
        try:
            y = comm.allreduce(x)
            out.put(("call", rank, i, bool(np.array_equal(y, want)), None, None, time.time()))
        except hostlib.INAError as e:
            out.put(("call", rank, i, False, e.cause, e.rank, time.time()))
            if e.cause == "peer_dead" and e.rank == victim:
                break  # the killed rank never joins again: the job is over
    comm.close()
    out.put(("done", rank, time.time()))


def run_busy(a) -> dict:
    sw = SwitchProcess("--workers", a.workers, "--loss", 0.05, "--dup", 0.01, "--reorder", 0.05, "--seed", a.seed,
                       backend="c")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    env = {"INA_NATIVE_HEARTBEAT": "0"} if a.python_heartbeat else {}
    kill_after = a.calls // 2 if a.kill else -10
    plan = holders(a.seed, a.workers, a.calls)
    victim = next(r for r in range(a.workers) if r not in plan[kill_after + 1]) if a.kill else None
    procs = [ctx.Process(target=busy_rank, args=(sw.address, r, a.workers, a.calls, a.hold, a.seed, kill_after,
                                                 victim, env, out)) for r in range(a.workers)]
    calls: dict[int, dict[int, tuple]] = {}
    killed_at, done = None, set()
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + a.calls * (a.hold + 60) + 120
        while len(done) < a.workers - (1 if killed_at else 0) and time.monotonic() < deadline:
            msg = out.get(timeout=max(1.0, deadline - time.monotonic()))
            if msg[0] == "call":
                _, r, i, ok, cause, named, at = msg
                calls.setdefault(i, {})[r] = (ok, cause, named, at)
                if i == kill_after and len(calls[i]) == a.workers and killed_at is None:
                    os.kill(procs[victim].pid, signal.SIGKILL)
                    killed_at = time.time()
            elif msg[0] == "done":
                done.add(msg[1])
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
        sw.stop()
    return summarize_busy(a, calls, victim, killed_at)


def summarize_busy(a, calls, victim, killed_at) -> dict:
    exact = sum(all(v[0] for v in calls.get(i, {}).values()) and len(calls.get(i, {})) == a.workers
                for i in range(a.calls))
    false_dead = sum(1 for i, by in calls.items() for r, (ok, cause, named, at) in by.items()
                     if cause == "peer_dead" and named != victim)
    other = sorted({cause for by in calls.values() for (ok, cause, named, at) in by.values()
                    if cause not in (None, "peer_dead")})
    row = {"workers": a.workers, "calls": a.calls, "hold_s": a.hold, "heartbeat": "python" if a.python_heartbeat
           else "native", "exact_calls": exact, "false_peer_dead": false_dead, "other_errors": other}
    if victim is not None:
        named = [at - killed_at for i, by in calls.items() for r, (ok, cause, who, at) in by.items()
                 if cause == "peer_dead" and who == victim and at >= killed_at]
        row.update(killed=victim, survivors_named=len(named), named_after_s=[round(t, 2) for t in sorted(named)][:3],
                   named_max_s=round(max(named), 2) if named else None)
    return row


# ---------------------------------------------------------------- floods


def flood_packets(shape: str, world: int) -> list[bytes]:
    rs = np.random.default_rng(7)
    session = int(rs.integers(1, 2**32))  # a stranger does not know the session
    if shape == "heartbeat":
        return [wire.pack(wire.MSG_HEARTBEAT, job=1, rank=r, session=session) for r in range(world)]
    if shape == "join":
        return [wire.pack_join(1, r, int(rs.integers(1, 2**62)), world, 64, elements=256) for r in range(world)]
    if shape == "abort":
        return [wire.pack(wire.MSG_ABORT, job=1, rank=r, session=session, payload=b"stranger") for r in range(world)]
    if shape == "leave":
        return [wire.pack(wire.MSG_LEAVE, job=1, rank=r, session=session) for r in range(world)]
    return [wire.pack(wire.MSG_STATS_REQ)]


def flooder(address, shape, world, seconds, sources, out):
    """Flood from `sources` sockets of their own (addresses) with the C blaster, flat out, for `seconds`."""
    from switchsim._native import ffi, lib

    socks = []
    for _ in range(sources):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.connect(address)
        socks.append(s)
    pkts = flood_packets(shape, world)
    n = 65536
    chosen = [pkts[i % len(pkts)] for i in range(n)]
    blob = b"".join(chosen)
    fds = ffi.new("int[]", [s.fileno() for s in socks])
    lens = ffi.new("uint32_t[]", [len(p) for p in chosen])
    which = ffi.new("uint8_t[]", [i % sources for i in range(n)])
    res = ffi.new("ina_blast_result *")
    end, sent = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        lib.ina_blast(fds, sources, blob, lens, which, n, 0.0, 0, min(1.0, end - time.monotonic()), 0.0005, 0, res)
        sent += res.sent
    out.put(("flood", sent / seconds))
    for s in socks:
        s.close()


def flood_rank(address, rank, world, seconds, key, out):
    """Join, sit SECONDS between calls, then call for SECONDS: element 0 of each call says whether this rank
    wants another, so every rank makes the same calls and stops together."""
    import hostlib

    x = np.arange(4096, dtype=np.int32) * (rank + 1)
    want = np.arange(4096, dtype=np.int64) * (world * (world + 1) // 2)
    results = []
    comm = hostlib.connect(address, rank, world, codec="int32", timeout=30, key=key)
    out.put(("ready", rank))
    time.sleep(seconds)  # between calls while the flood runs
    end, more = time.monotonic() + seconds, True
    while more:  # calling while it runs
        x[0] = int(time.monotonic() < end)
        try:
            y = comm.allreduce(x)
            results.append("ok" if np.array_equal(y[1:], want[1:]) else "wrong")
            more = y[0] == world
        except hostlib.INAError as e:
            results.append(e.cause)
            more = time.monotonic() < end + 30
    comm.close()
    out.put(("rank", rank, results))


def run_flood(backend, keyed, shape, a) -> dict:
    keyfile = None
    args = ["--workers", a.workers]
    if keyed:
        keyfile = tempfile.NamedTemporaryFile("wb", suffix=".key", delete=False)
        keyfile.write(KEY)
        keyfile.close()
        args += ["--key-file", f"1:{keyfile.name}"]
    sw = SwitchProcess(*args, backend=backend)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ranks = [ctx.Process(target=flood_rank, args=(sw.address, r, a.workers, a.seconds, KEY if keyed else None, out))
             for r in range(a.workers)]
    fl = ctx.Process(target=flooder, args=(parse_address(sw.address), shape, a.workers, 2 * a.seconds, 16, out))
    got, pps = {}, 0.0
    try:
        for p in ranks:
            p.start()
        ready = 0
        while ready < a.workers:
            ready += out.get(timeout=120)[0] == "ready"
        fl.start()
        while len(got) < a.workers or not pps:
            msg = out.get(timeout=4 * a.seconds + 120)
            if msg[0] == "rank":
                got[msg[1]] = msg[2]
            elif msg[0] == "flood":
                pps = msg[1]
    finally:
        for p in [*ranks, fl]:
            if p.is_alive():
                p.kill()
            p.join(10)
        report = sw.stop()
        if keyfile:
            os.unlink(keyfile.name)
    dropped = {}
    try:
        dropped = json.loads(report).get("dropped", {})
    except (ValueError, TypeError):
        pass
    calls = [c for r in got.values() for c in r]
    return {"backend": backend, "keyed": keyed, "shape": shape, "flood_pps": round(pps),
            "calls": len(calls), "exact": calls.count("ok"), "errors": sorted(set(calls) - {"ok"}),
            "rate_limited": dropped.get("rate_limited")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    b = sub.add_parser("busy")
    b.add_argument("--workers", type=int, default=16)
    b.add_argument("--calls", type=int, default=20)
    b.add_argument("--hold", type=int, default=10, help="seconds a busy rank holds the GIL before a call")
    b.add_argument("--kill", action="store_true")
    b.add_argument("--python-heartbeat", action="store_true")
    b.add_argument("--seed", type=int, default=1)
    f = sub.add_parser("floods")
    f.add_argument("--backends", default="python,c")
    f.add_argument("--shapes", default=",".join(SHAPES))
    f.add_argument("--keyed", default="no,yes")
    f.add_argument("--seconds", type=float, default=10.0)
    f.add_argument("--workers", type=int, default=2)
    for sp in (b, f):
        sp.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.what == "busy":
        rows = [run_busy(a)]
    else:
        rows = [run_flood(be, k == "yes", s, a) for be in a.backends.split(",") for k in a.keyed.split(",")
                for s in a.shapes.split(",")]
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0
    cols = list(rows[0])
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r.get(c)) for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
