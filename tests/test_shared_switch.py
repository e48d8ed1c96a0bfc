"""A shared switch on loopback (serve without --job), as the issue's users run it: jobs of their own processes
that come and go; a killed job's slots back within the liveness window, seen in `switchsim stats`; a job
beyond the pool refused by name at once."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import hostlib
from hostlib import errors
from inabench.harness import ROOT, SwitchProcess
from inaproto.timers import PEER_SILENT
from switchsim import native
from inaproto.net import parse_address
from switchsim.control import Pool
from switchsim.server import query_stats

HERE = os.path.dirname(__file__)


def switch_stats(address: str) -> dict:
    """`switchsim stats ADDRESS`, as an operator reads it."""
    run = subprocess.run([sys.executable, "-m", "switchsim", "stats", address], cwd=ROOT, capture_output=True,
                         text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def start_job(address: str, job: int, seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.join(HERE, "scripts", "shared_job.py"), address, "--job", str(job),
                             "--seconds", str(seconds)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_four_jobs_a_second_apart_share_a_c_switch_and_a_killed_jobs_slots_come_back():
    native.require()
    sw = SwitchProcess(backend="c")  # shared: jobs admitted at their first join, 512 slots each
    address = parse_address(sw.address)
    jobs: dict[int, subprocess.Popen] = {}
    try:
        for job in (1, 2, 3, 4):  # each runs until about 10 s after the first started
            jobs[job] = start_job(sw.address, job, 10.0 - (job - 1))
            time.sleep(1.0)
        held = switch_stats(sw.address)
        assert sorted(held["jobs"]) == ["1", "2", "3", "4"] and held["pool"]["jobs"] == 4, held["jobs"]
        t0 = time.monotonic()  # a fifth job: no room, refused by name at once
        with pytest.raises(errors.PoolFull, match="in use by 4 jobs"):
            hostlib.connect(sw.address, 0, 2, job=5, join_timeout=10)
        assert time.monotonic() - t0 < 1.0
        jobs[2].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        while "2" in query_stats(address)["jobs"] and time.monotonic() - killed < PEER_SILENT + 3:
            time.sleep(0.1)
        gone = time.monotonic() - killed  # its last packet came at most a heartbeat before the kill
        back = switch_stats(sw.address)
        assert "2" not in back["jobs"] and gone < PEER_SILENT + 1.0, (gone, back["jobs"])
        assert back["pool"]["in_use"] == held["pool"]["in_use"] - held["jobs"]["2"]["slots"]
        for job, proc in jobs.items():
            out, err = proc.communicate(timeout=60)
            if job == 2:
                continue
            report = json.loads(out.strip().splitlines()[-1])
            assert proc.returncode == 0 and all(r["exact"] and r["calls"] > 5 for r in report["ranks"].values()), err
        done = switch_stats(sw.address)
        assert done["jobs"] == {} and done["pool"]["in_use"] == 0 and done["pool"]["ended"] == 4
    finally:
        for proc in jobs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        sw.stop()


def test_the_pool_lends_first_fit_runs_and_the_largest_when_none_fits():
    pool = Pool(10)
    assert pool.take(1, 4, 4) == (0, 4) and pool.take(2, 4, 4) == (4, 4) and pool.take(3, 4, 4) is None
    assert pool.take(3, 2, 4) == (8, 2)  # the largest free run, at least the least
    pool.give_back(1)
    assert pool.free_runs() == [(0, 4)] and pool.take(4, 1, 3) == (0, 3) and pool.in_use() == 9
    assert "9 of 10 slots in use by 3 jobs, the largest free run 1" == pool.describe()
