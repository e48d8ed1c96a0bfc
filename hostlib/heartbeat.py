"""A member's heartbeat: one datagram every HEARTBEAT_EVERY seconds, in calls and between them, so the
switch tells a dead rank (silent for PEER_SILENT seconds) from a busy one. It is sent by a native thread
(csrc/ina_beat.c) that never takes the GIL: a rank that holds the interpreter for minutes (a long C call, an
extension that does not release it) still beats, and only a stopped, killed or vanished process falls
silent. Where the kernels are not built (or INA_NATIVE_HEARTBEAT=0), a Python thread sends it, and a
process that holds the GIL for PEER_SILENT seconds is taken for dead.
"""
from __future__ import annotations

import os
import threading

from inaproto.timers import HEARTBEAT_EVERY

from . import kernels


class Heartbeat:
    """The heartbeat of one Communicator's socket (a UDP socket or a shared-memory port)."""

    def __init__(self, sock, every: float = HEARTBEAT_EVERY):
        self.sock, self.every = sock, every
        self._native, self._sent, self._packet, self._stop = None, 0, None, threading.Event()
        lib, ffi = kernels.lib, kernels.ffi
        if lib is not None and os.environ.get("INA_NATIVE_HEARTBEAT", "1") != "0":
            shm = getattr(sock, "handle", None) or ffi.NULL
            beat = lib.ina_beat_start(sock.fileno() if shm == ffi.NULL else -1, shm, int(every * 1000))
            self._native = beat if beat != ffi.NULL else None
        if self._native is None:
            threading.Thread(target=self._run, name="ina-heartbeat", daemon=True).start()

    def set(self, packet: bytes | None):
        """The datagram to send from now on (a generation's heartbeat); None: nothing. Sent at once."""
        if self._native is not None:
            data = packet or b""
            kernels.lib.ina_beat_set(self._native, kernels.ffi.from_buffer(data), len(data))
        else:
            self._packet = packet
            self._send()

    def sent(self) -> int:
        return int(kernels.lib.ina_beat_sent(self._native)) if self._native is not None else self._sent

    def stop(self):
        """Stop sending (before the socket closes); idempotent."""
        if self._native is not None:
            beat, self._native = self._native, None
            self._sent = int(kernels.lib.ina_beat_sent(beat))
            kernels.lib.ina_beat_stop(beat)
        self._stop.set()

    def _send(self):
        packet = self._packet
        if packet is None:
            return
        try:
            self.sock.send(packet)
        except OSError:
            pass  # refused, full, closing: the call loops see the socket's errors themselves
        self._sent += 1

    def _run(self):
        while not self._stop.wait(self.every):
            self._send()
