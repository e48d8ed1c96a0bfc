"""The "ina" process group's failure protocol, in one object (as torchft's Manager keeps failure policy apart
from its ProcessGroup wrapper): when the switch is joined, what the ranks do through the c10d store when it
fails under a call, and when they go back to it. docs/protocol.md, "The torch backend's failover", is its
specification and docs/failover.svg its state diagram (tools/draw_architecture.py draws it from STATES and
TRANSITIONS below).

A call through the switch completes on every rank or on none while the switch lives (protocol v3), so a
working call costs no store operation. Only two steps use the store: a join, whose outcome every rank votes
(CallVote), and a recovery, where every rank publishes where it stands (Place) and all make the same
decisions from the same published numbers (Recovery, Failover.recover).
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import os
import threading
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import errors
from ..worker import Communicator

RETRY_EVERY = 50  # calls on gloo between two attempts to re-join the switch ($INA_RETRY_EVERY)
RECOVERY_POLL = 0.2  # seconds between the watcher's looks for another rank's recovery ($INA_RECOVERY_POLL)
COUNTERS = ("gloo_calls", "faults", "rejoins", "failed_rejoins", "recovered_results", "landed_sums")  # ina_stats
SWITCH_FAULTS = (errors.SwitchFault, OSError)  # OSError: CallTimeout, SwitchUnreachable, a dead route
# a join refused for a passing reason is a fault too (gloo now, the switch again later): a shared switch's
# pool lent to other jobs
PASSING_REFUSALS = (errors.PoolFull,)
log = logging.getLogger("hostlib.integrations.torch_backend")  # one logger for the backend, whatever module


class State(enum.Enum):
    """Where a group's sums go."""

    JOINING = "joining"  # init_process_group: the first join, voted
    JOINED = "joined"  # through the switch
    RECOVERING = "recovering"  # the switch failed under a call: the ranks agree through the store
    ON_GLOO = "on gloo"  # through the fallback gloo group; a re-join every retry_every calls
    CLOSED = "closed"  # shutdown


# (from, to, what makes it): every transition Failover makes, and nothing else (tests/test_torch_failover.py)
TRANSITIONS = (
    (State.JOINING, State.JOINED, "every rank joined (vote ok)"),
    (State.JOINING, State.ON_GLOO, "a rank could not reach the switch or its pool is full (vote fault, not strict)"),
    (State.JOINED, State.RECOVERING, "a switch fault under a call, or another rank's recovery (watcher)"),
    (State.RECOVERING, State.ON_GLOO, "places agreed: kept sum handed over, landed blocks, or gloo"),
    (State.RECOVERING, State.JOINED, "another rank raised the call's error: CallAborted here too"),
    (State.ON_GLOO, State.JOINED, "re-join at retry_at, every rank ok"),
    (State.ON_GLOO, State.ON_GLOO, "a re-join failed on some rank: next try retry_every calls later"),
    (State.ON_GLOO, State.RECOVERING, "another rank's recovery seen by the watcher (idle here)"),
)
ENDS = (State.JOINING, State.JOINED, State.RECOVERING, State.ON_GLOO)  # -> CLOSED at shutdown


class CallVote:
    """Every rank's outcome of a join ("ok", "fault", "error"), agreed through the c10d store: the join is
    the one step whose outcome is voted (at init_process_group and when re-joining after a fault), never a
    call. Each rank adds its outcome to the key's counter (one round trip); the last to arrive writes the
    verdict (any error > any fault > ok), which the others read, and deletes the previous vote's keys, which
    every rank has read since it voted on this one. A rank whose own outcome is an error does not wait."""

    FIELD = {"ok": 1, "fault": 1 << 20, "error": 1 << 40}
    MASK = (1 << 20) - 1

    def __init__(self, store, size: int):
        self.store, self.size = store, size
        self.votes, self.seconds = 0, 0.0
        self._previous: str | None = None

    def __call__(self, key: str, outcome: str) -> str:
        start = time.perf_counter()
        total = self.store.add(key, self.FIELD[outcome])
        ok, fault, error = total & self.MASK, total >> 20 & self.MASK, total >> 40
        if ok + fault + error == self.size:
            verdict = "error" if error else "fault" if fault else "ok"
            self.store.set(key + "/verdict", verdict)
            if self._previous is not None:
                self.store.delete_key(self._previous)
                self.store.delete_key(self._previous + "/verdict")
        elif outcome == "error":
            verdict = "error"
        else:
            verdict = self.store.get(key + "/verdict").decode()
        self._previous = key
        self.votes += 1
        self.seconds += time.perf_counter() - start
        return verdict


@dataclasses.dataclass
class Place:
    """Where a rank stands when the switch fails (Recovery.agree publishes it): the call it failed on (or
    would make next: idle), its length, the element from which its result of that call is missing (the C
    loop writes each block's sum in place as it lands: the blocks before hold their sum; 0 when none landed
    or the input was copied), how many blocks landed, and the element from which it kept the previous call's
    sum (-1: nothing kept)."""

    call: int
    numel: int = 0
    missing_from: int = 0
    landed: int = 0
    kept_from: int = -1
    idle: bool = False

    def said(self) -> str:
        return f"{self.call} {self.numel} {self.missing_from} {self.landed} {self.kept_from} {int(self.idle)}"

    @classmethod
    def heard(cls, text: str) -> "Place":
        call, numel, missing_from, landed, kept_from, idle = (int(v) for v in text.split())
        return cls(call, numel, missing_from, landed, kept_from, bool(idle))


@dataclasses.dataclass
class Kept:
    """What a rank keeps of its last successful call's sum for a recovery: from element `start` on (a rank
    whose call failed lacks at most the last window's blocks), a tensor or an array."""

    call: int
    start: int
    total: object


class Recovery:
    """The store's side of a recovery. A call through the switch completes on every rank or on none while the
    switch lives; if it dies as call m ends, some ranks may hold m's result and go on to call m+1, which then
    fails on them, while the others fail on m: each rank publishes its Place, every rank reads all of them,
    so all know m (the lowest) and who is at m+1. The epoch (faults so far, the same count on every rank)
    keeps one fault's keys apart from the next's."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta):
        self.store, self.rank, self.size, self.timeout = store, rank, size, timeout
        self.epoch = 0
        self.seconds = 0.0

    def begun(self, epoch: int) -> bool:
        """Whether some rank has begun recovery `epoch` (the watcher's poll: one store check)."""
        return self.store.check([f"recover/{epoch}/begun"])

    def note_error(self, call: int):
        """This rank raises call `call`'s error (every rank does, but a rank whose switch failed under the
        same call waits in agree(): it learns here that the call failed, and raises too). Failure path only."""
        self.store.set(f"recover/{self.epoch}/{self.rank}", f"error {call}")
        self.epoch += 1

    def agree(self, place: Place) -> list[Place]:
        """Publish where this rank is; every rank's, in rank order.

        Raises:
            CallAborted: another rank raised an error instead (its call failed at the switch before it died).
        """
        start = time.perf_counter()
        prefix = f"recover/{self.epoch}/"
        self.epoch += 1
        self.store.set(prefix + "begun", "1")
        self.store.set(prefix + str(self.rank), place.said())
        keys = [prefix + str(r) for r in range(self.size)]
        self.store.wait(keys, self.timeout)
        said = [self.store.get(k).decode() for k in keys]
        self.seconds += time.perf_counter() - start
        raised = [r for r, v in enumerate(said) if v.startswith("error")]
        if raised:
            raise errors.CallAborted(f"rank {self.rank}: call {place.call} failed at the switch on rank "
                                     f"{raised[0]} ({said[raised[0]]}); it is raised here too", rank=raised[0])
        places = [Place.heard(v) for v in said]
        low = min(p.call for p in places)
        if any(p.call not in (low, low + 1) for p in places):
            raise RuntimeError(f"process group 'ina': ranks failed on calls {[p.call for p in places]} (more than "
                               f"one call apart); the switch's fault cannot be recovered")
        return places


class Failover:
    """One group's connection to the switch and what happens when it fails: the joins (voted), the recovery
    (agreed), the fallback gloo group and the re-join schedule. The call path asks `connection(n)` before each
    call and hands a fault to `recover`, whose result is the call's sum (or None); `state` says where sums go.

    Counters (ina_stats): faults, rejoins, failed_rejoins, recovered_results, landed_sums, gloo_calls."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta, switch: str, job: int, codec: str,
                 connect_kwargs: dict, retry_every: int | None = None, on_drop=None):
        self.rank, self.size, self.switch, self.job, self.codec = rank, size, switch, job, codec
        self.connect_kwargs = connect_kwargs
        self.retry_every = max(1, int(os.environ.get("INA_RETRY_EVERY", RETRY_EVERY)) if retry_every is None
                               else retry_every)
        self.recovery_poll = float(os.environ.get("INA_RECOVERY_POLL", RECOVERY_POLL))
        # the votes, the recovery and the fallback's gloo are this group's own: the worker thread alone uses
        # them, in call order, so every rank issues the same sequence whatever the caller's thread does
        ina_store = dist.PrefixStore("ina/", store)
        self.vote = CallVote(ina_store, size)
        self.recovery = Recovery(ina_store, rank, size, timeout)
        self.fallback = dist.ProcessGroupGloo(dist.PrefixStore("ina-fallback/", store), rank, size, timeout)
        self.state = State.JOINING
        self.comm: Communicator | None = None
        self.retry_at = 0  # on gloo: the call that joins again
        self.last_fault: str | None = None
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._on_drop = on_drop  # the call path's per-connection state goes with the connection
        self._was = State.JOINING  # the state before the last transition (a recovery begun on gloo)
        self._warned = False
        self._joins = 0
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None

    def _move(self, to: State):
        if (self.state, to) not in _ALLOWED and to is not State.CLOSED:
            raise RuntimeError(f"process group 'ina': no transition {self.state.value} -> {to.value}")
        self._was, self.state = self.state, to

    # ------------------------------------------------------------------ joins
    def start(self, strict: bool):
        """The first join, voted by every rank: joined, or on gloo from call 0 (a switch that cannot be reached
        and not strict).

        Raises:
            INAError: this rank's join was refused (or, strict, the switch unreachable); RuntimeError: another
                rank's was.
        """
        outcome, error = self._try_join(initial=True)
        verdict = self.vote("join", outcome)
        if verdict == "ok":
            self._move(State.JOINED)
            log.info("process group 'ina': rank %d joined switch %s (job %d, codec %s)", self.rank, self.switch,
                     self.job, self.codec)
            return
        self._drop_comm()
        if outcome == "error":
            raise error
        if verdict == "error":
            raise RuntimeError(f"process group 'ina': another rank failed to join the switch at {self.switch}")
        if strict:
            raise errors.SwitchUnreachable(f"process group 'ina' (INA_STRICT=1): cannot join switch {self.switch}"
                                           f": {error or 'a switch fault on another rank'}", switch=self.switch,
                                           job=self.job)
        self._go_to_gloo(error, at=0)

    def connection(self, n: int) -> Communicator | None:
        """The connection call n (the same number on every rank) goes through, or None: gloo. On gloo, call
        retry_at tries a re-join (one vote), so every rank goes back at the same call or none does."""
        if self.comm is None and n >= self.retry_at:
            self._rejoin(n)
        return self.comm

    def _rejoin(self, n: int) -> bool:
        outcome, error = self._try_join(initial=False)
        if self.vote(f"call/{n}", outcome) == "ok":
            self._move(State.JOINED)
            self.counters["rejoins"] += 1
            log.warning("process group 'ina': rank %d re-joined switch %s at call %d: sums go through the switch "
                        "again", self.rank, self.switch, n)
            return True
        self._go_to_gloo(error, at=n)
        return False

    def _try_join(self, initial: bool):
        """Join once every rank is ready (a store barrier, so the switch's join barrier never waits for a rank
        that is still computing). Returns ("ok" | "fault" | "error", the exception or None): unreachable is a
        fault, and so is a full pool (PoolFull: other jobs hold a shared switch's slots for now); another
        refused join an error at init_process_group, a fault when re-joining (the restarted switch may serve
        other jobs: training goes on)."""
        self.vote(f"ready/{self._joins}", "ok")
        self._joins += 1
        try:
            self.comm = Communicator(self.switch, self.rank, self.size, job=self.job, codec=self.codec,
                                     **self.connect_kwargs)
            return "ok", None
        except (*SWITCH_FAULTS, *PASSING_REFUSALS) as e:
            return "fault", e
        except errors.INAError as e:
            return ("error" if initial else "fault"), e
        except Exception as e:  # noqa: BLE001 - a bad option: raised at init_process_group
            return "error", e

    # ------------------------------------------------------------------ faults
    def raised(self, n: int):
        """Call n raises a CollectiveError or an input error on every rank: a rank whose switch failed under
        the same call learns it in its recovery and raises it too."""
        self.recovery.note_error(n)

    def recover(self, n: int, place: Place, x: torch.Tensor | None, mask: torch.Tensor | None,
                kept: Kept | None, error: BaseException | None) -> torch.Tensor | None:
        """The switch failed under call n on this rank (x: its input, the blocks where mask is set holding
        their sum), or another rank's did while this one was idle (x None, from the watcher): agree on where
        each rank is, then one of three: hand call n-1's kept sum to the ranks that missed part of it, build
        call n's sum from the blocks that landed, or sum call n on gloo; then go on through gloo. Returns
        call n's sum on this rank (None when idle)."""
        self._move(State.RECOVERING)
        try:
            places = self.recovery.agree(place)
        except Exception:
            self._move(self._was)  # the call failed at the switch (the Communicator re-joins), or cannot be recovered
            raise
        low = min(p.call for p in places)
        ahead = [r for r, p in enumerate(places) if p.call == low + 1]
        self._go_to_gloo(error, at=max(p.call for p in places))
        if ahead:  # call `low` completed on the ranks in `ahead`: the part others lack goes to them
            result = self._hand_over(n, low, places, ahead[0], kept, x, mask)
            if n == low:
                self.counters["recovered_results"] += 1
                return result
        elif any(p.landed for p in places):  # every rank is in call n: the blocks that landed are its sums
            return self._landed_sum(x, mask, places)
        return None if x is None else self.gloo_sum(x)

    def _hand_over(self, n, low, places, src, kept, x, mask):
        """Call `low`'s sum from rank src (which completed it) to the ranks at `low`: the elements from the
        first any of them misses, broadcast on the fallback gloo group; a rank at low returns its sum."""
        need = min(p.missing_from for p in places if p.call == low)
        if places[src].kept_from < 0 or places[src].kept_from > need:
            raise RuntimeError(f"process group 'ina': call {low}'s sum is needed from element {need}, rank {src} "
                               f"kept it from element {places[src].kept_from}: the fault cannot be recovered")
        if self.rank == src:
            part = torch.as_tensor(kept.total[need - kept.start:]).contiguous()
        else:  # a rank at low + 1 completed low: it kept (part of) its sum
            numel = next(p.numel for p in places if p.call == low)
            part = torch.empty(numel - need, dtype=x.dtype if n == low else torch.as_tensor(kept.total).dtype)
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.fallback.broadcast([part], opts).wait()
        if n != low:
            return None
        if mask is None:
            result = torch.empty_like(x)
            result[need:] = part
            return result
        missing = ~mask[need:]
        x[need:][missing] = part[missing]
        return x

    def _landed_sum(self, x: torch.Tensor, mask: torch.Tensor | None, places) -> torch.Tensor:
        """Call n on gloo when the switch died under it on every rank with some blocks landed: per element,
        the lowest rank holding its sum gives it and the others 0, or every rank its input where none holds
        it; one gloo sum (exact where one rank gives: x + 0)."""
        if any(p.idle for p in places) or x is None:
            raise RuntimeError("process group 'ina': a rank was idle while others hold sums of its call: the "
                               "fault cannot be recovered")
        holder = torch.zeros(x.numel(), dtype=torch.int32)
        if mask is not None:
            holder[mask] = self.size - self.rank
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self.fallback.allreduce([holder], opts).wait()  # size - the lowest holder, 0 where none
        give = (holder == 0) | (holder == self.size - self.rank)
        part = torch.where(give, x.detach(), torch.zeros((), dtype=x.dtype))
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self.fallback.allreduce([part], opts).wait()
        self.counters["gloo_calls"] += 1
        self.counters["landed_sums"] += 1
        return part

    def gloo_sum(self, x: torch.Tensor) -> torch.Tensor:
        """The fallback: every rank's intact input summed by the group's own gloo backend, on the host."""
        host = x.detach().to("cpu", copy=True)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self.fallback.allreduce([host], opts).wait()
        self.counters["gloo_calls"] += 1
        return host.to(x.device) if x.is_cuda else host

    def _go_to_gloo(self, error, at: int):
        """Go on through gloo, with a re-join attempt at call at + retry_every (the same call on every rank).
        One warning and one log line when the state changes (switch -> gloo), a counter for every failed
        re-join."""
        was_down = State.ON_GLOO in (self.state, self._was if self.state is State.RECOVERING else None)
        self._drop_comm()
        self._move(State.ON_GLOO)
        self.counters["failed_rejoins" if was_down else "faults"] += 1
        if error is not None:
            self.last_fault = f"{type(error).__name__}: {error}"
        self.retry_at = at + self.retry_every
        if was_down:
            return
        why = error if error is not None else "a switch fault on another rank"
        how = "has no slots for this job" if isinstance(error, errors.PoolFull) else "failed"
        if not self._warned:
            self._warned = True
            warnings.warn(f"process group 'ina': switch {self.switch} {how} ({why}); the calls go through gloo, "
                          f"with a re-join every {self.retry_every} calls", RuntimeWarning, stacklevel=3)
        log.warning("process group 'ina': rank %d: switch %s %s (%s): sums go through gloo, a re-join every "
                    "%d calls", self.rank, self.switch, how, why, self.retry_every)

    def _drop_comm(self):
        if self._on_drop is not None:
            self._on_drop()
        if self.comm is not None:
            try:
                self.comm.close()
            except OSError:
                pass  # the switch learns it from the silence
            self.comm = None

    # ------------------------------------------------------------------ the watcher, and the end
    def watch(self, submit, idle_recovery):
        """Start the watcher thread: a rank that completed its last call and makes no other (the switch died
        as that call ended: the last step's last bucket, then a collective of another group) would hold the
        others' recovery forever. Every RECOVERY_POLL seconds it looks for a recovery begun by another rank
        (one store check) and, if there is one, submit(idle_recovery, epoch) joins it between calls."""
        def look():
            watched = -1
            while not self._closed.wait(self.recovery_poll):
                epoch = self.recovery.epoch
                try:
                    begun = self.recovery.begun(epoch)
                except Exception:  # noqa: BLE001 - a store gone at shutdown
                    return
                if begun and watched != epoch:
                    watched = epoch
                    submit(idle_recovery, epoch)

        self._watcher = threading.Thread(target=look, name=f"ina-recovery-{self.rank}", daemon=True)
        self._watcher.start()

    def stop_watching(self):
        self._closed.set()
        if self._watcher is not None:
            self._watcher.join(5)

    def close(self):
        """Leave the switch (its ranks are free at once) and shut the fallback group down."""
        self.stop_watching()
        self._drop_comm()
        self.fallback.shutdown()
        self._move(State.CLOSED)

    def stats(self) -> dict:
        return dict(self.counters, votes=self.vote.votes, vote_seconds=self.vote.seconds,
                    recoveries=self.recovery.epoch, recovery_seconds=self.recovery.seconds, switch=self.switch,
                    codec=self.codec, connected=self.comm is not None, state=self.state.value)


_ALLOWED = frozenset((a, b) for a, b, _ in TRANSITIONS)
