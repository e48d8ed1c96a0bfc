"""A leaf switch for two-level aggregation (beyond SwitchML's single rack; ATP-style hierarchies do this):
it aggregates its own workers slot by slot like any switch, but a completed round goes up to a parent (root)
switch as this leaf's rank there, and the root's result comes down through the leaf to its workers.

The leaf keeps no timer: its workers' retransmissions drive recovery end to end, as in SwitchML. A worker
that re-sends into a round still waiting for the root makes the leaf re-send its partial sum up (the root
answers a duplicate of a completed round with its stored result); a worker that re-sends after the result
came down gets it from the leaf, like from any switch. So int32 stays exact under loss on every link.

What goes up is the round's partial sum in the round's codec. int32 goes as is (an overflow of the partial
is flagged in the workers' result). NC is re-compressed by the leaf, and this is where the code table
decides: a block's table holds the levels up to its agreed exponent e (no worker's value is larger), and
the root rejects anything above (bad_codes), but a partial sum of k workers reaches e + log2 k. So the leaf
moves its partial into the table of e + NC_HEADROOM (6 levels: a partial of up to MAX_WORKERS = 64
workers fits) and rounds it there: the division by 2^(floor shift) and the power-of-two rounding are both
stochastic and unbiased, and the table's span of NC_SPAN levels loses its lowest 6 on the way up. The root
sums those codes and rounds once more (its own stream); its result comes down unchanged, so every worker of
every leaf gets the same codes. Dense rounds only: a leaf drops block-sparse packets (mismatch).

A leaf serves one job, whose slots are its uplink's window; packet ids are mapped between the leaf's
generation and the root's (both count uses of a slot from their own first id). The uplink joins once: a new
generation of the leaf's workers keeps the root's.
"""
from __future__ import annotations

import select
import socket

import numpy as np

from hostlib import join
from hostlib.generation import Link
from hostlib.worker import CommStats, Communicator
from inaproto import nc, rng, wire

from .model import Switch

NC_HEADROOM = (wire.MAX_WORKERS - 1).bit_length()  # levels a partial sum may climb above its block's exponent


class Uplink(Communicator):
    """The leaf's membership in the root's job: the join barrier of hostlib's Communicator, run from the
    leaf's own switch socket (the root admits a rank only from the address it joined from)."""

    def __init__(self, sock: socket.socket, root: tuple[str, int], rank: int, leaves: int, job: int,
                 window: int, timeout: float, key: bytes | None = None):
        self.sock, self.address = sock, root
        self.switch = f"{root[0]}:{root[1]}"  # how the worker's errors name the switch (the root)
        self.rank, self.world_size, self.job, self.key = rank, leaves, job, key
        self.stats, self.link, self.gen, self.group = CommStats(), Link(), None, None
        self._buf = bytearray(65536)
        self.chan = self  # its own channel: the leaf's switch socket
        self.gen = join.join(self, window, timeout)  # its session, window, elements per packet, first packet id

    def send(self, data: bytes):
        self.sock.sendto(data, self.address)

    def wait(self, seconds: float):
        select.select([self.sock], [], [], max(0.0, seconds))

    def recv(self):
        """The root's datagrams only: a worker that joins the leaf early is heard again later."""
        while True:
            try:
                n, src = self.sock.recvfrom_into(self._buf)
            except (BlockingIOError, InterruptedError):
                return None
            except ConnectionRefusedError:
                return b""
            if src == self.address:
                return bytes(self._buf[:n])


class LeafSwitch(Switch):
    """The reference model with its completions sent up to the root and the root's results sent down."""

    def __init__(self, config, uplink: Uplink, **kw):
        super().__init__(config, **kw)
        if list(self.jobs) != [uplink.job]:
            raise ValueError(f"a leaf serves exactly its uplink's job ({uplink.job}), not {sorted(self.jobs)}")
        self.uplink = uplink
        self.up_sent = self.up_resent = self.down = 0

    def process(self, data, src):
        if src == self.uplink.address:
            self.packets_in += 1
            out = self._from_root(data)
            self.packets_out += len(out)
            return out
        return super().process(data, src)

    def _up_id(self, job, packet_id: int) -> int:
        return (packet_id - job.first_id + self.uplink.gen.first_id) & wire.PACKET_ID_MASK

    def _update(self, h, data, src):
        if h.msg_type == wire.MSG_SPARSE_UPDATE:
            return self._drop("mismatch")
        return super()._update(h, data, src)

    def _complete(self, job, h, st):
        """Every local worker contributed: the partial sum goes up (congested if a local contribution was); the
        round completes when the root answers."""
        exp = st.exp_cur
        if st.codec == wire.CODEC_INT32:
            self._finish(st)
            payload = st.result
        else:
            exp, payload = self._nc_partial(st)
        st.up = wire.pack(wire.MSG_UPDATE, job=self.uplink.job, rank=self.uplink.rank,
                          packet_id=self._up_id(job, st.round_id), slot=h.slot, set=h.set, count=st.n_elems,
                          codec=st.codec, exp_cur=exp, exp_next=st.exp_max, payload=payload,
                          session=self.uplink.session, flags=st.flags & wire.FLAG_CONGESTED)
        self.up_sent += 1
        return [(st.up, self.uplink.address)]

    def _nc_partial(self, st):
        """(exponent, codes) of the round's NC partial sum in the table NC_HEADROOM levels up."""
        if st.exp_cur == wire.EXP_NONE:
            return st.exp_cur, np.zeros(st.n_elems, np.uint8).tobytes()  # an all-zero block stays one
        exp = min(st.exp_cur + NC_HEADROOM, wire.NC_LEVEL_MAX)
        shift = wire.nc_floor(exp) - wire.nc_floor(st.exp_cur)
        mag = np.abs(st.acc)
        q, rem = mag >> shift, mag & ((1 << shift) - 1)
        if shift and self.nc_deterministic:
            q += rem >= (1 << (shift - 1))
        elif shift:  # unbiased: up with probability rem / 2^shift
            bits = rng.bits64(self.seed ^ 0x1EAF, self.nc_elements_rounded, mag.size)
            q += (bits >> np.uint64(64 - shift)).astype(np.int64) < rem
        codes, overflow = nc.int_to_codes(np.where(st.acc < 0, -q, q), exp, self.nc_deterministic, self.seed,
                                          self.nc_elements_rounded)
        self.nc_elements_rounded += mag.size
        if overflow:
            st.flags |= wire.FLAG_OVERFLOW
            self.overflows += 1
        return exp, codes.tobytes()

    def _duplicate(self, job, h, st, other, src, size: int):
        if h.packet_id == st.round_id and not st.complete and st.count == job.world_size:
            other.bitmap &= ~(1 << h.rank)
            self.up_resent += 1
            return [(st.up, self.uplink.address)]  # the partial or the root's result was lost: ask again
        return super()._duplicate(job, h, st, other, src, size)

    def _from_root(self, data):
        """The root's result for a round waiting here: store it, multicast it to the leaf's workers."""
        try:
            h = wire.unpack(data)
        except wire.WireError:
            return self._drop("malformed")
        up = self.uplink
        if (h.msg_type != wire.MSG_RESULT or (h.job, h.rank, h.session) != (up.job, up.rank, up.session)
                or h.slot >= self.slots):
            return self._drop("malformed" if h.msg_type != wire.MSG_RESULT else "wrong_session")
        job = self.jobs[up.job]
        st = job.sets[2 * h.slot + h.set]
        if st.round_id is None or st.complete or self._up_id(job, st.round_id) != h.packet_id:
            return self._drop("stale", job, h.slot)  # a duplicate of a result already passed down
        st.result = bytes(wire.payload_view(data, h))
        st.flags |= h.flags  # the root's OVERFLOW and CONGESTED (any leaf's, or CE on the way down: server.py)
        st.exp_max = h.exp_next
        st.complete = True
        self.down += 1
        job.counters["multicast"][h.slot] += 1
        return self._to_members(job, h, st)

    def stats(self, per_slot: bool = False) -> dict:
        s = super().stats(per_slot)
        s["uplink"] = {"root": f"{self.uplink.address[0]}:{self.uplink.address[1]}", "rank": self.uplink.rank,
                       "leaves": self.uplink.world_size, "sent": self.up_sent, "resent": self.up_resent,
                       "results_down": self.down}
        return s


def make_leaf(config, server_cls, host: str, port: int, root: str, rank: int, leaves: int, timeout: float, **net):
    """(switch, server) for `serve --uplink`: bind, join the root as rank of leaves, then build the leaf's
    model with the slots and element limit the root granted.

    Raises:
        ValueError: a configuration the root cannot carry; TimeoutError: the root or a leaf is missing.
    """
    from dataclasses import replace

    from inaproto.net import parse_address

    from .server import bind_udp

    (job_id, world), = config.jobs.items() if len(config.jobs) == 1 else [(None, None)]
    if job_id is None:
        raise ValueError("a leaf (--uplink) serves one job")
    sock = bind_udp(host, port)
    sock.setblocking(False)
    try:
        key = config.keys.get(job_id) if config.keys else None
        uplink = Uplink(sock, parse_address(root), rank, leaves, job_id, config.slots, timeout, key)
        config = replace(config, slots=min(config.slots, uplink.window),
                         max_elements=min(config.max_elements, uplink.max_elements))
        switch = LeafSwitch(config, uplink)
        return switch, server_cls(switch, sock=sock, **net)
    except BaseException:
        sock.close()
        raise
