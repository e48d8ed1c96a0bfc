"""Addresses and UDP sockets, the same on both sides."""
from __future__ import annotations

import ipaddress
import os
import socket
import time
from functools import lru_cache

from . import wire

SOCKET_BUFFER = 8 << 20  # a window of bursts from every worker without drops on loopback


SHM_HOST = "shm"  # the host part of a shared-memory port's address: ("shm", port)
SHM_SCHEME = "shm://"
SHM_IDS = 1 << 56  # address id of shared-memory port p: SHM_IDS + p (csrc/ina_shm_switch.h INA_SHM_ID_BASE)
# a job's results group on loopback (wire.FLAG_GROUP): 239.255.(job >> 8).(job & 255), administratively scoped
# (RFC 2365), on the switch's own port, so two switches of this host never share one
GROUP_NET = 0xEFFF0000
GROUP_PROBE_WAIT = 0.2  # seconds a worker waits for its own probe on the group before it does without
IP_MULTICAST_ALL = getattr(socket, "IP_MULTICAST_ALL", 49)  # Linux; Python's socket module may lack the name


def shm_name(address) -> str | None:
    """NAME of a "shm://NAME" switch address (the shared-memory transport), else None."""
    if isinstance(address, str) and address.startswith(SHM_SCHEME):
        return address[len(SHM_SCHEME):]
    return None


def parse_address(address) -> tuple[str, int]:
    """"HOST:PORT" or (host, port) -> (host, port); ":PORT" means 127.0.0.1."""
    if isinstance(address, tuple):
        return address[0], int(address[1])
    host, sep, port = str(address).rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"switch address must look like HOST:PORT, got {address!r}")
    return host or "127.0.0.1", int(port)


def size_buffers(sock: socket.socket, nbytes: int = SOCKET_BUFFER):
    """Ask for nbytes of send and receive buffer; as root past net.core.[rw]mem_max (the *BUFFORCE options),
    since a drop there costs a retransmission timeout."""
    for force, plain in ((getattr(socket, "SO_RCVBUFFORCE", 33), socket.SO_RCVBUF),
                         (getattr(socket, "SO_SNDBUFFORCE", 32), socket.SO_SNDBUF)):
        try:
            sock.setsockopt(socket.SOL_SOCKET, force, nbytes)
        except OSError:  # not root: capped at the sysctl limit
            sock.setsockopt(socket.SOL_SOCKET, plain, nbytes)


def job_group(job: int, port: int) -> tuple[str, int]:
    """The group a switch on loopback sends job's results to, once for every member that asked."""
    return int_to_ip(GROUP_NET | job), port


def group_sender(sock: socket.socket):
    """A switch socket bound on loopback: group sends leave by lo and never leave the host (TTL 0)."""
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(sock.getsockname()[0]))
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 0)


def open_group(switch: tuple[str, int], job: int, rank: int) -> socket.socket | None:
    """A worker's socket on its job's group of a switch on loopback, connected to the switch (the kernel drops
    anyone else's datagrams), non-blocking; None where the host does not deliver the group's datagrams (checked
    with a probe), so that a worker asks for the group only where it will hear it."""
    host, port = switch
    if host == SHM_HOST or not is_loopback(host):
        return None
    group = job_group(job, port)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # every rank of the host binds it
        sock.bind(group)
        sock.setsockopt(socket.IPPROTO_IP, IP_MULTICAST_ALL, 0)  # this group only, not every one the host joined
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                        socket.inet_aton(group[0]) + socket.inet_aton("127.0.0.1"))
        size_buffers(sock)
        if not _probe(sock, group, job, rank):
            sock.close()
            return None
        sock.connect((host, port))
        sock.setblocking(False)
        while True:  # what came before the connect (other ranks' probes) is not the switch's
            sock.recv(65536)
    except BlockingIOError:
        return sock
    except OSError:
        sock.close()
        return None


def _probe(sock: socket.socket, group: tuple[str, int], job: int, rank: int) -> bool:
    """Whether a datagram sent to group through lo reaches sock (a host without multicast on lo: no). The probe
    is the rank's heartbeat with a random packet id, so a capture of the switch's port reads as the protocol."""
    token = wire.pack(wire.MSG_HEARTBEAT, job=job, rank=rank, packet_id=int.from_bytes(os.urandom(4), "big"))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
        tx.bind(("127.0.0.1", 0))
        group_sender(tx)
        tx.sendto(token, group)
    deadline = time.monotonic() + GROUP_PROBE_WAIT
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if sock.recv(65536) == token:
                return True
        except socket.timeout:
            break
    return False


def ip_to_int(host: str) -> int:
    return int(ipaddress.IPv4Address(host))


def int_to_ip(ip: int) -> str:
    return str(ipaddress.IPv4Address(ip))


def address_id(host: str, port: int) -> int:
    """The id the C loops give a source: IPv4 << 16 | port for UDP, SHM_IDS + port for a shared-memory port."""
    if host == SHM_HOST:
        return SHM_IDS + port
    return ip_to_int(host) << 16 | port


@lru_cache(maxsize=4096)  # a switch asks it for every control request: a flood comes from few hosts
def is_loopback(host) -> bool:
    if host == SHM_HOST:
        return True  # a shared-memory port is on this host by construction
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def format_address(address) -> str:
    """A worker's address for messages: HOST:PORT, or the shared-memory port's number."""
    if isinstance(address, tuple) and len(address) == 2:
        return f"{address[0]}:{address[1]}"
    return str(address)
