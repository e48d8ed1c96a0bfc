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
    ("worker", "C loop (fastpath) or Python loop (pyloop)\npackets carry Call.fields(); heartbeats beat"),
    ("switch", "control plane: join -> join_ack (a Generation)\nmembers first; strangers budgeted"),
    ("switch", "data plane: slot/set per packet id; the call's\nidentity checked across ranks; sum; multicast"),
    ("worker", "Outcome: done -> result; else Communicator.failure\nbuilds the exception, Generation.settle moves"),
]
# where the words of each (from, to) arrow go; the arrows and their events are read from hostlib/generation.py
WORDS_AT = {("live", "pending"): (3.75, 3.35), ("pending", "ended"): (7.6, 1.9), ("live", "ended"): (4.3, 2.6), ("ended", "live"): (4.6, 1.2),
            ("ended", "pending"): (4.9, 1.55), ("live", "broken"): (0.35, 1.9), ("pending", "broken"): (2.6, 1.55),
            ("ended", "broken"): (3.75, 0.25)}
FAILOVER = os.path.join("hostlib", "integrations", "torch_failover.py")


def _literal(path: str, name: str):
    """The value of a module-level tuple of tuples `name` in path, read with ast (State.X read as its value
    in lower case, "on gloo" as on_gloo's): nothing is imported, so the drawing needs neither torch nor the
    package."""
    with open(os.path.join(ROOT, path)) as f:
        tree = ast.parse(f.read())
    node = next(n.value for n in tree.body if isinstance(n, ast.Assign) and
                any(isinstance(t, ast.Name) and t.id == name for t in n.targets))

    def value(v):
        if isinstance(v, ast.Attribute):  # State.ON_GLOO
            return v.attr.lower()
        return ast.literal_eval(v)

    return [tuple(value(v) for v in row.elts) for row in node.elts]


def transitions() -> list[tuple[str, str, str]]:
    """The generation's arrows, (from, to, the events that make it), from Generation's TRANSITIONS."""
    arrows: dict = collections.defaultdict(list)
    for a, event, b in _literal(os.path.join("hostlib", "generation.py"), "TRANSITIONS"):
        if a != b:
            arrows[a, b].append(event)
    arrows["ended", "live"].append("the next call joins again")
    return [(a, b, ",\n".join(", ".join(events[i:i + 2]) for i in range(0, len(events), 2)))
            for (a, b), events in arrows.items()]


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
        _box(ax, x, y, 1.7, 0.6, f"Generation\n{name}", patch, "#fff4d6", 7)
    for a, b, what in transitions():
        (x0, y0), (x1, y1) = STATES[a], STATES[b]
        tx, ty = WORDS_AT.get((a, b), (4.6, 2.25))
        rad = 0.25 if (a, b) in (("live", "ended"), ("ended", "live")) else 0.0
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0), arrowprops=dict(
            arrowstyle="->", color="#a66", connectionstyle=f"arc3,rad={rad}", shrinkA=22, shrinkB=22))
        ax.text(tx, ty, what, ha="center", va="center", fontsize=6.5, color="#844")


def draw_failover(path: str):
    """docs/failover.svg: the torch backend's failure protocol, states and transitions read from
    torch_failover.py (State, TRANSITIONS)."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    plt.rcParams["svg.hashsalt"] = "ina"
    plt.rcParams["svg.fonttype"] = "none"
    rows = _literal(FAILOVER, "TRANSITIONS")
    states = list(dict.fromkeys([a for a, _, _ in rows] + [b for _, b, _ in rows])) + ["closed"]
    placed = {"joining": (5, 8.6), "joined": (1.2, 5), "recovering": (8.8, 5), "on_gloo": (5, 1.6),
              "closed": (9.5, 8.6)}  # a state added to the code lands on the circle until it is placed here
    at = {name: placed.get(name, (5 + 3.6 * math.cos(2 * math.pi * i / len(states)),
                                  5 + 3.6 * math.sin(2 * math.pi * i / len(states)))) for i, name in enumerate(states)}
    fig, ax = plt.subplots(figsize=(11, 9))
    ax.set_axis_off()
    ax.set_xlim(-1, 11)
    ax.set_ylim(0, 10)
    ax.set_title("the torch backend's failover (hostlib/integrations/torch_failover.py: State, TRANSITIONS)",
                 fontsize=10)
    for name, (x, y) in at.items():
        _box(ax, x, y, 1.9, 0.6, f"Failover\n{name.replace('_', ' ')}", FancyBboxPatch, "#fff4d6", 8)
    for a, b, what in rows:
        (x0, y0), (x1, y1) = at[a], at[b]
        if a == b:
            ax.annotate("", xy=(x0 + 0.5, y0 + 0.3), xytext=(x0 - 0.5, y0 + 0.3), arrowprops=dict(
                arrowstyle="->", color="#a66", connectionstyle="arc3,rad=-1.2"))
            ax.text(x0, y0 + 1.05, what, ha="center", fontsize=6.5, color="#844", wrap=True)
            continue
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0), arrowprops=dict(
            arrowstyle="->", color="#a66", connectionstyle="arc3,rad=0.15", shrinkA=24, shrinkB=24))
        ax.text((x0 + x1) / 2 + 0.25 * (y1 - y0) / 3, (y0 + y1) / 2 - 0.25 * (x1 - x0) / 3, what, ha="center",
                va="center", fontsize=6.5, color="#844")
    ax.text(5, 0.2, "every state -> closed at shutdown; a call that works costs no store operation", ha="center",
            fontsize=7)
    fig.savefig(path, format="svg", metadata={"Date": None})


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
    draw_failover(os.path.join(os.path.dirname(args.out), "failover.svg"))
    print(f"draw_architecture: wrote {args.out} ({len(edges)} package imports, floors "
          f"{', '.join(f'{p} {floor[p]}' for p in PACKAGES)})")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
