"""Where the CPU goes in one allreduce configuration, next to torch gloo's: CPU seconds per call of every
process (the switch, each rank) and, with `perf`, what they spend it on (encode, decode, the switch's
aggregation, kernel network work, the interpreter, idle cores).

    python benchmarks/profile_allreduce.py [--size 64M] [--workers 4] [--codec nc] [--backend c]
        [--payload 8192] [--iters 5] [--no-perf] [--json]

Every process warms up, then all wait at a barrier; the parent reads each process's CPU time
(/proc/PID/stat: user and system, all threads), starts `perf record -a` (cpu-clock, 2 kHz), lets the ranks
run `iters` calls and reads the CPU times again. perf's samples are grouped by process (pid) and by what
the sampled function does (CATEGORIES: first match of the symbol or its library). Needs root or
kernel.perf_event_paranoid <= 0 for perf (Debian: apt install linux-perf); --no-perf gives the CPU times alone.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from inabench.allreduce import parse_size  # noqa: E402
from inabench.harness import SwitchProcess, cpu_seconds, free_port  # noqa: E402

# (category, regex on "symbol dso"): the first match names a sample
CATEGORIES = [
    ("idle", r"^(intel_idle|default_idle|cpu_idle|poll_idle|acpi_idle|mwait_idle|native_safe_halt|pv_native_safe_halt|"
             r"cpuidle|do_idle|arch_cpu_idle)"),
    ("encode (NC / fixed, Philox)", r"nc_encode|philox|fixed_quantize|_encode_|ina_nc_code"),
    ("decode", r"nc_decode|dequantize|_decode"),
    ("exponents, input checks", r"block_exp|exponent|isfinite|check_input"),
    ("switch aggregation (C core)", r"nc_add_finish|nc_values|int32_values|int32_finish|widen_int32|nc_finish|nc_valid|ina_switch_process|ina_core|ina_agg|ina_sw_|nc_to_int|int_to_nc|ina_round|simd_add|ina_shm_switch"),
    ("worker loop (C)", r"ina_wk_|on_result|store_elements|build|pack|flush|receive|scan\b"),
    ("gloo reduce/copy (torch)", r"gloo|libtorch|at::|c10::|sum_|reduce"),
    ("memcpy/memset", r"memmove|memcpy|memset|__memcpy|copy_page|clear_page"),
    ("kernel: network (socket copies, UDP/TCP)", r"copy_user|_copy_to_|_copy_from_|copyin|copyout|rep_movs|udp|tcp|ip_|__ip|skb|sock|net_|netif|__dev|loopback|napi|inet|sendmsg|recvmsg|"
     r"sendmmsg|recvmmsg"),
    ("kernel: scheduler, wait, syscalls", r"schedule|futex|poll|select|epoll|wake|hrtimer|entry_SYSCALL|syscall|"
                                          r"finish_task|__switch_to|pick_next|dequeue|enqueue|update_curr|rcu|"
                                          r"irq|_raw_spin|clock|ktime|native_write_msr|sched"),
    ("kernel: other", r"\[kernel|vmlinux"),
    ("numpy", r"_multiarray_umath|numpy"),
    ("interpreter (Python)", r"libpython|python3|_Py|Py[A-Z]"),
]


def _name(label: str):
    """This thread's name in perf and top (15 bytes)."""
    try:
        ctypes.CDLL(None).prctl(15, label.encode()[:15], 0, 0, 0)
    except OSError:
        pass


def _ina_rank(rank, n, address, codec, elements, window, count, warm, iters, barrier, out):
    import numpy as np

    import hostlib
    from inabench.demo import make_input

    _name(f"ina-rank{rank}")
    x = make_input(codec, count, rank)
    res = np.empty_like(x)
    with hostlib.connect(address, rank, n, job=1, codec=codec, elements_per_packet=elements, timeout=60,
                         window=window) as comm:
        for _ in range(warm):
            comm.allreduce(x, out=res)
        barrier.wait()  # ready
        barrier.wait()  # go: the parent has read the CPU times and started perf
        t0 = time.perf_counter()
        for _ in range(iters):
            comm.allreduce(x, out=res)
        wall = (time.perf_counter() - t0) / iters
        barrier.wait()
    out.put((rank, os.getpid(), wall))


def _gloo_rank(rank, n, port, count, warm, iters, barrier, out):
    import torch
    import torch.distributed as dist

    from inabench.demo import make_input

    _name(f"gloo-rank{rank}")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    t = torch.from_numpy(make_input("float32", count, rank))
    for _ in range(warm):
        dist.all_reduce(t)
    dist.barrier()
    barrier.wait()
    barrier.wait()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t)
    wall = (time.perf_counter() - t0) / iters
    barrier.wait()
    out.put((rank, os.getpid(), wall))
    dist.destroy_process_group()


class Perf:
    """`perf record -a` between start() and stop(); samples() -> [(pid, comm, symbol, dso)]."""

    def __init__(self, enabled: bool):
        self.path = self.proc = None
        self.why = None if enabled and shutil.which("perf") else ("--no-perf" if not enabled else "perf not found")

    def start(self):
        if self.why:
            return
        fd, self.path = tempfile.mkstemp(prefix="ina-perf-", suffix=".data")
        os.close(fd)
        self.proc = subprocess.Popen(["perf", "record", "-q", "-a", "-F", "2000", "-e", "cpu-clock", "-k", "CLOCK_MONOTONIC",
                                      "-o", self.path],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(0.3)  # perf attaches to every CPU before the timed calls start
        if self.proc.poll() is not None:
            self.why = f"perf record failed: {self.proc.stderr.read().strip()[:200]}"

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(30)

    def samples(self, t0: float, t1: float) -> list[tuple[int, str, str, str]]:
        """The samples taken between t0 and t1 (time.monotonic())."""
        if self.why or not self.path:
            return []
        try:
            text = subprocess.run(["perf", "script", "-i", self.path, "-F", "comm,pid,time,ip,sym,dso"], capture_output=True,
                                  text=True, timeout=300).stdout
        finally:
            os.unlink(self.path)
        rows = []
        for line in text.splitlines():
            m = re.match(r"\s*(\S.*?)\s+(\d+)\s+([\d.]+):\s+[0-9a-f]+\s+(.*?)\s+\((.*)\)\s*$", line)
            if m and t0 <= float(m.group(3)) <= t1:
                rows.append((int(m.group(2)), m.group(1), m.group(4).split("+")[0], os.path.basename(m.group(5))))
        return rows


def categorise(symbol: str, dso: str) -> str:
    text = f"{symbol} {dso}"
    for name, pattern in CATEGORIES:
        if re.search(pattern, text):
            return name
    return "other"


def _measure(label, target, world, args, switch_pid, perf, warm, iters) -> dict:
    """Ranks of one configuration; the per-process CPU and the perf categories of the timed calls."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(world + 1), ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, *args, warm, iters, barrier, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        barrier.wait(timeout=600)
        pids = {"switch": switch_pid} if switch_pid else {}
        pids.update({f"rank {r}": p.pid for r, p in enumerate(procs)})
        before = {k: cpu_seconds(pid) for k, pid in pids.items()}
        perf.start()
        barrier.wait(timeout=60)
        t0 = time.monotonic()
        barrier.wait(timeout=600)
        t1 = time.monotonic()
        elapsed = t1 - t0
        perf.stop()
        after = {k: cpu_seconds(pid) for k, pid in pids.items()}
        walls = sorted(out.get(timeout=60)[2] for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    role = {pid: k for k, pid in pids.items()}
    per, top = defaultdict(Counter), defaultdict(Counter)
    for pid, comm, sym, dso in perf.samples(t0, t1):
        who = role.get(pid, "idle" if pid == 0 else "other processes")
        per[who][categorise(sym, dso)] += 1
        top[who][f"{sym} ({dso})"] += 1
    cpu = {k: {"user s/call": (after[k][0] - before[k][0]) / iters, "sys s/call": (after[k][1] - before[k][1]) / iters}
           for k in pids}
    return {"config": label, "wall s/call": walls[len(walls) // 2], "elapsed s": elapsed, "iters": iters,
            "cpu": cpu, "samples": {k: dict(v) for k, v in per.items()},
            "top": {k: v.most_common(12) for k, v in top.items()}, "perf": perf.why or "ok"}


def profile_ina(backend, codec, workers, size, payload, warm, iters, use_perf, window=None) -> dict:
    from hostlib.codecs import get_codec
    from inaproto import wire

    elements = payload // wire.ELEMENT_SIZE[get_codec(codec).wire_codec]
    sw = SwitchProcess("--workers", workers, "--elements-per-packet", max(elements, 1024), backend=backend)
    try:
        return _measure(f"{backend}/{codec} x{workers} {payload} B" + (f" W={window}" if window else ""), _ina_rank, workers,
                        (sw.address, codec, elements, window, size // 4), sw.proc.pid, Perf(use_perf), warm, iters)
    finally:
        sw.stop()


def profile_gloo(workers, size, warm, iters, use_perf) -> dict:
    return _measure(f"gloo x{workers}", _gloo_rank, workers, (free_port(), size // 4), None, Perf(use_perf), warm,
                    iters)


def report(r: dict, top: int = 0) -> str:
    lines = [f"## {r['config']}: {r['wall s/call'] * 1e3:.1f} ms per call (median rank), {r['iters']} calls, "
             f"perf: {r['perf']}", "", f"{'process':<16}{'user ms/call':>14}{'sys ms/call':>13}"]
    total_u = total_s = 0.0
    for k, v in r["cpu"].items():
        lines.append(f"{k:<16}{v['user s/call'] * 1e3:>14.1f}{v['sys s/call'] * 1e3:>13.1f}")
        total_u, total_s = total_u + v["user s/call"], total_s + v["sys s/call"]
    lines.append(f"{'all':<16}{total_u * 1e3:>14.1f}{total_s * 1e3:>13.1f}   "
                 f"(2 cores x elapsed per call: {2e3 * r['elapsed s'] / r['iters']:.1f} ms)")
    samples = r["samples"]
    if samples:
        cats = sorted({c for v in samples.values() for c in v}, key=lambda c: -sum(v.get(c, 0) for v in samples.values()))
        whos = [w for w in [*r["cpu"], "idle", "other processes"] if w in samples]
        total = sum(sum(v.values()) for v in samples.values())
        lines += ["", "share of all CPU samples (%), by process and by what the sampled function does", "",
                  f"{'':<36}" + "".join(f"{w:>11.11}" for w in whos) + f"{'all':>8}"]
        for c in cats:
            row = [100 * samples[w].get(c, 0) / total for w in whos]
            lines.append(f"{c:<36}" + "".join(f"{x:>11.1f}" for x in row) + f"{sum(row):>8.1f}")
    if top:
        for who, syms in r["top"].items():
            n = sum(samples[who].values())
            lines += ["", f"top functions of {who} (% of its samples)"]
            lines += [f"  {100 * c / n:5.1f}  {s}" for s, c in syms[:top]]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="64M", help="bytes of float32 per rank (K/M/G); default 64M")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--codec", default="nc")
    ap.add_argument("--backend", default="c", help="switch backend: c (UDP on loopback, what connect uses for "
                                                   "HOST:PORT), shm or python")
    ap.add_argument("--payload", type=int, default=8192, help="payload bytes per packet (default 8192)")
    ap.add_argument("--window", type=int, default=None, help="packets in flight per rank (default: connect's)")
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--no-perf", action="store_true")
    ap.add_argument("--no-gloo", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--top", type=int, default=0, help="also list each process's N hottest functions")
    a = ap.parse_args(argv)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    size = parse_size(a.size)
    results = [profile_ina(a.backend, a.codec, a.workers, size, a.payload, a.warm, a.iters, not a.no_perf,
                           a.window)]
    if not a.no_gloo:
        results.append(profile_gloo(a.workers, size, a.warm, a.iters, not a.no_perf))
    print(json.dumps(results) if a.json else "\n\n".join(report(r, a.top) for r in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
