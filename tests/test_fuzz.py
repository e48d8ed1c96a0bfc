"""Malformed and hostile packets never crash a switch; each is dropped and counted."""
import socket
import time

import numpy as np
from hypothesis import given, settings, strategies as st

from hostlib import wire
from switchsim.model import DROP_REASONS, Switch

from .test_e2e import run_workers


SESSION = 0x5E55


def admitted_switch(world, **kw):
    """A model switch whose job 1 is admitted: rank r sends from address r + 1 with SESSION."""
    sw = Switch({1: world}, **kw)
    sw.admit(1, 1, SESSION, 0, [r + 1 for r in range(world)])
    return sw


def valid_update(rank=0, count=8, codec=wire.CODEC_INT32, exp_cur=0, sparse=False):
    size = wire.ELEMENT_SIZE[codec]
    if sparse:  # a block-sparse round's packet: elements of block 3, next block 7
        return wire.pack_sparse(wire.MSG_SPARSE_UPDATE, 1, rank, count=count, codec=codec, exp_cur=exp_cur,
                                block=3 if count else wire.BLOCK_NONE, next_block=7, payload=bytes(count * size),
                                session=SESSION)
    return wire.pack(wire.MSG_UPDATE, job=1, rank=rank, count=count, codec=codec, exp_cur=exp_cur,
                     payload=bytes(count * size), session=SESSION)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_crash_the_model(data):
    sw = Switch({1: 2}, slots=4, max_elements=64)
    out = sw.process(data, ("127.0.0.1", 1))
    assert isinstance(out, list)
    assert sw.packets_in == 1


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_mutated_valid_packets_are_processed_or_counted(data):
    sw = admitted_switch(2, slots=4, max_elements=64)
    codec = data.draw(st.sampled_from([wire.CODEC_INT32, wire.CODEC_NC8]))
    pkt = bytearray(valid_update(count=8, codec=codec, exp_cur=10, sparse=data.draw(st.booleans())))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(pkt) - 1))
        pkt[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(pkt)))
    before = sum(sw.drops.values())
    out = sw.process(bytes(pkt[:cut]), 1)
    after = sum(sw.drops.values())
    # either the packet was dropped and counted (answered at most by an error: not a member, or the failed
    # generation's), or it was accepted (and then no drop was counted)
    job = sw.jobs[1]
    accepted = any(s.count for s in job.sets)
    results = [d for d, _ in out if wire.unpack(d).msg_type != wire.MSG_ERROR]
    assert (after == before + 1) != (accepted or bool(results))
    assert all(len(d) <= len(pkt[:cut]) for d, _ in out if wire.unpack(d).msg_type == wire.MSG_ERROR)


def test_invalid_nc_codes_are_dropped():
    sw = admitted_switch(1, slots=1, max_elements=8)
    exp = 0  # codes must lie in [2^-55, 2^0]
    for code in (0x80, 64 + 1, 1):  # negative zero, 2^1 > 2^exp, 2^-63 below the floor
        p = wire.pack(wire.MSG_UPDATE, job=1, count=1, codec=wire.CODEC_NC8, exp_cur=exp, payload=bytes([code]),
                      session=SESSION)
        assert sw.process(p, 1) == []
    assert sw.drops["bad_codes"] == 3
    ok = wire.pack(wire.MSG_UPDATE, job=1, count=1, codec=wire.CODEC_NC8, exp_cur=exp, payload=bytes([64]),
                   session=SESSION)
    assert len(sw.process(ok, 1)) == 1


def test_udp_server_survives_garbage_and_still_aggregates(switch_process):
    from switchsim.server import query_stats
    from hostlib.worker import parse_address

    sw = switch_process("--workers", 2)
    addr = parse_address(sw.address)
    rs = np.random.default_rng(0)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for i in range(300):
            if i % 3 == 0:
                s.sendto(rs.bytes(int(rs.integers(0, 100))), addr)
            elif i % 3 == 1:
                s.sendto(valid_update(count=8)[: int(rs.integers(1, 51))], addr)  # truncated
            else:
                s.sendto(bytes([wire.VERSION, wire.MSG_RESULT]) + rs.bytes(60), addr)  # wrong direction
    time.sleep(0.3)
    stats = query_stats(addr)
    assert stats["packets_in"] >= 250 and sum(stats["dropped"].values()) >= 250
    assert set(stats["dropped"]) == set(DROP_REASONS)
    xs = [np.arange(500), np.arange(500) * 2]
    outs, errors, _ = run_workers(sw.address, xs, "int32")
    assert errors == [None, None] and np.array_equal(outs[0], np.arange(500) * 3)
