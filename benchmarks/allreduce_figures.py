"""The allreduce figures docs/performance.md quotes, reproducibly: `switchsim bench allreduce --repeat R`
run INVOCATIONS times (separate processes, so one slow start-up or one noisy minute moves one invocation,
not the figure); per configuration and size, the median of the invocations' medians, their spread (lowest
and highest median) and the ratios users ask about, each ratio taken within an invocation (gloo and the
configuration alternate there) and then its median over the invocations.

    python benchmarks/allreduce_figures.py                        # issue 36's and 37's rows
    python benchmarks/allreduce_figures.py --sizes 1K,64M --codecs nc --payloads 1024,8192 --plain --json

Ratios: "x gloo" (time over gloo's), "x out" (a plain `y = allreduce(x)` row over the `out=` row of the same
configuration, or the plain row's own, measured in batches alternating with out= in the same
processes), "x hostlib" (a torch ina row's own: its `dist.all_reduce` calls over hostlib's `out=` calls with
the same codec and packets, in batches alternating in the same processes; "x hostlib, rows": the torch row
over hostlib's row of the same backend, codec and payload, separate process sets).
The first line says the commit, the CPU model and the SIMD paths the switch and the workers take: figures
move with each.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # switchsim and hostlib, for the paths machine() reports


RATIOS = ("x gloo", "x out", "x hostlib", "x hostlib, rows")


def invocation(args) -> list[dict]:
    """One `switchsim bench --json allreduce` process; its rows (errors too)."""
    cmd = [sys.executable, "-m", "switchsim", "bench", "--json", "allreduce", "--sizes", args.sizes,
           "--workers", str(args.workers), "--codecs", args.codecs, "--payloads", args.payloads,
           "--repeat", str(args.repeat), "--backends", args.backends] + (["--plain"] if args.plain else [])
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=args.timeout)
    if run.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({run.returncode}): {run.stderr.strip()[-500:]}")
    return json.loads(run.stdout)["allreduce"]


def ratios(rows: list[dict]) -> dict:
    """(config, size) -> {time, x gloo, x out, x hostlib} within one invocation."""
    by = {(r["config"], r["size"]): r for r in rows if "time" in r}
    gloo = {size: r["time"] for (config, size), r in by.items() if r["backend"] == "gloo"}
    got = {}
    for (config, size), r in by.items():
        row = {"time": r["time"]}
        if size in gloo:
            row["x gloo"] = r["time"] / gloo[size]
        if "x out" in r:  # a plain row's own: paired with out= in its processes (inabench.allreduce.PAIRS)
            row["x out"] = r["x out"]
        elif config.endswith(" plain") and (config[:-6], size) in by:
            row["x out"] = r["time"] / by[config[:-6], size]["time"]
        if "x hostlib" in r:  # a torch row's own: paired with hostlib's calls in its processes
            row["x hostlib"] = r["x hostlib"]
            row["x hostlib, rows"] = r["time"] / by[config[len("torch ina "):], size]["time"] \
                if (config[len("torch ina "):], size) in by else None
        elif config.startswith("torch ina ") and (config[len("torch ina "):], size) in by:
            row["x hostlib"] = r["time"] / by[config[len("torch ina "):], size]["time"]
        got[config, size] = row
    return got


def summary(invocations: list[dict]) -> list[dict]:
    """Per (config, size): the median over invocations of each figure, with the spread of the times."""
    keys = sorted({k for inv in invocations for k in inv}, key=lambda k: (k[0], k[1]))
    out = []
    for config, size in keys:
        got = [inv[config, size] for inv in invocations if (config, size) in inv]
        times = [g["time"] for g in got]
        row = {"config": config, "size": size, "invocations": len(got), "time": statistics.median(times),
               "time min": min(times), "time max": max(times)}
        for name in RATIOS:
            values = [g[name] for g in got if g.get(name) is not None]
            if values:
                row[name] = statistics.median(values)
                row[name + " spread"] = (min(values), max(values))
        out.append(row)
    return out


def machine() -> dict:
    """What the figures depend on besides the code: the commit (and whether the tree differs from it), the CPU
    model and cores, and the SIMD paths the switch's core and the workers' kernels take on this CPU (one CPU
    model name covers machines with and without AVX-512, which run different paths)."""
    def git(*cmd):
        return subprocess.run(["git", *cmd], capture_output=True, text=True, cwd=ROOT).stdout.strip()

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    return {"commit": git("rev-parse", "--short", "HEAD") or "?",
            "changes": bool(git("status", "--porcelain", "--untracked-files=no")), "cpu": cpu,
            "cores": os.cpu_count(), "switch lanes": switch_lanes(), "worker kernels": worker_kernels()}


def switch_lanes() -> str:
    """The lane path a C switch takes here (INA_SWITCH_SIMD, inherited by `serve`, or the best the CPU runs)."""
    from switchsim import native

    if native.lib is None:
        return "not built"
    return native.ffi.string(native.lib.ina_switch_lanes(native.CoreSwitch({1: 1}).core)).decode()


def worker_kernels() -> str:
    from hostlib import kernels

    return kernels.simd_path()


def table(rows: list[dict], info: dict, args) -> str:
    commit = info["commit"] + (" with uncommitted changes" if info["changes"] else "")
    lines = [f"# commit {commit}, {info['cpu']}, {info['cores']} cores, switch lanes {info['switch lanes']}, "
             f"worker kernels {info['worker kernels']}; {args.invocations} invocations of "
             f"`switchsim bench allreduce --repeat {args.repeat}` (medians of their medians; time spread = lowest "
             f"and highest median)",
             "| config | size | time (us) | spread (us) | " + " | ".join(RATIOS) + " |",
             "|---|---|---|---|" + "---|" * len(RATIOS)]
    for r in rows:
        cells = [f"{r[name]:.3g} ({r[name + ' spread'][0]:.3g}-{r[name + ' spread'][1]:.3g})" if name in r else ""
                 for name in RATIOS]
        lines.append(f"| {r['config']} | {r['size']} | {r['time']:.0f} | {r['time min']:.0f}-{r['time max']:.0f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--invocations", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--sizes", default="1K,64K,64M")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--codecs", default="nc,int32")
    ap.add_argument("--payloads", default="1024")
    ap.add_argument("--backends", default="c")
    ap.add_argument("--plain", action="store_true", help="also y = allreduce(x) rows (x out)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per invocation")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    info = machine()
    invocations = []
    for i in range(args.invocations):
        if sys.stderr.isatty():
            print(f"invocation {i + 1} of {args.invocations}", file=sys.stderr)
        invocations.append(ratios(invocation(args)))
    rows = summary(invocations)
    print(json.dumps({**info, "rows": rows}, indent=1) if args.json else table(rows, info, args))


if __name__ == "__main__":
    main()
