"""Addresses and UDP sockets, the same on both sides."""
from __future__ import annotations

import ipaddress
import socket
from functools import lru_cache

SOCKET_BUFFER = 8 << 20  # a window of bursts from every worker without drops on loopback


SHM_HOST = "shm"  # the host part of a shared-memory port's address: ("shm", port)
SHM_SCHEME = "shm://"
SHM_IDS = 1 << 56  # address id of shared-memory port p: SHM_IDS + p (csrc/ina_shm_switch.h INA_SHM_ID_BASE)


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
