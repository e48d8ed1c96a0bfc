"""A shared BMv2 switch's jobs come and go (issue 55): BMv2Server.add_job / admit / remove_job called as the
control plane calls them, checked with real packets through the switch's veth. One server for every check
(BMv2 takes seconds to start): a job at base 8 sums exactly; removed, its packets drop as unknown_job; a job
added later on the same cells (another session) sums exactly from clean state, its counters from zero."""
from __future__ import annotations

import select
import socket
import threading
import time

import numpy as np
import pytest

from inaproto import wire
from switchsim.config import SwitchConfig

K = 64  # the program's lanes


def missing() -> str:
    from switchsim import bmv2

    return bmv2.why_not()


pytestmark = pytest.mark.skipif(bool(missing()), reason=missing() or "-")


class Worker:
    """A UDP socket on the host end of the switch's veth (the kernel picks the source address)."""

    def __init__(self, server):
        self.server, self.sock = server, socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("0.0.0.0", 0))
        self.address = (server.ns.worker_ip, self.sock.getsockname()[1])

    def send(self, data: bytes):
        self.sock.sendto(data, self.server.address)

    def recv(self, timeout: float = 2.0) -> bytes | None:
        if not select.select([self.sock], [], [], timeout)[0]:
            return None
        return self.sock.recv(65536)

    def introduce(self):
        """A stats request (the namespace's worker end is a control host): its packet-in teaches the switch
        this socket's MAC and port, as a join would; the answer says it arrived."""
        for _ in range(20):  # the first packet waits for ARP
            self.send(wire.pack(wire.MSG_STATS_REQ))
            got = self.recv(0.5)
            if got is not None and got[1] == wire.MSG_STATS:
                return
        raise TimeoutError("the switch did not answer a stats request")


@pytest.fixture(scope="module")
def shared():
    """A shared BMv2 switch (pool 32, quota 8) serving in a thread, and two workers it knows."""
    from switchsim.bmv2 import BMv2Server

    server = BMv2Server(SwitchConfig({}, slots=8, max_elements=K, shared=True, pool=32))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    workers = []
    try:
        workers = [Worker(server), Worker(server)]
        for w in workers:
            w.introduce()
        yield server, workers
    finally:
        server.stop()
        thread.join(5)
        server.close()
        for w in workers:
            w.sock.close()


def update(job: int, rank: int, session: int, pid: int, slot: int, lanes) -> bytes:
    return wire.pack(wire.MSG_UPDATE, job=job, rank=rank, packet_id=pid, slot=slot, set=pid & 1, count=len(lanes),
                     codec=wire.CODEC_INT32, exp_cur=0, exp_next=0, payload=np.asarray(lanes, ">i4").tobytes(),
                     session=session)


def round_sums(workers, job: int, session: int, pid: int, slot: int, xs) -> list[np.ndarray]:
    """Each rank sends its lanes of round `pid` on `slot`; the result each rank gets (checked a result)."""
    for r, w in enumerate(workers):
        w.send(update(job, r, session, pid, slot, xs[r]))
    out = []
    for w in workers:
        data = w.recv()
        assert data is not None, f"job {job}: no result of round {pid} on slot {slot}"
        h = wire.unpack(data)
        assert (h.msg_type, h.job, h.packet_id, h.session) == (wire.MSG_RESULT, job, pid, session), h
        out.append(np.frombuffer(data[wire.HEADER_SIZE:], ">i4"))
    return out


def check_rounds(workers, job: int, session: int, rounds, seed: int):
    """Rounds (packet id, slot) of random int32 lanes: every rank gets the exact sum."""
    rs = np.random.default_rng(seed)
    for pid, slot in rounds:
        xs = [rs.integers(-2**20, 2**20, K) for _ in workers]
        for got in round_sums(workers, job, session, pid, slot, xs):
            assert np.array_equal(got, np.sum(xs, axis=0)), (job, pid, slot)


def test_jobs_come_and_go_on_shared_cells(shared):
    server, workers = shared
    addresses = [w.address for w in workers]
    server.add_job(7, 2, 8, base=8)
    with pytest.raises(ValueError):
        server.add_job(7, 2, 8, base=16)  # served already
    with pytest.raises(ValueError):
        server.add_job(8, 2, 8, base=12)  # on job 7's slots
    server.admit(7, 1, 0x1111, 0, addresses)
    check_rounds(workers, 7, 0x1111, [(0, 3), (0, 4), (1, 3)], seed=1)
    workers[0].send(update(7, 0, 0x1111, 0, 5, [1] * K))  # an open round left on the cells: half of slot 5's
    time.sleep(0.2)
    job = server.stats(per_slot=True)["jobs"]["7"]
    assert (job["world_size"], job["slots"], job["received"]) == (2, 8, 7)
    assert job["per_slot"]["received"] == [0, 0, 0, 4, 2, 1, 0, 0]
    assert server.member_packets(7) == [4, 3]

    dropped = server.stats()["dropped"]["unknown_job"]
    server.remove_job(7)
    with pytest.raises(KeyError):
        server.remove_job(7)
    assert "7" not in server.stats()["jobs"]
    workers[1].send(update(7, 1, 0x1111, 0, 5, [1] * K))
    assert workers[1].recv(0.3) is None
    assert server.stats()["dropped"]["unknown_job"] == dropped + 1

    # on job 7's cells (slots, members, job index) with another session: rounds that would be resends of job 7's
    # results, or complete job 7's open round, if its state were not clean; counters and liveness from zero
    server.add_job(9, 2, 8, base=8)
    server.add_job(5, 2, 16, base=16)  # a second job beside it, of its own size
    jobs = server.stats(per_slot=True)["jobs"]
    assert {j: (s["slots"], s["received"], len(s["per_slot"]["received"])) for j, s in jobs.items()} == \
        {"9": (8, 0, 8), "5": (16, 0, 16)}
    assert server.member_packets(9) == [0, 0]
    server.admit(9, 1, 0x2222, 0, addresses)
    server.admit(5, 1, 0x3333, 0, addresses)
    check_rounds(workers, 9, 0x2222, [(0, 3), (0, 5), (1, 3), (0, 4)], seed=2)
    check_rounds(workers, 5, 0x3333, [(0, 15)], seed=3)
    jobs = server.stats(per_slot=True)["jobs"]
    assert jobs["9"]["per_slot"]["received"] == [0, 0, 0, 4, 2, 2, 0, 0]
    assert jobs["5"]["per_slot"]["received"][15] == jobs["5"]["received"] == 2
    assert server.member_packets(9) == [4, 4]
    server.remove_job(9)
    server.remove_job(5)
    assert server.stats()["jobs"] == {}
