"""Persistent allreduce (MPI 4's MPI_Allreduce_init): one array summed in place over the ranks again and again,
as a training loop sums the same gradient buffers every step (the torch backend's lanes do). A plain
`allreduce(x, out=x)` works out on every call what only the first needs: the checks of x and out, the C loop's
kind, and its argument struct's pointers into x. Here they are made once (again after a re-join: the frame
belongs to a generation), and each call sets only what is its own: its number, slots and seed, its exponents,
and the connection's round-trip estimate and window. The packets, results and errors are allreduce's.

Why it is worth a module: with four ranks and a switch on two cores, each small call's Python runs on cold
caches and is about half of a 1 KiB call's CPU; a call through it takes 0.61-0.85x hostlib's `allreduce(x,
out=y)` at 1 KiB and 64 KiB (docs/performance.md, "The torch layer, lean").
"""
from __future__ import annotations

import numpy as np

from . import fastpath, wire


def kept_from(size: int, k: int, window: int) -> int:
    """The first element a rank keeps of a sum of size elements landed in blocks of k with this window: the
    last `window` blocks' (a rank whose call failed has every block's sum but those of the window's last
    packets: it sent a slot's next packet only after the result of its last)."""
    return max(0, -(-size // k) - window) * k


class PersistentAllreduce:
    """`Communicator.allreduce_init(flat, codec, elements, keep_tail)`: call it to sum flat in place (returns
    flat). keep_tail: each call that succeeds leaves `kept` = (start, a copy of flat[start:]'s sums) from
    kept_from, what a recovery hands to ranks that missed the call's last results (the torch backend's
    failover); the C loop copies each block of the tail as it lands, into one of two buffers in turn, so a
    call that fails leaves the last success's."""

    __slots__ = ("comm", "flat", "codec", "elements", "kind", "keep_tail", "kept", "_frame", "_for")

    def __init__(self, comm, flat: np.ndarray, codec, elements: int | None, keep_tail: bool, kind: int | None):
        """kind: the C loop's for flat (None: the Python loop, as with fast=False, INA_KERNELS=numpy or an
        empty array, when the call was made)."""
        if not isinstance(flat, np.ndarray) or flat.ndim != 1 or not flat.flags.c_contiguous:
            raise ValueError("allreduce_init: flat must be a contiguous 1-D numpy array")
        if not flat.flags.writeable:
            raise ValueError("allreduce_init: flat is read-only; its sum lands in it")
        native = np.int32 if codec.name == "int32" else np.float32
        if flat.dtype != native:
            raise TypeError(f"allreduce_init: codec {codec.name!r} sums {np.dtype(native)} in place; got {flat.dtype}")
        if flat.size > wire.MAX_CALL_LEN:
            raise ValueError(f"allreduce of {flat.size} elements: at most {wire.MAX_CALL_LEN} per call "
                             f"(split the tensor)")
        self.comm, self.flat, self.codec, self.elements = comm, flat, codec, elements
        self.kind = kind if kind is not None and fastpath.out_dtype(kind) == flat.dtype else None
        self.keep_tail, self.kept = keep_tail, None
        self._frame, self._for = None, None  # the C loop's frame, and the (generation, k) it was made for

    def __call__(self) -> np.ndarray:
        if self.kind is not None:
            return self.comm.persistent_call(self)
        self.comm.allreduce(self.flat, out=self.flat, codec=self.codec, elements=self.elements)
        if self.keep_tail:
            self.kept = (0, self.flat.copy())  # the whole sum holds the tail
        return self.flat

    def frame(self, comm, call) -> fastpath.BoundFrame:
        """The C loop's frame for call (made again for a new generation or packet size)."""
        if self._for != (call.gen, call.k):
            tail = kept_from(self.flat.size, call.k, call.gen.window) if self.keep_tail else None
            self._frame = fastpath.BoundFrame(comm, self.flat, call.k, call.gen.window, self.kind, tail)
            self._for = (call.gen, call.k)
        return self._frame

    def succeeded(self):
        """The call on the frame succeeded: its tail is the one kept."""
        if self.keep_tail:
            self.kept = self._frame.kept()
