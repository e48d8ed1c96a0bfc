"""A worker's datagrams: its socket to the switch (UDP, connected, or a shared-memory port) and the job's
group socket where the switch may multicast; every datagram counted in the Communicator's CommStats, every
refusal noted on its Link."""
from __future__ import annotations

import os
import select
import socket

from inaproto import net, wire
from inaproto.net import size_buffers

from .shm import ShmSocket


IP_RECVTOS = getattr(socket, "IP_RECVTOS", 13)  # Linux's value where Python does not name it
TOS_CMSG = socket.CMSG_SPACE(4)


class Channel:
    def __init__(self, sock, group, stats, link, on_mark=None):
        """on_mark: called for each datagram that came CE-marked (a queue on the way is congested)."""
        self.sock, self.group, self.stats, self.link, self.on_mark = sock, group, stats, link, on_mark
        self._buf = bytearray(65536)
        self._view = memoryview(self._buf)
        # whether datagrams come with their TOS byte, as open_socket asked (rings carry no IP header)
        self._tos = not isinstance(sock, ShmSocket) and bool(sock.getsockopt(socket.IPPROTO_IP, IP_RECVTOS))
        self._poll = None  # the sockets, for waiting(): a ring has none
        if not isinstance(sock, ShmSocket):
            self._poll = select.poll()
            for s in (sock, group):
                if s is not None:
                    self._poll.register(s, select.POLLIN | select.POLLERR)

    def waiting(self) -> bool:
        """Whether a datagram (or a refusal) may wait on the socket or the group: False only where none does.
        One poll costs a third of the two failing recvs (and their exceptions) that would find out otherwise,
        a call's largest piece of Python between calls (with cold caches, ~15 us of CPU)."""
        return self._poll is None or bool(self._poll.poll(0))

    def send(self, data: bytes):
        try:
            self.sock.send(data)
        except ConnectionRefusedError:
            self.link.refused()
        except (BlockingIOError, PermissionError):
            pass  # counted as sent (a full buffer, a firewall's drop): the protocol recovers by timeout like any loss
        self.stats.packets_sent += 1
        self.stats.bytes_sent += len(data)

    def recv(self):
        """One datagram as bytes, from the socket or the job's group, or None when nothing is waiting (b"": the
        switch's port refused)."""
        try:
            n = self._recv_sock()
        except (BlockingIOError, InterruptedError):
            n = self._recv_group()
            if n is None:
                return None
        except ConnectionRefusedError:
            self.link.refused()
            return b""  # ICMP port unreachable: the switch is not there (yet)
        self.link.answered()  # something listens; it is heard once a packet proves it is the switch
        if n == wire.HEADER_SIZE and self._view[1] == wire.MSG_HEARTBEAT:
            self.stats.heartbeat_answers += 1  # a heartbeat's answer is not a call's traffic (as heartbeats)
        else:
            self.stats.packets_received += 1
            self.stats.bytes_received += n
        return bytes(self._view[:n])

    def _recv_sock(self) -> int:
        """A datagram into the buffer; its IP_TOS (asked with IP_RECVTOS) told to on_mark when it is CE."""
        if not self._tos:
            return self.sock.recv_into(self._buf)
        n, anc, _, _ = self.sock.recvmsg_into([self._buf], TOS_CMSG)
        for level, kind, data in anc:
            if level == socket.IPPROTO_IP and kind == socket.IP_TOS and data and data[0] & 3 == wire.CE:
                if self.on_mark is not None:
                    self.on_mark()
        return n

    def _recv_group(self):
        """The length of a datagram the switch sent to the job's group, or None (its socket takes the switch's
        datagrams only: connected)."""
        if self.group is None:
            return None
        try:
            return self.group.recv_into(self._buf)
        except (BlockingIOError, InterruptedError):
            return None

    def wait(self, seconds: float):
        if isinstance(self.sock, ShmSocket):
            self.sock.wait(seconds)
        else:
            select.select([self.sock] if self.group is None else [self.sock, self.group], [], [], max(0.0, seconds))


def open_socket(shm: str | None, address):
    """The shared-memory port of switch `shm`, or a non-blocking UDP socket connected to address."""
    if shm is not None:
        return ShmSocket(shm)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    size_buffers(sock)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, wire.ECT0)  # ECN-capable: a congested queue marks, not drops
    if not net.is_loopback(address[0]):  # a result's mark is seen (the C loop's ce_marked too); loopback's
        sock.setsockopt(socket.IPPROTO_IP, IP_RECVTOS, 1)  # queues never mark: its calls skip the cmsg
    sock.connect(address)
    sock.setblocking(False)
    return sock


def open_group(shm: str | None, address, job: int, rank: int, key) -> socket.socket | None:
    """The job's loopback group socket (net.open_group) where the switch is on loopback, the job has no key (a
    switch sends a keyed job's results to each member alone) and $INA_GROUP is not 0; else None."""
    if shm is not None or key is not None or os.environ.get("INA_GROUP", "1") == "0":
        return None
    return net.open_group(address, job, rank)


def parse(data):
    """The header of a datagram, or None (b"" for a refusal, or not a packet of the protocol)."""
    try:
        return wire.unpack(data) if data else None
    except wire.WireError:
        return None
