"""Cross traffic between a topology's hosts, beside INA (`switchsim bench net`): what else runs on a
cluster's links — bulk TCP (data loading, checkpoints), short request/response flows (RPCs, parameter
lookups). One process per role, started inside a host by the benchmark and stopped with it:

    python -m topologies.traffic sink PORT SECONDS           # counts what TCP senders deliver, per 100 ms
    python -m topologies.traffic bulk HOST:PORT SECONDS [CC] # one TCP flow, as fast as it goes (CC: its
                                                             # congestion control, e.g. cubic; default the host's)
    python -m topologies.traffic rr-server PORT SECONDS      # answers each request with the bytes it asks
    python -m topologies.traffic rr-client HOST:PORT SECONDS RATE KB   # RATE flows/s of KB each, timed

Each prints one JSON line when its time is up (or on SIGTERM): the sink its bytes per bin (early, once its
senders have closed and SECONDS from its first byte have passed), the client every flow's completion time.
Every loop is bounded in time; nothing outlives SECONDS + a few seconds.
"""
from __future__ import annotations

import json
import selectors
import signal
import socket
import sys
import threading
import time

BIN = 0.1  # seconds per goodput bin
CHUNK = 1 << 16
GRACE = 5.0  # seconds past the run a process waits for a straggling flow before it reports


class Stop:
    """SIGTERM or the deadline, whichever comes first."""

    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds
        self.event = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: self.event.set())

    def __bool__(self):
        return self.event.is_set() or time.monotonic() >= self.deadline


def _listener(port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(128)
    s.setblocking(False)
    return s


def sink(port: int, seconds: float):
    """Bytes received from every TCP sender, per BIN seconds since the first byte (goodput over time). It
    reports once every sender has closed and the window (SECONDS from the first byte) has passed: a
    benchmark's phase need not wait out the GRACE kept for a straggling sender."""
    stop, sel, t0 = Stop(seconds + GRACE), selectors.DefaultSelector(), None
    lst = _listener(port)
    sel.register(lst, selectors.EVENT_READ)
    bins: list[int] = []
    print("ready", flush=True)

    def senders_done() -> bool:  # a sender came, none is left (only the listener), the window has passed
        return t0 is not None and len(sel.get_map()) == 1 and time.monotonic() >= t0 + seconds

    while not stop and not senders_done():
        for key, _ in sel.select(0.1):
            if key.fileobj is lst:
                conn, _ = lst.accept()
                conn.setblocking(False)
                sel.register(conn, selectors.EVENT_READ)
                continue
            try:
                data = key.fileobj.recv(CHUNK)
            except BlockingIOError:
                continue
            except ConnectionError:
                data = b""
            if not data:
                sel.unregister(key.fileobj)
                key.fileobj.close()
                continue
            now = time.monotonic()
            t0 = now if t0 is None else t0
            i = int((now - t0) / BIN)
            bins.extend([0] * (i + 1 - len(bins)))
            bins[i] += len(data)
    print(json.dumps({"role": "sink", "bin_s": BIN, "bytes": bins, "total": sum(bins)}), flush=True)


def bulk(address: str, seconds: float, cc: str | None = None):
    """One TCP flow sending as fast as the path lets it, for `seconds`; cc: its congestion control (the
    host's default otherwise, which may be one that ignores ECN, as BBR does)."""
    host, port = address.rsplit(":", 1)
    stop, sent, buf = Stop(seconds), 0, bytes(CHUNK)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        if cc:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cc.encode())
        s.settimeout(10)
        s.connect((host, int(port)))
        s.settimeout(0.2)
        while not stop:
            try:
                sent += s.send(buf)
            except socket.timeout:
                continue
            except OSError:
                break
    print(json.dumps({"role": "bulk", "sent": sent}), flush=True)


def rr_server(port: int, seconds: float):
    """Each connection sends 4 bytes (the response size, big-endian); it gets that many bytes, then EOF."""
    stop, lst = Stop(seconds + GRACE), _listener(port)
    served = 0
    print("ready", flush=True)

    def answer(conn):
        try:
            conn.settimeout(5)
            want = b""
            while len(want) < 4:
                more = conn.recv(4 - len(want))
                if not more:
                    return
                want += more
            n = int.from_bytes(want, "big")
            conn.sendall(bytes(min(n, 64 << 20)))
        except OSError:
            pass
        finally:
            conn.close()

    while not stop:
        try:
            conn, _ = lst.accept()
        except BlockingIOError:
            time.sleep(0.002)
            continue
        served += 1
        threading.Thread(target=answer, args=(conn,), daemon=True).start()
    print(json.dumps({"role": "rr-server", "served": served}), flush=True)


def _flow(host: str, port: int, size: int, out: list):
    """One request/response flow: connect, ask for `size` bytes, read them; its completion time (None: failed)."""
    t = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=5) as s:
            s.settimeout(5)
            s.sendall(size.to_bytes(4, "big"))
            got = 0
            while got < size:
                chunk = s.recv(CHUNK)
                if not chunk:
                    break
                got += len(chunk)
        out.append(time.monotonic() - t if got == size else None)
    except OSError:
        out.append(None)


def rr_client(address: str, seconds: float, rate: float, kb: float):
    """`rate` flows a second (evenly spaced) of `kb` KB each for `seconds`; each flow's completion time."""
    host, port = address.rsplit(":", 1)
    stop, times, threads = Stop(seconds), [], []
    size, start = int(kb * 1024), time.monotonic()
    n = 0
    while not stop:
        due = start + n / rate
        if time.monotonic() < due:
            time.sleep(min(0.01, due - time.monotonic()))
            continue
        t = threading.Thread(target=_flow, args=(host, int(port), size, times), daemon=True)
        t.start()
        threads.append(t)
        n += 1
    for t in threads:
        t.join(max(0.0, start + seconds + GRACE - time.monotonic()))
    done = [x for x in times if x is not None]
    print(json.dumps({"role": "rr-client", "flows": n, "failed": n - len(done), "fct_s": done}), flush=True)


def main(argv: list[str]):
    role, rest = argv[0], argv[1:]
    if role == "sink":
        sink(int(rest[0]), float(rest[1]))
    elif role == "bulk":
        bulk(rest[0], float(rest[1]), rest[2] if len(rest) > 2 else None)
    elif role == "rr-server":
        rr_server(int(rest[0]), float(rest[1]))
    elif role == "rr-client":
        rr_client(rest[0], float(rest[1]), float(rest[2]), float(rest[3]))
    else:
        raise SystemExit(f"unknown role {role!r}: sink, bulk, rr-server, rr-client")


if __name__ == "__main__":
    main(sys.argv[1:])
