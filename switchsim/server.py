"""UDP server around a switch backend, with an optional impaired network (loss, duplication, reordering)."""
from __future__ import annotations

import json
import os
import random
import select
import socket
import sys
import threading
import time

from inaproto import net, wire
from inaproto.net import SOCKET_BUFFER, shm_name, size_buffers

from .capture import DECIDE_DROP, DECIDE_DUP, DECIDE_HOLD, Capture
from .model import Switch


def check_probabilities(loss, dup, reorder) -> None:
    """The impairment limits every server enforces (the C loops get validated values).

    Args:
        loss, dup, reorder: probabilities per packet and direction.

    Raises:
        ValueError: one outside [0, 1) (1 would drop or hold everything).
    """
    for name, p in (("loss", loss), ("dup", dup), ("reorder", reorder)):
        if not 0.0 <= p < 1.0:
            raise ValueError(f"{name} probability must be in [0, 1), got {p}")


def bind_udp(host, port) -> socket.socket:
    """The switch's UDP socket, with buffers large enough for a window of bursts.

    Args:
        host, port: where to listen (port 0: any free port; read it from getsockname()).

    Returns:
        The bound socket.

    Raises:
        OSError: the address is in use or not local.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    size_buffers(sock, SOCKET_BUFFER)
    sock.bind((host, port))
    return sock


# ECN (docs/protocol.md, "Congestion"): a data packet that arrives CE-marked counts as FLAG_CONGESTED, and data
# packets leave ECN-capable (ECT(0): results, and a leaf's partial sums up), so a queue on the way marks them
# instead of dropping; control answers do not
ECT0_CMSG = [(socket.IPPROTO_IP, socket.IP_TOS, wire.ECT0.to_bytes(4, sys.byteorder))]  # an int, as the kernel takes it
TOS_SPACE = socket.CMSG_SPACE(4)


def listen_ecn(sock: socket.socket):
    """Every datagram sock receives comes with its IP header's TOS byte (an IP_TOS cmsg)."""
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)


def ce_marked(ancdata) -> bool:
    """Whether recvmsg's ancillary data says the datagram arrived with ECN CE."""
    return any(level == socket.IPPROTO_IP and kind == socket.IP_TOS and data and data[0] & 3 == wire.CE
               for level, kind, data in ancdata)


def congested(data: bytes) -> bytes:
    """A data packet that arrived CE-marked as the switch takes it: with FLAG_CONGESTED set (no check covers the
    flags byte; a packet that is no data packet is left as it is)."""
    if len(data) <= wire.OFFSETS["flags"] or data[1] not in wire.DATA_MESSAGES:
        return data
    marked = bytearray(data)
    marked[wire.OFFSETS["flags"]] |= wire.FLAG_CONGESTED
    return bytes(marked)


def offer_groups(sock: socket.socket, control):
    """A switch bound on loopback may send a job's results once to the job's group (docs/protocol.md, "Results
    to a group"): its socket sends groups through lo, and the control plane learns the port. $INA_GROUP=0: never."""
    host, port = sock.getsockname()[:2]
    if os.environ.get("INA_GROUP", "1") == "0" or not net.is_loopback(host):
        return
    try:
        net.group_sender(sock)
    except OSError:
        return  # no multicast here: a copy to each member
    control.group_port = port


class Impairment:
    """Per-direction network faults: drop with probability loss, deliver twice with probability dup,
    hold a packet back behind the next one with probability reorder."""

    def __init__(self, loss=0.0, dup=0.0, reorder=0.0, seed=None):
        check_probabilities(loss, dup, reorder)
        self.loss, self.dup, self.reorder = loss, dup, reorder
        self.rand = random.Random(seed)
        self.held = None
        self.dropped = self.duplicated = self.reordered = 0

    @property
    def active(self):
        return bool(self.loss or self.dup or self.reorder)

    def decide(self) -> int:
        """The faults for the next packet (capture.DECIDE_* flags), drawn before it goes so a capture can note
        them: loss, then duplication, then reordering unless a packet is already held."""
        if self.loss and self.rand.random() < self.loss:
            self.dropped += 1
            return DECIDE_DROP
        d = 0
        if self.dup and self.rand.random() < self.dup:
            self.duplicated += 1
            d |= DECIDE_DUP
        if self.held is None and self.reorder and self.rand.random() < self.reorder:
            self.reordered += 1
            d |= DECIDE_HOLD
        return d

    def act(self, item, d: int) -> list:
        """What goes out now for item under decision d (a held item goes after the next one)."""
        if d & DECIDE_DROP:
            return []
        if d & DECIDE_HOLD:
            self.held = item
            return [item] if d & DECIDE_DUP else []
        return ([item, item] if d & DECIDE_DUP else [item]) + self.flush()

    def apply(self, item) -> list:
        return self.act(item, self.decide())

    def flush(self) -> list:
        held, self.held = self.held, None
        return [held] if held is not None else []

    def stats(self):
        return {"dropped": self.dropped, "duplicated": self.duplicated, "reordered": self.reordered}


class UDPServer:
    """Runs one backend (anything with process(data, src) and stats()) on a UDP socket, in Python: the
    reference transport, slow but the same semantics as the C loops, impairments included.

    Args:
        backend: the data plane (a model.Switch, or native.CoreSwitch); its control plane's stats replies
            get this server's counters too.
        host, port: where to listen (port 0: any free port; see self.address).
        loss, dup, reorder: impairment probabilities, per packet, applied to each direction separately.
        seed: of the impairments' random streams, for repeatable faults.
        sock: an already bound socket to serve on instead of host, port (a leaf joins its root from it first).

    Raises:
        ValueError: a probability outside [0, 1).
        OSError: the address cannot be bound.
    """

    def __init__(self, backend: Switch, host="127.0.0.1", port=wire.DEFAULT_PORT, loss=0.0, dup=0.0,
                 reorder=0.0, seed=None, sock: socket.socket | None = None):
        self.backend = backend
        self.sock = sock if sock is not None else bind_udp(host, port)
        self.address = self.sock.getsockname()
        rs = random.Random(seed)
        self.rx = Impairment(loss, dup, reorder, rs.random())
        self.tx = Impairment(loss, dup, reorder, rs.random())
        self.stop_event = threading.Event()
        self.bytes_in = self.bytes_out = self.send_errors = 0
        self.capture = None
        self.started = time.monotonic()
        backend.control.stats = self.stats  # stats replies carry the transport's counters too
        offer_groups(self.sock, backend.control)
        listen_ecn(self.sock)

    def _send(self, items):
        for data, dst in items:
            try:
                if data[1:2] and data[1] in wire.DATA_MESSAGES:
                    self.sock.sendmsg([data], ECT0_CMSG, 0, dst)
                else:
                    self.sock.sendto(data, dst)
                self.bytes_out += len(data)
            except OSError:
                self.send_errors += 1  # e.g. a worker that went away; never fatal to the switch

    def _handle(self, data, src):
        d = self.rx.decide() if self.rx.active else 0
        if self.capture:
            self.capture.record(True, src, data, d)
        for pkt, s in (self.rx.act((data, src), d) if self.rx.active else [(data, src)]):
            self._emit(self.backend.process(pkt, s))

    def _emit(self, out):
        """The switch's packets, through the send-side impairment and the capture."""
        if not self.tx.active and not self.capture:
            return self._send(out)
        sent = []
        for item in out:
            d = self.tx.decide() if self.tx.active else 0
            if self.capture:
                self.capture.record(False, item[1], item[0], d)
            sent += self.tx.act(item, d) if self.tx.active else [item]
        self._send(sent)

    def start_capture(self, path: str, max_mb: float):
        """Write every packet in and out to a pcapng file (serve --pcap); closed by close().

        Raises:
            OSError: the file cannot be written.
        """
        self.capture = Capture(path, self.address, max_mb)

    def serve_forever(self, poll_interval=0.01):
        """Serve until stop() (from a signal handler or another thread).

        Args:
            poll_interval: seconds of idleness before packets held back for reordering are let go, and the
                longest stop() waits to be seen.
        """
        buf = bytearray(65536)
        view = memoryview(buf)
        sock = self.sock
        sock.setblocking(False)
        control = self.backend.control
        while not self.stop_event.is_set():
            ready, _, _ = select.select([sock], [], [], poll_interval)
            if not ready:  # idle: release any packet held back for reordering
                control.drained()
                for d, s in self.rx.flush():
                    self._emit(self.backend.process(d, s))
                self._send(self.tx.flush())
                continue
            for _ in range(256):  # drain a batch before looking at the stop flag again
                try:
                    n, anc, _, src = sock.recvmsg_into([buf], TOS_SPACE)
                except BlockingIOError:
                    control.drained()  # it keeps up: a member's silence is the member's (check_members)
                    break
                except OSError:
                    continue
                self.bytes_in += n
                data = bytes(view[:n])
                self._handle(congested(data) if ce_marked(anc) else data, src)

    def start_thread(self) -> threading.Thread:
        """serve_forever in a daemon thread, for tests and in-process demos.

        Returns:
            The started thread (stop() then join it).
        """
        t = threading.Thread(target=self.serve_forever, name="switchsim", daemon=True)
        t.start()
        return t

    def stop(self):
        """Ask serve_forever to return; safe from a signal handler or another thread."""
        self.stop_event.set()

    def close(self):
        """Close the socket (after serve_forever returned), freeing the port, and the capture."""
        self.sock.close()
        if self.capture:
            self.capture.close()

    def stats(self, per_slot: bool = False) -> dict:
        """The backend's counters plus the transport's, in the layout every server reports.

        Args:
            per_slot: add each job's per-slot arrays.

        Returns:
            Switch.stats plus bytes_in/out, send_errors, impairment (rx, tx) and uptime_s.
        """
        s = self.backend.stats(per_slot=per_slot)
        s.update({"bytes_in": self.bytes_in, "bytes_out": self.bytes_out, "send_errors": self.send_errors,
                  "impairment": {"rx": self.rx.stats(), "tx": self.tx.stats()},
                  "uptime_s": round(time.monotonic() - self.started, 3)})
        if self.capture:
            s.update(self.capture.stats())
        return s


def query_stats(address: tuple[str, int], timeout=2.0, per_slot: bool = False) -> dict:
    """Ask a running switch for its counters (MSG_STATS_REQ); it answers control hosts only (loopback, or
    those given to `serve --control`).

    Args:
        address: (host, port) of the switch, or "shm://NAME" for a shared-memory switch on this host.
        timeout: seconds to wait for the answer.
        per_slot: ask for each job's per-slot counters too (left out by the switch past one datagram).

    Returns:
        The switch's stats (UDPServer.stats' layout, whatever the backend).

    Raises:
        TimeoutError: no answer (no switch there, or this host is not a control host).
        RuntimeError: something else answered.
    """
    request = wire.pack(wire.MSG_STATS_REQ, flags=wire.FLAG_PER_SLOT if per_slot else 0)
    if shm_name(address) is not None:
        data = _query_shm(shm_name(address), request, timeout)
    else:
        data = _query_udp(address, request, timeout)
    h = wire.unpack(data)
    if h.msg_type != wire.MSG_STATS:
        raise RuntimeError(f"switch answered {wire.MSG_NAMES.get(h.msg_type)} to a stats request")
    return json.loads(bytes(data[wire.HEADER_SIZE:]))


STATS_RETRY = 0.25  # seconds between a stats request's repeats (a lost request or answer is not an error)


def _query_udp(address, request: bytes, timeout: float) -> bytes:
    """The request, repeated every STATS_RETRY seconds until an answer comes or timeout passes."""
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        while (left := deadline - time.monotonic()) > 0:
            s.sendto(request, address)
            s.settimeout(min(STATS_RETRY, left))
            try:
                data, _ = s.recvfrom(1 << 20)
                return data
            except socket.timeout:
                continue
            except ConnectionRefusedError:
                raise TimeoutError(f"no switch at {address[0]}:{address[1]} (connection refused)") from None
    raise TimeoutError(f"no stats from {address[0]}:{address[1]} within {timeout:g} s, asked every "
                       f"{STATS_RETRY:g} s (no switch there, or this host is not one of its control hosts: see "
                       f"serve --control)")


def _query_shm(name: str, request: bytes, timeout: float) -> bytes:
    """A stats request through a port of a shared-memory switch (serve --shm NAME), and its answer."""
    from hostlib.shm import ShmSocket

    sock, buf = ShmSocket(name), bytearray(1 << 17)
    try:
        sock.send(request)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sock.wait(deadline - time.monotonic()):
                n = sock.recv_into(buf)
                return bytes(buf[:n])
        raise TimeoutError(f"no stats from shm://{name} within {timeout:g} s")
    finally:
        sock.close()


def print_json(obj, file=sys.stdout):
    """Print obj as sorted, indented JSON and flush, so a parent process reading the pipe sees it at once.

    Args:
        obj: anything json.dumps takes.
        file: where to write.
    """
    file.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    file.flush()
