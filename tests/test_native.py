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
from hostlib.codecs import fixed, natural
from switchsim import native
from switchsim.model import Switch

from .conftest import ROOT

CSRC = os.path.join(ROOT, "csrc")


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
                 "NC_LEVEL_MIN", "NC_LEVEL_MAX", "NC_SPAN", "MAX_WORKERS", "HEADER_SIZE", "POOL_SET_BIT",
                 "POOL_RESERVED_BIT", "POOL_SLOT_MASK", "MAX_SLOTS", "BLOCK_EXT_SIZE", "BLOCK_NONE"):
        assert d[f"INA_{name}"] == getattr(wire, name), name
    for code, name in wire.MSG_NAMES.items():
        assert d[f"INA_MSG_{name.upper()}"] == code
    for code, name in wire.CODEC_NAMES.items():
        assert d[f"INA_CODEC_{name.upper()}"] == code
    assert d["INA_MSG_COUNT"] == len(wire.MSG_NAMES)
    assert d["INA_JOIN_PAYLOAD_SIZE"] == wire.JOIN_PAYLOAD.size
    assert d["INA_JOIN_ACK_PAYLOAD_SIZE"] == wire.JOIN_ACK_PAYLOAD.size
    # field offsets: pack a header with distinct bytes and read each field where the C header says it is
    pkt = wire.pack(wire.MSG_JOIN_WAIT, job=0x0102, rank=3, packet_id=0x04050607, slot=0x0809, set=1,
                    count=0x0A0B, codec=12, exp_cur=13, exp_next=14, flags=15)
    assert pkt[d["INA_OFF_VERSION"]] == wire.VERSION and pkt[d["INA_OFF_TYPE"]] == wire.MSG_JOIN_WAIT
    assert pkt[d["INA_OFF_CODEC"]] == 12 and pkt[d["INA_OFF_FLAGS"]] == 15 and pkt[d["INA_OFF_RANK"]] == 3
    assert pkt[d["INA_OFF_JOB"]:][:2] == b"\x01\x02" and pkt[d["INA_OFF_PACKET_ID"]:][:4] == b"\x04\x05\x06\x07"
    assert pkt[d["INA_OFF_POOL"]:][:2] == b"\x88\x09" and pkt[d["INA_OFF_COUNT"]:][:2] == b"\x0a\x0b"
    assert pkt[d["INA_OFF_EXP_CUR"]] == 13 and pkt[d["INA_OFF_EXP_NEXT"]] == 14


# ---------------------------------------------------------------- random traffic
JOBS = {1: 3, 4: 2}
SLOTS, K = 4, 16


def traffic(seed: int, n: int = 3000) -> list[tuple[bytes, int]]:
    """Packets as a worker population would send them, plus the faults a network and buggy peers add:
    stale ids, wrong exponents, invalid codes, truncation, bit flips, duplicates, reordering, joins."""
    rs = np.random.default_rng(seed)
    out, rounds = [], {}
    for _ in range(n):
        job = int(rs.choice([1, 4])) if rs.random() < 0.95 else int(rs.choice([9, int(rs.integers(0, 65536))]))
        world = JOBS.get(job, 2)
        rank = int(rs.integers(0, world + (rs.random() < 0.03)))
        src = 100 * job + rank
        kind = rs.random()
        if kind < 0.03:
            world_claim = world if rs.random() < 0.9 else world + 1
            nonce = int(rs.integers(0, 3))
            out.append((wire.pack(wire.MSG_JOIN, job, rank, payload=wire.JOIN_PAYLOAD.pack(nonce, world_claim)), src))
            continue
        pid = int(rs.integers(0, 12))  # few rounds, so sets are reused, completed and resent
        slot, set_ = pid % SLOTS, (pid // SLOTS) & 1
        if rs.random() < 0.02:
            slot = int(rs.integers(0, SLOTS + 2))
        # every rank of a round agrees on codec, count and exponent, except for a few deviants
        if (job, pid) not in rounds or rs.random() < 0.03:
            rounds[(job, pid)] = (int(rs.choice([wire.CODEC_INT32, wire.CODEC_NC8])),
                                  int(rs.choice([K, K, K, K, 5, 0, K + 1])),
                                  int(rs.choice([wire.EXP_NONE, 0, 3, 40, 63, 70, 127, -100])),
                                  rs.random() < 0.2, rs.random() < 0.3, int(rs.integers(0, 4)))
        codec, count, exp_cur, big, sparse, block = rounds[(job, pid)]
        if sparse and rs.random() < 0.4:
            count = 0  # a worker that does not hold the round's block
        if codec == wire.CODEC_INT32:
            vals = rs.integers(-(2**31), 2**31, count) if big else rs.integers(-1000, 1000, count)
            payload = vals.astype(">i4").tobytes()
        else:
            floor = wire.nc_floor(exp_cur) if exp_cur != wire.EXP_NONE else wire.NC_LEVEL_MIN
            top = min(exp_cur, wire.NC_LEVEL_MAX) if exp_cur != wire.EXP_NONE else wire.NC_LEVEL_MIN - 1
            if top >= floor:
                lv = rs.integers(max(floor, top - 3) if rs.random() < 0.5 else floor, top + 1, count)
                codes = (lv + wire.NC_BIAS).astype(np.uint8) | (rs.integers(0, 2, count) << 7).astype(np.uint8)
                codes[rs.random(count) < 0.3] = 0
            else:
                codes = np.zeros(count, np.uint8)
            if rs.random() < 0.05 and count:
                codes[int(rs.integers(0, count))] = int(rs.choice([0x80, 0x7F, 0x01, 0xC0]))  # mostly invalid
            payload = codes.tobytes()
        if sparse:  # block-sparse round: the holders' next blocks mostly lie after the round's block
            nxt = int(rs.choice([block + 1, block + 2, block + 3, wire.BLOCK_NONE, block, block - 1, 0]))
            if not count:
                nxt = int(rs.choice([block + 1, block + 3, wire.BLOCK_NONE, block]))
            data = wire.pack_sparse(wire.MSG_SPARSE_UPDATE, job, rank, pid, min(slot, wire.MAX_SLOTS - 1), set_,
                                    count, codec, exp_cur, int(rs.integers(-128, 128)), 0,
                                    block if count else wire.BLOCK_NONE, nxt & 0xFFFFFFFF, payload)
        else:
            data = wire.pack(wire.MSG_UPDATE, job, rank, pid, min(slot, wire.MAX_SLOTS - 1), set_, count, codec,
                             exp_cur, int(rs.integers(-128, 128)), 0, payload)
        fault = rs.random()
        if fault < 0.03:
            data = data[: int(rs.integers(0, len(data)))]
        elif fault < 0.06:
            b = bytearray(data)
            b[int(rs.integers(0, min(len(b), 32)))] ^= 1 << int(rs.integers(0, 8))
            data = bytes(b)
        elif fault < 0.07:
            data = wire.pack(int(rs.choice([wire.MSG_RESULT, wire.MSG_JOIN_ACK, wire.MSG_ERROR])), job, rank)
        out.append((data, src))
        if rs.random() < 0.05:
            out.append((data, src))  # duplicate
        if rs.random() < 0.05 and len(out) > 2:
            out[-1], out[-2] = out[-2], out[-1]  # reorder
    return out


@pytest.mark.parametrize("rounding", ["stochastic", "deterministic"])
@pytest.mark.parametrize("seed", range(4))
def test_core_matches_model_packet_for_packet(seed, rounding):
    model = Switch(JOBS, slots=SLOTS, max_elements=K, nc_rounding=rounding, seed=seed)
    core = native.CoreSwitch(JOBS, slots=SLOTS, max_elements=K, nc_rounding=rounding, seed=seed)
    emitted, sparse_blocks, sparse_empty = 0, 0, 0
    for i, (data, src) in enumerate(traffic(seed)):
        want, got = model.process(data, src), core.process(data, src)
        assert got == want, f"packet {i}: {data.hex()}"
        emitted += len(want)
        for pkt, _ in want:
            if pkt[1] == wire.MSG_SPARSE_RESULT:
                h = wire.unpack(pkt)
                sparse_blocks += h.count > 0
                sparse_empty += h.count == 0
    assert core.stats(per_slot=True) == model.stats(per_slot=True)
    stats = model.stats()
    # the traffic reaches every branch worth comparing
    assert emitted > 200 and stats["overflows"] > 0 and all(stats["dropped"].values())
    assert stats["jobs"]["1"]["resent"] > 0 and stats["jobs"]["4"]["multicast"] > 0
    assert sparse_blocks > 20 and sparse_empty > 5  # block-sparse rounds, with and without elements


def test_core_answers_stats_requests_like_the_model():
    model, core = Switch({1: 2}), native.CoreSwitch({1: 2})
    req = wire.pack(wire.MSG_STATS_REQ)
    assert core.process(req, 7) == model.process(req, 7)


def write_replay(path, packets, rounding, seed):
    with open(path, "wb") as f:
        f.write(struct.pack("<IIIQI", SLOTS, K, rounding == "deterministic", seed, len(JOBS)))
        for job, n in JOBS.items():
            f.write(struct.pack("<II", job, n))
        for data, src in packets:
            f.write(struct.pack("<IQ", len(data), src) + data)


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
                    os.path.join(CSRC, "ina_core.c"), os.path.join(CSRC, "ina_kernels.c"), "-lm", "-o", str(exe)],
                   check=True)
    for seed, rounding in ((11, "stochastic"), (12, "deterministic")):
        packets = traffic(seed, 2000)
        write_replay(tmp_path / "in", packets, rounding, seed)
        run = subprocess.run([str(exe), str(tmp_path / "in"), str(tmp_path / "out")], capture_output=True, text=True,
                             env={**os.environ, "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0"}, timeout=300)
        assert run.returncode == 0, run.stderr[-4000:]
        assert "ERROR" not in run.stderr and "runtime error" not in run.stderr, run.stderr[-4000:]
        model = Switch(JOBS, slots=SLOTS, max_elements=K, nc_rounding=rounding, seed=seed)
        want = [(i, src, pkt) for i, (data, s) in enumerate(packets) for pkt, src in model.process(data, s)]
        assert read_replay_output(tmp_path / "out") == want


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
