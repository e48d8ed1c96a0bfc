"""Results to a group (wire.FLAG_GROUP, docs/protocol.md "Results to a group"): a switch bound on loopback sends a
completed round's result once to the job's group when every rank asked for it from loopback; resends and errors
stay unicast; the model and the C core agree byte for byte; workers take results from either socket."""
from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from hostlib import worker as worker_mod
from inaproto import net, wire
from switchsim import native
from switchsim.model import Switch

from .conftest import confirmed_join
from .test_e2e import run_workers

GROUP = ("239.255.0.1", 5000)
SESSION = 0x5E55


def _update(rank, values, slot=0, packet_id=0, call_len=None):
    return wire.pack(wire.MSG_UPDATE, job=1, rank=rank, packet_id=packet_id, slot=slot, set=packet_id & 1,
                     count=len(values), codec=wire.CODEC_INT32, payload=np.asarray(values, ">i4").tobytes(),
                     session=SESSION, call_kind=1, call=0, call_len=call_len or len(values))


def _switches(world, group):
    model = Switch({1: world}, slots=8, first_packet_id=0)
    core = native.CoreSwitch({1: world}, slots=8, first_packet_id=0)
    for sw in (model, core):
        sw.set_boot(0xB007)
        sw.admit(1, 1, SESSION, 0, [("127.0.0.1", 40000 + r) for r in range(world)], None, group)
    return model, core


@pytest.mark.parametrize("group", [GROUP, None], ids=["group", "unicast"])
def test_model_and_core_send_a_completed_round_once_to_the_group_and_resend_by_unicast(group):
    native.require()
    world = 4
    model, core = _switches(world, group)
    rs = np.random.default_rng(7)
    xs = [rs.integers(-1000, 1000, 64) for _ in range(world)]
    packets = [(_update(r, xs[r]), ("127.0.0.1", 40000 + r)) for r in range(world)]
    packets.append(packets[2])  # rank 2 again after completion: a resend to rank 2 alone
    for data, src in packets[:world - 1]:
        assert model.process(data, src) == [] and core.process(data, src) == []
    done = model.process(*packets[world - 1])
    assert done == core.process(*packets[world - 1])
    if group:
        [(data, dst)] = done
        h = wire.unpack(data)
        assert dst == GROUP and h.rank == wire.NO_RANK and h.flags & wire.FLAG_GROUP
    else:
        assert [dst for _, dst in done] == [("127.0.0.1", 40000 + r) for r in range(world)]
        assert not any(wire.unpack(d).flags & wire.FLAG_GROUP for d, _ in done)
    assert np.array_equal(wire.payload_view(done[0][0], wire.unpack(done[0][0])), np.sum(xs, axis=0))
    resent = model.process(*packets[world])
    assert resent == core.process(*packets[world])
    [(data, dst)] = resent
    h = wire.unpack(data)
    assert dst == ("127.0.0.1", 40002) and h.rank == 2 and not h.flags & wire.FLAG_GROUP
    assert data[wire.HEADER_SIZE:] == done[0][0][wire.HEADER_SIZE:]


def _join(sw, rank, world, src, group=True):
    return confirmed_join(sw.process, wire.pack_join(1, rank, 100 + rank, world, 16, group=group), src)


@pytest.mark.parametrize("case", ["all", "one_without", "off_host", "keyed", "no_port"])
def test_the_control_plane_names_the_group_only_when_every_rank_asks_from_loopback(case):
    world = 3
    keys = {1: b"k" * 16} if case == "keyed" else {}
    sw = Switch({1: world}, keys=keys)
    sw.control.group_port = None if case == "no_port" else 5000
    for r in range(world):
        host = "10.0.0.9" if case == "off_host" and r == 1 else "127.0.0.1"
        src = (host, 40000 + r)
        if keys:
            from inaproto import auth
            mac = auth.join_mac(keys[1], 1, r, 100 + r, world, 16)
            join = wire.pack_join(1, r, 100 + r, world, 16, mac, group=True)
            confirmed_join(sw.process, join, src)
        else:
            _join(sw, r, world, src, group=not (case == "one_without" and r == 2))
    stats = sw.stats()["jobs"]["1"]
    assert stats["generation"] == 1
    assert stats["group"] == ("239.255.0.1:5000" if case == "all" else None)


def _switch_bytes_out(switch_process, monkeypatch, group: bool, n=4, size=120_000, **args):
    """The switch's bytes out for two int32 calls of n ranks, less its unicast resends (a slow switch resends
    many: the ranks' timers), and the job's group as its stats name it."""
    monkeypatch.setenv("INA_GROUP", "1" if group else "0")
    sw = switch_process("--workers", n, *[a for kv in args.items() for a in (f"--{kv[0]}", kv[1])])
    rs = np.random.default_rng(n)
    xs = [rs.integers(-(2**20), 2**20, size).astype(np.int32) for _ in range(n)]
    outs, errors, stats = run_workers(sw.address, xs, "int32", calls=2, timeout=30)
    assert errors == [None] * n
    exact = np.sum(np.array(xs, dtype=np.int64), axis=0)
    assert all(np.array_equal(o, exact) for o in outs)
    report = sw.stop_stats()
    job = report["jobs"]["1"]
    result = wire.HEADER_SIZE + 4 * 256  # int32's default packet: 256 elements
    return report["bytes_out"] - job["resent"] * result, job["group"]


def test_workers_take_their_results_from_the_group_and_the_switch_sends_a_quarter(switch_process, monkeypatch):
    """Over UDP on loopback (python and C switches) the job's results go once to the group; with $INA_GROUP=0
    (the workers do not ask) a copy to each: four times the bytes. DPDK's switch is not on loopback: unicast."""
    grouped, where = _switch_bytes_out(switch_process, monkeypatch, True)
    unicast, none = _switch_bytes_out(switch_process, monkeypatch, False)
    assert none is None
    if where is None:  # the DPDK switch serves a veth, not loopback
        assert 0.9 < grouped / unicast < 1.1
        return
    assert where.startswith("239.255.0.1:")
    assert 0.2 < grouped / unicast < 0.3, (grouped, unicast)


def test_group_results_stay_exact_under_loss_duplication_and_reordering(switch_process, monkeypatch):
    """A lost group copy is lost for every member at once; each asks again and gets it by unicast."""
    _, where = _switch_bytes_out(switch_process, monkeypatch, True, n=3, size=20_000, loss=0.05, dup=0.05,
                                 reorder=0.05, seed=3)
    assert where is None or where.startswith("239.255.")


def test_a_rank_without_the_group_makes_the_switch_send_each_rank_its_copy(switch_process, monkeypatch):
    opened = worker_mod.open_group
    monkeypatch.setattr(worker_mod, "open_group", lambda shm, address, job, rank, key:
                        None if rank == 3 else opened(shm, address, job, rank, key))
    sw = switch_process("--workers", 4)
    xs = [np.full(5000, r + 1, dtype=np.int32) for r in range(4)]
    outs, errors, _ = run_workers(sw.address, xs, "int32", timeout=30)
    assert errors == [None] * 4 and all(np.array_equal(o, np.full(5000, 10)) for o in outs)
    assert sw.stop_stats()["jobs"]["1"]["group"] is None


def test_the_group_socket_takes_only_the_switchs_datagrams():
    """The worker's group socket is connected to the switch: a stranger's datagram to the group never reaches
    it, the switch's does; a switch address off loopback gets no group socket."""
    switch = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    switch.bind(("127.0.0.1", 0))
    net.group_sender(switch)
    port = switch.getsockname()[1]
    group = net.open_group(("127.0.0.1", port), 7, 0)
    stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        assert group is not None, "this host does not deliver multicast on lo"
        stranger.bind(("127.0.0.1", 0))
        net.group_sender(stranger)
        stranger.sendto(b"forged result", net.job_group(7, port))
        switch.sendto(b"the switch's", net.job_group(7, port))
        deadline, got = time.monotonic() + 2, []
        while time.monotonic() < deadline and not got:
            try:
                got.append(group.recv(100))
            except BlockingIOError:
                time.sleep(0.01)
        time.sleep(0.05)
        try:
            got.append(group.recv(100))
        except BlockingIOError:
            pass
        assert got == [b"the switch's"]
    finally:
        for s in (switch, group, stranger):
            if s is not None:
                s.close()
    assert net.open_group(("10.1.2.3", port), 7, 0) is None
    assert net.job_group(0x1234, 9) == ("239.255.18.52", 9)


def test_a_keyed_job_or_ina_group_0_asks_for_no_group(monkeypatch):
    """The worker asks only where the switch is on loopback, the job has no key and $INA_GROUP is not 0."""
    assert worker_mod.open_group(None, ("127.0.0.1", 9), 1, 0, b"k" * 16) is None
    assert worker_mod.open_group("name", ("shm", 0), 1, 0, None) is None
    monkeypatch.setenv("INA_GROUP", "0")
    assert worker_mod.open_group(None, ("127.0.0.1", 9), 1, 0, None) is None
    monkeypatch.delenv("INA_GROUP")
    g = worker_mod.open_group(None, ("127.0.0.1", 9), 1, 0, None)
    assert g is not None
    g.close()
