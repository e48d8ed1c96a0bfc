"""The delay stage of a link (this kernel has no netem): frames cross from one interface to its partner
`delay_ms` later, both ways, through AF_PACKET sockets in the host (namespace) that holds both.

    python -m switchsim.delay --delay-ms D A:B [C:D ...]

prints "ready" once every socket is bound, then forwards until SIGTERM and prints its counters as JSON.
A constant delay keeps each direction first-in first-out, so one deque per direction is the whole queue.
Frames beyond `--limit` waiting in one direction are dropped and counted (a queue, like a router's).
"""
import argparse
import collections
import json
import select
import signal
import socket
import sys
import time

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4  # what this host sent out of the interface: not ours to forward


def open_port(ifname: str) -> socket.socket:
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    s.bind((ifname, 0))
    s.setblocking(False)
    return s


class Stage:
    def __init__(self, pairs: list[tuple[str, str]], delay_s: float, limit: int):
        self.delay, self.limit = delay_s, limit
        self.peer, self.queue = {}, {}  # socket -> the socket its frames leave by; -> frames waiting to
        for a, b in pairs:
            sa, sb = open_port(a), open_port(b)
            self.peer[sa], self.peer[sb] = sb, sa
            self.queue[sa], self.queue[sb] = collections.deque(), collections.deque()
        self.forwarded = self.dropped = self.send_errors = 0
        self.running = True

    def receive(self, s: socket.socket, now: float):
        q = self.queue[self.peer[s]]
        for _ in range(1024):
            try:
                frame, addr = s.recvfrom(65536)
            except BlockingIOError:
                return
            if addr[2] == PACKET_OUTGOING:
                continue
            if len(q) >= self.limit:
                self.dropped += 1
            else:
                q.append((now + self.delay, frame))

    def send_due(self, now: float) -> float:
        """Send what is due; the seconds until the next frame is (at most 1 s)."""
        wait = 1.0
        for s, q in self.queue.items():
            while q and q[0][0] <= now:
                try:
                    s.send(q[0][1])
                except BlockingIOError:
                    break  # the interface's queue is full: retry on the next turn
                except OSError:
                    self.send_errors += 1
                q.popleft()
                self.forwarded += 1
            if q:
                wait = min(wait, max(0.0, q[0][0] - now))
        return wait

    def run(self):
        socks = list(self.peer)
        wait = 1.0
        while self.running:
            ready, _, _ = select.select(socks, [], [], wait)
            now = time.monotonic()
            for s in ready:
                self.receive(s, now)
            wait = self.send_due(time.monotonic())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--delay-ms", type=float, required=True)
    ap.add_argument("--limit", type=int, default=100_000, help="frames waiting per direction before drops")
    ap.add_argument("pairs", nargs="+", help="IF_A:IF_B")
    args = ap.parse_args(argv)
    stage = Stage([tuple(p.split(":", 1)) for p in args.pairs], args.delay_ms / 1000, args.limit)

    def stop(*_):
        stage.running = False

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print("ready", flush=True)
    try:
        stage.run()
    except InterruptedError:
        pass
    print(json.dumps({"forwarded": stage.forwarded, "dropped": stage.dropped, "send_errors": stage.send_errors}),
          flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
