"""The layering docs/architecture.md shows holds in the code: packages on floors, each importing only those
below it except the named exceptions, no circle; the picture is drawn from the same graph and names every
package and every step of a call's life."""
from __future__ import annotations

import ast
import os
import sys

import pytest

from inabench.harness import ROOT

sys.path.insert(0, os.path.join(ROOT, "tools"))
import draw_architecture as arch  # noqa: E402


def test_no_import_runs_back_up_and_no_circle():
    edges = arch.imports()
    floor = arch.floors(edges)
    assert arch.problems(edges, floor) == []
    assert [p for p in sorted(arch.PACKAGES, key=floor.get)] == list(arch.PACKAGES)  # the floors, bottom up
    assert set(arch.EXCEPTIONS) <= set(edges), "an exception that no longer exists: drop it from the list"


def test_a_new_upward_import_is_caught():
    """Every package uses the ones below it, so an import up is a circle; one between two packages of a floor
    is named."""
    edges = dict(arch.imports())
    with pytest.raises(ValueError, match="circle"):
        arch.floors({**edges, ("hostlib", "inabench"): ["hostlib/worker.py"]})
    floor = {**arch.floors(edges), "topologies": 4}
    assert "inabench -> topologies (inabench/cli.py)" in arch.problems(
        {**edges, ("inabench", "topologies"): ["inabench/cli.py"]}, floor)


def test_the_picture_is_drawn_from_the_code(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib (the bench extra) is not installed")
    out = tmp_path / "a.svg"
    assert arch.main(["--out", str(out)]) == 0
    svg = out.read_text()
    for word in (*arch.PACKAGES, "Generation", "Call", "Outcome", "pending", "ended", "broken"):
        assert word in svg
    with open(os.path.join(ROOT, "docs", "architecture.svg")) as f:
        committed = f.read()
    assert all(p in committed for p in arch.PACKAGES), "docs/architecture.svg: run tools/draw_architecture.py"


def _longest(path: str) -> tuple[int, str]:
    with open(os.path.join(ROOT, path)) as f:
        tree = ast.parse(f.read())
    return max((n.end_lineno - n.lineno + 1, n.name) for n in ast.walk(tree)
               if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


@pytest.mark.parametrize("path", ["hostlib/worker.py", "hostlib/fastpath.py", "hostlib/streams.py",
                                  "hostlib/generation.py", "inacli/main.py"])
def test_no_function_of_the_call_loops_or_the_command_line_is_over_60_lines(path):
    lines, name = _longest(path)
    assert lines <= 60, f"{path}: {name} has {lines} lines"


def test_no_module_reaches_into_a_communicators_private_state():
    hits = []
    for pkg in ("hostlib", "switchsim", "inabench"):
        for folder, _, files in os.walk(os.path.join(ROOT, pkg)):
            for name in files:
                path = os.path.join(folder, name)
                if not name.endswith(".py") or path.endswith(os.path.join("hostlib", "worker.py")):
                    continue
                with open(path) as f:
                    hits += [f"{path}: {line.strip()}" for line in f if "comm._" in line or 'comm, "_' in line]
    assert hits == []
