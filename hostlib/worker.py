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

A call is exact on every rank or raises on every rank (protocol v3): every packet carries the call's
identity (call number, codec, length), which the switch checks across ranks; a rank whose call fails
before it is sent aborts it at the switch; the switch tells every member when the generation failed
(mismatch, abort, dead member), and the communicator re-joins on its next call. A heartbeat every
HEARTBEAT_EVERY seconds, in calls and between them, lets the switch tell a dead rank from a busy one.
"""
from __future__ import annotations

import functools
import sys
import threading
import time

import numpy as np

from inaproto import auth
from inaproto.timers import ABORT_WAIT, REFUSED_AFTER, SWITCH_SILENT
from inaproto.net import SHM_HOST, SOCKET_BUFFER, parse_address, shm_name, size_buffers  # noqa: F401 - public names

from . import cc as congestion
from . import errors, failures, fastpath, join, pyloop, rng, tensors, wire
from .channel import Channel, open_group, open_socket, parse
from .codecs import get_codec
from .codecs.base import extremes
from .errors import INAError
from .generation import Generation, Link, Outcome
from .heartbeat import HEARTBEAT_EVERY, Heartbeat  # noqa: F401 - HEARTBEAT_EVERY: public name
from .persistent import PersistentAllreduce
from .shm import ShmSocket
from .streams import DenseStream, RttEstimator, SparseStream
from .window import AUTO_WINDOW_MAX, IN_FLIGHT_BYTES, CommStats, auto_window  # noqa: F401 - public


def _of_generation(name: str, doc: str) -> property:
    """A read-only attribute of the current generation, by the name users know."""
    return property(lambda self: getattr(self.gen, name), doc=doc)


class Communicator:
    """One worker's connection to an INA switch for one job. Use `hostlib.connect(...)`."""

    group = None  # the socket on the job's loopback group (net.open_group), where the switch may multicast

    def __init__(self, switch, rank: int, world_size: int, job: int = 1, codec: str = "int32",
                 window: int | None = None, elements_per_packet: int | None = None, timeout: float = 30.0,
                 join_timeout: float | None = None, rto: float | None = None, max_rto: float = 0.1, seed: int = 0,
                 fast: bool | None = None, key: bytes | str | None = None, cc: str | None = None, **codec_params):
        """Join the job (a barrier) so that the first allreduce finds every rank admitted.

        Args:
            switch, rank, world_size, job, codec: as in `hostlib.connect`.
            window: slots to use at once (the switch may grant fewer: self.window after the join). None:
                as many packets as IN_FLIGHT_BYTES hold (auto_window), the same on every rank.
            elements_per_packet: elements per packet (default: the codec's), asked in the join: every rank must
                ask the same (the switch refuses the join otherwise), and the switch caps it at its limit.
            timeout: seconds without a result before an allreduce gives up.
            join_timeout: seconds to wait for every rank to join (default: timeout).
            rto, max_rto: floor and ceiling of the retransmission timeout, which follows the measured round
                trip between them (None: the policy's floor, cc.configure).
            cc: the congestion policy (hostlib/cc.py: "aimd", "ecn", or "none", SwitchML's fixed window;
                None: $INA_CC, else "aimd", "none" on loopback and shared memory: no path to follow).
            seed: base of the stochastic-rounding streams, so runs can be repeated bit for bit.
            fast: None for the C loop where it applies, False to force the Python loop.
            key: the job key (default $INA_JOB_KEY), needed when the switch serves the job with --key-file.
            **codec_params: options of the codec (e.g. rounding="deterministic" for nc).

        Raises:
            ValueError: rank, world_size, job or window out of range (checked before anything is sent).
            TimeoutError, INAError: as in `hostlib.connect`.
        """
        _check_args(rank, world_size, job, window)
        auto, window = window is None, AUTO_WINDOW_MAX if window is None else window
        shm = shm_name(switch)
        self.address = (SHM_HOST, shm) if shm is not None else parse_address(switch)
        self.rank, self.world_size, self.job = rank, world_size, job
        self.codec = get_codec(codec, **codec_params)
        self.policy, rto = congestion.configure(cc, shm is not None or self._on_loopback(shm), rto)
        # rto is the floor of the retransmission timeout; above it the timeout follows the measured round trip
        self.timeout, self.rtt = float(timeout), RttEstimator(rto, max_rto, self.policy)
        self.cc = congestion.Window(self.policy)  # the congestion window: a fresh one per generation
        self.seed = seed
        self._seed_base = rng.derive_seed(seed, job, rank)  # a call's seed: one more derive_seed step (_start)
        self.fast = fast  # None: the C loop where it applies; False: always the Python loop
        self.key = auth.check_key(key) if key is not None else auth.key_from_env()
        self.stats = CommStats()
        self.switch = switch if isinstance(switch, str) else f"{self.address[0]}:{self.address[1]}"
        self._calls = 0  # calls ever made: the RNG streams' counter (never reset)
        self.gen: Generation | None = None  # the join's state (set by _start_generation)
        self.link = Link()  # what this worker hears of the switch
        self._kept_results: dict = {}  # (size, dtype) -> results allreduce(x) returned (_result_buffer)
        self.c_frames = fastpath.Frames()  # the C loop's argument frames per call shape
        self._lock = threading.RLock()  # one call (or join) on the socket at a time
        self._asked = (window, auto, elements_per_packet)
        self._join_timeout = self.timeout if join_timeout is None else join_timeout
        self._open(shm)
        try:
            self._start_generation()
        except BaseException:
            self._heartbeat.stop()
            join.withdraw(self)
            self._close_sockets()
            raise

    @property
    def cc(self) -> congestion.Window:
        """The congestion window (hostlib/cc.py). A C loop call leaves its window in an ina_cc struct
        (cc_struct), read into the Window only when it is asked for here: calls in a row copy one struct in
        and out, not its fields one by one (microseconds a call)."""
        if self.cc_struct is not None:
            for name in congestion.FIELDS:
                setattr(self._cc, name, getattr(self.cc_struct, name))
            self.cc_struct = None
        return self._cc

    @cc.setter
    def cc(self, window: congestion.Window):
        self._cc, self.cc_struct = window, None

    def _across_network(self) -> bool:
        """A switch reached over a network (not loopback, not shared memory) under a congestion policy."""
        return not self.link.loopback and not isinstance(self.sock, ShmSocket) and self.policy != congestion.NONE

    def _on_loopback(self, shm: str | None) -> bool:
        return shm is None and self.address[0].startswith("127.")

    def _open(self, shm: str | None):
        """The sockets (or the shared-memory port), the channel over them and the heartbeat."""
        self.sock = open_socket(shm, self.address)
        self.group = open_group(shm, self.address, self.job, self.rank, self.key)
        self.link.loopback = self._on_loopback(shm)
        self.chan = Channel(self.sock, self.group, self.stats, self.link, on_mark=lambda: self.cc.mark())
        self._send, self._recv, self._wait = self.chan.send, self.chan.recv, self.chan.wait
        self._sock_closed = False
        self._heartbeat = Heartbeat(self.sock)

    def _start_generation(self):
        """Join (a barrier with every rank) and set up a fresh generation: window, slots, call numbers."""
        window, auto, elements_per_packet = self._asked
        elements = elements_per_packet or self.codec.default_elements
        if auto:  # every rank asks the same (same codec, packet size, world): the switch grants their minimum
            window = auto_window(window, elements * wire.ELEMENT_SIZE[self.codec.wire_codec], self.world_size,
                                 network=self._across_network())
        gen = join.join(self, window, self._join_timeout, elements)
        if not 1 <= gen.window <= min(window, 0xFFFF):  # the agreed window (join_ack) maps every rank's slots
            raise errors.JoinRejected(f"rank {self.rank}: switch {self.switch} granted window {gen.window}, "
                                      f"this worker asked {window}", switch=self.switch, job=self.job)
        self.gen = gen
        kept = {name: getattr(self.cc, name) for name in congestion.COUNTERS}
        self.cc = congestion.Window.fresh(self.policy, gen.window, gen.join_rtt)
        self.cc.__dict__.update(kept)
        self.rtt.seed(gen.join_rtt)
        self._heartbeat.set(wire.pack(wire.MSG_HEARTBEAT, job=self.job, rank=self.rank, session=gen.session,
                                      boot=gen.boot))

    # ------------------------------------------------------------------ the generation's, by name
    session = _of_generation("session", "The session every packet of this generation carries.")
    boot = _of_generation("boot", "The switch's boot id, from the join_ack.")
    window = _of_generation("window", "The agreed window (join_ack): slots in use at once.")
    max_elements = _of_generation("max_elements", "Elements per packet: what every rank asked, capped by the "
                                                  "switch (a call may use fewer).")
    k = max_elements

    @property
    def drop_notes(self) -> list[str]:
        """What the switch said of this generation's dropped packets (the last few)."""
        return self.gen.drop_notes if self.gen is not None else []

    # ------------------------------------------------------------------ helpers
    def addressing(self) -> tuple[int, int]:
        """(job, rank) as every packet of this worker carries them."""
        return self.job, self.rank

    def check_switch(self):
        """Raise SwitchUnreachable when the switch's port has refused for REFUSED_AFTER seconds with nothing
        heard since (UDP), or the shared-memory switch's process is gone."""
        gone = self.sock.switch_gone() if isinstance(self.sock, ShmSocket) else False
        since = self.link.refused_since
        if (since is not None and time.monotonic() - since >= REFUSED_AFTER) or gone:
            raise self.failure(Outcome("refused"))

    def check_silence(self):
        """Raise SwitchSilent when nothing came from the switch for SWITCH_SILENT seconds while this worker
        waits on it (the loops call this; silence is counted from the start of the call or join): the switch
        answers every heartbeat, so a live switch is never silent that long."""
        if self.link.silent_for() >= SWITCH_SILENT:
            raise self.failure(Outcome("silent"))

    def dropped_note(self, data) -> bool:
        """An ERR_DROPPED (the switch dropped a packet of this worker for a mistake, told once per reason):
        kept for the timeout's message, never an error by itself."""
        code, reason, text = wire.unpack_error(data)
        if len(data) == wire.HEADER_SIZE or code != wire.ERR_DROPPED:
            return False
        self.stats.switch_drops += 1
        self.gen.note_drop(text or wire.drop_reason(reason))
        return True

    def error_from_datagram(self, data) -> INAError:
        """The exception for a switch's MSG_ERROR datagram (from the Python or the C loop): failures.py."""
        return failures.from_datagram(self, data)

    def failure(self, outcome: Outcome, call=None) -> BaseException:
        """The exception for what stopped a call's stream or a wait on the switch (either loop), after the
        transition it makes of the call's generation (Generation.settle: the one place that decides)."""
        error = (self.error_from_datagram(outcome.error) if outcome.status == "switch_error" else
                 failures.of_outcome(self, outcome, call))
        gen = call.gen if call is not None else self.gen
        if gen is not None:
            gen.settle(outcome.status, error)
        return error

    # ------------------------------------------------------------------ allreduce
    def allreduce(self, x, progress=None, sparse: bool = False, out=None, codec=None, elements: int | None = None):
        """Sum x over all workers of the job.

        Args:
            x: numpy array or torch tensor (any shape). A CUDA tensor with codec nc or dither is encoded and
                decoded on its GPU (hostlib.cuda: 1 byte per element crosses to the host) where the CUDA
                kernels are built; other CUDA tensors go through host memory.
            progress: optional callable, called with the number of elements done so far.
            sparse: block-sparse INA (OmniReduce-style): only blocks of elements_per_packet elements that
                are non-zero on this worker carry data; every worker of the job must pass the same flag.
            out: where to write the sum: an array or tensor of x's type, shape and dtype; x itself for an
                in-place allreduce (as torch.distributed.all_reduce). The C loop writes each result into a
                contiguous out as it arrives, so no pass over the tensor and no fresh pages follow the
                last result. After an error, the exception's `landed` (the C loop; else None: out untouched)
                is a bool per block of `elements` elements: whether out holds that block's sum already (the
                other blocks hold what they held, x's own values when out is x).
            codec: this call's codec (a name or a Codec; default the connection's): part of the call's
                identity, so every rank must pass the same; one join serves every codec.
            elements: this call's elements per packet (default and at most the joined max_elements).
        Returns:
            The sum, of x's type, shape and dtype, the same on every worker (out, when given).
        Raises:
            CollectiveError: the call failed on every rank: CallMismatch (the ranks' calls differ: number,
                codec or length), CallAborted (a peer's call failed on its own input), PeerDead (a peer is
                silent or left). The next call re-joins and is exact.
            SwitchFault: SwitchUnreachable (nothing listens: connection refused, or the shm switch exited),
                SwitchRestarted (another boot id), NotMember (the job re-formed without this worker).
            CallTimeout: no result within `timeout` although the switch and the peers seem alive.
            INAError: a join on the next call failed (JoinRejected, RankTaken, CallTimeout).
            TypeError: a dtype the codec does not carry (floats with int32, integers with fixed or nc);
                ValueError / OverflowError: an input the codec cannot carry. These local errors abort the
                call at the switch first, so every peer raises CallAborted naming this rank.
            ValueError: NaN/Inf on some worker; OverflowError: the sum does not fit the codec (agreed:
                every rank raises the same).
            RuntimeError: a corrupt result earlier: reconnect.
        """
        return self._call(self._codec(codec), sparse, tensors.numel(x), elements, self._allreduce, x, progress, sparse,
                          out)

    def allreduce_init(self, flat: np.ndarray, codec=None, elements: int | None = None,
                       keep_tail: bool = False) -> PersistentAllreduce:
        """A persistent allreduce of flat (MPI 4's MPI_Allreduce_init): calling it sums flat in place, as
        allreduce(flat, out=flat, codec=codec, elements=elements), with what that call works out each time made
        once. flat: contiguous, writable, 1-D, of the codec's own dtype (float32 for fixed and nc, int32 for
        int32), alive and unmoved while it is used. keep_tail: see hostlib/persistent.py."""
        codec = self._codec(codec)
        return PersistentAllreduce(self, flat, codec, elements, keep_tail, self._c_loop_kind(codec, flat))

    def persistent_call(self, p: PersistentAllreduce) -> np.ndarray:
        """One call of p, with the C loop (p.kind), on p's frame."""
        return self._call(p.codec, False, p.flat.size, p.elements, self._persistent, p)

    def _persistent(self, call, p: PersistentAllreduce) -> np.ndarray:
        start, flat = time.perf_counter(), p.flat  # as _timed, without its closure: a small call's Python
        exps = p.codec.flat_exponents(flat, call.k) if p.codec.negotiates_exponent else None
        self._start(call, None)  # the call's seed and slots (the kind is p's)
        self._run_c_loop(call, p.kind, flat, exps, None, dst=flat, bound=p.frame(self, call))
        p.succeeded()
        self.stats.called(time.perf_counter() - start, flat.size, self._heartbeat.sent())
        return flat

    def _call(self, codec, sparse: bool, n: int, elements: int | None, body, *args):
        """body(call, *args) as this connection's next call: the call's identity, and what its failure does
        (the switch aborts it on every rank, or the generation's failure is taken)."""
        with self._lock:
            self._enter_call()
            call = self.gen.call(wire.call_kind(codec.name, sparse), n, codec, elements or self.gen.max_elements)
            try:
                if call.length > wire.MAX_CALL_LEN:
                    raise ValueError(f"allreduce of {call.length} elements: at most {wire.MAX_CALL_LEN} per "
                                     f"call (split the tensor)")
                return body(call, *args)
            except BaseException as e:
                if isinstance(e, errors.CallTimeout):
                    self._abort(e, call)  # a late peer's call then fails naming this rank, which gave up waiting
                if isinstance(e, INAError):
                    call.gen.take_pending()  # this call reported the generation's failure
                elif not call.done:
                    self._abort(e, call)
                raise
            finally:
                call.gen.called()

    def lands_blocks(self, flat: np.ndarray, codec=None) -> bool:
        """Whether allreduce(flat, out=flat, codec=codec) writes each block's sum into out as its result lands
        (the C loop), so a failed call's exception says which blocks hold their sum (`landed`); otherwise out
        is written once the call completed (the Python loop)."""
        return self._c_loop_kind(self._codec(codec), flat) is not None

    def _codec(self, codec):
        """A call's codec: the connection's, or one named or given."""
        return self.codec if codec is None else get_codec(codec) if isinstance(codec, str) else codec

    def _c_loop_kind(self, codec, flat: np.ndarray | None):
        """The C loop's kind for flat with codec, or None: the Python loop (always for flat None)."""
        use_c = self.fast is not False and flat is not None and flat.size > 0
        return fastpath.kind(codec, flat) if use_c else None

    def _enter_call(self):
        """Before a call: an error the switch sent since the last call fails this one (it failed on the
        peers too); a generation that is gone is joined again."""
        gen = self.gen
        if gen.state == "broken":
            raise RuntimeError("communicator unusable after an earlier failure (corrupt result); reconnect")
        if gen.pending is None and not gen.ended and self.chan.waiting():
            self._drain()
        if gen.pending is not None:
            raise gen.take_pending()
        if gen.ended:  # this rank raised the generation's failure already: what waits is stale
            self._drain(stale=True)
            self._start_generation()
        self.link.start_waiting()  # silence counts from here (SWITCH_SILENT)

    def _drain(self, stale: bool = False):
        """Take what waits on the socket between calls: an error of this generation becomes pending; the
        rest (late duplicates of results) is stale."""
        while (data := self._recv()) is not None:
            h = parse(data)
            if h is not None and (h.msg_type == wire.MSG_HEARTBEAT or
                                  h.msg_type == wire.MSG_ERROR and self.dropped_note(data)):
                continue
            if (not stale and h is not None and h.msg_type == wire.MSG_ERROR and h.job == self.job
                    and h.session == self.gen.session):
                self.gen.settle("pending", self.error_from_datagram(data))
            elif data:
                self.stats.stale_results += 1

    def _abort(self, exc: BaseException, call):
        """This rank's call failed on its own (its input, an interrupt): tell the switch, which fails the
        call on every rank (CallAborted naming this rank); wait up to ABORT_WAIT for its confirmation. A
        call that timed out aborts too (its generation is given up already), so a peer that comes late
        fails naming this rank and why, instead of waiting for a rank that no longer waits."""
        gen = call.gen
        if gen.ended and not isinstance(exc, errors.CallTimeout):
            return  # the generation is gone already
        gen.settle("aborted")
        reason = f"{type(exc).__name__}: {exc}".encode()[:wire.MAX_ABORT_TEXT]
        session, kind, number, length, boot = call.fields()
        abort = wire.pack(wire.MSG_ABORT, job=self.job, rank=self.rank, session=session, payload=reason,
                          call_kind=kind, call=number, call_len=length, boot=boot)
        deadline = time.monotonic() + ABORT_WAIT
        while time.monotonic() < deadline:
            self._send(abort)
            until = min(time.monotonic() + 0.1, deadline)
            while time.monotonic() < until:
                self._wait(until - time.monotonic())
                while (data := self._recv()) is not None:
                    h = parse(data)
                    if h is not None and h.msg_type == wire.MSG_ERROR and h.session == session:
                        return  # the switch failed the generation: every member is told
                if self.link.refused_since is not None:
                    return

    def _allreduce(self, call, x, progress, sparse, out):
        torch_like = type(x).__module__.startswith("torch")
        if torch_like and not sparse and x.numel() and tensors.on_gpu_path(call.codec, x):
            return self._timed(functools.partial(self._allreduce_cuda, call, x, progress), x.numel())
        arr = tensors.to_numpy(x) if torch_like else np.asarray(x)
        flat = np.ascontiguousarray(arr).reshape(-1)
        call.codec.check_input(flat)
        dst = tensors.out_view(out, x, arr) if out is not None else None
        if sparse and flat.size:
            run = functools.partial(self._allreduce_sparse, call, flat, progress)
        else:
            run = functools.partial(self._allreduce_flat, call, flat, progress, dst)
        res = self._timed(run, flat.size)
        if out is None:
            res = res.reshape(arr.shape)
            return tensors.from_numpy(res, x) if torch_like else res
        if dst is None or not isinstance(res, np.ndarray) or not np.shares_memory(res, dst):  # res: a GPU tensor
            tensors.copy_into(out, res, arr.shape)
        return out

    def _timed(self, run, elements: int):
        """run() counted in the stats."""
        start = time.perf_counter()
        out = run()
        self.stats.called(time.perf_counter() - start, elements, self._heartbeat.sent())
        return out

    def _allreduce_cuda(self, call, x, progress):
        """A CUDA tensor with nc/dither (hostlib.cuda): exponents and codes made on the GPU, each block with
        the floor of this worker's own exponent; the Python loop sends each block's codes with the floor
        raised to the agreed exponent's; the result codes are decoded on the GPU into x's dtype and shape."""
        from . import cuda

        flat = x.detach().reshape(-1)
        exps_dev, exps = cuda.own_exponents(flat, call.k)
        exps = call.codec.check_exponents(exps)
        self._start(call, None)
        codes = cuda.precode(flat, exps_dev, call.codec, call.k, call.seed)
        stream = DenseStream(self, call, codes, exps)
        stream.codec = cuda.PrecodedNC(call.codec)  # the stream sends the codes as they are
        pyloop.drive(self, stream, progress)
        return cuda.decode_like(stream.result[:stream.N], x)

    def _allreduce_flat(self, call, flat: np.ndarray, progress, dst=None):
        codec = call.codec
        exps = codec.flat_exponents(flat, call.k) if codec.negotiates_exponent else None
        kind = self._start(call, flat)
        if kind is not None:
            return self._run_c_loop(call, kind, flat, exps, progress, dst=dst)
        return pyloop.window_loop(self, DenseStream(self, call, flat, exps), progress)

    def _allreduce_sparse(self, call, flat: np.ndarray, progress):
        """Block-sparse allreduce (streams.SparseStream says how): blocks of k elements, only the non-zero
        ones carry data."""
        k, N = call.k, flat.size
        nb = -(-N // k)
        if nb >= wire.BLOCK_NONE - 1:
            raise ValueError(f"sparse allreduce: {nb} blocks of {k} elements; block ids are 32-bit")
        if call.codec.negotiates_exponent:
            exps = call.codec.flat_exponents(flat, k)
            held = exps != wire.EXP_NONE
        else:
            exps = None
            whole = N // k  # whole blocks through a view, the short last one apart: no copy of the tensor
            held = np.zeros(nb, dtype=bool)
            held[:whole] = flat[:whole * k].reshape(whole, k).any(axis=1)
            if whole < nb:
                held[whole] = flat[whole * k:].any()
        kind = self._start(call, flat)
        if kind is not None:
            return self._run_c_loop(call, kind, flat, exps, progress, held)
        return pyloop.window_loop(self, SparseStream(self, call, flat, exps, held), progress)

    def _start(self, call, flat: np.ndarray | None):
        """The call starts: its RNG seed and slots; returns the C loop's kind for flat (None: the Python
        loop, always for flat None)."""
        call.start(rng.key(self._seed_base ^ (self._calls & rng.MASK64)))  # derive_seed(seed, job, rank, calls)
        self._calls += 1
        return self._c_loop_kind(call.codec, flat)

    def _run_c_loop(self, call, kind, flat, exps, progress, held=None, dst=None, bound=None) -> np.ndarray:
        """The C loop; dense, it decodes each result into dst (the caller's out, where its dtype is the
        loop's) or a result buffer as it arrives. bound: a persistent call's frame (dst is flat)."""
        into_out = held is None and dst is not None and dst.dtype == fastpath.out_dtype(kind)
        if held is None and not into_out:
            dst = self._result_buffer(flat.size, fastpath.out_dtype(kind))
        try:
            try:
                outcome = fastpath.allreduce(self, call, kind, flat, exps, progress, held,
                                             out=None if held is not None else dst, bound=bound)
            except BaseException as e:  # an interrupt between the loop's chunks
                if getattr(e, "outcome", None) is not None:
                    self.learn(e.outcome, call)
                raise
            self.learn(outcome, call)
            if outcome.pending is not None:  # the call completed; the next one raises the failure (_results)
                call.gen.settle("pending", self.error_from_datagram(outcome.pending))
            if outcome.status != "done":
                error = self.failure(outcome, call)
                error.landed = outcome.landed
                raise error
        except BaseException as e:  # e.landed: the blocks of the caller's out that hold their sum
            e.landed = getattr(e, "landed", None) if into_out else None
            raise
        self.check_result(call, exps, outcome.agreed, outcome.overflow)
        if held is not None:
            return fastpath.decode(kind, outcome.result, outcome.agreed, self.world_size, call.k, flat.dtype)
        return dst.astype(flat.dtype, copy=False)

    def learn(self, outcome: Outcome, call):
        """What the C loop learned on the way (its Outcome): counters, the drop note, the offloads the kernel
        refused, the round-trip estimate, when the switch was last heard, where the call's slots go on."""
        s = self.stats
        for name, n in outcome.counters.items():
            if name == "repairs":
                s.repairs = [a + b for a, b in zip(s.repairs, n)]
            else:
                setattr(s, name, getattr(s, name) + n)
        if outcome.drop_note is not None:
            call.gen.note_drop(outcome.drop_note)
        self.link.gso_ok, self.link.gro_ok = self.link.gso_ok and outcome.gso_ok, self.link.gro_ok and outcome.gro_ok
        if outcome.rtt is not None:
            self.rtt.srtt, self.rtt.rttvar, self.rtt.rto, self.rtt.min_rto = outcome.rtt
        if outcome.cc is not None:
            self.cc_struct = outcome.cc
        if outcome.heard_at is not None and outcome.heard_at > self.link.heard_at:
            self.link.heard_at = outcome.heard_at
            self.link.refused_since = None
        if outcome.status == "refused" and not isinstance(self.sock, ShmSocket):
            self.link.refused()  # refused() words it "connection refused"
        if outcome.total is not None or outcome.rounds is not None:
            call.gen.advance(call.slots, total=outcome.total, rounds=outcome.rounds)

    def _result_buffer(self, n: int, dtype) -> np.ndarray:
        """Where allreduce(x) without out decodes: one of the arrays earlier calls of this size returned that
        nobody holds (nor a view of it) any more, else a new one; two are kept, so `y = allreduce(x)` in a
        loop (the last y still held during the call) takes turns between two. A fresh 64 MiB array costs
        its page faults inside the call."""
        key = (n, np.dtype(dtype))
        kept = self._kept_results.get(key, [])
        for buf in kept:
            if sys.getrefcount(buf) == 3:  # the list, the loop variable, getrefcount's argument: no one else
                return buf
        buf = np.empty(n, dtype)
        self._kept_results = {key: (kept + [buf])[-2:]}  # one size kept: a job's calls mostly repeat theirs
        return buf

    def check_result(self, call, exps, agreed, overflow):
        """The call is complete on the wire: what it raises now, every rank raises (no abort)."""
        call.done = True
        if exps is not None and agreed.size and extremes(agreed)[1] == wire.EXP_NONFINITE:  # the largest exponent
            raise ValueError("allreduce input contains NaN or Inf (on at least one worker)")
        if overflow:
            raise OverflowError(f"allreduce result overflows codec {call.codec.name!r}")

    # ------------------------------------------------------------------ lifetime
    def close(self):
        """Leave the job and close the socket, so the ranks are free for a new generation at once instead
        of after the switch notices the silence. Best effort: a lost leave is not an error."""
        self._heartbeat.stop()  # before the socket goes: the heartbeat thread sends on it
        with self._lock:
            self._leave_and_close()

    def _leave_and_close(self):
        if self._sock_closed:
            return
        self._sock_closed = True
        self.stats.heartbeats = self._heartbeat.sent()
        try:
            self.sock.send(wire.pack(wire.MSG_LEAVE, job=self.job, rank=self.rank, session=self.session,
                                     boot=self.boot))
        except OSError:
            pass  # the switch learns it by the rank's silence
        self._close_sockets()

    def _close_sockets(self):
        self.sock.close()
        if self.group is not None:
            self.group.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _check_args(rank: int, world_size: int, job: int, window: int | None):
    """Raise ValueError before anything is sent."""
    if not 1 <= world_size <= wire.MAX_WORKERS:
        raise ValueError(f"world_size must be in 1..{wire.MAX_WORKERS}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world_size {world_size}")
    if not 0 <= job <= 0xFFFF:
        raise ValueError("job id must be in 0..65535")
    if window is not None and window < 1:
        raise ValueError("window must be >= 1")


def connect(switch, rank: int, world_size: int, job: int = 1, codec: str = "int32", **kwargs) -> Communicator:
    """Join `job` on the switch and return the worker's Communicator (a barrier: every rank must connect).

    Args:
        switch: "HOST:PORT" or (host, port) of the switch, or "shm://NAME" for a switch on this host serving
            shared-memory rings (`switchsim serve --backend c --shm NAME`).
        rank, world_size: this worker's rank in 0..world_size-1; the job's size (the switch's --job ID:N).
        job: the switch job id (0..65535).
        codec: "int32" (exact), "fixed" (SwitchML fixed point), "nc" (natural compression) or "dither"
            (natural dithering as NC codes).
        **kwargs: window, elements_per_packet, timeout, join_timeout, rto, max_rto, seed, fast, key (the
            job key; default $INA_JOB_KEY), and codec options (rounding="deterministic" for nc,
            rounding="stochastic" for fixed, levels=s for dither).
    Returns:
        Communicator: use `allreduce`, then `close()` (or a `with` block), which frees the rank.
    Raises:
        TimeoutError: the switch is unreachable or a rank did not join in time.
        INAError: the switch refused the join (unknown job, wrong world size, bad MAC).
    """
    return Communicator(switch, rank, world_size, job=job, codec=codec, **kwargs)
