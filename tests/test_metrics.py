"""`serve --metrics-port` (Prometheus text, read back with prometheus_client's own parser) and
`switchsim stats --watch` (JSON lines in a pipe, a live view on a terminal)."""
from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from inabench.harness import ROOT, SwitchProcess, free_port
from inaproto import wire
from switchsim import metrics, native
from switchsim.server import query_stats
from tests.test_e2e import run_workers


def scrape(port) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


@pytest.mark.parametrize("backend", ["python", "c"])
def test_prometheus_exposition_is_the_switchs_counters(backend):
    if backend == "c":
        native.require()
    port = free_port()
    sw = SwitchProcess("--workers", 2, "--metrics-port", port, "--loss", 0.05, backend=backend)
    try:
        xs = [np.arange(8000, dtype=np.int32) * (r + 1) for r in range(2)]
        _, errors, _ = run_workers(sw.address, xs, "int32", elements_per_packet=64, window=8, timeout=30)
        assert errors == [None] * 2
        host, p = sw.address.split(":")
        stats = query_stats((host, int(p)))
        got = scrape(port)
    finally:
        sw.stop()
    job = stats["jobs"]["1"]
    for counter in wire.SLOT_COUNTERS:
        assert got[(f"ina_job_{counter}_total", (("job", "1"),))] == job[counter]
    assert job["received"] > 2 * 8000 // 64
    assert got[("ina_job_world_size", (("job", "1"),))] == 2
    assert got[("ina_job_generation", (("job", "1"),))] == job["generation"]
    assert got[("ina_job_grouped", (("job", "1"),))] == (job["group"] is not None) == 1  # workers on loopback
    for reason in wire.DROP_REASONS:
        assert got[("ina_dropped_total", (("reason", reason),))] == stats["dropped"][reason]
    rx_lost = got[("ina_impairment_total", (("fault", "dropped"), ("side", "rx")))]
    assert rx_lost == stats["impairment"]["rx"]["dropped"] > 0
    assert got[("ina_packets_in_total", ())] >= stats["packets_in"] - 1  # the scrape came after the stats request


def test_a_shared_switchs_jobs_and_pool_are_metrics():
    stats = {"packets_in": 1, "packets_out": 1, "dropped": {}, "jobs": {"7": {
        "world_size": 2, "slots": 128, "slot_base": 256, "age_s": 4.5, "generation": 1, "members": 2, "received": 3}},
        "pool": {"slots": 512, "in_use": 128, "jobs": 1, "largest_free": 256, "ended": 3}}
    got = {(s.name, tuple(s.labels.items())): s.value for fam in metrics.StatsCollector(lambda: stats).collect()
           for s in fam.samples}
    assert got[("ina_job_slots", (("job", "7"),))] == 128 and got[("ina_job_age_seconds", (("job", "7"),))] == 4.5
    assert got[("ina_job_slot_base", (("job", "7"),))] == 256 and got[("ina_pool_in_use", ())] == 128
    assert got[("ina_pool_jobs_ended_total", ())] == 3 and got[("ina_pool_largest_free", ())] == 256


def test_metrics_listen_on_loopback_only_by_default():
    port = free_port()
    sw = SwitchProcess("--workers", 2, "--metrics-port", port)
    try:
        line = sw.proc.stdout.readline()  # the line after "listening on"
        assert ("ina_job_world_size", (("job", "1"),)) in scrape(port)
    finally:
        sw.stop()
    assert f"metrics on http://127.0.0.1:{port}/metrics" in line


def test_watch_prints_json_lines_into_a_pipe():
    sw = SwitchProcess("--workers", 2, "--slots", 64)
    try:
        xs = [np.ones(4000, dtype=np.int32)] * 2
        run_workers(sw.address, xs, "int32", elements_per_packet=64, window=8, timeout=30)
        r = subprocess.run([sys.executable, "-m", "switchsim", "stats", sw.address, "--watch", "--interval", "0.1",
                            "--count", "3"], capture_output=True, text=True, timeout=30, cwd=ROOT)
    finally:
        sw.stop()
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(lines) == 3 and "\x1b" not in r.stdout  # no terminal codes in a pipe
    per_slot = lines[-1]["jobs"]["1"]["per_slot"]
    assert all(len(per_slot[c]) == 64 for c in wire.SLOT_COUNTERS)
    assert sum(per_slot["received"]) == lines[-1]["jobs"]["1"]["received"] == 2 * -(-4000 // 64)


def test_watch_view_shows_jobs_rates_and_the_busiest_slots():
    def stats(received):
        per = {c: [0] * 8 for c in wire.SLOT_COUNTERS}
        per["received"] = received
        per["resent"][3] = 2
        return {"packets_in": sum(received), "packets_out": 0, "uptime_s": 5, "dropped": {"stale": 4},
                "jobs": {"1": {"world_size": 2, "generation": 1, "members": 2, "received": sum(received),
                               "multicast": 0, "resent": 2, "dropped": 0, "per_slot": per}}}

    prev, cur = stats([1, 1, 1, 1, 1, 1, 1, 1]), stats([1, 9, 1, 31, 1, 1, 1, 1])
    assert [r["slot"] for r in metrics.busiest_slots(prev, cur)] == [3, 1]
    console = Console(record=True, width=120, force_terminal=True)
    console.print(metrics.render(prev, cur, 2.0))
    text = console.export_text()
    assert "busiest slots" in text and "dropped: stale 4" in text
    assert "19" in text  # (46 - 8) received / 2 s


def test_a_per_slot_reply_too_large_for_a_datagram_leaves_the_arrays_out():
    sw = SwitchProcess("--job", "1:2", "--job", "2:2", "--slots", 8192)
    try:
        host, p = sw.address.split(":")
        stats = query_stats((host, int(p)), per_slot=True)
    finally:
        sw.stop()
    assert stats["per_slot_omitted"] > wire.MAX_STATS_REPLY
    assert "per_slot" not in stats["jobs"]["1"] and stats["jobs"]["2"]["world_size"] == 2
