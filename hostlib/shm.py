"""The worker's end of the shared-memory transport (`shm://NAME`, csrc/ina_shm.h): a port of the switch's
segment in /dev/shm with the few socket calls Communicator makes (send, recv_into, close), plus wait in
place of select and switch_gone in place of ECONNREFUSED. The packets are the UDP protocol's; the C worker
loop drives the rings itself."""
from __future__ import annotations

import errno
import os

from . import kernels

WHY = {errno.ENOENT: "no switch serves that name (start one with `switchsim serve --backend c --shm NAME`)",
       errno.EPROTO: "not a segment of this version (a switch of another build?)",
       errno.EBUSY: "every port of the switch is taken (more workers than `serve --shm` made ports for)",
       errno.EINVAL: "a name must be 1..64 of [A-Za-z0-9_.-]"}


class ShmSocket:
    """A claimed port; its address is ("shm", port), as the switch sees it.

    Args:
        name: the switch's NAME (from "shm://NAME").

    Raises:
        RuntimeError: the worker kernels are not built.
        ConnectionRefusedError, OSError: the switch's segment cannot be used (the message says why).
    """

    def __init__(self, name: str):
        if not kernels.enabled():
            raise RuntimeError("the shared-memory transport needs the C kernels (pip install -e . with a compiler)")
        ffi, lib = kernels.ffi, kernels.lib
        err = ffi.new("int *")
        handle = lib.ina_shm_connect(name.encode(), err)
        if handle == ffi.NULL:
            cls = ConnectionRefusedError if err[0] == errno.ENOENT else OSError
            raise cls(err[0], f"shm://{name}: {WHY.get(err[0], os.strerror(err[0]))}")
        self.handle = ffi.gc(handle, lib.ina_shm_close)
        self.name = name
        self.port = lib.ina_shm_client_port(handle)

    def getpeername(self):
        return "shm", self.name

    def fileno(self) -> int:
        return -1

    def send(self, data) -> int:
        """Raises:
            BlockingIOError: the ring is full (the packet is lost; the protocol resends it).
        """
        if kernels.lib.ina_shm_send(self.handle, kernels.ffi.from_buffer(data), len(data)) < 0:
            raise BlockingIOError(errno.EAGAIN, "shared-memory ring full")
        return len(data)

    def recv_into(self, buf) -> int:
        """Raises:
            BlockingIOError: nothing waits.
        """
        n = kernels.lib.ina_shm_recv(self.handle, kernels.ffi.from_buffer(buf), len(buf))
        if n == -1:
            raise BlockingIOError(errno.EAGAIN, "no packet waiting")
        return max(n, 0)  # -2 (a corrupt or oversized record, dropped): an empty datagram, ignored

    def wait(self, seconds: float) -> bool:
        return bool(kernels.lib.ina_shm_wait(self.handle, max(0.0, seconds)))

    def switch_gone(self) -> bool:
        """Whether the switch is gone: its process exited, or it removed its segment (stopped) or another
        switch took the name; looked at no more than every 100 ms (csrc/ina_shm.c ina_shm_switch_gone), and
        once gone, always gone. A closed port has no switch: True."""
        if self.handle is None:
            return True
        return bool(kernels.lib.ina_shm_switch_gone(self.handle))

    def close(self):
        if self.handle is not None:
            kernels.ffi.release(self.handle)
            self.handle = None
