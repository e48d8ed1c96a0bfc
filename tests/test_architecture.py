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
    failover = (tmp_path / "failover.svg").read_text()  # the torch backend's, drawn from torch_failover.py
    for word in ("joining", "joined", "recovering", "on gloo", "closed", "re-join at retry_at"):
        assert word in failover
    assert [row[:2] for row in arch._literal(arch.FAILOVER, "TRANSITIONS")][0] == ("joining", "joined")
    assert ("live", "pending", "pending") in arch._literal(os.path.join("hostlib", "generation.py"), "TRANSITIONS")
    with open(os.path.join(ROOT, "docs", "architecture.svg")) as f:
        committed = f.read()
    assert all(p in committed for p in arch.PACKAGES), "docs/architecture.svg: run tools/draw_architecture.py"


def _longest(path: str) -> tuple[int, str]:
    with open(os.path.join(ROOT, path)) as f:
        tree = ast.parse(f.read())
    return max((n.end_lineno - n.lineno + 1, n.name) for n in ast.walk(tree)
               if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


@pytest.mark.parametrize("path", ["hostlib/worker.py", "hostlib/fastpath.py", "hostlib/streams.py",
                                  "hostlib/generation.py", "hostlib/pyloop.py", "hostlib/join.py",
                                  "hostlib/integrations/torch_backend.py", "hostlib/integrations/torch_calls.py",
                                  "hostlib/integrations/torch_failover.py", "inacli/main.py"])
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


HANDWRITTEN = [os.path.join(folder, name) for folder, _, files in os.walk(os.path.join(ROOT, "hostlib"))
               for name in files if name.endswith(".py")]


@pytest.mark.parametrize("path", sorted(os.path.relpath(p, ROOT) for p in HANDWRITTEN))
def test_no_hand_written_file_in_hostlib_is_over_600_lines(path):
    with open(os.path.join(ROOT, path)) as f:
        lines = sum(1 for _ in f)
    assert lines <= 600, f"{path}: {lines} lines"


def _writes_to_a_communicator(tree) -> list[int]:
    """Lines that assign to an attribute of something named comm (comm.x = ..., self.comm.x += ...,
    comm.x[...] = ..., setattr(comm, ...)): a Communicator's own attributes."""
    def is_comm(node) -> bool:
        return (isinstance(node, ast.Name) and node.id in ("comm", "communicator") or
                isinstance(node, ast.Attribute) and node.attr in ("comm", "communicator"))

    def target(node) -> bool:
        while isinstance(node, ast.Subscript):
            node = node.value
        return isinstance(node, ast.Attribute) and is_comm(node.value)

    hits = []
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                   if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else node.targets
                   if isinstance(node, ast.Delete) else [])
        hits += [node.lineno for t in targets if target(t)]
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")
                and node.args and is_comm(node.args[0])):
            hits.append(node.lineno)
    return hits


def test_no_module_but_worker_and_generation_writes_a_communicators_attributes():
    """The C loop (fastpath), the Python loop (pyloop), the join, the torch backend and the benchmarks read a
    Communicator; only worker.py and generation.py change it (the loops return what happened)."""
    hits = []
    for pkg in ("hostlib", "switchsim", "inabench", "topologies", "inacli", "benchmarks"):
        for folder, _, files in os.walk(os.path.join(ROOT, pkg)):
            for name in files:
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, ROOT)
                if not name.endswith(".py") or rel in ("hostlib/worker.py", "hostlib/generation.py"):
                    continue
                with open(path) as f:
                    hits += [f"{rel}:{n}" for n in _writes_to_a_communicator(ast.parse(f.read()))]
    assert hits == []


def test_the_write_check_finds_a_write():
    tree = ast.parse("comm.rtt = 1\nself.comm.link.x = 2\ncomm.c_frames[k] = 3\nsetattr(comm, 'gen', 4)\n"
                     "comm.stats.x += 1\ny = comm.rtt\n")
    assert _writes_to_a_communicator(tree) == [1, 3, 4]


@pytest.mark.parametrize("fast", [True, False])
def test_a_call_and_its_failure_write_the_communicator_only_from_worker_and_generation(switch_process, fast,
                                                                                       monkeypatch):
    """At run time: every attribute set on a Communicator during calls through the C or the Python loop, a
    re-join and a switch's failure comes from worker.py (generation.py holds no Communicator)."""
    import threading

    import numpy as np

    import hostlib
    from hostlib.worker import Communicator

    writers = set()
    original = Communicator.__setattr__

    def spy(self, name, value):
        writers.add((os.path.relpath(sys._getframe(1).f_code.co_filename, ROOT), name))
        original(self, name, value)

    monkeypatch.setattr(Communicator, "__setattr__", spy)
    sw = switch_process("--workers", 2)
    errors, mismatched = [], []

    def work(r):
        try:
            with hostlib.connect(sw.address, r, 2, codec="fixed", timeout=10, fast=fast) as c:
                for n in (10, 5000):
                    c.allreduce(np.ones(n, dtype=np.float32))
                try:  # the ranks' calls differ: both raise, and the next call re-joins
                    c.allreduce(np.ones(10 + r, dtype=np.float32))
                except hostlib.errors.CallMismatch:
                    mismatched.append(r)
                assert np.array_equal(c.allreduce(np.ones(3, dtype=np.float32)), np.full(3, 2.0))
                assert c.gen.number == 2
        except Exception as e:  # noqa: BLE001 - reported to the test
            errors.append(e)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == [] and sorted(mismatched) == [0, 1] and writers
    assert {w for w, _ in writers} <= {"hostlib/worker.py"}, sorted(writers)
