"""The SwitchML worker protocol over UDP.

Packet q of an allreduce uses slot (first + q) mod W, so a slot is never reused before its previous
result is back (self-clocking: the result of q releases q + W). Packet ids count per slot (protocol v2):
the u-th use of a slot since the join has packet id u (mod 2^32) and set u mod 2, so the switch can accept
a new round only with the one id it must have, and a slot alternates sets whatever the calls in between.
For codecs with a shared scale the stream is shifted by D = min(W, blocks): packet q carries the data of
block q - D and this worker's exponent of block q; the result of packet q returns the max exponent of
block q, which is exactly what packet q + D needs to quantize its data.
Lost packets or results are detected by a per-packet timeout with exponential backoff and the packet is
rebuilt from the source tensor (the counter-based RNG makes the rebuild bit-identical).
"""
from __future__ import annotations

import secrets
import select
import socket
import time
from dataclasses import dataclass

import numpy as np

from inaproto import auth
from inaproto.net import SOCKET_BUFFER, parse_address, size_buffers  # noqa: F401 - public names

from . import fastpath, rng, wire
from .codecs import get_codec
from .errors import INAError


@dataclass
class CommStats:
    packets_sent: int = 0
    packets_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    retransmissions: int = 0
    duplicate_results: int = 0
    stale_results: int = 0
    elements: int = 0
    allreduces: int = 0
    seconds: float = 0.0

    @property
    def wire_bytes_sent(self) -> int:
        return self.bytes_sent + self.packets_sent * wire.WIRE_OVERHEAD

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["wire_bytes_sent"] = self.wire_bytes_sent
        return d


class Communicator:
    """One worker's connection to an INA switch for one job. Use `hostlib.connect(...)`."""

    def __init__(self, switch, rank: int, world_size: int, job: int = 1, codec: str = "int32",
                 window: int = 64, elements_per_packet: int | None = None, timeout: float = 30.0,
                 join_timeout: float | None = None, rto: float = 0.03, max_rto: float = 0.1, seed: int = 0,
                 fast: bool | None = None, key: bytes | str | None = None, **codec_params):
        if not 1 <= world_size <= wire.MAX_WORKERS:
            raise ValueError(f"world_size must be in 1..{wire.MAX_WORKERS}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        if not 0 <= job <= 0xFFFF:
            raise ValueError("job id must be in 0..65535")
        if window < 1:
            raise ValueError("window must be >= 1")
        self.address = parse_address(switch)
        self.rank, self.world_size, self.job = rank, world_size, job
        self.codec = get_codec(codec, **codec_params)
        # rto is the floor of the retransmission timeout; above it the timeout follows the measured
        # round trip (RFC 6298, Karn's rule: only packets sent once are sampled)
        self.timeout, self.min_rto, self.max_rto = float(timeout), float(rto), float(max_rto)
        self.rto, self._srtt, self._rttvar = float(rto), None, 0.0
        self.seed = seed
        self.fast = fast  # None: the C loop where it applies; False: always the Python loop
        self.key = auth.check_key(key) if key is not None else auth.key_from_env()
        self.stats = CommStats()
        self._calls = 0
        self._broken: str | None = None
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        size_buffers(self.sock)
        self.sock.connect(self.address)
        self.sock.setblocking(False)
        self._buf = bytearray(65536)
        self._view = memoryview(self._buf)
        try:
            self._join(window, self.timeout if join_timeout is None else join_timeout)
        except BaseException:
            self.sock.close()
            raise
        self.k = min(elements_per_packet or self.codec.default_elements, self.max_elements)
        # per slot: its uses since the join (the next packet id on it, mod 2^32); the slot the next call starts on
        self._uses = np.full(self.window, self._first_id, dtype=np.uint32)
        self._next_slot = 0

    # ------------------------------------------------------------------ helpers
    def _send(self, data: bytes):
        try:
            self.sock.send(data)
        except (ConnectionRefusedError, BlockingIOError):
            pass  # counted as sent: the protocol recovers by timeout like any loss
        self.stats.packets_sent += 1
        self.stats.bytes_sent += len(data)

    def _recv(self):
        """One datagram as bytes, or None when nothing is waiting."""
        try:
            n = self.sock.recv_into(self._buf)
        except (BlockingIOError, InterruptedError):
            return None
        except ConnectionRefusedError:
            return b""  # ICMP port unreachable: the switch is not there (yet)
        self.stats.packets_received += 1
        self.stats.bytes_received += n
        return bytes(self._view[:n])

    def _wait(self, seconds: float):
        select.select([self.sock], [], [], max(0.0, seconds))

    # ------------------------------------------------------------------ join barrier
    def _join(self, window: int, timeout: float):
        nonce = secrets.randbits(64)
        window = min(window, 0xFFFF)
        mac = (auth.join_mac(self.key, self.job, self.rank, nonce, self.world_size, window) if self.key
               else bytes(wire.JOIN_MAC_SIZE))
        join = wire.pack_join(self.job, self.rank, nonce, self.world_size, window, mac)
        deadline = time.monotonic() + timeout
        joined, heard, refused, confirmed = 0, False, False, False
        while True:
            self._send(join)
            until = min(time.monotonic() + 0.1, deadline)
            while time.monotonic() < until:
                self._wait(until - time.monotonic())
                while (data := self._recv()) is not None:
                    if not data:
                        refused = True
                        continue
                    try:
                        h = wire.unpack(data)
                    except wire.WireError:
                        continue
                    heard = True
                    if h.msg_type == wire.MSG_ERROR:
                        raise INAError(f"switch {self.address[0]}:{self.address[1]} rejected rank {self.rank}: "
                                       + data[wire.HEADER_SIZE:].decode(errors="replace"))
                    if h.msg_type == wire.MSG_JOIN_WAIT and h.job == self.job:
                        joined = int.from_bytes(data[wire.HEADER_SIZE:wire.HEADER_SIZE + 8], "big")
                        if not confirmed:  # the switch counts a join once it is repeated: do it at once
                            confirmed = True
                            self._send(join)
                    if h.msg_type == wire.MSG_JOIN_ACK and h.job == self.job:
                        self.generation, self.slots, self.max_elements, self.window, self._first_id = (
                            wire.JOIN_ACK_PAYLOAD.unpack_from(data, wire.HEADER_SIZE))
                        self.session = h.session
                        return
            if time.monotonic() >= deadline:
                where = f"{self.address[0]}:{self.address[1]}"
                if not heard:
                    why = "connection refused" if refused else "no answer"
                    raise TimeoutError(f"rank {self.rank}: switch at {where} unreachable ({why}) after {timeout:g} s")
                missing = [r for r in range(self.world_size) if not joined >> r & 1 and r != self.rank]
                raise TimeoutError(f"rank {self.rank}: job {self.job}: ranks {missing} did not join "
                                   f"within {timeout:g} s (a peer is dead or missing)")

    # ------------------------------------------------------------------ allreduce
    def allreduce(self, x, progress=None, sparse: bool = False):
        """Sum x over all workers of the job. numpy array or torch tensor in, same type/shape/dtype out.

        sparse=True: block-sparse INA (OmniReduce-style): only blocks of elements_per_packet elements
        that are non-zero on this worker carry data; every worker of the job must pass the same flag."""
        if self._broken:
            raise RuntimeError(f"communicator unusable after an earlier failure ({self._broken}); reconnect")
        torch_like = type(x).__module__.startswith("torch")
        arr = _to_numpy(x) if torch_like else np.asarray(x)
        flat = np.ascontiguousarray(arr).reshape(-1)
        self.codec.check_input(flat)
        start = time.perf_counter()
        try:
            if not flat.size:
                out = flat.copy()
            elif sparse:
                out = self._allreduce_sparse(flat, progress)
            else:
                out = self._allreduce_flat(flat, progress)
        except TimeoutError as e:
            self._broken = str(e)
            raise
        self.stats.seconds += time.perf_counter() - start
        self.stats.allreduces += 1
        self.stats.elements += flat.size
        out = out.reshape(arr.shape)
        return _from_numpy(out, x) if torch_like else out

    def _allreduce_flat(self, flat: np.ndarray, progress):
        codec, k, W, n = self.codec, self.k, self.window, self.world_size
        N = flat.size
        nb = -(-N // k)
        if codec.negotiates_exponent:
            exps, D = codec.flat_exponents(flat, k), min(W, nb)
        else:
            exps, D = None, 0
        total = nb + D
        slots, seed, kind = self._begin_call(flat)
        if kind is not None:
            return self._run_c_loop(kind, flat, exps, seed, slots, progress)
        agreed = np.full(nb, wire.EXP_NONE, dtype=np.int16)
        result = np.zeros(nb * k, dtype=codec.result_dtype())
        done = np.zeros(total, dtype=bool)
        overflow = False

        def build(q: int) -> bytes:
            pid, slot = slots.pid(q % W, q // W), slots.slot(q % W)
            exp_next = int(exps[q]) if exps is not None and q < nb else wire.EXP_NONE
            if q < D:
                payload, count, exp_cur = b"", 0, 0
            else:
                j = q - D
                lo, hi = j * k, min(j * k + k, N)
                exp_cur = int(agreed[j]) if exps is not None else 0
                block = flat[lo:hi]
                if exp_cur == wire.EXP_NONFINITE:
                    block = np.zeros(hi - lo, dtype=flat.dtype)  # everyone raises at the end
                payload, count = codec.encode(block, exp_cur, n, seed, lo), hi - lo
            return wire.pack(wire.MSG_UPDATE, self.job, self.rank, pid, slot, pid & 1, count,
                             codec.wire_codec, exp_cur, exp_next, 0, payload, self.session)

        outstanding: dict[int, list] = {}  # q -> [first_sent, deadline, rto, tries]
        next_q = ndone = 0
        next_scan = 0.0
        report_every = max(1, total // 100)
        while ndone < total:
            now = time.monotonic()
            while next_q < total and (next_q < W or done[next_q - W]) and (next_q < D or done[next_q - D] or D == 0):
                self._send(build(next_q))
                outstanding[next_q] = [now, now + self.rto, self.rto, 0]
                next_q += 1
            self._wait(0.002 if outstanding else 0.0)
            for h, data in self._results():
                j, i = slots.locate(h)
                q = i * W + j
                if h.msg_type != wire.MSG_RESULT or q >= total:
                    self.stats.stale_results += 1
                    continue
                if done[q]:
                    self.stats.duplicate_results += 1
                    continue
                expect = 0 if q < D else min(k, N - (q - D) * k)
                if h.count != expect or h.codec != codec.wire_codec:
                    self.stats.stale_results += 1
                    continue
                if h.flags & wire.FLAG_OVERFLOW:
                    overflow = True
                if exps is not None and q < nb:
                    agreed[q] = h.exp_next
                if q >= D:
                    lo = (q - D) * k
                    result[lo:lo + h.count] = wire.payload_view(data, h)
                done[q] = True
                ndone += 1
                o = outstanding.pop(q)
                if o[3] == 0:
                    self._rtt_sample(time.monotonic() - o[0])
                if progress is not None and ndone % report_every == 0:
                    progress(min(N, ndone * k))
            now = time.monotonic()
            if now >= next_scan:
                next_scan = now + 0.002
                self._resend_overdue(outstanding, build, lambda q: (slots.pid(q % W, q // W), slots.slot(q % W)), now)
        slots.commit(self, total=total)
        return self._end_python_loop(flat, result, exps, agreed, overflow, progress)

    def _allreduce_sparse(self, flat: np.ndarray, progress):
        """Block-sparse allreduce: the tensor is cut into blocks of k elements and block j travels on stream
        j mod S (S = min(W, blocks)), one slot per stream: round r of stream s is that slot's r-th use.

        Round 0 announces: each worker sends no elements, only its first non-zero block of the stream (and,
        for codecs with a shared scale, that block's exponent). Every later round is about the block the
        previous result named (the smallest next block over workers, with the max exponent of the workers
        holding it): its holders send it, the others send the header alone with their next block. The
        switch emits the block once every worker has moved past it. Unlike OmniReduce, a worker without the
        block still sends a header: it acknowledges the previous result, so two sets per slot are enough
        to recover any loss. Streams end on an even round (one padding round if needed), so each slot's
        sets keep alternating across calls."""
        codec, k, W, n = self.codec, self.k, self.window, self.world_size
        NONE = wire.BLOCK_NONE
        N = flat.size
        nb = -(-N // k)
        S = min(W, nb)
        if nb >= NONE - 1:
            raise ValueError(f"sparse allreduce: {nb} blocks of {k} elements; block ids are 32-bit")
        if codec.negotiates_exponent:
            exps = codec.flat_exponents(flat, k)
            held = exps != wire.EXP_NONE
        else:
            exps = None
            whole = N // k  # whole blocks through a view, the short last one apart: no copy of the tensor
            held = np.zeros(nb, dtype=bool)
            held[:whole] = flat[:whole * k].reshape(whole, k).any(axis=1)
            if whole < nb:
                held[whole] = flat[whole * k:].any()
        slots, seed, kind = self._begin_call(flat)
        if kind is not None:
            return self._run_c_loop(kind, flat, exps, seed, slots, progress, held)
        nonzero = np.flatnonzero(held)
        mine = [nonzero[nonzero % S == s].tolist() for s in range(S)]
        ptr, rounds = [0] * S, [0] * S
        target: list = [None] * S  # None: the announce round; NONE: the padding round
        exp_target = [wire.EXP_NONE] * S  # agreed exponent of the target block
        agreed = np.full(nb, wire.EXP_NONE, dtype=np.int16)
        result = np.zeros(nb * k, dtype=codec.result_dtype())
        overflow = False

        def upcoming(s: int, skip: int):
            i = ptr[s] + skip
            b = mine[s][i] if i < len(mine[s]) else NONE
            return b, int(exps[b]) if exps is not None and b != NONE else wire.EXP_NONE

        def holds_target(s: int) -> bool:
            return ptr[s] < len(mine[s]) and mine[s][ptr[s]] == target[s]

        def build(s: int) -> bytes:
            pid = slots.pid(s, rounds[s])
            exp_cur = exp_target[s] if exps is not None else 0
            block, count, payload = NONE, 0, b""
            if target[s] == NONE:
                nxt, exp_next = NONE, wire.EXP_NONE
            elif target[s] is not None and holds_target(s):
                block = target[s]
                lo, hi = block * k, min(block * k + k, N)
                data = flat[lo:hi]
                if exp_cur == wire.EXP_NONFINITE:
                    data = np.zeros(hi - lo, dtype=flat.dtype)  # everyone raises at the end
                payload, count = codec.encode(data, exp_cur, n, seed, lo), hi - lo
                nxt, exp_next = upcoming(s, 1)
            else:
                nxt, exp_next = upcoming(s, 0)
            return wire.pack_sparse(wire.MSG_SPARSE_UPDATE, self.job, self.rank, pid, slots.slot(s), pid & 1,
                                    count, codec.wire_codec, exp_cur, exp_next, 0, block, nxt, payload,
                                    self.session)

        outstanding: dict[int, list] = {}  # stream -> [first_sent, deadline, rto, tries]

        def send(s: int):
            self._send(build(s))
            now = time.monotonic()
            outstanding[s] = [now, now + self.rto, self.rto, 0]

        for s in range(S):
            send(s)
        emitted = 0
        next_scan = 0.0
        while outstanding:
            self._wait(0.002)
            for h, data in self._results():
                s, r = slots.locate(h)
                if h.msg_type != wire.MSG_SPARSE_RESULT or s >= S or r > rounds[s]:
                    self.stats.stale_results += 1
                    continue
                if r < rounds[s] or s not in outstanding:
                    self.stats.duplicate_results += 1
                    continue
                t = target[s]
                real = t is not None and t != NONE
                if h.codec != codec.wire_codec or h.block != (t if real else NONE) or (
                        h.count != (min(k, N - t * k) if real else 0)) or not (
                        h.next_block == NONE or (h.next_block % S == s and h.next_block < nb
                                                 and (not real or h.next_block > t))):
                    self.stats.stale_results += 1  # not what this round can be: never accepted
                    continue
                if h.flags & wire.FLAG_OVERFLOW:
                    overflow = True
                if real:
                    result[t * k:t * k + h.count] = wire.payload_view(data, h)
                    agreed[t] = h.exp_cur
                    emitted += 1
                    if holds_target(s):
                        ptr[s] += 1
                o = outstanding.pop(s)
                if o[3] == 0:
                    self._rtt_sample(time.monotonic() - o[0])
                rounds[s] += 1
                target[s], exp_target[s] = h.next_block, h.exp_next
                if h.next_block != NONE or rounds[s] % 2:
                    send(s)
                if progress is not None and real:
                    progress(min(N, emitted * k))
            now = time.monotonic()
            if now >= next_scan:
                next_scan = now + 0.002
                self._resend_overdue(outstanding, build, lambda s: (slots.pid(s, rounds[s]), slots.slot(s)), now)
        slots.commit(self, rounds=rounds)
        return self._end_python_loop(flat, result, exps, agreed, overflow, progress)

    def _begin_call(self, flat: np.ndarray):
        """This call's slots (CallSlots), RNG seed, and the C loop's kind for it (None: the Python loop)."""
        seed = rng.derive_seed(self.seed, self.job, self.rank, self._calls)
        self._calls += 1
        kind = fastpath.kind(self.codec, flat) if self.fast is not False else None
        return CallSlots(self._next_slot, self._uses), seed, kind

    def _run_c_loop(self, kind, flat, exps, seed: int, slots, progress, held=None) -> np.ndarray:
        result, agreed, overflow = fastpath.allreduce(self, kind, flat, exps, seed, slots, progress, held)
        self._check_result(exps, agreed, overflow)
        return fastpath.decode(kind, result, agreed, self.world_size, self.k, flat.dtype)

    def _end_python_loop(self, flat, result, exps, agreed, overflow: bool, progress) -> np.ndarray:
        if progress is not None:
            progress(flat.size)
        self._check_result(exps, agreed, overflow)
        values = self.codec.decode(result, agreed, self.world_size, self.k)[:flat.size]
        return values.astype(flat.dtype, copy=False)

    def _results(self):
        """Parsed datagrams waiting on the socket; a switch's MSG_ERROR ends the allreduce."""
        while (data := self._recv()) is not None:
            if not data:
                continue
            try:
                h = wire.unpack(data)
            except wire.WireError:
                continue
            if h.msg_type == wire.MSG_ERROR:
                self._broken = "switch error"
                raise INAError(data[wire.HEADER_SIZE:].decode(errors="replace"))
            if h.job != self.job or h.session != self.session:
                self.stats.stale_results += 1  # not of this job's generation
                continue
            yield h, data

    def _resend_overdue(self, outstanding: dict, build, where, now: float):
        """Rebuild and resend every packet whose timeout expired, backing off; give up after self.timeout.
        outstanding: key -> [first_sent, deadline, rto, tries]; where(key) = (packet id, slot) for errors."""
        for key, o in outstanding.items():
            if now < o[1]:
                continue
            if now - o[0] > self.timeout:
                raise TimeoutError(self.timeout_message(*where(key), o[3]))
            self._send(build(key))
            self.stats.retransmissions += 1
            o[2] = min(o[2] * 2, self.max_rto)
            o[1], o[3] = now + o[2], o[3] + 1

    def timeout_message(self, pid: int, slot: int, tries: int) -> str:
        return (f"rank {self.rank}: job {self.job}: no result for packet {pid} (slot {slot}) after {tries} "
                f"retransmissions in {self.timeout:g} s; a peer is dead, the switch is gone, the job was "
                f"re-joined elsewhere, or the ranks' calls differ (size, codec, sparse=)")

    def _check_result(self, exps, agreed, overflow):
        if exps is not None and np.any(agreed == wire.EXP_NONFINITE):
            raise ValueError("allreduce input contains NaN or Inf (on at least one worker)")
        if overflow:
            raise OverflowError(f"allreduce result overflows codec {self.codec.name!r}")

    def _rtt_sample(self, r: float):
        if self._srtt is None:
            self._srtt, self._rttvar = r, r / 2
        else:
            self._rttvar = 0.75 * self._rttvar + 0.25 * abs(self._srtt - r)
            self._srtt = 0.875 * self._srtt + 0.125 * r
        self.rto = min(max(self._srtt + 4 * self._rttvar, self.min_rto), self.max_rto)

    # ------------------------------------------------------------------ lifetime
    def close(self):
        """Leave the job (its ranks are free for a new generation at once) and close the socket."""
        try:
            self.sock.send(wire.pack(wire.MSG_LEAVE, job=self.job, rank=self.rank, session=self.session))
        except OSError:
            pass  # the switch learns it by the rank's silence
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class CallSlots:
    """Where one allreduce's packets go: its j-th lane (packet q's lane is q mod W, a sparse stream's is
    its index) uses slot (first + j) mod W, and that lane's i-th packet has the slot's packet id
    uses[slot] + i (mod 2^32), so every slot's ids run on without gaps whatever the calls in between."""

    def __init__(self, first: int, uses: np.ndarray):
        self.first, self.W, self.uses = first, uses.size, uses.copy()

    def slot(self, j: int) -> int:
        return (self.first + j) % self.W

    def pid(self, j: int, i: int) -> int:
        return (int(self.uses[self.slot(j)]) + i) & wire.PACKET_ID_MASK

    def locate(self, h) -> tuple[int, int]:
        """(lane, index) of a result; a lane >= W for a slot this worker does not use."""
        if h.slot >= self.W:
            return self.W, wire.PACKET_ID_MASK + 1
        return (h.slot - self.first) % self.W, (h.packet_id - int(self.uses[h.slot])) & wire.PACKET_ID_MASK

    def commit(self, comm, total: int | None = None, rounds=None):
        """After the call, move comm's slot counters on: a dense call sent packets 0..total-1 (lane j
        carries q = j, j + W, ...); a sparse one sent rounds[s] packets on stream s. The next call starts
        on the slot after the last lane used."""
        W = self.W
        used = rounds if rounds is not None else [total // W + (j < total % W) for j in range(W)]
        for j, n in enumerate(used):
            s = self.slot(j)
            comm._uses[s] = (int(self.uses[s]) + int(n)) & wire.PACKET_ID_MASK
        comm._next_slot = (self.first + (len(rounds) if rounds is not None else total)) % W


def _to_numpy(t):
    import torch

    t = t.detach().to("cpu")
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.float()
    return t.numpy()


def _from_numpy(a, like):
    import torch

    return torch.from_numpy(np.ascontiguousarray(a)).to(dtype=like.dtype, device=like.device)


def connect(switch, rank: int, world_size: int, job: int = 1, codec: str = "int32", **kwargs) -> Communicator:
    """Join `job` on the switch at "HOST:PORT" (blocks until all world_size ranks joined)."""
    return Communicator(switch, rank, world_size, job=job, codec=codec, **kwargs)
