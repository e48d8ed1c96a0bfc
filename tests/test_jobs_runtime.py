"""Jobs added and removed at run time (a shared switch, issue 55): the C core's add_job / remove_job against
the reference model's, packet for packet and counter for counter, and the core's freed memory under
AddressSanitizer."""
from __future__ import annotations

import os
import shutil
import struct
import subprocess

import numpy as np
import pytest

from hostlib import wire
from inaproto import net
from switchsim import model, native
from switchsim.config import SwitchConfig

from .conftest import ROOT

pytestmark = pytest.mark.skipif(not native.available(), reason="the C core is not built")

CSRC = os.path.join(ROOT, "csrc")
K = 64  # elements per packet
BOOT = 0x5EED


def session(job: int) -> int:
    return 0x1000 + job


def config() -> SwitchConfig:
    """A shared switch: no jobs at start, each job's slots given when it is added."""
    return SwitchConfig({}, slots=8, max_elements=K, shared=True, pool=32)


class Pair:
    """The model and the C core driven alike; every call's answer must be the same on both."""

    def __init__(self):
        self.model, self.core = model.Switch(config()), native.CoreSwitch(config())
        self.call("set_boot", BOOT)  # each control plane drew its own

    def call(self, name, *args):
        """The data plane call on both; its (equal) result."""
        want, got = getattr(self.model, name)(*args), getattr(self.core, name)(*args)
        assert got == want, name
        return want

    def raises(self, error, name, *args):
        """The call fails on both with the same error."""
        for sw in (self.model, self.core):
            with pytest.raises(error):
                getattr(sw, name)(*args)

    def send(self, data: bytes, src) -> list:
        """A packet into both; what they emit (equal)."""
        want, got = self.model.process(data, src), self.core.process(data, src)
        assert got == want, wire.unpack(data)
        return want

    def jobs(self) -> dict:
        """stats()["jobs"] with per-slot arrays, equal on both."""
        want, got = self.model.stats(per_slot=True)["jobs"], self.core.stats(per_slot=True)["jobs"]
        assert got == want
        return want


def addr(job: int, rank: int) -> tuple[str, int]:
    return "10.0.0.%d" % job, 5000 + rank


def admit(sw: Pair, job: int, world: int, generation=1, first_id=100):
    sw.call("admit", job, generation, session(job), first_id, [addr(job, r) for r in range(world)], None, None)


def values(job: int, rank: int, slot: int, pid: int) -> np.ndarray:
    return (np.arange(K, dtype=np.int64) * (rank + 1) + 1000 * job + 10 * slot + pid).astype(np.int32)


def update(job: int, rank: int, slot: int, set_: int, pid: int) -> bytes:
    return wire.pack(wire.MSG_UPDATE, job=job, rank=rank, packet_id=pid, slot=slot, set=set_, count=K,
                     codec=wire.CODEC_INT32, exp_cur=0, exp_next=0, session=session(job),
                     payload=values(job, rank, slot, pid).astype(">i4").tobytes())


def round_on(sw: Pair, job: int, world: int, slot: int, set_: int, pid: int):
    """Every rank's packet of one int32 round: the last one completes it, its sum to every rank."""
    for rank in range(world - 1):
        assert sw.send(update(job, rank, slot, set_, pid), addr(job, rank)) == []
    out = sw.send(update(job, world - 1, slot, set_, pid), addr(job, world - 1))
    assert sorted(dst for _, dst in out) == [addr(job, r) for r in range(world)]
    want = sum(values(job, r, slot, pid).astype(np.int64) for r in range(world))
    for data, _ in out:
        h = wire.unpack(data)
        assert (h.msg_type, h.job, h.slot, h.set, h.packet_id) == (wire.MSG_RESULT, job, slot, set_, pid)
        np.testing.assert_array_equal(wire.payload_view(data, h), want)


def rounds(sw: Pair, job: int, world: int, slots: int, first_id=100):
    """Two rounds on every slot of the job (set 0, then set 1)."""
    for slot in range(slots):
        for set_ in (0, 1):
            round_on(sw, job, world, slot, set_, first_id + set_)


def dropped(sw: Pair, reason: str) -> int:
    n = sw.model.stats()["dropped"][reason]
    assert sw.core.stats()["dropped"][reason] == n
    return n


def test_jobs_of_their_own_slot_counts_match_the_model():
    """Two jobs added at run time, 4 and 8 slots: each aggregates on its own slots alone (a slot past its
    count is bad_slot, told with its own count), and stats report each job's slots and arrays of that length."""
    sw = Pair()
    assert sw.jobs() == {}
    sw.call("add_job", 1, 2, 4)
    sw.call("add_job", 2, 3, 8, 4)  # base: the pooled P4 registers' offset, unused by these
    admit(sw, 1, 2)
    admit(sw, 2, 3)
    rounds(sw, 1, 2, 4)
    rounds(sw, 2, 3, 8)
    bad = dropped(sw, "bad_slot")
    told = sw.send(update(1, 0, 4, 0, 102), addr(1, 0))  # job 1 has 4 slots: 4 is past them
    assert len(told) == 1 and b"the job has 4 slots" in told[0][0]
    assert dropped(sw, "bad_slot") == bad + 1
    round_on(sw, 2, 3, 7, 0, 102)  # job 2's eighth slot
    jobs = sw.jobs()
    assert {j: (s["world_size"], s["slots"]) for j, s in jobs.items()} == {"1": (2, 4), "2": (3, 8)}
    assert [len(jobs[j]["per_slot"]["received"]) for j in ("1", "2")] == [4, 8]
    assert jobs["1"]["received"] == 4 * 2 * 2 and jobs["2"]["multicast"] == 8 * 2 + 1


def test_a_removed_job_is_unknown_and_can_come_back():
    """remove_job: the job's packets are then unknown_job (nothing answered), the other job goes on; the
    same id added again (another slot count, another world size) starts clean and works."""
    sw = Pair()
    sw.call("add_job", 1, 2, 4)
    sw.call("add_job", 2, 3, 8)
    admit(sw, 1, 2)
    admit(sw, 2, 3)
    rounds(sw, 1, 2, 4)
    sw.call("remove_job", 1)
    assert list(sw.jobs()) == ["2"]
    unknown = dropped(sw, "unknown_job")
    assert sw.send(update(1, 0, 0, 0, 102), addr(1, 0)) == []
    assert dropped(sw, "unknown_job") == unknown + 1
    rounds(sw, 2, 3, 8)
    sw.call("add_job", 1, 4, 2)
    jobs = sw.jobs()
    assert list(jobs) == ["2", "1"]  # the order added, as the model's dict
    assert jobs["1"]["slots"] == 2 and jobs["1"]["generation"] == 0
    assert all(sum(a) == 0 for a in jobs["1"]["per_slot"].values())
    admit(sw, 1, 4, generation=2, first_id=7)
    rounds(sw, 1, 4, 2, first_id=7)
    assert sw.send(update(1, 0, 2, 0, 9), addr(1, 0))  # slot 2: past its 2 slots now (told)
    assert sw.jobs()["1"]["multicast"] == 2 * 2
    assert sw.call("member_packets", 1) == [5, 4, 4, 4]  # rank 0's bad_slot packet was admitted, then refused


def test_removing_every_job_and_adding_many():
    """Jobs removed from the middle and the end, and more added after: the core's index of each moved job
    stays right (each one's packets reach its own slots)."""
    sw = Pair()
    for job in range(1, 7):
        sw.call("add_job", job, 2, job)
    for job in (3, 6, 1):
        sw.call("remove_job", job)
    for job in (2, 4, 5):
        admit(sw, job, 2)
        rounds(sw, job, 2, job)
    sw.call("add_job", 6, 2, 1)
    admit(sw, 6, 2)
    rounds(sw, 6, 2, 1)
    assert [(j, s["slots"]) for j, s in sw.jobs().items()] == [("2", 2), ("4", 4), ("5", 5), ("6", 1)]
    for job in (2, 4, 5, 6):
        sw.call("remove_job", job)
    assert sw.jobs() == {}


def test_unknown_and_twice_added_jobs_are_refused():
    """remove_job of a job not served is a KeyError, add_job of one served a ValueError, on both."""
    sw = Pair()
    sw.raises(KeyError, "remove_job", 9)
    sw.call("add_job", 9, 2, 4)
    sw.raises(ValueError, "add_job", 9, 2, 4)
    sw.call("remove_job", 9)
    sw.raises(KeyError, "remove_job", 9)
    sw.raises(KeyError, "admit", 9, 1, 1, 0, [addr(9, 0), addr(9, 1)], None, None)


def test_core_refuses_what_it_cannot_hold():
    """The core's own checks: a job id, world size or slot count out of range is a ValueError."""
    core = native.CoreSwitch(config())
    for args in ((1 << 16, 2, 4), (1, 0, 4), (1, wire.MAX_WORKERS + 1, 4), (1, 2, 0), (1, 2, wire.MAX_SLOTS + 1)):
        with pytest.raises(ValueError):
            core.add_job(*args)
    assert core.jobs == {} and core.stats()["jobs"] == {}


def test_shared_memory_ports_of_a_shared_switch():
    """A shared switch has no jobs to size its shared-memory ports by: it opens native.SHARED_PORTS."""
    core = native.CoreSwitch(config())
    name = f"jobs-runtime-{os.getpid()}"
    try:
        server = native.CShmServer(core, name)
    except OSError as e:
        pytest.skip(f"no shared memory here: {e}")
    try:
        with open(f"/dev/shm/ina-{name}", "rb") as f:  # the segment's header: u64 magic, u32 ports
            assert struct.unpack("<QI", f.read(12))[1] == native.SHARED_PORTS
    finally:
        server.close()


# ---------------------------------------------------------------- the core under AddressSanitizer
def replay_input(records) -> bytes:
    """csrc/tests/replay.c's input for a switch of no jobs at start: ("add", job, world, slots),
    ("remove", job), ("admit", job, world) or ("packet", data, src)."""
    out = [struct.pack("<IIIQI", 8, K, 0, 1, 0), struct.pack("<BI", 3, BOOT)]
    for r in records:
        if r[0] == "add":
            out.append(struct.pack("<BIII", 4, *r[1:]))
        elif r[0] == "remove":
            out.append(struct.pack("<BI", 5, r[1]))
        elif r[0] == "admit":
            ids = [net.address_id(*addr(r[1], rank)) for rank in range(r[2])]
            out.append(struct.pack("<BIQIII", 1, r[1], 1, session(r[1]), 100, r[2]) + struct.pack(f"<{r[2]}Q", *ids))
        else:
            out.append(struct.pack("<BIQ", 0, len(r[1]), net.address_id(*r[2])) + r[1])
    return b"".join(out)


def replay_output(data: bytes) -> list:
    out, pos = [], 0
    while pos < len(data):
        i, dst, n = struct.unpack_from("<IQI", data, pos)
        out.append((i, dst, data[pos + 16:pos + 16 + n]))
        pos += 16 + n
    return out


def traffic() -> list:
    """Jobs added, used, removed while their rounds are half done, used as strangers, added again."""
    r = [("add", 1, 2, 4), ("add", 2, 3, 8), ("admit", 1, 2), ("admit", 2, 3)]
    for job, world, slots in ((1, 2, 4), (2, 3, 8)):
        r += [("packet", update(job, rank, s, 0, 100), addr(job, rank)) for s in range(slots + 1) for rank in
              range(world)]
    r += [("packet", update(1, 0, s, 1, 101), addr(1, 0)) for s in range(4)]  # half done
    r += [("remove", 1), ("remove", 2)]
    r += [("packet", update(j, 0, 0, 1, 101), addr(j, 0)) for j in (1, 2)]
    r += [("add", 2, 2, 2), ("admit", 2, 2), ("add", 1, 3, 16), ("admit", 1, 3), ("remove", 2)]
    r += [("packet", update(1, rank, 15, 0, 100), addr(1, rank)) for rank in range(3)]
    return r


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")
def test_removed_jobs_under_address_sanitizer(tmp_path):
    """The core built with -fsanitize=address,undefined adds and removes jobs mid-round without a report
    (no freed slot read, nothing leaked), emitting what the in-process core emits."""
    exe = tmp_path / "replay"
    sources = ["tests/replay.c", "ina_core.c", "ina_core_simd.c", "ina_kernels.c", "ina_kernels_avx2.c",
               "ina_kernels_avx512.c"]
    subprocess.run(["gcc", "-std=gnu11", "-g", "-O1", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                    "-fno-omit-frame-pointer", "-I", CSRC, *(os.path.join(CSRC, s) for s in sources), "-lm", "-o",
                    str(exe)], check=True)
    records = traffic()
    (tmp_path / "in").write_bytes(replay_input(records))
    env = {**os.environ, "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0"}
    run = subprocess.run([str(exe), str(tmp_path / "in"), str(tmp_path / "out")], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0 and "ERROR" not in run.stderr, run.stderr[-4000:]
    core, want, index = native.CoreSwitch(config()), [], 0
    core.set_boot(BOOT)
    for r in records:
        if r[0] == "packet":
            want += [(index, net.address_id(*dst), data) for data, dst in core.process(r[1], r[2])]
            index += 1
        elif r[0] == "admit":
            core.admit(r[1], 1, session(r[1]), 100, [addr(r[1], rank) for rank in range(r[2])])
        else:
            getattr(core, r[0] + "_job")(*r[1:])
    assert replay_output((tmp_path / "out").read_bytes()) == want
    assert len(want) > 20
