"""docs/architecture.svg from the code: the packages on their floors with the imports between them (read from
the sources with ast, nothing imported), and the path of one call, worker -> switch -> worker, with the
generation's failure transitions (hostlib/generation.py).

    python tools/draw_architecture.py            # writes docs/architecture.svg
    python tools/draw_architecture.py --check    # exit 1 if an import runs back up a floor or in a circle

A package's floor is one above the highest package it imports; the allowed exceptions (EXCEPTIONS) are
drawn dashed and named in docs/architecture.md.
"""
from __future__ import annotations

import argparse
import ast
import collections
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("inaproto", "hostlib", "switchsim", "inabench", "topologies", "inacli")
# imports that run against the floors on purpose: (from package, to package) -> why
EXCEPTIONS = {
    ("inaproto", "switchsim"): "gen_doc.py, a generator, replays the reference model for the doc's examples",
    ("switchsim", "inacli"): "switchsim/__main__.py, the `python -m switchsim` entry point, which nothing imports",
}


def imports() -> dict[tuple[str, str], list[str]]:
    """(from package, to package) -> the files of the first that import the second (tests excluded)."""
    edges = collections.defaultdict(list)
    for pkg in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, pkg)):
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(folder, name)
                for target in _targets(path):
                    if target != pkg and target in PACKAGES:
                        edges[pkg, target].append(os.path.relpath(path, ROOT))
    return {k: sorted(set(v)) for k, v in edges.items()}


def _targets(path: str):
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0]


def floors(edges) -> dict[str, int]:
    """Each package's floor: 1 + the highest floor it imports (exceptions left out); raises on a circle."""
    deps = collections.defaultdict(set)
    for (a, b) in edges:
        if (a, b) not in EXCEPTIONS:
            deps[a].add(b)
    floor, visiting = {}, set()

    def visit(p):
        if p in floor:
            return floor[p]
        if p in visiting:
            raise ValueError(f"a circle of imports through {p}")
        visiting.add(p)
        floor[p] = 1 + max((visit(d) for d in deps[p]), default=0)
        visiting.discard(p)
        return floor[p]

    for p in PACKAGES:
        visit(p)
    return floor


def problems(edges, floor) -> list[str]:
    """Imports that run back up (or sideways) a floor and are not named exceptions."""
    return [f"{a} -> {b} ({', '.join(files)})" for (a, b), files in sorted(edges.items())
            if floor[b] >= floor[a] and (a, b) not in EXCEPTIONS]


CALL_PATH = [  # (lane, step): the life of one allreduce
    ("worker", "Communicator.allreduce(x, codec=, elements=)\n_enter_call: raise the pending failure, or re-join"),
    ("worker", "Generation.call() -> Call\nnumber, kind, length, codec (its identity)"),
    ("worker", "C loop (fastpath) or Python loop (streams)\npackets carry Call.fields(); heartbeats beat"),
    ("switch", "control plane: join -> join_ack (a Generation)\nmembers first; strangers budgeted"),
    ("switch", "data plane: slot/set per packet id; the call's\nidentity checked across ranks; sum; multicast"),
    ("worker", "Outcome: done -> result; else Communicator.failure\nmaps it to the named exception"),
]
TRANSITIONS = [  # (from state, to state, what, where its words go)
    ("live", "pending", "fail_later: the switch failed it;\nthis call still completes exactly", (3.75, 3.35)),
    ("pending", "ended", "the next call raises it\n(every rank the same)", (7.6, 1.9)),
    ("live", "ended", "end: a switch error, timeout,\nsilence, refusal, abort", (4.6, 2.25)),
    ("ended", "live", "the next call joins again", (4.6, 2.25)),
    ("live", "broken", "a corrupt result:\nreconnect", (0.35, 1.9)),
]
STATES = {"live": (1.5, 3.0), "pending": (6.0, 3.0), "ended": (6.0, 0.6), "broken": (1.5, 0.6)}


def draw(edges, floor, path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    plt.rcParams["svg.hashsalt"] = "ina"  # the same file for the same code
    plt.rcParams["svg.fonttype"] = "none"  # words as text: searchable, and checked by tests/test_architecture.py
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 8), gridspec_kw={"width_ratios": [1, 1.35]})
    for ax in (left, right):
        ax.set_axis_off()
        ax.set_xlim(0, 10)
        ax.set_ylim(0, 10)
    _packages(left, edges, floor, FancyBboxPatch)
    _call(right, FancyBboxPatch)
    fig.savefig(path, format="svg", metadata={"Date": None})


def _box(ax, x, y, w, h, text, patch, color, size=8):
    ax.add_patch(patch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.05", fc=color, ec="#444"))
    ax.text(x, y, text, ha="center", va="center", fontsize=size)


def _packages(ax, edges, floor, patch):
    ax.set_title("packages (a floor imports only those below it)", fontsize=10)
    top = max(floor.values())
    by_floor = collections.defaultdict(list)
    for p in PACKAGES:
        by_floor[floor[p]].append(p)
    where = {}
    for f, names in by_floor.items():
        for i, p in enumerate(names):  # floors zigzag, so an arrow past a floor does not cross its box
            where[p] = ((3.0 if f % 2 else 7.0) + 3.0 * i, 0.8 + 8.4 * (f - 1) / max(top - 1, 1))
            _box(ax, *where[p], 2.6, 0.8, p, patch, "#e8eef7", 9)
    for (a, b), files in sorted(edges.items()):
        exception = (a, b) in EXCEPTIONS
        ax.annotate("", xy=where[b], xytext=where[a], arrowprops=dict(
            arrowstyle="->", ls="--" if exception else "-", color="#b60" if exception else "#777", lw=0.8,
            shrinkA=14, shrinkB=14, connectionstyle=f"arc3,rad={0.12 * (floor[a] - floor[b])}"))
    ax.text(5, 0.0, "dashed: the named exceptions (EXCEPTIONS)", ha="center", fontsize=7, color="#b60")


def _call(ax, patch):
    ax.set_title("one call: worker -> switch -> worker, and the generation's failure transitions", fontsize=10)
    colors = {"worker": "#f7e8e8", "switch": "#e8f0e8"}
    ys = [9.4 - 1.05 * i for i in range(len(CALL_PATH))]
    for (lane, text), y in zip(CALL_PATH, ys):
        _box(ax, 2.8 if lane == "worker" else 7.2, y, 4.4, 0.9, text, patch, colors[lane], 7)
    for (l0, _), (l1, _), y0, y1 in zip(CALL_PATH, CALL_PATH[1:], ys, ys[1:]):
        x0, x1 = (2.8 if l0 == "worker" else 7.2), (2.8 if l1 == "worker" else 7.2)
        ax.annotate("", xy=(x1, y1 + 0.45), xytext=(x0, y0 - 0.45), arrowprops=dict(arrowstyle="->", color="#555"))
    for name, (x, y) in STATES.items():
        owner = "Communicator" if name == "broken" else "Generation"
        _box(ax, x, y, 1.7, 0.6, f"{owner}\n{name}", patch, "#fff4d6", 7)
    for a, b, what, (tx, ty) in TRANSITIONS:
        (x0, y0), (x1, y1) = STATES[a], STATES[b]
        rad = 0.25 if (a, b) in (("live", "ended"), ("ended", "live")) else 0.0
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0), arrowprops=dict(
            arrowstyle="->", color="#a66", connectionstyle=f"arc3,rad={rad}", shrinkA=22, shrinkB=22))
        ax.text(tx, ty, what, ha="center", va="center", fontsize=6.5, color="#844")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only check the import graph; exit 1 on a problem")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "architecture.svg"))
    args = ap.parse_args(argv)
    edges = imports()
    try:
        floor = floors(edges)
    except ValueError as e:
        print(f"draw_architecture: {e}", file=sys.stderr)
        return 1
    bad = problems(edges, floor)
    for line in bad:
        print(f"draw_architecture: an import runs back up: {line}", file=sys.stderr)
    if args.check:
        return 1 if bad else 0
    draw(edges, floor, args.out)
    print(f"draw_architecture: wrote {args.out} ({len(edges)} package imports, floors "
          f"{', '.join(f'{p} {floor[p]}' for p in PACKAGES)})")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
