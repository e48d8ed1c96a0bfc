"""The C aggregator core's packets/s on one core (ina_switch_replay of a lossless stream, 4 workers, full
rounds, best of --repeat), for this tree and, with --against DIR, for another built checkout in the same
run, as a table with the ratio. How protocol v2's admission checks were measured against v1:

    git worktree add /tmp/old e402216 && (cd /tmp/old && python setup.py build_ext --inplace)
    python benchmarks/core_versions.py --against /tmp/old --rounds 3

Each tree is measured in a subprocess of its own (its own switchsim/_native module); the rounds alternate.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MEASURE = r"""
import json, sys, time
from switchsim import native
from hostlib import wire
import os
if os.path.exists("switchsim/bench.py"):  # a tree from before inabench (cwd is the tree)
    from switchsim import bench
elif os.path.exists("inabench/micro.py"):  # a tree after bench.py's split
    from inabench import micro as bench
else:
    from inabench import bench
packets, workers, repeat = (int(a) for a in sys.argv[1:4])
admit = hasattr(native.lib, "ina_switch_admit")  # protocol v2: the stream's generation is admitted first
out = {}
for name, codec, k in (("int32 x 256", wire.CODEC_INT32, 256), ("NC x 1024", wire.CODEC_NC8, 1024)):
    stream = bench._rounds(codec, workers, k, packets // workers, 512)
    blob = b"".join(d for d, _ in stream)
    lens = native.ffi.new("uint32_t[]", [len(d) for d, _ in stream])
    srcs = native.ffi.new("uint64_t[]", [s for _, s in stream])
    best = 0.0
    for _ in range(repeat):
        if admit:
            from switchsim.config import SwitchConfig
            core = native.new_core(SwitchConfig({1: workers}))
            addrs = native.ffi.new("uint64_t[]", list(range(workers)))
            extra = (0,) * (len(native.ffi.typeof(native.lib.ina_switch_admit).args) - 6)  # v3: elements (0: max)
            native.lib.ina_switch_admit(core, 1, 1, bench.BENCH_SESSION, 0, addrs, *extra)
        else:
            core = native.new_core({1: workers}, 512, 1024, "stochastic", 0)
        t = time.perf_counter()
        emitted = native.lib.ina_switch_replay(core, blob, lens, srcs, len(stream))
        dt = time.perf_counter() - t
        assert emitted == len(stream), f"{name}: {emitted} packets out for {len(stream)} in"
        best = max(best, len(stream) / dt)
    out[name] = best
print(json.dumps(out))
"""


def measure(tree: str, packets: int, workers: int, repeat: int) -> dict:
    run = subprocess.run([sys.executable, "-c", MEASURE, str(packets), str(workers), str(repeat)], cwd=tree,
                         env={**os.environ, "PYTHONPATH": tree}, capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"measuring {tree} failed:\n{run.stderr[-2000:]}")
    return json.loads(run.stdout)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--against", metavar="DIR", help="another built checkout to measure in the same run")
    p.add_argument("--packets", type=int, default=200_000)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--rounds", type=int, default=1, help="measurements per tree, alternating")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    trees = [("this", ROOT)] + ([("against", os.path.abspath(a.against))] if a.against else [])
    rows = []
    for r in range(a.rounds):
        for label, tree in trees:
            for stream, pps in measure(tree, a.packets, a.workers, a.repeat).items():
                rows.append({"round": r, "tree": label, "stream": stream, "packets/s": pps})
    for row in rows:
        base = [x["packets/s"] for x in rows if x["tree"] == "against" and x["stream"] == row["stream"]
                and x["round"] == row["round"]]
        row["x against"] = row["packets/s"] / base[0] if base else None
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'round':>5} {'tree':>8} {'stream':>12} {'packets/s':>12} {'x against':>10}")
    for row in rows:
        ratio = f"{row['x against']:.3f}" if row["x against"] is not None else "-"
        print(f"{row['round']:>5} {row['tree']:>8} {row['stream']:>12} {row['packets/s']:12,.0f} {ratio:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
