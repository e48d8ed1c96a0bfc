"""Deployments on topologies of network namespaces (switchsim.netns): a star of workers around one switch,
or two-level aggregation (leaf switches under a root), with switches of any backend on their own hosts and
one or more jobs. `switchsim topo run` builds one, runs an allreduce from a worker process in every worker
host, checks it, reports and tears everything down; `topo up` keeps it (topologies/state.py)."""
from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields

import numpy as np

from inabench.harness import ROOT
from inaproto import wire
from switchsim.netns import Star, Tree

WORKER = os.path.join(ROOT, "topologies", "worker.py")
BACKENDS = ("python", "c", "dpdk", "bmv2")


@dataclass
class Spec:
    """What to build; the CLI flags, or a TOML file (`topo run --file`, examples in topologies/examples/):
    top-level workers, backend, leaves, jobs; a [links] table with bw_mbit, delay_ms, loss, ecn."""

    workers: int = 4
    backend: str = "python"  # the switch (a star's; a tree's root: its leaves run the reference model)
    bw_mbit: float | None = None  # every link's rate (None: the veth's own speed)
    delay_ms: float = 0.0  # every link's delay, each way
    loss: float = 0.0  # every link's drop probability, per packet and direction
    ecn: bool = False  # every link's queue marks CE above a threshold instead of dropping (switchsim.netns)
    leaves: int = 0  # 0: a star; else two-level aggregation, workers split evenly over the leaves
    jobs: int = 1  # jobs sharing the switch(es), workers split evenly over them (a star only)

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {self.backend!r}")
        if self.workers < 1 or self.jobs < 1 or self.workers % self.jobs:
            raise ValueError(f"{self.workers} workers cannot be split evenly into {self.jobs} jobs")
        if self.leaves and (self.workers % self.leaves or self.jobs != 1 or self.backend not in ("python", "c")):
            raise ValueError("two-level aggregation needs workers divisible by leaves, one job, and a python "
                             "or c root")

    @classmethod
    def load(cls, path: str, **overrides) -> "Spec":
        """A Spec from a TOML file; overrides (flags given on the command line) win.

        Raises:
            ValueError: an unknown key or a bad value; OSError: an unreadable file.
        """
        import tomllib

        with open(path, "rb") as f:
            doc = tomllib.load(f)
        links = doc.pop("links", {})
        flat = {**doc, **links}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(flat) - known)
        if unknown:
            raise ValueError(f"{path}: unknown keys {unknown} (known: {sorted(known)}, links: bw_mbit, delay_ms, loss, ecn)")
        return cls(**{**flat, **{k: v for k, v in overrides.items() if v is not None}})


@dataclass
class Member:
    """One worker of a deployment: where it runs and what it joins."""

    host: str  # its namespace
    switch: str  # HOST:PORT of its switch (a leaf's in a tree)
    job: int
    rank: int
    world: int


class Deployment:
    """A topology with its switches running. close() (or the context manager) ends everything."""

    def __init__(self, spec: Spec, logs: str, extra_jobs: dict[int, int] | None = None):
        """logs: a directory for the switches' output (their start-up line and, on exit, their counters);
        extra_jobs: job id -> world size the star's switch serves besides the spec's (cross traffic: a
        second INA job whose ranks run on the spec's hosts)."""
        self.spec, self.logs, self.extra_jobs = spec, logs, dict(extra_jobs or {})
        self.switches: dict[str, tuple] = {}  # name -> (Popen, log path, address)
        if spec.leaves:
            self.topo = Tree(spec.leaves, spec.workers // spec.leaves, spec.loss, spec.bw_mbit, spec.delay_ms,
                             spec.ecn)
        else:
            bridge = {"bmv2": False, "dpdk": "port"}.get(spec.backend, True)
            self.topo = Star(spec.workers, spec.loss, spec.bw_mbit, bridge=bridge, delay_ms=spec.delay_ms,
                             ecn=spec.ecn)
        try:
            self.members = self._start_tree() if spec.leaves else self._start_star()
        except BaseException:
            self.close()
            raise

    def _serve(self, name: str, ns: str, host: str, args: list, backend: str = "python") -> str:
        argv = [sys.executable, "-m", "switchsim", "serve", "--backend", backend, "--host", host,
                "--port", wire.DEFAULT_PORT, "--json-stats", *args]
        log = os.path.join(self.logs, f"{name}.log")
        with open(log, "w") as f:
            p = self.topo.popen(ns, argv, cwd=ROOT, stdout=f, stderr=f, start_new_session=True)
        self.switches[name] = (p, log, None)
        address = _listening(p, log)
        self.switches[name] = (p, log, address)
        return address

    def _start_star(self) -> list[Member]:
        t, s = self.topo, self.spec
        per_job = s.workers // s.jobs
        jobs = [a for j in range(s.jobs) for a in ("--job", f"{j + 1}:{per_job}")]
        jobs += [a for j, n in self.extra_jobs.items() for a in ("--job", f"{j}:{n}")]
        args = [*jobs, "--control", t.worker_ips[0]]
        if s.backend == "bmv2":  # the links are its ports
            args += ["--iface", ",".join(t.switch_ifs)]
        if s.backend == "dpdk":  # one port on the bridge; DPDK answers ARP for the switch's address itself
            args += ["--iface", t.switch_port]
        address = self._serve("switch", t.switch_ns, t.switch_ip, args, s.backend)
        return [Member(t.worker_ns[w], address, w // per_job + 1, w % per_job, per_job) for w in range(s.workers)]

    def _start_tree(self) -> list[Member]:
        t, s = self.topo, self.spec
        root = self._serve("root", t.root_ns, t.root_ip, ["--workers", t.leaves, "--control", t.uplink_ips[0]],
                           s.backend)
        with concurrent.futures.ThreadPoolExecutor(t.leaves) as pool:  # each leaf waits for the others at the root
            leaves = list(pool.map(lambda j: self._serve(
                f"leaf{j}", t.leaf_ns[j], t.leaf_ips[j],
                ["--workers", t.per_leaf, "--uplink", root, "--uplink-rank", j, "--uplink-leaves", t.leaves,
                 "--control", t.worker_ips[j * t.per_leaf]]), range(t.leaves)))
        return [Member(t.worker_ns[w], leaves[w // t.per_leaf], 1, w % t.per_leaf, t.per_leaf)
                for w in range(t.n)]

    def stop_switches(self) -> dict:
        """SIGTERM every switch; name -> the counters it printed on exit."""
        out = {}
        for name, (p, log, _) in self.switches.items():
            if p.poll() is None:
                os.kill(p.pid, signal.SIGTERM)
            try:
                p.wait(10)
            except Exception:  # noqa: BLE001 - TimeoutExpired: close() kills it
                continue
            text = open(log).read()
            try:
                out[name] = json.loads(text[text.index("\n{") + 1:]) if "\n{" in text else {}
            except json.JSONDecodeError:
                out[name] = {}
        return out

    def close(self):
        self.topo.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _listening(p, log: str, limit: float = 90.0) -> str:
    """HOST:PORT from the switch's start-up line in its log; RuntimeError if it exits or stays silent."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        text = open(log).read()
        m = re.search(r"listening on ([\d.]+):(\d+)", text)
        if m:
            return f"{m.group(1)}:{m.group(2)}"
        if p.poll() is not None:
            raise RuntimeError(f"switch failed to start (exit {p.returncode}): {text[-2000:]}")
        time.sleep(0.05)
    raise RuntimeError(f"switch did not start within {limit:g} s: {open(log).read()[-2000:]}")


def inputs(codec: str, n: int, size: int, seed: int) -> list[np.ndarray]:
    rs = np.random.default_rng(seed)
    if codec == "int32":
        return [rs.integers(-(2**20), 2**20, size).astype(np.int32) for _ in range(n)]
    return [rs.standard_normal(size).astype(np.float32) for _ in range(n)]


def allreduce(dep: Deployment, codec: str = "int32", size: int = 1 << 16, window: int = 32,
              timeout: float = 60.0, seed: int = 0, cc: str | None = None) -> dict:
    """One allreduce of every job at once, a worker process per worker host; checked per job. cc: the
    workers' congestion policy (None: hostlib's default)."""
    policy = [f"cc={json.dumps(cc)}"] if cc else []
    with tempfile.TemporaryDirectory() as tmp:
        xs = inputs(codec, len(dep.members), size, seed)
        procs = []
        for w, (m, x) in enumerate(zip(dep.members, xs)):
            np.save(os.path.join(tmp, f"in{w}.npy"), x)
            procs.append(dep.topo.popen(m.host, [sys.executable, WORKER, m.switch, m.rank, m.world, codec,
                                                 os.path.join(tmp, f"in{w}.npy"), os.path.join(tmp, f"out{w}"),
                                                 f"window={window}", f"timeout={json.dumps(timeout)}", f"job={m.job}",
                                                 *policy],
                                        cwd=ROOT, stderr=open(os.path.join(tmp, f"err{w}"), "w")))
        wait_workers(procs, tmp, timeout * 2 + 30)
        outs = [np.load(os.path.join(tmp, f"out{w}.npy")) for w in range(len(procs))]
        stats = [json.load(open(os.path.join(tmp, f"out{w}.json"))) for w in range(len(procs))]
    checks = [_check(codec, [x for x, m in zip(xs, dep.members) if m.job == j],
                     [o for o, m in zip(outs, dep.members) if m.job == j])
              for j in sorted({m.job for m in dep.members})]
    report = {"exact": all(c["exact"] for c in checks)} if codec == "int32" else {
        "exact": None, "rel_error": max(c["rel_error"] for c in checks),
        "same_everywhere": all(c["same_everywhere"] for c in checks)}
    return {**report, "seconds": max(s["seconds"] for s in stats),
            "retransmissions": sum(s["retransmissions"] for s in stats),
            "bytes_sent": sum(s["bytes_sent"] for s in stats),
            "rtt_ms": round(1000 * min(s["srtt"] for s in stats if s.get("srtt") is not None), 3)
            if any(s.get("srtt") is not None for s in stats) else None}


def run(spec: Spec, codec: str = "int32", size: int = 1 << 16, window: int = 32, timeout: float = 60.0,
        seed: int = 0, cc: str | None = None) -> dict:
    """Build, allreduce once, report, tear down: what `topo run --json` prints.

    Returns:
        The spec, "seconds" (the slowest worker's allreduce), "exact" (int32: every job's result equals its
        int64 sum; other codecs: None and "rel_error"), "retransmissions", "rtt_ms" (the workers' smallest
        smoothed round trip), per-link bytes and the switches' drops.
    """
    with tempfile.TemporaryDirectory() as logs, Deployment(spec, logs) as dep:
        report = allreduce(dep, codec, size, window, timeout, seed, cc)
        counters = dep.stop_switches()
        return {**asdict(spec), "codec": codec, "size": size, **report, "links": dep.topo.link_bytes(),
                "switch_dropped": {name: {k: v for k, v in c.get("dropped", {}).items() if v}
                                   for name, c in counters.items()},
                "switch_jobs": {name: {j: {k: c["jobs"][j][k] for k in ("received", "multicast")}
                                       for j in c.get("jobs", {})} for name, c in counters.items()}}


def run_star(workers: int = 4, backend: str = "python", bw: float | None = None, loss: float = 0.0,
             codec: str = "int32", size: int = 1 << 16, window: int = 32, timeout: float = 60.0,
             seed: int = 0, delay_ms: float = 0.0) -> dict:
    """run() of a star of `workers` hosts around one `backend` switch."""
    return run(Spec(workers, backend, bw, delay_ms, loss), codec, size, window, timeout, seed)


SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's, where the mininet package installs


def mininet_why_not() -> str:
    """Why the mininet star cannot run here ("" if it can)."""
    import subprocess

    if os.geteuid() != 0:
        return "mininet needs root"
    if not os.path.exists(SYSTEM_PYTHON):
        return f"mininet runs under the system Python, and {SYSTEM_PYTHON} is missing"
    r = subprocess.run([SYSTEM_PYTHON, "-c", "import mininet.nodelib, mininet.link"], capture_output=True, text=True)
    if r.returncode:
        return f"{SYSTEM_PYTHON} cannot import mininet (apt-get install mininet): {r.stderr.strip()[-200:]}"
    if not os.path.exists("/usr/bin/mnexec"):
        return "mininet's mnexec is missing (apt-get install mininet)"
    return ""


def run_mininet(spec: Spec, codec: str = "int32", size: int = 1 << 16, window: int = 32, timeout: float = 60.0,
                seed: int = 0) -> dict:
    """The same allreduce on the mininet star (topologies/mininet_star.py under the system Python)."""
    import subprocess

    reason = mininet_why_not()
    if reason:
        raise RuntimeError(reason)
    if spec.leaves or spec.jobs != 1 or spec.backend == "bmv2":
        raise ValueError("the mininet topology is a star of one job around a python or c switch")
    if spec.ecn:
        raise ValueError("the mininet topology has no --ecn links (its links are TCLink's htb); drop --mininet")
    with tempfile.TemporaryDirectory() as tmp:
        xs = inputs(codec, spec.workers, size, seed)
        for w, x in enumerate(xs):
            np.save(os.path.join(tmp, f"in{w}.npy"), x)
        argv = [SYSTEM_PYTHON, os.path.join(ROOT, "topologies", "mininet_star.py"), "--python", sys.executable,
                "--workers", spec.workers, "--loss", spec.loss, "--delay-ms", spec.delay_ms, "--backend", spec.backend,
                "--codec", codec, "--dir", tmp, "--timeout", timeout * 2, *(["--bw", spec.bw_mbit] if spec.bw_mbit else []),
                "--", f"window={window}", f"timeout={json.dumps(timeout)}"]
        r = subprocess.run(list(map(str, argv)), capture_output=True, text=True, timeout=timeout * 2 + 120, cwd=ROOT)
        if r.returncode or not r.stdout.strip():
            raise RuntimeError(f"mininet run failed (exit {r.returncode}): {r.stderr[-2000:]}")
        net = json.loads(r.stdout.strip().splitlines()[-1])
        bad = [w for w, c in enumerate(net["workers_exit"]) if c != 0]
        if bad:
            raise RuntimeError(f"mininet workers {bad} failed: {open(os.path.join(tmp, f'err{bad[0]}')).read()[-2000:]}")
        outs = [np.load(os.path.join(tmp, f"out{w}.npy")) for w in range(spec.workers)]
        stats = [json.load(open(os.path.join(tmp, f"out{w}.json"))) for w in range(spec.workers)]
    return {**asdict(spec), "topology": "mininet", "codec": codec, "size": size, **_check(codec, xs, outs),
            "seconds": max(s["seconds"] for s in stats), "retransmissions": sum(s["retransmissions"] for s in stats),
            "links": net["links"], "switch_dropped": {k: v for k, v in net["switch"].get("dropped", {}).items() if v}}


def wait_workers(procs, tmp: str, limit: float):
    """Every worker exits 0 within limit seconds, else RuntimeError with the first failure's stderr (tmp/err{r})."""
    deadline = time.monotonic() + limit
    for r, p in enumerate(procs):
        try:
            rc = p.wait(max(0.1, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - TimeoutExpired: the topology's close() ends it
            raise RuntimeError(f"worker {r} did not finish within {limit:g} s") from None
        if rc:
            with open(os.path.join(tmp, f"err{r}")) as f:
                raise RuntimeError(f"worker {r} failed (exit {rc}): {f.read()[-2000:]}")


def _check(codec: str, xs, outs) -> dict:
    exact = np.sum(np.array(xs, dtype=np.float64 if codec != "int32" else np.int64), axis=0)
    if codec == "int32":
        return {"exact": all(np.array_equal(o.astype(np.int64), exact) for o in outs)}
    err = max(float(np.linalg.norm(o.astype(np.float64) - exact)) for o in outs)
    return {"exact": None, "rel_error": err / (float(np.linalg.norm(exact)) or 1.0),
            "same_everywhere": all(np.array_equal(o, outs[0]) for o in outs)}
