"""The C parts against their Python definitions: wire constants, the aggregator core against the reference
model on random traffic (also replayed under AddressSanitizer), and the codec kernels bit for bit."""
from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess

import numpy as np
import pytest

from hostlib import kernels, wire
from inaproto import auth, timers
from hostlib.codecs import fixed, natural
from switchsim import control, native
from switchsim.model import Switch

from .conftest import ROOT

CSRC = os.path.join(ROOT, "csrc")
KERNEL_SOURCES = [os.path.join(CSRC, f) for f in ("ina_kernels.c", "ina_kernels_avx2.c", "ina_kernels_avx512.c")]
CONTROL = {bytes([m]) for m in wire.CONTROL_REQUESTS}


def test_native_parts_are_built():
    """pip install builds the core and the kernels (cffi at install time); the tests below need both."""
    native.require()
    assert kernels.lib is not None and kernels.enabled()


def c_defines(name):
    with open(os.path.join(CSRC, name)) as f:
        return {m[1]: int(m[2], 0) for m in re.finditer(r"#define (INA_\w+) \(?(-?\w+)\)?", f.read())}


def test_c_wire_constants_match_wire_py():
    d = c_defines("ina_wire.h")
    for name in ("VERSION", "DEFAULT_PORT", "FLAG_OVERFLOW", "EXP_NONE", "EXP_NONFINITE", "EXP_MIN", "EXP_MAX", "NC_BIAS",
                 "NC_LEVEL_MIN", "NC_LEVEL_MAX", "NC_SPAN", "MAX_WORKERS", "MAX_ELEMENTS", "HEADER_SIZE",
                 "POOL_SET_BIT", "POOL_RESERVED_BIT", "POOL_SLOT_MASK", "MAX_SLOTS", "PACKET_ID_MASK", "JOIN_SIZE",
                 "JOIN_MAC_SIZE", "MAX_ERROR_TEXT", "BLOCK_EXT_SIZE", "BLOCK_NONE", "FLAG_PER_SLOT", "FLAG_REPLY",
                 "NO_RANK", "MAX_ABORT_TEXT", "CALL_SPARSE", "CALL_NUMBER_MASK", "MAX_CALL_LEN", "FLAG_CONGESTED",
                 "ECT0", "CE"):
        assert d[f"INA_{name}"] == getattr(wire, name), name
    for code, name in wire.ERROR_NAMES.items():
        assert d[f"INA_ERR_{name.upper()}"] == code
    for kind, name in wire.CALL_KIND_NAMES.items():
        assert d[f"INA_CALL_KIND_{name.upper()}"] == kind
    assert d["INA_ERROR_PAYLOAD_SIZE"] == wire.ERROR_PAYLOAD.size
    assert d["INA_CONTROL_REQUESTS"] == sum(1 << m for m in wire.CONTROL_REQUESTS)
    for code, name in wire.MSG_NAMES.items():
        assert d[f"INA_MSG_{name.upper()}"] == code
    for code, name in wire.CODEC_NAMES.items():
        assert d[f"INA_CODEC_{name.upper()}"] == code
    assert d["INA_MSG_COUNT"] == len(wire.MSG_NAMES)
    assert d["INA_JOIN_PAYLOAD_SIZE"] == wire.JOIN_SIZE - wire.HEADER_SIZE
    assert d["INA_JOIN_ACK_PAYLOAD_SIZE"] == wire.JOIN_ACK_PAYLOAD.size
    # field offsets: pack a header with distinct bytes and read each field where the C header says it is
    pkt = wire.pack(wire.MSG_JOIN_WAIT, job=0x0102, rank=3, packet_id=0x04050607, slot=0x0809, set=1,
                    count=0x0A0B, codec=12, exp_cur=13, exp_next=14, flags=15, session=0x10111213, call_kind=0x16,
                    call=0x1718, call_len=0x191A1B1C, boot=0x1D1E1F20)
    assert pkt[d["INA_OFF_CALL_KIND"]] == 0x16 and pkt[d["INA_OFF_CALL"]:][:2] == b"\x17\x18"
    assert pkt[d["INA_OFF_CALL_LEN"]:][:4] == b"\x19\x1a\x1b\x1c" and pkt[d["INA_OFF_BOOT"]:][:4] == b"\x1d\x1e\x1f\x20"
    assert pkt[d["INA_OFF_VERSION"]] == wire.VERSION and pkt[d["INA_OFF_MSG_TYPE"]] == wire.MSG_JOIN_WAIT
    assert pkt[d["INA_OFF_SESSION"]:][:4] == b"\x10\x11\x12\x13"
    # the C loops' control-request budgets are the control plane's (inaproto.timers, generated)
    assert (d["INA_CONTROL_RATE"], d["INA_CONTROL_BURST"]) == control.CONTROL_RATE
    assert (d["INA_SOURCE_RATE"], d["INA_SOURCE_BURST"]) == control.SOURCE_RATE
    assert d["INA_REFUSED_AFTER_MS"] == round(timers.REFUSED_AFTER * 1000)
    assert "#define INA_CONTROL_RATE" not in open(os.path.join(CSRC, "ina_punt.h")).read()  # defined once
    assert pkt[d["INA_OFF_CODEC"]] == 12 and pkt[d["INA_OFF_FLAGS"]] == 15 and pkt[d["INA_OFF_RANK"]] == 3
    assert pkt[d["INA_OFF_JOB"]:][:2] == b"\x01\x02" and pkt[d["INA_OFF_PACKET_ID"]:][:4] == b"\x04\x05\x06\x07"
    assert pkt[d["INA_OFF_POOL"]:][:2] == b"\x88\x09" and pkt[d["INA_OFF_COUNT"]:][:2] == b"\x0a\x0b"
    assert pkt[d["INA_OFF_EXP_CUR"]] == 13 and pkt[d["INA_OFF_EXP_NEXT"]] == 14


# ---------------------------------------------------------------- random traffic
JOBS = {1: 3, 4: 2}
KEYS = {4: b"k" * 16}  # job 4 is keyed: its joins need the MAC
SLOTS, K = 4, 16
SECRET = 0xC0FFEE  # both switches derive the same sessions
BOOT = 0xB0071D  # and send the same boot id


class Clock:
    """A control-plane clock the test moves: 1 ms per packet, so expiry and rate limits are reproducible."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def switches(rounding, seed):
    """(model, core, clock), the same configuration and control-plane clock."""
    clock = Clock()
    kw = dict(slots=SLOTS, max_elements=K, nc_rounding=rounding, seed=seed, keys=KEYS, secret=SECRET, clock=clock,
              member_idle=0.5, join_expiry=1.0, boot=BOOT)
    return Switch(JOBS, **kw), native.CoreSwitch(JOBS, **kw), clock


def addr(job, rank):
    return 100 * job + rank


def join(job, rank, nonce, world=None, mac=None):
    world = JOBS.get(job, 2) if world is None else world
    if mac is None:
        mac = auth.join_mac(KEYS[job], job, rank, nonce, world, SLOTS) if job in KEYS else bytes(16)
    return wire.pack_join(job, rank, nonce, world, SLOTS, mac)


def elements(rs, codec, count, exp_cur, big):
    if codec == wire.CODEC_INT32:
        vals = rs.integers(-(2**31), 2**31, count) if big else rs.integers(-1000, 1000, count)
        return vals.astype(">i4").tobytes()
    floor = wire.nc_floor(exp_cur) if exp_cur != wire.EXP_NONE else wire.NC_LEVEL_MIN
    top = min(exp_cur, wire.NC_LEVEL_MAX) if exp_cur != wire.EXP_NONE else wire.NC_LEVEL_MIN - 1
    codes = np.zeros(count, np.uint8)
    if top >= floor:
        lv = rs.integers(max(floor, top - 3) if rs.random() < 0.5 else floor, top + 1, count)
        codes = (lv + wire.NC_BIAS).astype(np.uint8) | (rs.integers(0, 2, count) << 7).astype(np.uint8)
        codes[rs.random(count) < 0.3] = 0
    if rs.random() < 0.15 and count:
        codes[int(rs.integers(0, count))] = int(rs.choice([0x80, 0x7F, 0x01, 0xC0]))  # mostly invalid
    return codes.tobytes()


class Traffic:
    """Packets as the jobs' workers would send them, driven by a model switch's answers (sessions from join
    acks, a slot's next round once the model multicast the last), plus what networks, buggy peers and
    attackers add: spoofed ranks, strangers, previous sessions, far-ahead and stale ids, wrong exponents,
    invalid codes, ranks in another call than their round's, truncation, bit flips, duplicates, reordering,
    joins, leaves, aborts, heartbeats, stats requests."""

    def __init__(self, seed, model, clock):
        self.rs, self.model, self.clock = np.random.default_rng(seed), model, clock
        self.sessions = {j: 0 for j in JOBS}
        self.first = {j: 0 for j in JOBS}  # every slot's first packet id in the job's generation
        self.round = {}  # (job, slot) -> the round the workers are on
        self.shapes = {}  # (job, slot, round) -> codec, count, exp_cur, big, sparse, block
        self.calls = {}  # (job, slot, round) -> the round's call: number, kind, length
        self.failed = set()  # jobs whose generation failed (their workers re-join soon, as hostlib's do)
        self.log = []  # (data, src, what the model answered, the clock then)
        self.cookies = {}  # (destination, job, rank, echoed nonce) -> the cookie of a join_wait the model sent

    def send(self, data, src):
        self.clock.t += 0.001
        out = self.model.process(data, src)
        self.log.append((data, src, out, self.clock.t))
        for pkt, dst in out:
            h = wire.unpack(pkt)
            if h.msg_type == wire.MSG_JOIN_WAIT:
                self.cookies[(dst, h.job, h.rank, h.packet_id)] = pkt
            if h.msg_type == wire.MSG_JOIN_ACK:
                if h.session != self.sessions[h.job]:
                    self.round = {k: v for k, v in self.round.items() if k[0] != h.job}
                self.sessions[h.job] = h.session
                self.first[h.job] = wire.JOIN_ACK_PAYLOAD.unpack_from(pkt, wire.HEADER_SIZE)[4]
                self.failed.discard(h.job)
            elif (h.msg_type == wire.MSG_ERROR and len(pkt) > wire.HEADER_SIZE and h.session == self.sessions.get(h.job)
                  and wire.unpack_error(pkt)[0] != wire.ERR_DROPPED):  # a dropped packet told: informational
                self.failed.add(h.job)  # the generation failed: its workers re-join
            elif h.msg_type in (wire.MSG_RESULT, wire.MSG_SPARSE_RESULT) and self.round.get((h.job, h.slot)) == h.packet_id:
                if self.rs.random() < 0.7:
                    self.round[(h.job, h.slot)] = h.packet_id + 1  # the workers move on

    def join_all(self, job):
        for r in range(JOBS[job]):
            data = join(job, r, int(self.rs.integers(1, 2**40)))
            self.send(data, addr(job, r))
            waits = [pkt for pkt, _ in self.log[-1][2] if pkt[1] == wire.MSG_JOIN_WAIT]
            self.send(wire.confirm_join(data, waits[-1]) if waits else data, addr(job, r))  # confirmed: its cookie

    def control(self, job, rank, src):
        rs, c = self.rs, self.rs.random()
        if c < 0.4:
            world = None if rs.random() < 0.9 else JOBS.get(job, 2) + 1
            mac = bytes(16) if rs.random() < 0.5 else None
            data = join(job, rank, int(rs.integers(0, 3)), world, mac)
            echo = wire.JOIN_PAYLOAD.unpack_from(data, wire.HEADER_SIZE)[0] & wire.PACKET_ID_MASK
            wait = self.cookies.get((src, job, rank, echo))  # a worker that read its join_wait confirms
            return wire.confirm_join(data, wait) if wait is not None and rs.random() < 0.7 else data
        session = self.sessions.get(job, 0)
        if c < 0.5:
            return wire.pack(wire.MSG_LEAVE, job=job, rank=rank, session=session)
        if c < 0.55:  # a reason of any bytes (not utf-8, NULs, longer than the switch reads)
            reason = rs.bytes(int(rs.integers(0, 2 * wire.MAX_ABORT_TEXT)))
            return wire.pack(wire.MSG_ABORT, job=job, rank=rank, session=session, call=int(rs.integers(0, 9)),
                             payload=reason)
        if c < 0.8:
            return wire.pack(wire.MSG_HEARTBEAT, job=job, rank=rank, session=session)
        return wire.pack(wire.MSG_STATS_REQ)

    def call_of(self, key, codec, sparse):
        """The call of a round's packet, (number, kind, length): the round's, but for a rare rank whose call
        differs in one of the three (the switch fails the generation, naming it)."""
        rs = self.rs
        if key not in self.calls:
            kinds = ("int32", "fixed") if codec == wire.CODEC_INT32 else ("nc", "dither")
            self.calls[key] = (key[2] // 3 & wire.CALL_NUMBER_MASK, wire.call_kind(str(rs.choice(kinds)), sparse),
                               int(rs.choice([K * SLOTS * 5, 1000, 2**32 - 1])))
        call, kind, n = self.calls[key]
        d = rs.random()
        if d < 0.003:
            call = (call + int(rs.choice([1, 2**16 - 1]))) & wire.CALL_NUMBER_MASK
        elif d < 0.008:
            kind = int(rs.choice([kind ^ wire.CALL_SPARSE, kind % 4 + 1, 9, 0x80 | 77]))
        elif d < 0.011:
            n = (n + 1) & 0xFFFFFFFF
        return call, kind, n

    def update(self, job, rank):
        rs = self.rs
        slot = int(rs.integers(0, SLOTS))
        cur = self.round.get((job, slot), self.first.get(job, 0))
        pid = int(rs.choice([cur] * 16 + [cur - 1, cur - 1, cur - 2, cur + 1, cur + 2, cur + 1000]))
        pid &= wire.PACKET_ID_MASK
        if rs.random() < 0.02:
            slot = int(rs.integers(0, SLOTS + 2))
        key = (job, slot, pid)
        if key not in self.shapes or rs.random() < 0.03:  # the ranks of a round agree, but for a few deviants
            self.shapes[key] = (int(rs.choice([wire.CODEC_INT32, wire.CODEC_NC8])),
                                int(rs.choice([K, K, K, K, 5, 0, K + 1])),
                                int(rs.choice([wire.EXP_NONE, 0, 3, 40, 63, 70, 127, -100])),
                                rs.random() < 0.35, rs.random() < 0.3, int(rs.integers(0, 4)))
        codec, count, exp_cur, big, sparse, block = self.shapes[key]
        if sparse and rs.random() < 0.4:
            count = 0  # a worker that does not hold the round's block
        payload = elements(rs, codec, count, exp_cur, big)
        session = self.sessions.get(job, 0)
        if rs.random() < 0.04:
            session = int(rs.choice([session ^ 1, 0, int(rs.integers(1, 2**32))]))  # an old or guessed session
        s = min(slot, wire.MAX_SLOTS - 1)
        call, kind, n = self.call_of(key, codec, sparse)
        flags = wire.FLAG_CONGESTED if (pid + rank + slot) % 5 == 0 else 0  # not drawn: the stream stays as it was
        if sparse:  # block-sparse round: the holders' next blocks mostly lie after the round's block
            nxt = int(rs.choice([block + 1, block + 2, block + 3, wire.BLOCK_NONE, block, block - 1, 0]))
            if not count:
                nxt = int(rs.choice([block + 1, block + 3, wire.BLOCK_NONE, block]))
            return wire.pack_sparse(wire.MSG_SPARSE_UPDATE, job, rank, pid, s, pid & 1, count, codec, exp_cur,
                                    int(rs.integers(-128, 128)), flags, block if count else wire.BLOCK_NONE,
                                    nxt & 0xFFFFFFFF, payload, session, kind, call, n)
        return wire.pack(wire.MSG_UPDATE, job, rank, pid, s, pid & 1, count, codec, exp_cur,
                         int(rs.integers(-128, 128)), flags, payload, session, kind, call, n)

    def fault(self, data, job, rank):
        rs, f = self.rs, self.rs.random()
        if f < 0.03:
            return data[: int(rs.integers(0, len(data)))]
        if f < 0.06:
            b = bytearray(data)
            b[int(rs.integers(0, min(len(b), 32)))] ^= 1 << int(rs.integers(0, 8))
            return bytes(b)
        if f < 0.07:
            return wire.pack(int(rs.choice([wire.MSG_RESULT, wire.MSG_JOIN_ACK, wire.MSG_ERROR])), job, rank)
        return data

    def run(self, n):
        rs = self.rs
        for j in JOBS:
            self.join_all(j)
        held = None
        for _ in range(n):
            job = int(rs.choice([1, 4])) if rs.random() < 0.95 else int(rs.choice([9, int(rs.integers(0, 65536))]))
            world = JOBS.get(job, 2)
            rank = int(rs.integers(0, world + (rs.random() < 0.03)))
            who = rs.random()
            src = addr(job, rank) if who < 0.94 else addr(job, (rank + 1) % world) if who < 0.97 else 999
            if job in JOBS and rs.random() < (0.05 if job in self.failed else 0.003):
                self.join_all(job)  # the job restarts: a new generation, packets of the old one still around
                continue
            kind = rs.random()
            data = self.control(job, rank, src) if kind < 0.04 else self.update(job, rank)
            data = self.fault(data, job, rank)
            if held is not None:
                self.send(data, src)
                data, src, held = held[0], held[1], None
            elif rs.random() < 0.05:
                held = (data, src)  # reorder: sent after the next one
                continue
            self.send(data, src)
            if rs.random() < 0.05:
                self.send(data, src)  # duplicate
            if rs.random() < 0.01:
                self.clock.t += 1.5  # a quiet spell: members idle, pending joins expire
        return self.log


def traffic(seed: int, model, clock, n: int = 5000):
    return Traffic(seed, model, clock).run(n)


def untold_text(out, size: int):
    """The answers to a packet of size bytes, each ERR_DROPPED cut after its two code bytes: its detail text
    is the backend's own wording (all the rest, the code and the reason's index included, must be the
    model's). What is cut is checked: UTF-8 starting with the reason's name, the answer never larger than
    the packet."""
    keep = []
    for pkt, dst in out:
        if pkt[1] == wire.MSG_ERROR and wire.unpack_error(pkt)[0] == wire.ERR_DROPPED:
            assert len(pkt) <= size, (len(pkt), size)
            head = f"{wire.DROP_REASONS[pkt[wire.HEADER_SIZE + 1]]}: "
            text = pkt[wire.HEADER_SIZE + wire.ERROR_PAYLOAD.size:].decode()
            assert text.startswith(head) or head.startswith(text), text
            pkt = pkt[:wire.HEADER_SIZE + wire.ERROR_PAYLOAD.size]
        keep.append((pkt, dst))
    return keep


@pytest.mark.parametrize("rounding", ["stochastic", "deterministic"])
@pytest.mark.parametrize("seed", range(4))
def test_core_matches_model_packet_for_packet(seed, rounding):
    model, core, clock = switches(rounding, seed)
    log = traffic(seed, model, clock)
    emitted, sparse_blocks, sparse_empty = 0, 0, 0
    for i, (data, src, want, t) in enumerate(log):
        clock.t = t
        got = core.process(data, src)
        assert untold_text(got, len(data)) == untold_text(want, len(data)), f"packet {i}: {data.hex()}"
        emitted += len(want)
        for pkt, _ in want:
            if pkt[1] == wire.MSG_SPARSE_RESULT:
                h = wire.unpack(pkt)
                sparse_blocks += h.count > 0
                sparse_empty += h.count == 0
    assert core.stats(per_slot=True) == model.stats(per_slot=True)
    stats = model.stats()
    # the traffic reaches every branch worth comparing (DPDK alone sees fragments; nothing here floods, and
    # only the C loops cut requests too long or too many for their punt queue)
    assert emitted > 200 and stats["overflows"] > 0
    loops_only = ("fragment", "rate_limited", "oversized", "punt_overflow", "pool_full")  # pool_full: shared
    assert all(v for k, v in stats["dropped"].items() if k not in loops_only), stats["dropped"]
    mismatches = {wire.unpack_error(p)[2] for _, _, out, _ in log for p, _ in out
                  if p[1] == wire.MSG_ERROR and wire.unpack_error(p)[0] == wire.ERR_CALL_MISMATCH}
    for what in ("out of step", "with codec", "elements"):  # each way a call differs, worded by the core too
        assert any(what in t for t in mismatches), (what, mismatches)
    told = {wire.DROP_REASONS[p[wire.HEADER_SIZE + 1]] for _, _, out, _ in log for p, _ in out
            if p[1] == wire.MSG_ERROR and wire.unpack_error(p)[0] == wire.ERR_DROPPED}
    assert told == set(wire.TOLD_DROPS), told  # every reason a member is told of, told by the core too
    assert stats["jobs"]["1"]["resent"] > 0 and stats["jobs"]["4"]["multicast"] > 0
    assert stats["jobs"]["1"]["congested"] > 0 and any(p[1] in (wire.MSG_RESULT, wire.MSG_SPARSE_RESULT) and
                                                       p[3] & wire.FLAG_CONGESTED for _, _, out, _ in log for p, _ in out)
    assert stats["jobs"]["1"]["generation"] > 1  # restarts happened
    assert sparse_blocks > 20 and sparse_empty > 5  # block-sparse rounds, with and without elements


SIMD_PATHS = ("scalar", "avx2", "avx512")


def forced_core(monkeypatch, path, config, **kw):
    """A CoreSwitch whose lane arithmetic is `path` (INA_SWITCH_SIMD, read when the core is made); skips
    where this CPU cannot run it."""
    monkeypatch.setenv("INA_SWITCH_SIMD", path)
    core = native.CoreSwitch(config, **kw)
    took = native.ffi.string(native.lib.ina_switch_lanes(core.core)).decode()
    if took != path:
        pytest.skip(f"this CPU runs {took}, not {path}")
    return core


@pytest.mark.parametrize("rounding", ["stochastic", "deterministic"])
@pytest.mark.parametrize("path", SIMD_PATHS)
def test_each_simd_path_matches_model_on_random_traffic(monkeypatch, path, rounding):
    """The random traffic above (every drop reason, invalid codes, overflow, sparse rounds) through each
    forced lane path."""
    model, _, clock = switches(rounding, 7)
    core = forced_core(monkeypatch, path, JOBS, slots=SLOTS, max_elements=K, nc_rounding=rounding, seed=7,
                       keys=KEYS, secret=SECRET, clock=clock, member_idle=0.5, join_expiry=1.0, boot=BOOT)
    for i, (data, src, want, t) in enumerate(traffic(7, model, clock, 3000)):
        clock.t = t
        got = core.process(data, src)
        assert untold_text(got, len(data)) == untold_text(want, len(data)), f"packet {i}: {data.hex()}"
    assert core.stats(per_slot=True) == model.stats(per_slot=True)


def edge_codes(rs, n, exp, style):
    """NC codes of one worker for block exponent exp: the edges the lane arithmetic must get right."""
    floor, top = wire.nc_floor(exp), min(exp, wire.NC_LEVEL_MAX)
    if top < floor:  # below the table: only zeros are valid
        return np.zeros(n, np.uint8)
    if style == "top":  # every worker at the top level, one sign: sums up to 64 * 2^55, overflow past 63
        lv, sign = np.full(n, top), np.zeros(n, np.uint8)
    elif style == "floor":  # sums of +-1 floor units: a = 0 and cancellation to zero
        lv, sign = np.full(n, floor), rs.integers(0, 2, n).astype(np.uint8)
    else:  # anywhere in the block, with zeros
        lv, sign = rs.integers(floor, top + 1, n), rs.integers(0, 2, n).astype(np.uint8)
    codes = (lv + wire.NC_BIAS).astype(np.uint8) | (sign << 7)
    codes[rs.random(n) < (0.0 if style == "top" else 0.2)] = 0
    return codes


@pytest.mark.parametrize("rounding", ["stochastic", "deterministic"])
@pytest.mark.parametrize("path", SIMD_PATHS)
def test_each_simd_path_matches_model_on_wide_nc_rounds(monkeypatch, path, rounding):
    """Full rounds of 64 workers with long and odd-length NC blocks (vector bodies and scalar tails),
    exponents from the bottom of the table to past its top (overflow), codes at the block's edges, a
    bad code in a late packet, and int32 rounds that overflow: the core's bytes and counters = the model's."""
    workers, k = 64, 1031
    config = dict(slots=4, max_elements=k, nc_rounding=rounding, seed=99, boot=BOOT)
    model = Switch({1: workers}, **config)
    core = forced_core(monkeypatch, path, {1: workers}, **config)
    for sw in (model, core):
        sw.admit(1, 1, 0x5E55, 0, list(range(workers)))
    rs = np.random.default_rng(5)
    for q in range(24):
        exp, style = [(-70, "any"), (-8, "floor"), (0, "any"), (40, "top"), (57, "top"), (58, "top"),
                      (63, "any"), (100, "top")][q % 8]
        n = int(rs.choice([k, k - 8, 7, 64, 1]))
        codec = wire.CODEC_INT32 if q % 6 == 5 else wire.CODEC_NC8
        for r in range(workers):
            if codec == wire.CODEC_INT32:
                payload = rs.integers(-(2**31), 2**31, n).astype(">i4").tobytes()
            else:
                payload = edge_codes(rs, n, exp, style).tobytes()
                if r == workers - 1 and q % 4 == 1:  # a code above the block: dropped, the round stays open
                    bad = bytearray(payload)
                    top = min(exp, wire.NC_LEVEL_MAX)
                    bad[n - 1] = top + 1 + wire.NC_BIAS if top < wire.NC_LEVEL_MAX else 0x80
                    pkt = wire.pack(wire.MSG_UPDATE, 1, r, q // 4, q % 4, (q // 4) & 1, n, codec, exp, exp, 0,
                                    bytes(bad), 0x5E55)
                    told = untold_text(model.process(pkt, r), len(pkt))  # told once (the rank's first bad code)
                    assert untold_text(core.process(pkt, r), len(pkt)) == told
                    codes = bytes([wire.ERR_DROPPED, wire.DROP_REASONS.index("bad_codes")])
                    assert [p[wire.HEADER_SIZE:] for p, _ in told] in ([], [codes])
            pkt = wire.pack(wire.MSG_UPDATE, 1, r, q // 4, q % 4, (q // 4) & 1, n, codec, exp, exp, 0, payload,
                            0x5E55)
            want = model.process(pkt, r)
            assert core.process(pkt, r) == want, f"round {q}, rank {r}"
        assert len(want) == workers
    stats = model.stats(per_slot=True)
    assert core.stats(per_slot=True) == stats and stats["overflows"] > 0 and stats["dropped"]["bad_codes"] > 0



def narrow_codes(rs, n, exp, span, where):
    """NC codes of one worker within `span` levels of the block's top (a narrow round's range; the lowest
    level included), with "below" one code just under it (the round widens at that packet)."""
    top = min(exp, wire.NC_LEVEL_MAX)
    lv = rs.integers(max(top - span, wire.nc_floor(exp)), top + 1, n)
    lv[rs.random(n) < 0.3] = top  # sums up to world_size * 2^span: the top of int32's exact range
    lv[0] = max(top - span, wire.nc_floor(exp))
    if where == "below":
        lv[n // 2] = max(top - span - 1 - int(rs.integers(0, 20)), wire.nc_floor(exp))
    codes = (lv + wire.NC_BIAS).astype(np.uint8) | (rs.integers(0, 2, n).astype(np.uint8) << 7)
    codes[rs.random(n) < 0.1] = 0
    return codes


@pytest.mark.parametrize("rounding", ["stochastic", "deterministic"])
@pytest.mark.parametrize("path", SIMD_PATHS)
@pytest.mark.parametrize("workers", [4, 64])
def test_narrow_rounds_and_rounds_that_widen_match_the_model(monkeypatch, path, rounding, workers):
    """The core sums an NC round in int32 lanes while every code lies within narrow_span levels of the
    block's top (30 - log2 world_size), and widens it to int64 at the first packet with a lower code: at the
    first packet, a middle one or the last (which finish adds), codes at the narrow floor and one below it,
    sums at 2^30, all signs; one length with a scalar tail. Bytes and counters = the model's."""
    span = 30 - (workers - 1).bit_length()
    k = 1031
    config = dict(slots=4, max_elements=k, nc_rounding=rounding, seed=11, boot=BOOT)
    model = Switch({1: workers}, **config)
    core = forced_core(monkeypatch, path, {1: workers}, **config)
    for sw in (model, core):
        sw.admit(1, 1, 0x5E55, 0, list(range(workers)))
    rs = np.random.default_rng(workers)
    for q in range(16):
        exp = [0, 20, -40, 63, -10, 5, 30, 62][q % 8]
        widen_at = [None, 0, workers // 2, workers - 1][q % 4]
        n = k if q % 3 else k - 5
        for r in range(workers):
            codes = narrow_codes(rs, n, exp, span, "below" if r == widen_at else "in")
            if q % 8 == 3 and r % 2 == 0:
                codes[:] = wire.NC_LEVEL_MAX + wire.NC_BIAS  # every worker at the top: sums overflow
            pkt = wire.pack(wire.MSG_UPDATE, 1, r, q // 4, q % 4, (q // 4) & 1, n, wire.CODEC_NC8, exp, exp, 0,
                            codes.tobytes(), 0x5E55)
            want = model.process(pkt, r)
            assert core.process(pkt, r) == want, f"round {q}, rank {r}"
        assert len(want) == workers
    stats = model.stats(per_slot=True)
    assert core.stats(per_slot=True) == stats and stats["dropped"]["bad_codes"] == 0 and stats["overflows"] > 0

@pytest.mark.parametrize("path", SIMD_PATHS)
@pytest.mark.parametrize("workers", [4, 64])
def test_int32_rounds_in_int32_lanes_widen_where_an_add_wraps(monkeypatch, path, workers):
    """The core sums an int32 round in int32 lanes and widens it to int64 at the first packet whose add wraps
    (the second packet, a middle one or the last), up or down: a sum that leaves int32 on the way and comes
    back is exact without OVERFLOW; one that ends outside has OVERFLOW and wrapped bytes, its terms all of one
    sign, so only a wrap test that is right for that sign widens it (the bytes alone wrap alike either way).
    Sparse blocks too; one length with a scalar tail. Bytes and counters = the model's."""
    k = 1031
    config = dict(slots=4, max_elements=k, seed=3, boot=BOOT)
    model = Switch({1: workers}, **config)
    core = forced_core(monkeypatch, path, {1: workers}, **config)
    for sw in (model, core):
        sw.admit(1, 1, 0x5E55, 0, list(range(workers)))
    rs = np.random.default_rng(workers)
    top = int(np.iinfo(np.int32).max)
    for q in range(16):
        n = k if q % 3 else k - 5
        wrap_at = [None, 1, workers // 2, workers - 1][q % 4]
        sign = 1 if q % 8 < 4 else -1
        comes_back = q >= 8 and wrap_at != workers - 1
        sparse = q % 5 == 2
        for r in range(workers):
            x = sign * rs.integers(0, 1000, n, dtype=np.int64)
            if wrap_at is not None:  # lanes ::3: rank 0 near the edge, rank wrap_at's add leaves int32
                x[::3] = sign * {0: top - 500, wrap_at: 1000}.get(r, 0)
                if comes_back and r == workers - 1:
                    x[::3] = -sign * 1000  # the last rank's brings the sums back in
            payload = x.astype(np.int32).astype(">i4").tobytes()
            if sparse:
                pkt = wire.pack_sparse(wire.MSG_SPARSE_UPDATE, 1, r, q // 4, q % 4, (q // 4) & 1, n,
                                       wire.CODEC_INT32, wire.EXP_NONE, wire.EXP_NONE, 0, 7, 8, payload, 0x5E55)
            else:
                pkt = wire.pack(wire.MSG_UPDATE, 1, r, q // 4, q % 4, (q // 4) & 1, n, wire.CODEC_INT32,
                                wire.EXP_NONE, wire.EXP_NONE, 0, payload, 0x5E55)
            want = model.process(pkt, r)
            assert core.process(pkt, r) == want, f"round {q}, rank {r}"
        assert len(want) == workers
        overflow = bool(wire.unpack(want[0][0]).flags & wire.FLAG_OVERFLOW)
        assert overflow == (wrap_at is not None and not comes_back), f"round {q}"
    stats = model.stats(per_slot=True)
    assert core.stats(per_slot=True) == stats and stats["overflows"] == 8 and sum(stats["dropped"].values()) == 0


@pytest.mark.parametrize("path", SIMD_PATHS)
def test_sets_laid_out_for_each_generations_elements_match_the_model(monkeypatch, path):
    """Each generation lays its slots' sets out for the elements its join agreed, denser than max_elements. Rounds
    in flight on every slot at once (int32 narrow, int32 wide where an add wraps: 8 bytes an element, and NC)
    while the other sets keep the last rounds' results for a rank that has not moved on, results written right
    to left, each resent, in generations of 256, 1000 and 7 elements: the model's bytes, so no round's sums or
    result reach a neighbouring set's."""
    config = dict(slots=4, max_elements=1024, seed=5, boot=BOOT)
    model = Switch({1: 3}, **config)
    core = forced_core(monkeypatch, path, {1: 3}, **config)
    rs = np.random.default_rng(8)

    def packet(k, session, r, slot, use):
        if slot % 2:
            payload, codec = rs.integers(60, 64, k).astype(np.uint8).tobytes(), wire.CODEC_NC8
        else:  # slot 2's rounds wrap and widen to int64 sums
            x = rs.integers(2**29, 2**30, k) if slot == 2 else rs.integers(-1000, 1000, k)
            payload, codec = x.astype(">i4").tobytes(), wire.CODEC_INT32
        return wire.pack(wire.MSG_UPDATE, 1, r, use, slot, use & 1, k, codec, 0, 0, 0, payload, session)

    for gen, k in ((1, 256), (2, 1000), (3, 7)):
        session = 0x5E55 + gen
        for sw in (model, core):
            sw.admit(1, gen, session, 0, [0, 1, 2], elements=k)
        sent = {}

        def send(r, slot, use):
            sent[r, slot, use] = pkt = packet(k, session, r, slot, use)
            want = model.process(pkt, r)
            assert core.process(pkt, r) == want, f"generation {gen}, use {use}, rank {r}, slot {slot}"
            return want

        def resend(slot, use):  # rank 2's packet again: the round's stored result, unicast
            want = model.process(sent[2, slot, use], 2)
            assert len(want) == 1 and core.process(sent[2, slot, use], 2) == want, f"{gen}: {slot} {use}"

        for use in range(4):
            for r in (0, 1):  # every slot's round in flight at once, in the sets of this use's parity ...
                for slot in range(4):
                    assert send(r, slot, use) == []
            for slot in range(4 if use else 0):  # ... while the other sets keep the last use's results for rank 2
                resend(slot, use - 1)
            for slot in reversed(range(4)):  # each result written after its right-hand neighbour's
                assert len(send(2, slot, use)) == 3
            for slot in range(4):
                resend(slot, use)
    assert core.stats(per_slot=True) == model.stats(per_slot=True)


def test_core_answers_control_requests_like_the_model():
    clocks = [Clock(), Clock()]
    model = Switch({1: 2}, secret=5, clock=clocks[0], boot=BOOT)
    core = native.CoreSwitch({1: 2}, secret=5, clock=clocks[1], boot=BOOT)
    for data, src in ((wire.pack(wire.MSG_STATS_REQ), 7), (wire.pack(wire.MSG_STATS_REQ), ("10.1.2.3", 9)),
                      (join(1, 0, 5, 2), 1), (join(1, 1, 6, 2), 2), (join(1, 0, 5, 2), 1), (join(1, 1, 6, 2), 2),
                      (join(9, 0, 6, 2), 3),
                      (wire.pack(wire.MSG_LEAVE, job=1, rank=1), 2)):
        assert core.process(data, src) == model.process(data, src)
    assert core.stats()["dropped"] == model.stats()["dropped"]
    assert model.stats()["dropped"]["not_control"] == 2  # neither a test port nor 10.1.2.3 is a control host


def punted(data) -> bool:
    """Whether the core hands this packet to the control plane (a control request that parses)."""
    try:
        return wire.unpack(data).msg_type in wire.CONTROL_REQUESTS
    except wire.WireError:
        return False


def write_replay(path, records, rounding, seed):
    """records: ("packet", data, src), ("admit", job, generation, session, first id, addresses), ("fail", job,
    code, rank, text) or ("boot", boot id): csrc/tests/replay.c's input"""
    with open(path, "wb") as f:
        f.write(struct.pack("<IIIQI", SLOTS, K, rounding == "deterministic", seed, len(JOBS)))
        for job, n in JOBS.items():
            f.write(struct.pack("<II", job, n))
        for r in records:
            if r[0] == "packet":
                f.write(struct.pack("<BIQ", 0, len(r[1]), r[2]) + r[1])
            elif r[0] == "fail":
                text = r[4].encode()
                f.write(struct.pack("<BIBBI", 2, r[1], r[2], r[3], len(text)) + text)
            elif r[0] == "boot":
                f.write(struct.pack("<BI", 3, r[1]))
            else:
                _, job, gen, session, first, addrs = r
                f.write(struct.pack("<BIQIII", 1, job, gen, session, first, len(addrs))
                        + struct.pack(f"<{len(addrs)}Q", *addrs))


def read_replay_output(path):
    """[(packet index, dst, bytes)] as printed by csrc/tests/replay.c"""
    out, buf = [], open(path, "rb").read()
    pos = 0
    while pos < len(buf):
        i, dst, n = struct.unpack_from("<IQI", buf, pos)
        pos += 16
        out.append((i, dst, buf[pos:pos + n]))
        pos += n
    return out


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")
def test_core_and_kernels_under_address_sanitizer(tmp_path):
    """The core and the kernels built with -fsanitize=address,undefined replay random traffic (and random
    kernel inputs) without a report, and the replayed core emits exactly what the model emits."""
    exe = tmp_path / "replay"
    subprocess.run(["gcc", "-std=gnu11", "-g", "-O1", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                    "-fno-omit-frame-pointer", "-I", CSRC, os.path.join(CSRC, "tests", "replay.c"),
                    os.path.join(CSRC, "ina_core.c"), os.path.join(CSRC, "ina_core_simd.c"), *KERNEL_SOURCES, "-lm", "-o", str(exe)],
                   check=True)
    for seed, rounding in ((11, "stochastic"), (12, "deterministic")):
        model, _, clock = switches(rounding, seed)
        # the packets, and the generations the control plane admitted and failed, in order
        records = [("boot", BOOT)]
        admit, fail = model.admit, model.fail

        def logged_admit(job, generation, session, first, addresses, elements=None, group=None):
            assert elements in (None, model.max_elements)  # the replay admits with the switch's maximum
            assert group is None  # addresses here are numbers, not loopback ports: a copy to each member
            records.append(("admit", job, generation, session, first, addresses))
            admit(job, generation, session, first, addresses, elements)

        def logged_fail(job, code, rank, text):  # the core's own fails (call mismatches) again: no change
            records.append(("fail", job, code, rank, text))
            return fail(job, code, rank, text)

        model.admit, model.fail = logged_admit, logged_fail
        gen = Traffic(seed, model, clock)
        send = gen.send
        gen.send = lambda data, src: (records.append(("packet", data, src)), send(data, src))
        log = gen.run(2000)
        write_replay(tmp_path / "in", records, rounding, seed)
        # the data plane's answers (control requests the core punts are the Python control plane's), each
        # ERR_DROPPED's text cut (the core's own words)
        want = [(i, dst, pkt) for i, (data, _, out, _) in enumerate(log) if not punted(data)
                for pkt, dst in untold_text(out, len(data))]
        for path in SIMD_PATHS:  # each lane path (one the CPU lacks falls back, and is checked again)
            env = {**os.environ, "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0", "INA_SWITCH_SIMD": path}
            run = subprocess.run([str(exe), str(tmp_path / "in"), str(tmp_path / "out")], capture_output=True,
                                 text=True, env=env, timeout=300)
            assert run.returncode == 0, run.stderr[-4000:]
            assert "ERROR" not in run.stderr and "runtime error" not in run.stderr, run.stderr[-4000:]
            got = [(i, dst, pkt) for i, dst, data in read_replay_output(tmp_path / "out")
                   for pkt, _ in untold_text([(data, dst)], len(log[i][0]))]
            assert got == want, path


# ---------------------------------------------------------------- kernels
def nc_inputs(rs, n):
    x = (rs.standard_normal(n) * np.exp2(rs.integers(-70, 60, n))).astype(np.float32)
    x[rs.random(n) < 0.05] = 0.0
    x[rs.random(n) < 0.02] = np.float32(1e-42)  # denormal
    x[rs.random(n) < 0.02] *= -1
    return x


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("floor", [wire.NC_LEVEL_MIN, -30, 0, 20])
def test_nc_encode_kernel_is_bit_identical_to_numpy(deterministic, floor):
    rs = np.random.default_rng(floor + 100 + 200 * deterministic)
    x = nc_inputs(rs, 20011)
    x = np.clip(x, -(2.0**62), 2.0**62).astype(np.float32)
    for seed, offset in ((0, 0), (7, 123456789), (2**64 - 1, 2**40)):
        codes, status = kernels.nc_encode(x, seed, offset, deterministic, floor)
        assert status == 0
        assert np.array_equal(codes, natural.encode_reference(x, seed, offset, deterministic, floor))
    # a slice keeps its own offset: element i of the stream depends only on offset + i
    whole, _ = kernels.nc_encode(x, 5, 1000, deterministic, floor)
    part, _ = kernels.nc_encode(x[300:700].copy(), 5, 1300, deterministic, floor)
    assert np.array_equal(part, whole[300:700])


def test_nc_kernel_errors_match_numpy():
    for bad, exc in ((np.float32(np.nan), ValueError), (np.float32(np.inf), ValueError),
                     (np.float32(2.0**64), OverflowError)):
        x = np.ones(100, np.float32)
        x[37] = bad
        with pytest.raises(exc) as native_error:
            natural.encode(x)
        with pytest.raises(exc) as numpy_error:
            natural.encode_reference(x, 0, 0, False, wire.NC_LEVEL_MIN)
        assert str(native_error.value) == str(numpy_error.value)


def test_nc_decode_and_fixed_kernels_match_numpy(monkeypatch):
    rs = np.random.default_rng(3)
    codes = rs.integers(0, 256, 5000).astype(np.uint8)
    codes[codes == 0x80] = 0
    values, status = kernels.nc_decode(codes)
    assert status == 0 and np.array_equal(values, natural._DECODE[codes].astype(np.float32))
    assert kernels.nc_decode(np.array([1, 0x80], np.uint8))[1] == kernels.BAD_CODE
    codec = fixed.FixedPointCodec()
    x = (rs.standard_normal(4099) * 3).astype(np.float32)
    x[:4] = [0.5, -0.5, 1.5, 2.5]  # ties round to even in both
    for exp, world in ((2, 2), (4, 3), (wire.EXP_NONE, 5), (-3, 64)):
        native_bytes = codec.encode(x, exp, world, 0, 0)
        monkeypatch.setenv("INA_KERNELS", "numpy")
        assert native_bytes == codec.encode(x, exp, world, 0, 0)
        monkeypatch.delenv("INA_KERNELS")
