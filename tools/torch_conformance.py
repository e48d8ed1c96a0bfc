"""PyTorch's own distributed test suite, run on "ina" next to gloo.

Why: hostlib's "ina" backend (hostlib/integrations/torch_backend.py) claims to behave as a c10d backend:
sums through the switch, everything else through gloo. PyTorch ships the generic suite every backend is
held to (torch/testing/_internal/distributed/distributed_test.py, DistributedTest._DistTestBase; torch's
test/distributed/test_distributed_spawn.py runs it for gloo/nccl/ucc), so this script runs that suite on
process groups of "ina" and of gloo, test by test, and reports the tests that pass on gloo and fail on ina.
Some differences are torch's, not ours: e.g. dist.monitored_barrier is refused by torch for any backend
not named gloo, so the monitored_barrier tests fail on ina by design.

    .venv/bin/python tools/torch_conformance.py                      # the CPU subset, gloo then ina
    .venv/bin/python tools/torch_conformance.py -k test_all_reduce_sum -k test_broadcast
    .venv/bin/python tools/torch_conformance.py --list               # the selected tests, nothing run
    .venv/bin/python tools/torch_conformance.py --backends ina --json -k monitored_barrier

How: each backend runs in a worker process of its own (the suite reads $BACKEND when it is imported), as
a unittest suite of TestDistBackendWithSpawn (TestDistBackend + _DistTestBase, as test_distributed_spawn.py
makes it): every test spawns WORLD_SIZE ranks that init a process group on a file store, run the test and
exit; the suite's per-test timeout ($DISTRIBUTED_TESTS_DEFAULT_TIMEOUT, 300 s) stays, --timeout bounds
the whole run (each backend may use its share of the time left). For "ina" one C switch (`switchsim
serve --backend c --workers WORLD_SIZE`) serves every test: each test's process group re-joins it as a
new generation. The ranks' output goes to a log per backend (its path is printed); progress lines go to
stderr. Timing: about 6 s a test that spawns its ranks on an idle 2-core machine (twice that under load).

The suite's backend gates: many tests are decorated to run only where BACKEND is "gloo" (or in a feature
set such as DistTestCases.backend_feature["ddp"]), so under its own name ina skips most of the suite.
With --gates gloo (the default) the gates are evaluated as for gloo, since ina is gloo for everything it
does not send through the switch: the suite is imported with BACKEND=gloo, then its module-level BACKEND
becomes "ina" (the name init_process_group and test_get_backend use) that still compares equal to "gloo"
in the few test bodies that branch on it. --gates own evaluates them for "ina" (registered as a plugin
backend in DistTestCases, which require_backend_is_available consults).

Exit status: 0 when no backend has a failure or error on a test that the first backend (gloo) did not
also fail, 1 otherwise (also when a backend's run did not complete).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Set by the orchestrator for a backend's worker, inherited by the ranks the suite spawns (which re-run
# this module as __mp_main__ and so define the same test class).
ENV_BACKEND = "INA_CONFORMANCE_BACKEND"  # the backend under test
ENV_GATES = "INA_CONFORMANCE_GATES"  # gloo | own
ENV_CONFIG = "INA_CONFORMANCE_CONFIG"  # the worker's JSON config (only the worker reads it)

# Tests the default subset leaves out: CUDA/NCCL/MPI/UCC/XPU/HPU-only by name (most would skip anyway,
# each after spawning its ranks). --all keeps them.
NOT_CPU = re.compile(r"cuda|nccl|gpu|mpi|ucc|xpu|hpu|SyncBatchNorm|sync_bn", re.IGNORECASE)
OUTCOMES = ("passed", "failed", "error", "skipped")


# --- the suite (worker and ranks) --------------------------------------------------------------------------


class _GlooGated(str):
    """The suite's BACKEND in test bodies under --gates gloo: the backend's own name (what init_process_group
    and test_get_backend use) that also compares equal to "gloo" (a test body that branches on BACKEND ==
    "gloo" takes gloo's branch, as its decorators did)."""

    def __eq__(self, other):
        return str.__eq__(self, other) or str.__eq__("gloo", other)

    def __ne__(self, other):
        return not self.__eq__(other)

    __hash__ = str.__hash__


def _stub_expecttest():
    """torch's common_utils imports expecttest (a test-only dependency the wheel does not require) for its
    TestCase base class; the distributed suite uses none of its features, so unittest's TestCase stands in."""
    try:
        import expecttest  # noqa: F401
    except ImportError:
        stub = types.ModuleType("expecttest")
        stub.TestCase = unittest.TestCase
        stub.ACCEPT = False
        sys.modules["expecttest"] = stub


def _make_suite_class(backend: str, gates: str):
    """TestDistBackendWithSpawn for `backend`, as torch's test_distributed_spawn.py defines it."""
    _stub_expecttest()
    import hostlib  # noqa: F401 - registers "ina" (in the worker and in every rank it spawns)
    import torch
    from torch.testing._internal import common_distributed

    # A registered third-party backend is "available" to require_backend_is_available only through this set.
    common_distributed.DistTestCases.backend_feature["plugin"].add(backend)
    from torch.testing._internal.distributed import distributed_test as dt

    if gates == "gloo" and backend != "gloo":
        dt.BACKEND = _GlooGated(backend)

    class TestDistBackendWithSpawn(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            self._spawn_processes()
            torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

    # The ranks unpickle TestDistBackendWithSpawn._run by this module's name for it.
    TestDistBackendWithSpawn.__module__ = __name__
    TestDistBackendWithSpawn.__qualname__ = TestDistBackendWithSpawn.__name__
    return TestDistBackendWithSpawn


if os.environ.get(ENV_BACKEND):
    TestDistBackendWithSpawn = _make_suite_class(os.environ[ENV_BACKEND], os.environ.get(ENV_GATES, "gloo"))


def _select(patterns: list[str], everything: bool) -> list[str]:
    from torch.testing._internal.distributed.distributed_test import DistributedTest

    names = sorted(n for n in dir(DistributedTest._DistTestBase) if n.startswith("test_"))
    if not everything:
        names = [n for n in names if not NOT_CPU.search(n)]
    if patterns:
        names = [n for n in names if any(p in n for p in patterns)]
    return names


def summary(text: str) -> str:
    """One line for a failure: the (last) exception line of the rank's traceback that the suite's parent
    re-raises ("Process 0 exited with error code 10 and exception: ..."), or of the error itself."""
    lines = [ln.rstrip() for ln in text.splitlines()]
    found = [ln for ln in lines if ln and not ln[0].isspace()
             and re.match(r"[A-Za-z_][\w.]*(: |$)", ln)
             and not ln.startswith(("Traceback", "During handling", "The above exception"))
             and not ln.endswith("and exception:")]
    line = found[-1] if found else next((ln.strip() for ln in reversed(lines) if ln.strip()), "")
    return line[:300]


class _Recorder(unittest.TestResult):
    """Each test's outcome as one JSON line (written as it ends) and a progress line."""

    def __init__(self, backend: str, total: int, out, progress):
        super().__init__()
        self.backend, self.total, self.out, self.progress = backend, total, out, progress
        self.count, self.started = 0, 0.0

    def startTest(self, test):
        super().startTest(test)
        self.started = time.monotonic()

    def _record(self, test, outcome: str, detail: str = "", message: str = ""):
        name = test.id().split(".")[-1]
        seconds = round(time.monotonic() - self.started, 2) if self.started else 0.0
        self.started = 0.0
        self.count += 1
        row = {"test": name, "outcome": outcome, "seconds": seconds,
               "message": message or (summary(detail) if detail else ""), "detail": detail[-8000:]}
        self.out.write(json.dumps(row) + "\n")
        self.out.flush()
        tail = f": {row['message']}" if outcome != "passed" and row["message"] else ""
        self.progress.write(f"[{self.backend}] {self.count}/{self.total} {name} {outcome} ({seconds:.1f}s){tail}\n")
        self.progress.flush()

    def addSuccess(self, test):
        super().addSuccess(test)
        self._record(test, "passed")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._record(test, "failed", self.failures[-1][1])

    def addError(self, test, err):
        super().addError(test, err)
        self._record(test, "error", self.errors[-1][1])

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._record(test, "skipped", message=str(reason).splitlines()[0] if reason else "")

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._record(test, "passed", message="expected failure")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._record(test, "failed", message="unexpected success")


def _worker(config_path: str) -> int:
    """One backend's run (this process's module-level code made the test class from $ENV_BACKEND)."""
    with open(config_path) as f:
        cfg = json.load(f)
    cls = globals()["TestDistBackendWithSpawn"]
    names = _select(cfg["patterns"], cfg["all"])
    with open(cfg["results"], "w") as out:
        out.write(json.dumps({"tests": names}) + "\n")
        out.flush()
        if cfg["list"]:
            return 0
        # Progress to the orchestrator's stderr; everything else (the ranks' logs) to the backend's log.
        progress = os.fdopen(os.dup(2), "w", buffering=1)
        log_fd = os.open(cfg["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        result = _Recorder(cfg["backend"], len(names), out, progress)
        unittest.TestSuite(cls(n) for n in names).run(result)
    return 0


# --- the orchestrator --------------------------------------------------------------------------------------


def _run_backend(backend: str, args, run_dir: str, deadline: float, switch_address: str | None) -> dict:
    """Run one backend's worker until it ends or the deadline; its rows as {test: row}."""
    results = os.path.join(run_dir, f"{backend}.jsonl")
    log = os.path.join(run_dir, f"{backend}.log")
    config = os.path.join(run_dir, f"{backend}.json")
    tmp = os.path.join(run_dir, f"tmp-{backend}")
    os.makedirs(tmp, exist_ok=True)
    with open(config, "w") as f:
        json.dump({"backend": backend, "patterns": args.k or [], "all": args.all, "list": args.list,
                   "results": results, "log": log}, f)
    env = dict(os.environ)
    env.update({
        ENV_BACKEND: backend, ENV_GATES: args.gates, ENV_CONFIG: config,
        # The suite reads BACKEND when imported (its gates); under --gates gloo it is gloo's.
        "BACKEND": backend if args.gates == "own" else "gloo",
        "WORLD_SIZE": str(args.world_size), "TEMP_DIR": tmp, "INIT_METHOD": "env://",
        "TMPDIR": tmp,  # the suite's per-test temp dirs and file stores, removed with the run's
        "PYTHONUNBUFFERED": "1",
        "PYTORCH_PRINT_REPRO_ON_FAILURE": "0",  # its hint names a command that does not exist here
    })
    if args.test_timeout:
        env["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"] = str(args.test_timeout)
    if switch_address:
        env["INA_SWITCH"] = switch_address
    started = time.monotonic()
    # Its own session: on the deadline its process group (the worker and the ranks it spawned) is ended.
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], env=env, cwd=ROOT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    status = "complete"
    try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        if proc.returncode != 0:
            status = f"worker exited with status {proc.returncode} (see {log})"
    except subprocess.TimeoutExpired:
        status = f"stopped at its share of the --timeout of {args.timeout:.0f} s"
    finally:
        if proc.poll() is None:
            _end_group(proc)
    tests, rows = [], {}
    if os.path.exists(results):
        with open(results) as f:
            for i, line in enumerate(f):
                data = json.loads(line)
                if i == 0:
                    tests = data["tests"]
                else:
                    rows[data["test"]] = data
    if status == "complete" and not args.list and len(rows) < len(tests):
        status = f"{len(tests) - len(rows)} tests not run (see {log})"
    return {"backend": backend, "tests": tests, "rows": rows, "status": status, "log": log,
            "seconds": round(time.monotonic() - started, 1)}


def _end_group(proc: subprocess.Popen):
    """SIGTERM, then SIGKILL, the process group of a worker this script started (its pid is the group's id)."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _switch_summary(stats: dict) -> dict:
    """What the switch says it did (evidence the ina run went through it): packets, bytes, generations."""
    jobs = stats.get("jobs") or {}
    return {"packets_in": stats.get("packets_in"), "packets_out": stats.get("packets_out"),
            "bytes_in": stats.get("bytes_in"),
            "generation": max((j.get("generation", 0) for j in jobs.values()), default=None)}


def _counts(run: dict) -> dict:
    counts = {o: 0 for o in OUTCOMES}
    for row in run["rows"].values():
        counts[row["outcome"]] += 1
    counts["run"] = len(run["rows"])
    return counts


def _compare(reference: dict, run: dict) -> dict:
    """Tests that pass on the reference and not on `run` (failed/error, skipped), and the converse."""
    ref, own = reference["rows"], run["rows"]
    out = {"regressions": [], "skipped_only_here": [], "fixed_here": []}
    for name in sorted(set(ref) & set(own)):
        a, b = ref[name]["outcome"], own[name]["outcome"]
        if a == "passed" and b in ("failed", "error"):
            out["regressions"].append({"test": name, "outcome": b, "message": own[name]["message"]})
        elif a == "passed" and b == "skipped":
            out["skipped_only_here"].append({"test": name, "message": own[name]["message"]})
        elif a in ("failed", "error") and b == "passed":
            out["fixed_here"].append({"test": name, "message": ref[name]["message"]})
    # A failure here on a test the reference skipped (or did not run) is not one it "also has" either.
    for name in sorted(set(own) - set(ref)) + sorted(n for n in set(own) & set(ref)
                                                        if ref[n]["outcome"] == "skipped"):
        if own[name]["outcome"] in ("failed", "error"):
            out["regressions"].append({"test": name, "outcome": own[name]["outcome"],
                                       "message": own[name]["message"],
                                       "reference": ref.get(name, {}).get("outcome", "not run")})
    return out


def _print_report(runs: list[dict], comparisons: dict, args):
    print(f"\nPyTorch distributed_test.py (DistributedTest._DistTestBase), world size {args.world_size}, "
          f"gates {args.gates}")
    header = f"{'backend':<10}{'run':>6}{'passed':>8}{'failed':>8}{'errors':>8}{'skipped':>9}{'seconds':>9}  status"
    print(header)
    print("-" * len(header))
    for run in runs:
        c = _counts(run)
        print(f"{run['backend']:<10}{c['run']:>6}{c['passed']:>8}{c['failed']:>8}{c['error']:>8}{c['skipped']:>9}"
              f"{run['seconds']:>9.0f}  {run['status']}")
    for run in runs:
        if run.get("switch"):
            sw = run["switch"]
            print(f"{run['backend']}: the switch saw {sw['packets_in']} packets in, {sw['packets_out']} out "
                  f"({sw['bytes_in']} bytes in), job generation {sw['generation']}")
    ref = runs[0]["backend"]
    for backend, cmp in comparisons.items():
        regress = cmp["regressions"]
        print(f"\nFailing on {backend}, not on {ref} ({len(regress)}):")
        for r in regress:
            where = f" [{ref}: {r['reference']}]" if "reference" in r else ""
            print(f"  {r['test']} ({r['outcome']}){where}: {r['message']}")
        if cmp["skipped_only_here"]:
            print(f"\nPassing on {ref}, skipped on {backend} ({len(cmp['skipped_only_here'])}):")
            for r in cmp["skipped_only_here"]:
                print(f"  {r['test']}: {r['message']}")
        if cmp["fixed_here"]:
            print(f"\nFailing on {ref}, passing on {backend} ({len(cmp['fixed_here'])}):")
            for r in cmp["fixed_here"]:
                print(f"  {r['test']}: {r['message']}")
    print("\nLogs: " + ", ".join(run["log"] for run in runs))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="gloo,ina",
                        help="comma-separated; the first is the reference (default gloo,ina)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("-k", action="append", metavar="PATTERN",
                        help="run only tests whose name contains PATTERN (repeatable: any of them)")
    parser.add_argument("--all", action="store_true",
                        help="include the tests named for CUDA/NCCL/MPI/... (left out by default)")
    parser.add_argument("--gates", choices=("gloo", "own"), default="gloo",
                        help="evaluate the suite's backend gates as for gloo (default) or for each backend's name")
    parser.add_argument("--list", action="store_true", help="print the selected tests and exit")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--timeout", type=float, default=3600.0, help="for the whole run, seconds (default 3600)")
    parser.add_argument("--test-timeout", type=int, default=0,
                        help="per-test timeout, seconds (default: the suite's, "
                             "$DISTRIBUTED_TESTS_DEFAULT_TIMEOUT or 300)")
    parser.add_argument("--log-dir", help="where the logs and results go (default: a new temporary directory)")
    args = parser.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends or len(set(backends)) != len(backends):
        parser.error("--backends: one or more distinct names")
    if args.world_size < 2:
        parser.error("--world-size: at least 2")

    run_dir = args.log_dir or tempfile.mkdtemp(prefix="torch_conformance-")
    os.makedirs(run_dir, exist_ok=True)
    deadline = time.monotonic() + args.timeout

    if args.list:
        run = _run_backend(backends[0], args, run_dir, deadline, None)
        shutil.rmtree(os.path.join(run_dir, f"tmp-{backends[0]}"), ignore_errors=True)
        if args.json:
            print(json.dumps({"tests": run["tests"]}, indent=1))
        else:
            print("\n".join(run["tests"]))
            print(f"({len(run['tests'])} tests)", file=sys.stderr)
        return 0 if run["tests"] else 1

    runs = []
    for i, backend in enumerate(backends):
        # Each backend may use its share of the time left, so a run cut short by --timeout still compares
        # the backends on the same (alphabetical) first tests; a backend that ends early leaves the rest.
        share = time.monotonic() + (deadline - time.monotonic()) / (len(backends) - i)
        if time.monotonic() >= deadline:
            runs.append({"backend": backend, "tests": [], "rows": {}, "seconds": 0.0,
                         "status": f"not started: the --timeout of {args.timeout:.0f} s was spent",
                         "log": os.path.join(run_dir, f"{backend}.log")})
            continue
        switch = None
        try:
            if backend == "ina":
                from inabench.harness import SwitchProcess

                switch = SwitchProcess("--workers", args.world_size, backend="c")
                print(f"[ina] switch (C backend, {args.world_size} workers) on {switch.address}", file=sys.stderr)
            runs.append(_run_backend(backend, args, run_dir, share, switch.address if switch else None))
        finally:
            if switch is not None:
                stats = switch.stop_stats()  # SIGTERM by PID, then its exit counters
                if runs and runs[-1]["backend"] == backend:
                    runs[-1]["switch"] = _switch_summary(stats)
            shutil.rmtree(os.path.join(run_dir, f"tmp-{backend}"), ignore_errors=True)

    comparisons = {run["backend"]: _compare(runs[0], run) for run in runs[1:]}
    incomplete = [run["backend"] for run in runs if run["status"] != "complete"]
    bad = [b for b, cmp in comparisons.items() if cmp["regressions"]]
    if args.json:
        report = {"world_size": args.world_size, "gates": args.gates, "reference": backends[0],
                  "backends": {run["backend"]: {**_counts(run), "status": run["status"], "seconds": run["seconds"],
                                                "log": run["log"], "switch": run.get("switch"),
                                                "tests": {n: {k: r[k] for k in ("outcome", "seconds", "message")}
                                                          for n, r in run["rows"].items()}}
                               for run in runs},
                  "comparisons": comparisons, "ok": not bad and not incomplete}
        print(json.dumps(report, indent=1))
    else:
        _print_report(runs, comparisons, args)
        if incomplete:
            print(f"Incomplete: {', '.join(incomplete)}")
    return 1 if bad or incomplete else 0


if __name__ == "__main__":
    if os.environ.get(ENV_CONFIG) and os.environ.get(ENV_BACKEND):
        sys.exit(_worker(os.environ[ENV_CONFIG]))
    sys.exit(main())
