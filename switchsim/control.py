"""The switch's control plane, one for every data plane (the Python model, the C core under its UDP and
DPDK loops): the join barrier, admission, leaves and stats requests. Data planes hand it every
JOIN / LEAVE / STATS_REQ and it tells them who is admitted (`admit`).

What it guarantees (docs/protocol.md, threat model):
- a generation starts only when every rank of the job has joined; its session value (in every data packet
  of the generation) is a keyed hash of the switch's secret, the job, the generation and the ranks' nonces;
- each rank's packets are accepted only from the address it joined from;
- with a job key, a join must carry the MAC of it (inaproto.auth); without one, a rank held by a live
  member (heard within `member_idle` seconds, not left) is not handed to another address, nor re-joined
  from its own address by a join that does not carry the generation's session (a forged re-join);
- a pending join counts for the barrier only once confirmed (sent again from the same address with the
  same nonce and the cookie of its join_wait: workers answer their first join_wait at once, then repeat
  every 100 ms), a confirmed claim holds its rank against other addresses, and pending joins not repeated
  for `join_expiry` seconds expire; a member re-sending its own join is always answered. So a stray join,
  which does not read its answers, can neither wedge nor complete a barrier, nor take a rank in it;
- no answer is larger than the request it answers (joins are padded to JOIN_SIZE), errors and stats are
  rate-limited, and stats go only to control hosts (loopback by default);
- members first: a request from a member of a job (its rank, from the address it joined from) is handled
  before any budget; everyone else's requests go through a budget per source address and one shared by
  all strangers, so a flood from strangers, at any rate and from any number of addresses, never crowds out
  a member's heartbeat, abort or leave;
- every answer to a join (wait, ack, error) echoes the join's nonce (its low 32 bits in packet_id): a
  worker takes only the answers to its own join, so a forged join from its address cannot fail it;
- a member's heartbeat is answered (a header, the size of the heartbeat): a worker that hears nothing from
  its switch for SWITCH_SILENT seconds while it waits names the switch.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from inaproto import auth, net, rng, wire
# the timers and rates (inaproto.timers), importable from here as before
from inaproto.timers import (CLAIM_ACTIVE, CONTROL_RATE, ERROR_RATE, HEARTBEAT_EVERY, JOIN_EXPIRY,  # noqa: F401
                             MEMBER_IDLE, MEMBER_RATE, PEER_SILENT, SOURCE_RATE, SOURCES_KEPT, STATS_RATE,
                             TAKEN_AFTER)

COOKIE = 0xC0C1E  # a salt: the secret's cookies differ from its session values
SATURATED = 0.25  # a transport that has not found its receive queue empty for this long is behind it
SWEEP_EVERY = 0.25  # a shared switch looks for ended jobs this often at most (with the requests it handles)


class TokenBucket:
    """`rate` events per second with bursts of `burst`: take() says whether one more may happen now."""

    def __init__(self, rate: float, burst: int, clock):
        self.rate, self.burst, self.clock = rate, burst, clock
        self.tokens, self.at = float(burst), clock()

    def take(self) -> bool:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


@dataclass
class Member:
    address: object
    nonce: int
    seen_at: float  # when its packet count last changed (or it joined)
    seen_count: int = 0
    left: bool = False
    contested_at: float | None = None  # when another address first asked for this rank

@dataclass
class Pending:
    address: object
    nonce: int
    window: int
    elements: int  # per packet, as asked (0 already replaced by the switch's maximum), at most the maximum
    at: float  # when last (re)sent
    group: bool = False  # it listens on the job's loopback group too (wire.FLAG_GROUP)
    confirmed: bool = False  # sent again from its address: it reads our answers, a worker waits there
    contested_at: float | None = None  # when another address first asked for this rank


@dataclass
class JobControl:
    job_id: int
    world_size: int
    key: bytes | None = None
    generation: int = 0
    session: int = 0
    first_id: int = 0  # every slot's first packet id in this generation
    failed: bool = False  # the generation failed (mismatch, abort, dead member): its ranks are free
    window: int = 0
    elements: int = 0  # the generation's agreed elements per packet
    group: tuple | None = None  # where the generation's results go once for every member (_group), or None
    members: dict = field(default_factory=dict)  # rank -> Member of the current generation
    pending: dict = field(default_factory=dict)  # rank -> Pending for the next one
    slots: int = 0  # the job's slots in the data plane (0: a shared switch's job not holding any yet)
    base: int = 0  # their offset in a shared switch's pool
    shared: bool = False  # admitted at run time: it ends when its members leave or fall silent
    since: float | None = None  # when it got its slots (a static job: its first generation)


class Pool:
    """A shared switch's slots, lent to its jobs as contiguous runs (the P4 program's registers are one
    array: a job's slots are [base, base + slots)). First fit, so the pool's free end stays whole."""

    def __init__(self, size: int):
        self.size = size
        self.runs: dict[int, tuple[int, int]] = {}  # job id -> (base, slots)

    def in_use(self) -> int:
        return sum(n for _, n in tuple(self.runs.values()))  # a copy: stats may be read from another thread

    def free_runs(self) -> list[tuple[int, int]]:
        """(base, length) of every free run, in order."""
        out, at = [], 0
        for base, n in sorted(tuple(self.runs.values())):
            if base > at:
                out.append((at, base - at))
            at = base + n
        return out + ([(at, self.size - at)] if at < self.size else [])

    def largest_free(self) -> int:
        return max((n for _, n in self.free_runs()), default=0)

    def take(self, job_id: int, least: int, most: int) -> tuple[int, int] | None:
        """(base, slots) of a run of `most` slots (the first that fits), else of the largest free run if it
        has at least `least`; None: the pool cannot hold the job."""
        runs = self.free_runs()
        fit = next(((b, most) for b, n in runs if n >= most), None)
        if fit is None:
            b, n = max(runs, key=lambda r: r[1], default=(0, 0))
            fit = (b, n) if n >= least else None
        if fit is not None:
            self.runs[job_id] = fit
        return fit

    def give_back(self, job_id: int):
        self.runs.pop(job_id, None)

    def describe(self) -> str:
        return (f"{self.in_use()} of {self.size} slots in use by {len(self.runs)} jobs, the largest free run "
                f"{self.largest_free()}")


def derive_session(secret: int, job: int, generation: int, nonces: list[int]) -> int:
    """Nonzero 32-bit session value of a generation; unpredictable without the switch's secret."""
    s = rng.derive_seed(secret, job, generation, *nonces) & 0xFFFFFFFF
    return s or 1


class ControlPlane:
    def __init__(self, dataplane, config, secret: int | None = None, clock=None, join_expiry=JOIN_EXPIRY,
                 member_idle=MEMBER_IDLE, stats=None, in_flight: int | None = None, boot: int | None = None,
                 peer_silent: float | None = None):
        """dataplane: what to admit into (config.DataPlane); config: its SwitchConfig; secret: the key of
        the session values (random by default); clock, join_expiry, member_idle: for tests; in_flight: the
        packets a job may have in flight over all its workers (the agreed window is at most this divided
        by the world size; None: no limit but the slots), for a switch that drops bursts (BMv2); boot: the
        switch's boot id (random by default: a restarted switch has another); peer_silent: seconds of
        silence after which a member is dead (None: the config's)."""
        self.dataplane, self.slots, self.max_elements = dataplane, config.slots, config.max_elements
        self.jobs = {j: JobControl(j, n, config.keys.get(j), slots=config.slots) for j, n in config.jobs.items()}
        # a shared switch (config.shared): jobs admitted at their first join, slots lent from the pool
        self.pool = Pool(config.pool) if config.shared else None
        self.least_slots, self.admission, self.key_dir = config.least_slots, config.admit, config.key_dir
        self.ended = 0  # shared jobs ended so far
        self.swept_at = float("-inf")
        self.secret = secrets.randbits(64) if secret is None else secret
        self.control_hosts = set(config.control_hosts)  # besides loopback
        self.clock = clock or time.monotonic
        self.join_expiry, self.member_idle = join_expiry, member_idle
        self.peer_silent = config.peer_silent if peer_silent is None else peer_silent
        self.stats = stats or dataplane.stats
        self.first_packet_id = config.first_packet_id
        self.in_flight = in_flight
        self.requests = TokenBucket(*CONTROL_RATE, self.clock)  # every non-member together
        self.sources: OrderedDict = OrderedDict()  # source address -> its TokenBucket (non-members)
        self.errors = TokenBucket(*ERROR_RATE, self.clock)
        self.stats_replies = TokenBucket(*STATS_RATE, self.clock)
        self.boot = (secrets.randbits(32) or 1) if boot is None else boot
        dataplane.set_boot(self.boot)
        # silence is judged only while the switch keeps up with its queue: a transport that says when it
        # found its receive queue empty (drained) marks the times it did not (the kernel may have dropped a
        # member's heartbeat there); None: a transport that always keeps up (the C loops)
        self.drained_at: float | None = None
        # the port of a UDP switch bound on loopback, which may send a job's results once to its group
        # (net.job_group); None elsewhere (shared memory, DPDK, BMv2, a switch reachable off this host)
        self.group_port: int | None = None
        self.saturated_at = float("-inf")

    def handle(self, h: wire.Header, data, src) -> list[tuple[bytes, object]]:
        """Answer one control request (already parsed); returns the packets to send. Members first: a
        member's request is never rate-limited; a stranger's goes through its own budget and the shared one."""
        if not self.known(h, src) and not (self._source_budget(src).take() and self.requests.take()):
            return self._drop("rate_limited")
        self.sweep()
        if h.msg_type == wire.MSG_JOIN:
            return self._join(h, data, src)
        if h.msg_type == wire.MSG_LEAVE:
            return self._leave(h, src)
        if h.msg_type == wire.MSG_HEARTBEAT:
            return self._heartbeat(h, src)
        if h.msg_type == wire.MSG_ABORT:
            return self._abort(h, data, src)
        return self._stats(src, bool(h.flags & wire.FLAG_PER_SLOT))

    def known(self, h, src) -> bool:
        """Whether a request comes from a member of its job's generation (failed or not: a re-join), from
        the address that rank joined from: the same test as the C core's ina_switch_is_member and the P4
        program's member table (a pending joiner is not one: anyone can make itself one)."""
        job = self.jobs.get(h.job)
        m = job.members.get(h.rank) if job is not None else None
        return m is not None and m.address == src

    def _source_budget(self, src) -> TokenBucket:
        bucket = self.sources.get(src)
        if bucket is None:
            bucket = self.sources[src] = TokenBucket(*SOURCE_RATE, self.clock)
            if len(self.sources) > SOURCES_KEPT:
                self.sources.popitem(last=False)
        else:
            self.sources.move_to_end(src)
        return bucket

    def _drop(self, reason):
        self.dataplane.count_drop(reason)
        return []

    def _error(self, h, src, text: str, code: int = wire.ERR_REJECTED, subject: int = wire.NO_RANK):
        """A join's error, echoing its nonce (h.packet_id)."""
        if not self.errors.take():
            return self._drop("rate_limited")
        return [(wire.pack_error(code, text, h.job, h.rank, subject, boot=self.boot, packet_id=h.packet_id), src)]

    # ------------------------------------------------------------------ join barrier
    def _join(self, h, data, src):
        nonce, world, window, mac, elements = wire.JOIN_PAYLOAD.unpack_from(data, wire.HEADER_SIZE)
        h.packet_id = nonce & wire.PACKET_ID_MASK  # every answer echoes it: the joiner takes only its own
        job = self.jobs.get(h.job)
        if job is None and self.pool is not None:
            job, refused = self._arrival(h, src, world, window, elements, mac, nonce)
            if job is None:
                return refused
        if job is None:
            self.dataplane.count_drop("unknown_job")
            return self._error(h, src, f"unknown job {h.job}")
        if job.key is not None and not auth.mac_ok(job.key, mac, h.job, h.rank, nonce, world, window, elements):
            self.dataplane.count_drop("bad_mac")
            return self._error(h, src, f"join of job {h.job} rank {h.rank} refused: bad MAC (wrong job key?)")
        if job.shared and not job.slots:
            self._resize_unclaimed(job, world)
            need = min(self.least_slots, window)
            if self.pool.largest_free() < need:
                return self._pool_full(h, src, need)
        refusal = (f"job {h.job} has {job.world_size} workers, not {world}" if world != job.world_size else
                   f"rank {h.rank} out of range for job {h.job} of {job.world_size} workers"
                   if h.rank >= job.world_size else "window 0: a worker needs at least one slot" if window < 1 else "")
        if refusal:
            self.dataplane.count_drop("unknown_worker")
            return self._error(h, src, refusal)
        now = self.clock()
        out = self.check_members(job.job_id)  # a dead generation frees its ranks for the joiners
        m = job.members.get(h.rank)
        if m is not None and m.nonce == nonce and m.address == src and not m.left:
            return out + [(self._join_ack(job, h.rank), src)]  # its ack was lost: send it again
        job.pending = {r: p for r, p in job.pending.items() if now - p.at <= self.join_expiry}
        p = job.pending.get(h.rank)
        ours = p is not None and p.address == src and p.nonce == nonce  # a claim this join made before
        if job.key is None and m is not None and not ours and not self._failed(job) and self._live(job, h.rank, m, now):
            if m.address != src:
                return out + self._contested(job, h, src, m, now)  # in use: no takeover by another address
            if h.session != job.session:  # from a live member's address, without its session: a forged re-join
                self.dataplane.count_drop("spoofed")
                return out + [self._join_wait(job, h, src)]
        if ours:  # repeated; with the cookie of our join_wait it counts: a worker that reads answers waits there
            p.confirmed, p.at = p.confirmed or h.session == self._cookie(job, h.rank, h.packet_id, src), now
        elif p is not None and p.confirmed and now - p.at <= CLAIM_ACTIVE:  # a live claim holds its rank
            if p.address == src:  # another nonce from its address (a forged join): the claim stays
                return out + [self._join_wait(job, h, src)]
            p.contested_at = p.contested_at or now
            if job.key is None and p.at - p.contested_at >= CLAIM_ACTIVE:  # its holder repeats it: a live process
                return out + self._taken(job, h, src, "is being joined by another process")
            return out + [self._join_wait(job, h, src)]
        else:  # no claim, or one nobody repeats (a stray join): this join takes the rank
            job.pending[h.rank] = Pending(src, nonce, min(window, self._window_cap(job)),
                                          min(elements or self.max_elements, self.max_elements), now,
                                          bool(h.flags & wire.FLAG_GROUP))
        if not self._barrier_complete(job, now):
            return out + (self._gone_peer(job, h, src) or [self._join_wait(job, h, src)])
        sizes = {r: q.elements for r, q in job.pending.items()}
        if len(set(sizes.values())) > 1:
            stray = [r for r, q in job.pending.items() if now - q.at > CLAIM_ACTIVE and r != h.rank]
            if stray:  # a claim nobody repeats (a stray join) never refuses the live ones: it goes
                for r in stray:
                    del job.pending[r]
                return out + [self._join_wait(job, h, src)]
            return out + self._refuse_sizes(job, sizes)
        return out + self._start_generation(job, now)

    def _gone_peer(self, job, h, src):
        """A member of the last generation re-joining while a peer of that generation left (closed its
        communicator) and has not joined again: told at once, naming the peer, instead of waiting for it."""
        m = job.members.get(h.rank)
        if m is None or m.address != src or m.left:
            return []
        gone = [r for r, x in sorted(job.members.items()) if x.left and r not in job.pending]
        if not gone:
            return []
        return self._error(h, src, f"job {h.job}: rank {gone[0]} left the job (closed its communicator) and has "
                                   f"not joined again", wire.ERR_PEER_DEAD, gone[0])

    @staticmethod
    def _barrier_complete(job, now) -> bool:
        """Every rank has a confirmed claim (repeated from its address; claims expire join_expiry seconds
        after their last repeat)."""
        return len(job.pending) == job.world_size and all(q.confirmed for q in job.pending.values())

    def _refuse_sizes(self, job, sizes: dict):
        """The ranks ask for different packet sizes: refuse every pending join at once (their packets would
        never add up), naming two that differ, instead of a generation that hangs on `mismatch`."""
        a = min(sizes, key=lambda r: (sizes[r], r))  # the smallest size asked and the largest
        b = max(sizes, key=lambda r: (sizes[r], -r))
        ka, kb = sizes[a], sizes[b]
        text = (f"job {job.job_id}: ranks ask for different packet sizes: rank {b} {kb} elements per packet, "
                f"rank {a} {ka} (elements_per_packet, or the codecs, differ)")
        return self._refuse_all(job, wire.ERR_REJECTED, text, subject=b)

    def _refuse_all(self, job, code: int, text: str, reason: str | None = None, subject: int = wire.NO_RANK):
        """Refuse every pending join of the job at once (each answer echoes its join's nonce)."""
        pending, job.pending = job.pending, {}
        out = []
        for r, p in sorted(pending.items()):
            h = wire.Header(wire.MSG_JOIN, job=job.job_id, rank=r, packet_id=p.nonce & wire.PACKET_ID_MASK)
            if reason:
                self.dataplane.count_drop(reason)
            out += self._error(h, p.address, text, code, subject)
        return out

    def _contested(self, job, h, src, m: Member, now):
        """Another address asks for a live member's rank. If the whole generation goes on being heard for
        TAKEN_AFTER seconds, the job is running: the joiner is told at once who holds the rank. If a member
        falls silent meanwhile, the generation is dying (a crashed job being restarted): wait, its ranks
        free up when it is declared dead."""
        if m.contested_at is None:
            m.contested_at = now
        heard = all(now - x.seen_at < TAKEN_AFTER for x in job.members.values() if not x.left)
        if now - m.contested_at >= TAKEN_AFTER and heard:
            return self._taken(job, h, src, f"is held by a live member of generation {job.generation}")
        return [self._join_wait(job, h, src)]

    def _taken(self, job, h, src, how: str):
        """The rank is another process's: named, its address not (a stranger learns nothing of the job)."""
        return self._error(h, src, f"job {h.job} rank {h.rank} {how}; another process uses this rank "
                                   f"(a second job with the same id, or a stranger): give the job its own id, "
                                   f"or serve it with --key-file", wire.ERR_RANK_TAKEN, h.rank)

    def _window_cap(self, job) -> int:
        slots = job.slots or self.slots  # a shared job without slots yet: its quota
        if self.in_flight is None:
            return slots
        return max(1, min(slots, self.in_flight // job.world_size))

    def _live(self, job, rank, m: Member, now, idle: float | None = None) -> bool:
        if m.left:
            return False
        count = self.dataplane.member_packets(job.job_id)[rank]
        if count != m.seen_count:
            m.seen_count, m.seen_at = count, now
        return now - m.seen_at < (self.member_idle if idle is None else idle)

    def _start_generation(self, job, now):
        """Every rank joined: a new generation with clean slots, admitted in the data plane (a shared
        switch's job gets its slots from the pool first, or every join is refused: pool_full)."""
        ranks = range(job.world_size)
        window = min(job.pending[r].window for r in ranks)
        refusal = self._lend(job, window) if job.shared and not job.slots else ""
        if refusal:
            return self._refuse_all(job, wire.ERR_POOL_FULL, refusal, "pool_full")
        job.since = job.since or now
        job.generation += 1
        job.window = min(window, job.slots)
        job.elements = job.pending[0].elements
        nonces = [job.pending[r].nonce for r in ranks]
        job.session = derive_session(self.secret, job.job_id, job.generation, nonces)
        job.first_id = (self.first_packet_id if self.first_packet_id is not None else
                        rng.derive_seed(self.secret, job.session, *nonces) & (wire.PACKET_ID_MASK - 1))
        job.members = {r: Member(job.pending[r].address, job.pending[r].nonce, now) for r in ranks}
        job.group = self._group(job, [job.pending[r] for r in ranks])
        job.pending, job.failed = {}, False
        self.dataplane.admit(job.job_id, job.generation, job.session, job.first_id,
                             [job.members[r].address for r in ranks], job.elements, job.group)
        counts = self.dataplane.member_packets(job.job_id)
        for r in ranks:
            job.members[r].seen_count = counts[r]
        return [(self._join_ack(job, r), job.members[r].address) for r in ranks]

    def _group(self, job, joins: list) -> tuple[str, int] | None:
        """Where the generation's results go once for every member (docs/protocol.md, "Results to a group"):
        the job's loopback group when this switch sends on loopback (group_port), every rank asked and joined
        from loopback, and the job has no key (any local process may join a group); else None, a copy each."""
        if self.group_port is None or job.key is not None:
            return None
        if all(p.group and isinstance(p.address, tuple) and p.address[0] != net.SHM_HOST and net.is_loopback(p.address[0])
               for p in joins):
            return net.job_group(job.job_id, self.group_port)
        return None

    def _join_ack(self, job, rank):
        payload = wire.JOIN_ACK_PAYLOAD.pack(job.generation & 0xFFFFFFFF, job.slots, job.elements, job.window,
                                             job.first_id)
        return wire.pack(wire.MSG_JOIN_ACK, job=job.job_id, rank=rank, payload=payload, session=job.session,
                         boot=self.boot, packet_id=job.members[rank].nonce & wire.PACKET_ID_MASK)

    def _join_wait(self, job, h, src):
        """The answer to a join that does not complete the barrier: the bitmap of the ranks whose joins count,
        the join's nonce echoed, and in `session` the claim's cookie, which the joiner's next join carries
        to confirm that it reads answers at its address."""
        bitmap = sum(1 << r for r, q in job.pending.items() if q.confirmed)
        return wire.pack(wire.MSG_JOIN_WAIT, job=h.job, rank=h.rank, payload=wire.JOIN_WAIT_PAYLOAD.pack(bitmap),
                         boot=self.boot, packet_id=h.packet_id, session=self._cookie(job, h.rank, h.packet_id, src)), src

    def _cookie(self, job, rank: int, echo: int, src) -> int:
        """A claim's cookie: nonzero, a keyed hash of the switch's secret, the join and its source address,
        so only a joiner that reads the answers sent to that address can confirm its claim (a blind stray,
        or a join forged from another's address, never can). Stateless, like a SYN cookie."""
        where = int.from_bytes(hashlib.blake2b(repr(src).encode(), digest_size=8).digest(), "big")
        return (rng.derive_seed(self.secret, COOKIE, job.job_id, rank, echo, where) & 0xFFFFFFFF) or 1

    # ------------------------------------------------------------------ a shared switch (docs/protocol.md)
    def _arrival(self, h, src, world: int, window: int, elements: int, mac: bytes, nonce: int):
        """The first join of a job a shared switch does not have: (its new JobControl, None), or (None, the
        refusal). Keyed: only a job whose key the operator issued, with its MAC; a refusal creates nothing,
        so a stranger's joins hold no state and no slots."""
        key = None
        if self.admission == "keyed":
            key = self._issued_key(h.job)
            if key is None or not auth.mac_ok(key, mac, h.job, h.rank, nonce, world, window, elements):
                self.dataplane.count_drop("bad_mac")
                why = "no key was issued for it" if key is None else "bad MAC (wrong job key?)"
                return None, self._error(h, src, f"join of job {h.job} rank {h.rank} refused: {why}")
        if not 1 <= world <= wire.MAX_WORKERS:
            self.dataplane.count_drop("unknown_worker")
            return None, self._error(h, src, f"job {h.job}: world size {world} out of range 1..{wire.MAX_WORKERS}")
        need = min(self.least_slots, max(window, 1))
        if self.pool.largest_free() < need:
            return None, self._pool_full(h, src, need)
        job = self.jobs[h.job] = JobControl(h.job, world, key, shared=True)
        return job, []

    def _issued_key(self, job_id: int) -> bytes | None:
        """The key the operator issued for the job (`switchsim key issue`: KEY_DIR/JOB.key), or None."""
        try:
            return auth.load_key(os.path.join(self.key_dir, f"{job_id}.key"))
        except (OSError, ValueError):
            return None

    def _resize_unclaimed(self, job, world: int):
        """A job without slots whose joins nobody confirmed (a stray's, or expired) takes the world size
        of the next join: a stray join of another size never locks a job id out."""
        now = self.clock()
        if world != job.world_size and not any(p.confirmed and now - p.at <= self.join_expiry
                                               for p in job.pending.values()):
            job.world_size, job.pending = world, {}

    def _pool_text(self, job_id: int, need: int) -> str:
        return f"job {job_id}: the switch's slot pool is full: it needs {need} slots; {self.pool.describe()}"

    def _pool_full(self, h, src, need: int):
        self.dataplane.count_drop("pool_full")
        return self._error(h, src, self._pool_text(h.job, need), wire.ERR_POOL_FULL)

    def _lend(self, job, window: int) -> str:
        """Slots for a shared job from the pool (its window's worth up to its quota, at least min_slots or
        its window if smaller), and the job into the data plane; "" or why not (a P4 switch may run out of
        job or member cells before slots)."""
        need = min(self.least_slots, window)
        run = self.pool.take(job.job_id, need, min(self.slots, window))
        if run is None:
            return self._pool_text(job.job_id, need)
        try:
            self.dataplane.add_job(job.job_id, job.world_size, run[1], run[0])
        except ValueError as e:
            self.pool.give_back(job.job_id)
            return f"job {job.job_id}: the switch cannot hold it now: {e}"
        job.base, job.slots = run
        return ""

    def sweep(self):
        """End the shared jobs that are gone (every member left, or silent for peer_silent, and nobody
        joining): their slots go back to the pool. Run with the requests (any job's heartbeat, join or a
        stats request), at most every SWEEP_EVERY seconds."""
        now = self.clock()
        if self.pool is None or now - self.swept_at < SWEEP_EVERY:
            return
        self.swept_at = now
        deaf = self._deaf(now)
        for job in [j for j in self.jobs.values() if j.shared]:
            if any(now - p.at <= self.join_expiry for p in job.pending.values()):
                continue
            # every member looked at (a list, not all()'s short cut): a look is what dates a count's last change
            silent = [not self._live(job, r, m, now, self.peer_silent) for r, m in job.members.items()]
            if not job.slots or not deaf and all(silent):
                self._end(job)

    def _end(self, job):
        """A shared job ends: the data plane forgets it, its slots go back to the pool."""
        del self.jobs[job.job_id]
        if job.slots:
            self.dataplane.remove_job(job.job_id)
            self.pool.give_back(job.job_id)
            self.ended += 1

    # ------------------------------------------------------------------ failure of a generation
    def _member(self, h, src):
        """(job, member) of an admitted member's request, or (None, drop reason)."""
        job = self.jobs.get(h.job)
        m = job.members.get(h.rank) if job is not None else None
        if m is None:
            return None, "unknown_job" if job is None else "unknown_worker"
        if m.address != src:
            return None, "spoofed"
        if h.session != job.session:
            return None, "wrong_session"
        return job, m

    def _failed(self, job) -> bool:
        """Whether the generation failed, here or in the data plane (a call mismatch is the data plane's)."""
        job.failed = job.failed or (job.generation > 0 and self.dataplane.failed(job.job_id))
        return job.failed

    def fail(self, job, code: int, rank: int, text: str):
        """Fail the job's generation in the data plane (every member is told, now and on every later data
        packet) and free its ranks for the next join."""
        job.failed = True
        return self.dataplane.fail(job.job_id, code, rank, text)

    def drained(self):
        """The transport found its receive queue empty: it hears everything sent to it now."""
        self.drained_at = self.clock()

    def _deaf(self, now) -> bool:
        """Whether the switch fell behind its queue within peer_silent seconds (silence proves nothing)."""
        if self.drained_at is not None and now - self.drained_at > SATURATED:
            self.saturated_at = now
        return now - self.saturated_at < self.peer_silent

    def check_members(self, job_id: int):
        """A member of a running generation silent for peer_silent seconds (no data packet, no heartbeat)
        is dead: fail the generation naming it. Run on every heartbeat and join of the job, so it happens
        while some member is alive to be told. Silence counts only since the switch last fell behind its
        queue (SATURATED without draining it): a flood the switch cannot keep up with makes the kernel drop
        members' packets too, and that is the switch's deafness, not the member's death."""
        job = self.jobs[job_id]
        if not job.generation or self._failed(job):
            return []
        now = self.clock()
        if self._deaf(now):
            return []
        for r, m in job.members.items():
            if not m.left and not self._live(job, r, m, now, self.peer_silent):
                return self.fail(job, wire.ERR_PEER_DEAD, r,
                                 f"job {job_id}: rank {r} ({net.format_address(m.address)}) has been silent for "
                                 f"{now - m.seen_at:.1f} s (no packet, no heartbeat): its process is dead or hung")
        return []

    def _heartbeat(self, h, src):
        """A member is alive; answered with a heartbeat of the same size, so the member hears its switch
        while it waits (SWITCH_SILENT)."""
        job, m = self._member(h, src)
        if job is None:
            return self._drop(m)
        m.seen_at = self.clock()
        echo = wire.pack(wire.MSG_HEARTBEAT, job=h.job, rank=h.rank, session=h.session, boot=self.boot)
        return [(echo, src)] + self.check_members(job.job_id)

    def _abort(self, h, data, src):
        """A member's call failed before it sent it: fail the call on every rank, naming the reason."""
        job, m = self._member(h, src)
        if job is None:
            return self._drop(m)
        reason = bytes(data[wire.HEADER_SIZE:wire.HEADER_SIZE + wire.MAX_ABORT_TEXT]).decode(errors="replace")
        text = f"job {h.job}: rank {h.rank} aborted call {h.call}: {reason}"
        if self._failed(job):
            return self.dataplane.fail(job.job_id, wire.ERR_ABORTED, h.rank, text)  # repeats the first error
        return self.fail(job, wire.ERR_ABORTED, h.rank, text)

    # ------------------------------------------------------------------ leave, stats
    def _leave(self, h, src):
        pending = self.jobs[h.job].pending.get(h.rank) if h.job in self.jobs and not h.session else None
        if pending is not None and pending.address == src:  # a join given up: its claim goes at once
            del self.jobs[h.job].pending[h.rank]
            return []
        job, m = self._member(h, src)
        if job is None:
            return self._drop(m)
        m.left = True
        if all(x.left for x in job.members.values()):
            if job.shared and not job.pending:  # the job closed: its slots go back to the pool now
                self._end(job)
            return []
        if self._failed(job):
            return []
        # the others may still call: they fail by name at once (a call that completed still resends)
        return self.fail(job, wire.ERR_PEER_DEAD, h.rank, f"job {h.job}: rank {h.rank} left the job (closed its "
                                                          f"communicator) while the others go on")

    def _stats(self, src, per_slot: bool):
        host = src[0] if isinstance(src, tuple) else None
        if host is None or not (net.is_loopback(host) or host in self.control_hosts):
            return self._drop("not_control")
        if not self.stats_replies.take():
            return self._drop("rate_limited")
        body = json.dumps(self.stats(per_slot=per_slot)).encode()
        if len(body) > wire.MAX_STATS_REPLY:  # one datagram: the totals without the per-slot arrays
            body = json.dumps({**self.stats(), "per_slot_omitted": len(body)}).encode()
        return [(wire.pack(wire.MSG_STATS, payload=body, boot=self.boot), src)]

    def annotate(self, stats: dict) -> dict:
        """Add each job's control state (members, pending joins, whether keyed, its slots and age) to a data
        plane's stats, listing a shared switch's jobs that hold no slots yet too, and its pool."""
        now = self.clock()
        for j in tuple(self.jobs.values()):  # a copy: a metrics scrape runs beside the server's thread
            entry = stats["jobs"].setdefault(str(j.job_id), {"world_size": j.world_size, "slots": 0,
                                                             "generation": 0, "failed": False})
            entry.update(members=sum(not m.left for m in j.members.values()), pending=len(j.pending),
                         keyed=j.key is not None, group=net.format_address(j.group) if j.group else None,
                         age_s=round(now - j.since, 3) if j.since is not None else 0.0)
            if j.shared:
                entry.update(slot_base=j.base)
        if self.pool is not None:
            stats["pool"] = {"slots": self.pool.size, "in_use": self.pool.in_use(), "jobs": len(self.pool.runs),
                             "largest_free": self.pool.largest_free(), "job_slots": self.slots,
                             "min_slots": self.least_slots, "admit": self.admission, "ended": self.ended}
        stats["boot"] = self.boot
        return stats
