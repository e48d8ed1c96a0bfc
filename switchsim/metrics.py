"""`serve --metrics-port`: the switch's counters in Prometheus' text format, and `switchsim stats --watch`.

Prometheus scrapes the same dictionary every backend reports (`stats()`), converted at scrape time by a
custom collector, so there is no second set of counters to keep in step. Counters are per switch, per drop
reason, per job and per impairment side; per-slot counters stay out of Prometheus (512 series per job
and counter) and go to `stats --watch` instead.
"""
from __future__ import annotations

import json
import sys
import time

from inaproto import wire

PREFIX = "ina_"
SLOT_HELP = {"congested": "congested contributions counted in the job's rounds (docs/protocol.md, Congestion)"}
TRANSPORT = {"bytes_in": "bytes received", "bytes_out": "bytes sent", "send_errors": "sends that failed",
             "captured": "packets written to the capture", "capture_skipped": "packets past the capture's size"}


class StatsCollector:
    """A prometheus_client collector over a server's stats(): read when scraped, never cached."""

    def __init__(self, stats):
        self.stats = stats

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.stats()
        for name, text in (("packets_in", "packets the switch received"), ("packets_out", "packets it sent"),
                           ("overflows", "aggregates beyond the codec's range"), *TRANSPORT.items()):
            if name in s:
                yield CounterMetricFamily(PREFIX + name, text, value=s[name])
        drops = CounterMetricFamily(PREFIX + "dropped", "packets dropped, by reason", labels=["reason"])
        for reason, n in s.get("dropped", {}).items():
            drops.add_metric([reason], n)
        yield drops
        yield from _job_families(s.get("jobs", {}), CounterMetricFamily, GaugeMetricFamily)
        yield from _pool_families(s.get("pool"), CounterMetricFamily, GaugeMetricFamily)
        impaired = CounterMetricFamily(PREFIX + "impairment", "the emulated network's faults",
                                       labels=["side", "fault"])
        for side, faults in s.get("impairment", {}).items():
            for fault, n in faults.items():
                impaired.add_metric([side, fault], n)
        yield impaired
        if "uptime_s" in s:
            yield GaugeMetricFamily(PREFIX + "uptime_seconds", "seconds since the switch started", value=s["uptime_s"])


def _job_families(jobs: dict, counter, gauge):
    slot = {c: counter(PREFIX + "job_" + c, SLOT_HELP.get(c, f"packets {c} in the job's slots"), labels=["job"])
            for c in wire.SLOT_COUNTERS}
    state = {g: gauge(PREFIX + "job_" + g, f"the job's {g.replace('_', ' ')}", labels=["job"])
             for g in ("world_size", "generation", "members", "pending", "failed", "slots", "slot_base")}
    state["age_s"] = gauge(PREFIX + "job_age_seconds", "seconds since the job got its slots", labels=["job"])
    grouped = gauge(PREFIX + "job_grouped", "1 while the job's results go once to its loopback group (docs/protocol.md)",
                    labels=["job"])
    for job, j in jobs.items():
        for name, fam in (*slot.items(), *state.items()):
            if name in j:
                fam.add_metric([job], float(j[name]))
        if "group" in j:
            grouped.add_metric([job], float(j["group"] is not None))
    yield from slot.values()
    yield from state.values()
    yield grouped


def _pool_families(pool: dict | None, counter, gauge):
    """A shared switch's slot pool (docs/protocol.md, "A shared switch")."""
    if pool is None:
        return
    for name, text in (("slots", "slots in the shared switch's pool"), ("in_use", "slots lent to jobs"),
                       ("jobs", "jobs holding slots"), ("largest_free", "the longest run of free slots")):
        yield gauge(PREFIX + "pool_" + name, text, value=pool[name])
    yield counter(PREFIX + "pool_jobs_ended", "shared jobs that ended (their slots back in the pool)",
                  value=pool["ended"])


def serve_metrics(stats, host: str, port: int):
    """Expose stats() at http://host:port/metrics in a daemon thread; returns the port bound (port 0: any).

    Raises:
        RuntimeError: prometheus_client is not installed.
        OSError: the address cannot be bound.
    """
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise RuntimeError("--metrics-port needs prometheus_client (pip install prometheus_client)") from None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(stats))
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server.server_address[1]


# ---------------------------------------------------------------- stats --watch
def _at(per: dict, counter: str, i: int) -> int:
    """Slot i's count of a per-slot array; 0 where there is none (no previous look, a counter an older switch
    does not report)."""
    a = per.get(counter)
    return a[i] if a else 0


def busiest_slots(prev: dict | None, cur: dict, top: int = 8) -> list[dict]:
    """The slots that moved most since the last look (all jobs), with what each counter did meanwhile."""
    rows = []
    for job, j in cur.get("jobs", {}).items():
        per = j.get("per_slot")
        if not per:
            continue
        old = ((prev or {}).get("jobs", {}).get(job) or {}).get("per_slot") or {}
        for i in range(len(per["received"])):
            d = {c: _at(per, c, i) - _at(old, c, i) for c in wire.SLOT_COUNTERS}
            if any(d.values()):
                rows.append({"job": job, "slot": i, **d})
    rows.sort(key=lambda r: (-r["received"], -r["resent"], r["slot"]))
    return rows[:top]


def render(prev: dict | None, cur: dict, dt: float):
    """A rich renderable: per job its totals and rates, the busiest slots, and the drops by reason."""
    from rich.console import Group
    from rich.table import Table

    jobs = Table(title=f"switch: {cur.get('packets_in', 0)} in, {cur.get('packets_out', 0)} out, "
                       f"up {cur.get('uptime_s', 0):.0f} s")
    for col in ("job", "world", "generation", "members", "slots", "age s", *wire.SLOT_COUNTERS, "received/s"):
        jobs.add_column(col, justify="right")
    for job, j in sorted(cur.get("jobs", {}).items()):
        before = ((prev or {}).get("jobs", {}).get(job) or {}).get("received", j.get("received", 0))
        rate = (j.get("received", 0) - before) / dt if dt > 0 else 0.0
        jobs.add_row(job, str(j.get("world_size")), str(j.get("generation")), str(j.get("members", "")),
                     str(j.get("slots", "")), f"{j.get('age_s', 0):.0f}",
                     *(str(j.get(c, "")) for c in wire.SLOT_COUNTERS), f"{rate:,.0f}")
    slots = Table(title="busiest slots since the last look")
    for col in ("job", "slot", *wire.SLOT_COUNTERS):
        slots.add_column(col, justify="right")
    for r in busiest_slots(prev, cur):
        slots.add_row(*(str(r[c]) for c in ("job", "slot", *wire.SLOT_COUNTERS)))
    drops = ", ".join(f"{k} {v}" for k, v in cur.get("dropped", {}).items() if v) or "none"
    pool = cur.get("pool")
    lent = (f"pool: {pool['in_use']} of {pool['slots']} slots lent to {pool['jobs']} jobs, {pool['ended']} "
            f"ended\n" if pool else "")
    return Group(jobs, slots, f"{lent}dropped: {drops}")


def watch(address, interval: float, count: int | None, timeout: float, out=sys.stdout) -> int:
    """Poll the switch every interval seconds (count times, or until interrupted): a live view on a
    terminal, one JSON object per line otherwise. Returns 1 if the switch stops answering."""
    from .server import query_stats

    prev, then, n = None, time.monotonic(), 0
    live = None
    if out.isatty():
        from rich.live import Live

        live = Live(auto_refresh=False)
        live.start()
    try:
        while count is None or n < count:
            try:
                cur = query_stats(address, timeout=timeout, per_slot=True)
            except (OSError, TimeoutError) as e:
                where = address if isinstance(address, str) else f"{address[0]}:{address[1]}"  # or shm://NAME
                print(f"switchsim: no answer from {where}: {e}", file=sys.stderr)
                return 1
            now = time.monotonic()
            if live:
                live.update(render(prev, cur, now - then), refresh=True)
            else:
                out.write(json.dumps({"time": time.time(), **cur}, sort_keys=True) + "\n")
                out.flush()
            prev, then, n = cur, now, n + 1
            if count is None or n < count:
                time.sleep(interval)
    except KeyboardInterrupt:
        pass
    finally:
        if live:
            live.stop()
    return 0
