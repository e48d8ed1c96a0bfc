"""The "ina" process group's call path: one sum through the switch, per call, on the group's worker thread
(or the caller's, inline): its route (codec, elements per packet), where its sum lands, what is kept of it
for a recovery, and the hand-off of a switch fault to the failure protocol (torch_failover.Failover).
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging

import numpy as np
import torch

from ..codecs import get_codec
from ..persistent import kept_from
from .torch_failover import SWITCH_FAULTS, Failover, Kept, Place

SMALL_ELEMENTS = 64  # floating reductions up to this size (a loss, metrics) go per element (EXACT_SMALL)
EXACT_SMALL = "small"  # the path's key: the fixed codec, one element per packet, so each has its own exponent
LANES = 1024  # host tensors whose lane (Lane) a group keeps: a per-parameter loop of a large model fits
log = logging.getLogger("hostlib.integrations.torch_backend")  # one logger for the backend, whatever module


@dataclasses.dataclass
class Landing:
    """How an in-place call's sum lands in the caller's tensor (the C loop writes each block as its result
    comes): blocks of `block` elements, at most `window` in flight, `flat` the tensor's numpy view. After a
    fault the error's `landed` says which blocks hold their sum."""

    block: int
    window: int
    flat: np.ndarray


class SwitchCalls:
    """The calls of one group that can go through the switch, numbered the same on every rank."""

    def __init__(self, failover: Failover, codec: str, connect_kwargs: dict, count):
        self.failover, self.count = failover, count  # count(kind, path, n=1): the group's per-path counter
        self.number = 0  # calls made, the same count on every rank (a re-join and a recovery name calls by it)
        self.switch_calls = 0
        self.elements_per_packet = connect_kwargs.get("elements_per_packet")
        rounding = {"rounding": connect_kwargs["rounding"]} if "rounding" in connect_kwargs else {}
        self.codecs = {"float": get_codec(codec, **rounding), "int32": get_codec("int32"),
                       EXACT_SMALL: get_codec("fixed")}
        self.routes: dict = {}  # (dtype, small) -> (codec, elements per packet, path name): route
        self.lanes: dict = {}  # (address, numel, dtype) -> Lane of the inline path (one dict: the reads look in it)
        self.reset()

    def reset(self):
        """The connection is gone: what was made for it goes too."""
        self.lands: dict = {}  # (dtype, block size, non-empty) -> whether sums land block by block
        self._drop_lanes()
        self.landing: Landing | None = None  # the current call's, while it runs
        self.kept: Kept | tuple | None = None  # of the last call that succeeded: a Kept, or (call, its lane)

    def lane_counts(self) -> dict:
        """The calls each lane made, per (kind, path) (a lane counts its own: one add on the inline path)."""
        counts: dict = {}
        for lane in self.lanes.values():
            counts[lane.count] = counts.get(lane.count, 0) + lane.calls
        return counts

    def _drop_lanes(self):
        for (what, path), n in self.lane_counts().items():
            self.count(what, path, n)
        self.lanes.clear()

    @property
    def comm(self):
        return self.failover.comm

    def sum(self, x: torch.Tensor, lane: "Lane | None" = None) -> torch.Tensor:
        """x (flat) summed over the ranks, a tensor of x's dtype: x itself (the sum lands in place) or
        another; through the switch, or through gloo on every rank while the switch is down. With x's lane
        (the inline path: the switch is joined), x is any contiguous shape, and the sum lands in it: the same
        steps in fewer calls (each costs a few us with the cold caches a rank has between calls)."""
        n = self.number
        self.number += 1
        comm = self.failover.comm
        if lane is None or comm is None or lane.call.comm is not comm:  # a lane of a connection dropped meanwhile
            return self._sum(n, x if lane is None else x.view(-1))  # (by the queue's thread): the general path
        try:
            self._switch_sum(x, lane)
        except SWITCH_FAULTS as e:
            return self._recover(n, x.view(-1), lane.count[0], e)
        except Exception:
            self._raised(n, lane.count[0])
            raise
        self.switch_calls += 1
        lane.calls += 1
        self.kept, self.landing = (n, lane), None  # its tail, kept by its C loop: a Kept only if a recovery asks
        return x

    def _sum(self, n: int, x: torch.Tensor) -> torch.Tensor:
        what = _kind(x)
        if self.failover.connection(n) is None:
            self.count(what, "gloo (switch down)")
            return self.failover.gloo_sum(x)
        try:
            total, path = self._switch_sum(x)
        except SWITCH_FAULTS as e:
            return self._recover(n, x, what, e)
        except Exception:
            self._raised(n, what)
            raise
        self.switch_calls += 1
        self.count(what, path)
        self._keep(n, x, total)
        return total

    def _recover(self, n: int, flat: torch.Tensor, what: str, e: BaseException) -> torch.Tensor:
        """Call n failed under a switch fault: the failure protocol's sum of flat (through gloo)."""
        self.count(what, "gloo (recovered)")
        place, mask = self._place(n, flat, e)
        kept, self.kept = self._kept(), None
        return self.failover.recover(n, place, flat, mask, kept, e)

    def _raised(self, n: int, what: str):
        """A CollectiveError or the call's input (every rank raises; the next call re-joins)."""
        self.count(what, "error")
        self.failover.raised(n)

    def _kept(self) -> Kept | None:
        """What the last call that succeeded kept (a lane's tail, from its persistent call)."""
        if self.kept.__class__ is tuple:
            n, lane = self.kept
            return Kept(n, *lane.call.kept)
        return self.kept

    def idle_recovery(self, epoch: int):
        """Another rank's recovery, seen by the watcher while this rank makes no call: join it (worker thread)."""
        if self.failover.recovery.epoch != epoch:  # handled by a call of this rank's own meanwhile
            return
        place, _ = self._place(self.number, None, None)
        kept, self.kept = self._kept(), None
        try:
            self.failover.recover(self.number, place, None, None, kept, None)
        except Exception as e:  # noqa: BLE001 - the next call goes to gloo anyway; say why
            log.warning("process group 'ina': rank %d: joining another rank's recovery failed: %s",
                        self.failover.rank, e)

    def _keep(self, n: int, x: torch.Tensor, total: torch.Tensor):
        """What a recovery may have to hand to ranks that missed call n's last results: a rank whose call
        failed has every block's sum but those of the window's last packets (it sent a slot's next packet
        only after the result of its last), so of a sum landed block by block the last `window` blocks (a
        lane's: its C loop copies them as they land); otherwise the whole sum (a copy when it is x, the
        caller's)."""
        if self.landing is None:
            self.kept = Kept(n, 0, total.clone() if total is x else total)
            return
        landing, self.landing = self.landing, None  # not holding the caller's tensor
        start = kept_from(landing.flat.size, landing.block, landing.window)
        self.kept = Kept(n, start, landing.flat[start:].copy())  # numpy: a third of torch's copy

    def _place(self, n: int, x: torch.Tensor | None, error: BaseException | None) -> tuple[Place, torch.Tensor]:
        """This rank's Place at a recovery, and per element whether x holds its sum."""
        landed = getattr(error, "landed", None) if self.landing is not None else None
        if x is None or landed is None or not landed.any():
            mask = None
            place = Place(n, 0 if x is None else x.numel(), idle=x is None)
        else:
            mask = torch.from_numpy(landed).repeat_interleave(self.landing.block)[: x.numel()]
            missing = (~mask).nonzero()
            place = Place(n, x.numel(), int(missing[0]) if missing.numel() else x.numel(), int(landed.sum()))
        kept = self._kept()
        if kept is not None and kept.call == n - 1:
            place.kept_from = kept.start
        return place, mask

    def _switch_sum(self, x: torch.Tensor, lane: "Lane | None" = None) -> tuple[torch.Tensor, str]:
        """One allreduce through the switch, and the path's name. The connection was joined with the float
        codec; each call passes its own (every packet carries its call's codec, so one job and one join serve
        all; route says which). A float32 or int32 tensor on the host gets its sum in place (the C loop
        writes each block as its result lands: landing), through its lane when it has one (the inline path's:
        route and view made at its first call); 16-bit floats travel as float32, in a copy."""
        comm = self.failover.comm
        if lane is not None:
            if comm.gen is not lane.gen:  # the lane's first call on this generation (a re-join may change both)
                lane.land_on(comm.gen)
            self.landing = lane.landing
            lane.call()
            return x, lane.count[1]
        codec, k, path = self.route(x)
        self.landing = None
        if x.is_cuda:
            wide = x if x.dtype in (torch.int32, torch.float32) else x.float()
            return comm.allreduce(wide, codec=codec, elements=k).to(x.dtype), path
        if x.dtype in (torch.int32, torch.float32):
            flat = (x.detach() if x.requires_grad else x).numpy()
            key = (x.dtype, k, flat.size > 0)
            lands = self.lands.get(key)
            if lands is None:  # the C loop's or the Python loop's: asked once per connection and route
                lands = self.lands[key] = comm.lands_blocks(flat, codec)
            if lands:
                self.landing = Landing(min(k, comm.max_elements), comm.window, flat)
            comm.allreduce(flat, out=flat, codec=codec, elements=k)
            return x, path
        wide = x.float()  # a copy: x stays intact whatever lands
        comm.allreduce(wide.numpy(), out=wide.numpy(), codec=codec, elements=k)
        return wide.to(x.dtype), path

    def route(self, x: torch.Tensor) -> tuple:
        """(codec, elements per packet, path name) of a call, per dtype and size class: int32 tensors int32;
        floating tensors of at most SMALL_ELEMENTS elements (a loss, a metric) per-element fixed point,
        accurate to float32 rounding per element whatever the magnitudes; larger ones the group's codec."""
        key = (x.dtype, x.numel() <= SMALL_ELEMENTS)
        route = self.routes.get(key)
        if route is None:
            name = "int32" if x.dtype == torch.int32 else EXACT_SMALL if key[1] else "float"
            codec = self.codecs[name]
            k = 1 if name == EXACT_SMALL else self.elements_per_packet or codec.default_elements
            route = self.routes[key] = (codec, k, f"switch ({codec.name}{', per element' if k == 1 else ''})")
        return route

    def lane(self, t: torch.Tensor, key: tuple | None = None) -> "Lane | None":
        """t's lane (made at its first call, kept per address, size and dtype while this connection lives), or
        None where the inline path does not apply: other dtypes, an empty tensor, sums that do not land block by
        block (the Python loop). key: (t.data_ptr(), t.numel(), t.dtype) where the caller has read them."""
        key = key or (t.data_ptr(), t.numel(), t.dtype)
        lane = self.lanes.get(key)
        if lane is not None:
            return lane
        n = key[1]
        if t.dtype not in (torch.float32, torch.int32) or n == 0:
            return None
        view = np.frombuffer((ctypes.c_byte * (n * t.element_size())).from_address(key[0]),
                             dtype=np.float32 if t.dtype == torch.float32 else np.int32)
        codec, k, path = self.route(t)
        if not self.failover.comm.lands_blocks(view, codec):
            return None
        if len(self.lanes) >= LANES:
            self._drop_lanes()
        lane = self.lanes[key] = Lane(self.failover.comm.allreduce_init(view, codec, k, keep_tail=True),
                                      (_kind(t), path))
        return lane


class Lane:
    """What the inline path (ProcessGroupINA._inline_allreduce) keeps of one host tensor's memory while the
    connection lives: its persistent allreduce (`call`, hostlib/persistent.py) over a numpy view of the memory
    that does not hold it (used only while the call's tensor has that address, size and dtype, so the memory is
    the caller's, alive), which keeps each successful sum's tail for a recovery, and the (kind, path) its calls
    count under. Making the view costs more than the rest of the call; the persistent call makes the rest of
    the call's set-up once."""

    __slots__ = ("call", "count", "gen", "landing", "calls")

    def __init__(self, call, count):
        self.call, self.count = call, count
        self.gen = None  # the generation landing was made for
        self.calls = 0  # that succeeded through the switch (ina_stats' paths, under count)

    def land_on(self, gen):
        """Its calls' landing on generation gen (which blocks of a failed call hold their sum)."""
        self.landing = Landing(min(self.call.elements, gen.max_elements), gen.window, self.call.flat)
        self.gen = gen


def _kind(x: torch.Tensor) -> str:
    """A call's kind for ina_stats' paths: its dtype, and "small" for a loss or metric."""
    small = x.dtype.is_floating_point and x.numel() <= SMALL_ELEMENTS
    kind = _KINDS.get((x.dtype, small))
    if kind is None:
        kind = _KINDS[x.dtype, small] = str(x.dtype).replace("torch.", "") + (" small" if small else "")
    return kind


_KINDS: dict = {}
