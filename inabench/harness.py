"""The one harness that benchmarks, the demo, training runs and the tests share: a switch in a child
process (`SwitchProcess`), free loopback ports, and ranks in spawned processes (`run_ranks`)."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import secrets
import select
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process so far, all its threads (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


class SwitchProcess:
    """`switchsim serve` in a child process (its own interpreter, like a real deployment).

    Args:
        *args: serve arguments (e.g. "--workers", 4); --json-stats is always added.
        backend: python | c | shm (the C core on shared-memory rings; dpdk runs in a namespace: pass its
            command as cmd).
        cmd: the serve command to run instead (e.g. VethNamespace.serve_command(port)).
    """

    def __init__(self, *args, backend="python", cmd=None):
        if cmd is None and backend == "shm":
            cmd = [sys.executable, "-m", "switchsim", "serve", "--backend", "c", "--shm", f"bench-{os.getpid()}-{id(self)}"]
        elif cmd is None:
            cmd = [sys.executable, "-m", "switchsim", "serve", "--port", "0", "--backend", backend]
        cmd = [*cmd, "--json-stats", *map(str, args)]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self._line()
        while line.startswith(("TELEMETRY", "EAL")):  # DPDK's own start-up lines
            line = self._line()
        m = re.search(r"listening on (shm://\S+|[\d.]+:\d+)", line)
        if not m:
            self.proc.kill()
            raise RuntimeError(f"switch failed to start: {line!r} {self.proc.stderr.read()}")
        self.address = m.group(1)  # HOST:PORT, or shm://NAME (serve --shm)

    def _line(self, timeout: float = 60.0) -> str:
        """The child's next line of output; "" if it says nothing within timeout (a hung start fails)."""
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return self.proc.stdout.readline() if ready else ""

    def stop(self) -> str:
        """SIGTERM the child we started (by PID) and return what it printed after its start-up lines (the
        --json-stats report): serve's other banner lines ("switchsim P4Runtime on ...", "switchsim metrics
        on ...") may come after the one __init__ read, or already be in the pipe's buffer, by timing."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        lines = out.splitlines(keepends=True)
        while lines and lines[0].startswith("switchsim "):
            lines.pop(0)
        return "".join(lines)

    def stop_stats(self) -> dict:
        """Stop it and return the counters it printed on exit ({} if it printed none)."""
        out = self.stop()
        try:
            return json.loads(out[out.index("{"):]) if "{" in out else {}
        except json.JSONDecodeError:
            return {}


LISTEN_PORTS = (20000, 32768)  # below Linux's default ephemeral range (net.ipv4.ip_local_port_range)


def free_port() -> int:
    """A loopback port free for TCP and UDP now, for a process to bind later. Picked below the kernel's
    ephemeral range where it can: a port the kernel handed out (bind to 0) goes back to that range when
    released, and any outgoing connection made before its new owner binds it may take it (a rendezvous then
    fails with "address in use")."""
    lo, hi = _ephemeral_range()
    span = (LISTEN_PORTS[0], min(LISTEN_PORTS[1], lo)) if lo > LISTEN_PORTS[0] + 1000 else None
    for _ in range(200 if span else 0):
        port = span[0] + secrets.randbelow(span[1] - span[0])  # not random's: a test may have seeded it
        if _bindable(port):
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = map(int, f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(port: int) -> bool:
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
        with socket.socket(socket.AF_INET, kind) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def run_ranks(target, world: int, args: tuple, expect: int, timeout: float = 600) -> list:
    """Start target(rank, world, port, *args, queue) in `world` spawned processes (a torch.distributed
    rendezvous on a free loopback port) and collect `expect` items they put on the queue; RuntimeError
    if the ranks die or time out first."""
    ctx = mp.get_context("spawn")
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")  # one core per rank: idle BLAS threads spin on the cores the ranks share
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    items, deadline = [], time.monotonic() + timeout
    try:
        while len(items) < expect and time.monotonic() < deadline:
            try:
                items.append(queue.get(timeout=5))
            except Exception:  # noqa: BLE001 - queue.Empty: check the ranks are alive
                if not any(p.is_alive() for p in procs):
                    break
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    if len(items) < expect:
        raise RuntimeError(f"{target.__name__}: {len(items)} of {expect} reports from {world} ranks")
    return items


# ---------------------------------------------------------------- allreduce vs gloo

