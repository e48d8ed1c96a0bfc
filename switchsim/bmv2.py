"""The P4 data plane (p4/ina.p4) on BMv2's simple_switch_grpc, driven over P4Runtime by the project's control
plane (switchsim/control.py): `switchsim serve --backend bmv2`.

By default the server makes its own network namespace with one veth pair: BMv2's port 0 is the namespace
end, the other end stays here with WORKER_IP, and the switch answers ARP for its SWITCH_IP, so workers on
this machine reach it like any other backend. With `ifaces`, BMv2 takes those interfaces as ports 0, 1, ...
in the current namespace (topologies). JOIN, LEAVE, STATS_REQ, ABORT and HEARTBEAT come up as P4Runtime
packet-ins and the answers go down as packet-outs; admission writes the job's session into the `jobs` table,
each rank's address into `members` and `replicas`, and the job's multicast group (docs/p4.md). A shared
switch (serve without --job) has no job at start: the control plane lends a job a run of the pool's slots
(add_job: its `jobs` entry, member cells, counters zeroed) and takes them back when it ends (remove_job).

P4Runtime goes through p4runtime-shell (p4runtime_sh), the client P4 users know: the connection, the pipeline
push, and the shell's TableEntry, MulticastGroupEntry, MeterEntry and CounterEntry objects for the tables,
multicast groups, meters and counters (switchsim.p4rt.bind_shell lends them the controller's connection).
switchsim/p4rt.py keeps what p4runtime-shell lacks: arbitration as the primary that raises, batched writes
(admission), several counter cells in one read, packet-in / packet-out with their metadata by name
(p4/README.md, "P4Runtime clients"). The controller is the primary with election id CONTROLLER_ELECTION_ID,
above p4runtime-shell's default (1, 0): `python -m p4runtime_sh --grpc-addr unix:SOCKET --device-id 0` attaches
as a backup that reads (serve --p4runtime SOCKET says where).

Protocol v3's failures (p4/README.md, "protocol v3 in P4"): the data plane detects a call mismatch, marks the
generation failed itself and punts the packet with the round's call identity and writer (packet_in); the
controller words the error (wire.call_mismatch_text) and fails the job through the control plane. A failure
the control plane decides (abort, dead member, leave) sets the `failed` parameter of the job's table entry.
A failed job's data packets that no completed round answers are punted too, and answered with the stored
error from here. Not-member errors (unknown_worker, wrong_session) are made in the data plane.
"""
from __future__ import annotations

import copy
import functools
import ipaddress
import os
import shutil
import socket
import struct
import subprocess
import tempfile
import threading
import time
from typing import NamedTuple

from inaproto import gen_p4, wire

from .capture import Capture
from .config import SwitchConfig
from .control import CONTROL_RATE, MEMBER_RATE, SOURCE_RATE, ControlPlane
from .netns import VethNamespace

CPU_PORT = 255
MAX_ELEMENTS = gen_p4.LANES
SWITCH_MAC = "02:49:4e:41:00:01"  # locally administered: "INA"
# BMv2 takes bursts of about 30 packets on a port before it drops (measured here, 64-lane packets): a job's
# agreed window keeps its packets in flight below that (the control plane divides it among the workers)
IN_FLIGHT = 24
DEVICE_ID = 0
# the controller's election id: above p4runtime-shell's default (1, 0), so a user's shell is a backup (reads);
# a client with a higher one would take the primary role (and the packet-ins) from the controller
CONTROLLER_ELECTION_ID = (2, 0)
LAST_JOB = 0xFFFF  # its multicast group (job + 1) would not fit the program's 16 bits


def why_not() -> str:
    """Why this machine cannot run the BMv2 backend ("" if it can)."""
    tool = gen_p4.find_tool("simple_switch_grpc")
    if tool is None:
        return ("simple_switch_grpc not found (BMv2 with P4Runtime: set $SIMPLE_SWITCH_GRPC or put it on PATH; "
                "see p4/README.md)")
    broken = _does_not_run(tool)
    if broken:
        return broken
    try:
        import grpc  # noqa: F401
        import p4runtime_sh.shell  # noqa: F401 - p4runtime-shell: the P4Runtime client
        from p4.v1 import p4runtime_pb2  # noqa: F401
    except ImportError as e:
        return f"the BMv2 backend needs the p4 extra (pip install -e '.[p4]': p4runtime-shell, p4runtime): {e}"
    if os.geteuid() != 0:
        return "the BMv2 backend needs root to create its network namespace and veth pair"
    if not shutil.which("ip"):
        return "the BMv2 backend needs iproute2's ip command"
    return ""


def check_config(config: SwitchConfig) -> None:
    """What the P4 program can hold (its register and table sizes are compiled in): a shared switch's pool
    (its jobs come and go within it, add_job), or the static jobs laid out at start."""
    if config.max_elements > MAX_ELEMENTS:
        raise ValueError(f"the BMv2 switch takes at most {MAX_ELEMENTS} elements per packet "
                         f"(--elements-per-packet {config.max_elements})")
    if config.shared:
        if config.pool > gen_p4.SLOT_CAPACITY:
            raise ValueError(f"a pool of {config.pool} slots exceeds the P4 program's {gen_p4.SLOT_CAPACITY}")
        return
    if len(config.jobs) * config.slots > gen_p4.SLOT_CAPACITY:
        raise ValueError(f"{len(config.jobs)} jobs x {config.slots} slots exceed the P4 program's "
                         f"{gen_p4.SLOT_CAPACITY} slots")
    if sum(config.jobs.values()) > gen_p4.MEMBER_CAPACITY or len(config.jobs) > gen_p4.JOB_CAPACITY:
        raise ValueError(f"the P4 program holds {gen_p4.JOB_CAPACITY} jobs and {gen_p4.MEMBER_CAPACITY} ranks")
    if LAST_JOB in config.jobs:
        raise ValueError(f"job {LAST_JOB}: the P4 program's multicast group of a job is its id + 1 (16 bits)")


class JobLayout(NamedTuple):
    """Where a job lives in the P4 program's pools: its slots [slot_base, slot_base + slots) of the slot
    registers and per-slot counters, its ranks' cells [member_base, member_base + world) of `heard` and
    r_told, and its cell `index` of r_failed."""

    world: int
    slots: int
    slot_base: int
    member_base: int
    index: int


def static_layout(config: SwitchConfig) -> dict[int, JobLayout]:
    """A static switch's jobs in id order, packed from 0: job i has slots from i * slots and cell i."""
    layout, members = {}, 0
    for i, job in enumerate(sorted(config.jobs)):
        layout[job] = JobLayout(config.jobs[job], config.slots, i * config.slots, members, i)
        members += config.jobs[job]
    return layout


def first_fit(used: list[tuple[int, int]], size: int, capacity: int) -> int | None:
    """The lowest start of `size` free cells in [0, capacity) around the `used` (start, size) ranges."""
    at = 0
    for start, n in sorted(used):
        if start - at >= size:
            return at
        at = max(at, start + n)
    return at if capacity - at >= size else None


class BMv2Namespace(VethNamespace):
    """The BMv2 switch's namespace: its veth end is BMv2's port 0."""

    prefix, kind = "10.214", "b"

    @staticmethod
    def _why_not() -> str:
        return why_not()


@functools.lru_cache(maxsize=None)
def _does_not_run(tool: str) -> str:
    """Why `tool --version` fails ("" if it runs): a binary that is found but cannot start (its shared
    libraries missing: the prebuilt toolchain's install-deps, p4/README.md) is missing too, not a failed switch."""
    try:
        run = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{tool} does not run: {e}"
    if run.returncode != 0:
        said = (run.stderr or run.stdout).strip().splitlines()
        return (f"{tool} does not run (exit {run.returncode}: {said[-1] if said else 'no output'}); install its "
                f"runtime libraries (p4/README.md)")
    return ""


class BMv2Process:
    """simple_switch_grpc with no program yet, P4Runtime on a unix socket (reachable from any namespace):
    `socket`, or p4rt.sock in a temporary directory."""

    def __init__(self, ifaces: list[str], netns: str | None = None, timeout: float = 30.0, pcap_dir: str | None = None,
                 socket: str | None = None):
        self.dir = tempfile.mkdtemp(prefix="ina-bmv2-")
        self.socket = os.path.abspath(socket) if socket else os.path.join(self.dir, "p4rt.sock")
        self.own_socket = socket is not None
        if self.own_socket and os.path.exists(self.socket):
            raise RuntimeError(f"--p4runtime {socket}: the path exists (another switch's socket?)")
        cmd = [gen_p4.find_tool("simple_switch_grpc"), "--no-p4", *[a for i, name in enumerate(ifaces) for a in ("-i", f"{i}@{name}")],
               *([f"--pcap={pcap_dir}"] if pcap_dir else []),
               "--", "--grpc-server-addr", f"unix:{self.socket}", "--cpu-port", str(CPU_PORT)]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        self.log = open(os.path.join(self.dir, "switch.log"), "w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                said = self.output()  # before stop(), which closes the log
                self.stop()
                raise RuntimeError(f"simple_switch_grpc did not start: {said}")
            time.sleep(0.05)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()[-2000:]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.own_socket and os.path.exists(self.socket):
            os.unlink(self.socket)


class BMv2Server:
    """The INA switch as BMv2 + P4Runtime, with the Server and DataPlane interfaces (config.py).

    Args:
        config: the SwitchConfig (at most 64 elements per packet: the program's lanes).
        host: the switch's IPv4 address; ignored without ifaces (the namespace's SWITCH_IP).
        port: its UDP port, in DEFAULT_PORT .. DEFAULT_PORT + 15 (0: DEFAULT_PORT).
        ifaces: BMv2's ports, in the current namespace; None: a namespace and veth pair of its own.
        grpc_addr: a simple_switch_grpc already running (with --cpu-port 255) to control instead of one
            started here; host is then the switch's IP.
        pcap: (file, max MiB) for serve --pcap: BMv2's own per-port captures, merged into the file at close.
        p4runtime: the unix socket the started simple_switch_grpc serves P4Runtime on (serve --p4runtime;
            default: one in a temporary directory); `self.p4runtime` is the address ("unix:PATH").
    """

    def __init__(self, config: SwitchConfig, host: str = "", port: int = 0, ifaces: list[str] | None = None,
                 json_path: str = gen_p4.JSON, p4info_path: str = gen_p4.P4INFO, grpc_addr: str | None = None,
                 pcap: tuple[str, float] | None = None, p4runtime: str | None = None):
        from . import p4rt

        port = port or wire.DEFAULT_PORT
        if port & gen_p4.PORT_RANGE_MASK != wire.DEFAULT_PORT:
            raise ValueError(f"the BMv2 switch serves UDP ports {wire.DEFAULT_PORT}..{wire.DEFAULT_PORT + 15}, "
                             f"not {port}")
        check_config(config)
        reason = why_not()
        if reason:
            raise RuntimeError(reason)
        self.ns = self.process = self.sw = None
        if grpc_addr and p4runtime:
            raise ValueError("--p4runtime with --grpc: that simple_switch_grpc listens where it was told")
        if grpc_addr and not host:
            raise ValueError("--grpc needs --host: the switch's IPv4 address")
        if ifaces is None and grpc_addr is None:
            self.ns = BMv2Namespace()
            if self.ns.error:
                raise RuntimeError(self.ns.error)
            host, ifaces = self.ns.switch_ip, [self.ns.switch_if]
            config = config.replace(control_hosts=(*config.control_hosts, self.ns.worker_ip))
        self.config, self.address = config, (host, port)
        self.ports: dict[tuple, tuple[str, int]] = {}  # (ip, udp port) -> (MAC, switch port), from packet-ins
        self.control_drops = dict.fromkeys(wire.DROP_REASONS, 0)
        self.layout = static_layout(config)  # job -> JobLayout; a shared switch's come and go (add_job)
        self.admitted: dict[int, list] = {}
        self.generations: dict[int, tuple[int, int]] = {}  # job -> (session, first_id) of its admitted generation
        self.failures: dict[int, bytes] = {}  # job -> the error payload of its failed generation
        self.boot = 0  # the control plane sets it (set_boot)
        self.sent = 0  # packet-outs (control replies, errors)
        self._stopped = threading.Event()
        self.started = time.monotonic()
        if pcap and grpc_addr:
            raise ValueError("--pcap with --grpc: start that simple_switch_grpc with its own --pcap")
        self.pcap, self.pcap_dir, self.capture = pcap, tempfile.mkdtemp(prefix="ina-pcap-") if pcap else None, None
        try:
            if grpc_addr is None:
                self.process = BMv2Process(ifaces, self.ns.ns if self.ns else None, pcap_dir=self.pcap_dir,
                                           socket=p4runtime)
                grpc_addr = f"unix:{self.process.socket}"
            self.p4runtime = grpc_addr
            self.p4info = p4rt.P4Info(p4info_path)
            self.sw = p4rt.Switch(grpc_addr, device_id=DEVICE_ID, election_id=CONTROLLER_ELECTION_ID)
            self.sw.set_pipeline(self.p4info, json_path)  # p4runtime-shell's set_fwd_pipe_config
            p4rt.bind_shell(self.sw)  # its TableEntry, MulticastGroupEntry, MeterEntry, CounterEntry: through sw
            self._configure()
            # here too: it writes the boot id into the switch (set_boot), and BMv2 must not outlive a failure
            self.control = ControlPlane(self, config, stats=self.stats, in_flight=IN_FLIGHT)
        except BaseException:
            self.close()
            raise
        self.jobs = self.control.jobs

    # ------------------------------------------------------------------ configuration
    # Entries, multicast groups, meters and counters are p4runtime-shell's objects (values as the shell takes
    # them: strings, a MAC as aa:bb:..., an IPv4 address dotted), written through the controller's connection.
    def _configure(self):
        from p4runtime_sh import shell as sh

        self._write_switch_config()
        for j in sorted(self.layout):
            self._job_entry(j, 0, 0).insert()
        # 0: strangers' control requests; 1: failed jobs' data packets (answered from here); 2: members' requests
        for cell, (rate, burst) in enumerate((CONTROL_RATE, CONTROL_RATE, MEMBER_RATE)):
            sh.MeterEntry("punt_meter")(index=cell, cir=int(rate), cburst=burst, pir=int(rate), pburst=burst).modify()
        rate, burst = SOURCE_RATE  # every cell in one request
        self.sw.set_meter("source_meter", range(gen_p4.SOURCE_CELLS), int(rate), burst, int(rate), burst)

    def _write_switch_config(self):
        from p4runtime_sh import shell as sh

        host, port = self.address
        entry = sh.TableEntry("switch_config")(action="set_switch", is_default=True)
        entry.action.set(mac=SWITCH_MAC, ip=host, port=str(port),
                         nc_det=str(int(self.config.nc_rounding == "deterministic")), boot=str(self.boot))
        entry.modify()

    def _job_entry(self, job: int, session: int, first_id: int, elements: int | None = None, failed: bool = False):
        """The job's `jobs` entry (a p4runtime-shell TableEntry: .insert(), .modify(), .msg())."""
        from p4runtime_sh import shell as sh

        at = self.layout[job]
        entry = sh.TableEntry("jobs")(action="set_job")
        entry.match["hdr.ina.job"] = str(job)
        entry.action.set(**{k: str(v) for k, v in {
            "world": at.world, "slots": at.slots, "max_elements": elements or self.config.max_elements,
            "slot_base": at.slot_base, "session": session, "first_id": first_id, "group": job + 1,
            "index": at.index, "failed": int(failed)}.items()})
        return entry

    @staticmethod
    def _member_key(table: str, job: int, rank: int):
        from p4runtime_sh import shell as sh

        entry = sh.TableEntry(table)
        entry.match["hdr.ina.job"] = str(job)
        entry.match["hdr.ina.rank" if table == "members" else "sm.egress_rid"] = str(rank if table == "members"
                                                                                     else rank + 1)
        return entry

    # ------------------------------------------------------------------ DataPlane (what the control plane calls)
    def admit(self, job: int, generation: int, session: int, first_id: int, addresses: list,
              elements: int | None = None, group=None):
        """A new generation: bind each rank to its address, multicast to their ports, the new session
        (slot state of other sessions reads as clean in the data plane). group is always None here (the
        control plane has no group_port): the PRE replicates a result per member port, as Tofino's does."""
        from p4runtime_sh import shell as sh

        old = self.admitted.get(job)
        if old:  # one batched write (p4runtime-shell writes one entity a request)
            self.sw.delete(*[self._member_key(t, job, r).msg() for t in ("members", "replicas") for r in range(len(old))])
        members, replicas = [], []
        mc = sh.MulticastGroupEntry(job + 1)
        for rank, addr in enumerate(addresses):
            ip, port = str(ipaddress.IPv4Address(addr[0])), str(addr[1])
            mac, switch_port = self.ports[tuple(addr)]
            member = self._member_key("members", job, rank)(action="set_member")
            member.action.set(ip=ip, port=port, index=str(self.layout[job].member_base + rank))
            replica = self._member_key("replicas", job, rank)(action="to_worker")
            replica.action.set(mac=mac, ip=ip, port=port)
            members.append(member.msg())
            replicas.append(replica.msg())
            mc.add(switch_port, rank + 1)
        self.sw.insert(*members, *replicas)
        (mc.modify if old else mc.insert)()
        self._job_entry(job, session, first_id, elements).modify()
        self.admitted[job] = list(addresses)
        self.generations[job] = (session, first_id, elements)
        self.failures.pop(job, None)

    def add_job(self, job: int, world_size: int, slots: int, base: int = 0):
        """A shared switch admitted a job: its slots at `base` of the pool (the control plane's), member cells
        and a cell of r_failed found here, its counters zeroed (an earlier job's counts in those cells would
        be this one's stats and liveness), then its `jobs` entry with no generation (admit follows). Its slot
        registers need no clearing: state of another session reads as clean (slot_step, r_told, r_failed).
        Raises ValueError: a job already served, or one the program cannot hold."""
        at = self._place(job, world_size, slots, base)
        self._zero_counters(at)
        self.layout[job] = at
        try:
            self._job_entry(job, 0, 0).insert()
        except BaseException:
            del self.layout[job]
            raise

    def _place(self, job: int, world: int, slots: int, base: int) -> JobLayout:
        """The new job's cells: its slots where the control plane put them (checked: within the program's
        pool, on no other job's), its members first fit, the lowest free job index."""
        if job in self.layout:
            raise ValueError(f"job {job} is already served")
        if not 0 <= job < LAST_JOB or not 1 <= world <= wire.MAX_WORKERS or slots < 1 or base < 0:
            raise ValueError(f"job {job} of {world} ranks on {slots} slots at {base}: out of range")
        if base + slots > gen_p4.SLOT_CAPACITY:
            raise ValueError(f"job {job}'s slots [{base}, {base + slots}) exceed the P4 program's "
                             f"{gen_p4.SLOT_CAPACITY}")
        if any(base < at.slot_base + at.slots and at.slot_base < base + slots for at in self.layout.values()):
            raise ValueError(f"job {job}'s slots [{base}, {base + slots}) overlap another job's")
        member = first_fit([(at.member_base, at.world) for at in self.layout.values()], world,
                           gen_p4.MEMBER_CAPACITY)
        free = sorted(set(range(gen_p4.JOB_CAPACITY)) - {at.index for at in self.layout.values()})
        if member is None or not free:
            raise ValueError(f"the P4 program holds {gen_p4.JOB_CAPACITY} jobs and {gen_p4.MEMBER_CAPACITY} "
                             f"ranks: no room for job {job} of {world}")
        return JobLayout(world, slots, base, member, free[0])

    def _zero_counters(self, at: JobLayout):
        """Zero the job's per-slot counters and its members' `heard` cells, in one write (BMv2 cannot
        write registers, but it writes counter cells)."""
        from p4.v1 import p4runtime_pb2

        cells = [(name, range(at.slot_base, at.slot_base + at.slots)) for name in wire.SLOT_COUNTERS]
        cells.append(("heard", range(at.member_base, at.member_base + at.world)))
        self.sw.modify(*[p4runtime_pb2.CounterEntry(counter_id=self.p4info.counter_id(name),
                                                    index=p4runtime_pb2.Index(index=i),
                                                    data=p4runtime_pb2.CounterData(byte_count=0, packet_count=0))
                         for name, indices in cells for i in indices])

    def remove_job(self, job: int):
        """The job ended: its `jobs` entry, members, replicas and multicast group go in one write (its later
        packets drop as unknown_job), and its cells are free for a later job (add_job zeroes the counters).
        Raises KeyError: a job not served."""
        from p4runtime_sh import shell as sh

        if job not in self.layout:
            raise KeyError(f"job {job} is not served")
        entry = sh.TableEntry("jobs")
        entry.match["hdr.ina.job"] = str(job)
        gone = [entry.msg()]
        old = self.admitted.pop(job, None)
        if old is not None:
            gone += [self._member_key(t, job, r).msg() for t in ("members", "replicas") for r in range(len(old))]
            gone.append(sh.MulticastGroupEntry(job + 1).msg())
        self.sw.delete(*gone)
        del self.layout[job]
        self.generations.pop(job, None)
        self.failures.pop(job, None)

    def set_boot(self, boot: int):
        """The switch's boot id: a parameter of switch_config's default action, which every answer the data
        plane makes carries (results, not-member errors); the control plane's own answers carry it too."""
        self.boot = boot
        self._write_switch_config()

    def fail(self, job: int, code: int, rank: int, text: str) -> list[tuple[bytes, object]]:
        """The generation failed (model.Switch.fail): keep the first error, mark the job failed in its table
        entry (the data plane then sends its packets here, duplicates of completed rounds excepted), and
        return the error for every member."""
        addresses = self.admitted.get(job)
        if not addresses:
            return []
        if job not in self.failures:
            self.failures[job] = wire.ERROR_PAYLOAD.pack(code, rank) + text.encode()[:wire.MAX_ERROR_TEXT]
            self._job_entry(job, *self.generations[job], failed=True).modify()
        return [(self._error(job, r), addresses[r]) for r in range(len(addresses))]

    def failed(self, job: int) -> bool:
        return job in self.failures

    def _error(self, job: int, rank: int, answered=None) -> bytes:
        """The generation's error (model.Switch._error); as the answer to a packet (FLAG_REPLY) it echoes its
        packet id and pool."""
        if answered is None:
            return wire.pack(wire.MSG_ERROR, job=job, rank=rank, payload=self.failures[job],
                             session=self.generations[job][0], boot=self.boot)
        return wire.pack(wire.MSG_ERROR, job=job, rank=rank, packet_id=answered.packet_id, slot=answered.slot,
                         set=answered.set, flags=wire.FLAG_REPLY, payload=self.failures[job],
                         session=self.generations[job][0], boot=self.boot)

    def member_packets(self, job: int) -> list[int]:
        base, n = self.layout[job].member_base, self.layout[job].world
        heard = self._read_counter("heard", range(base, base + n))
        return [heard.get(base + r, 0) for r in range(n)]

    def _read_counter(self, name: str, indices=None) -> dict[int, int]:
        """{index: packets} of a counter: every cell with p4runtime-shell's CounterEntry (a wildcard read), or
        some cells in one read (p4rt: a per-slot counter is 4096 cells, and the shell reads one or all)."""
        if indices is None:
            from p4runtime_sh import shell as sh

            return {c.index: c.packet_count for c in sh.CounterEntry(name).read()}
        return {i: packets for i, (_, packets) in self.sw.read_counter_cells(name, indices).items()}

    def count_drop(self, reason: str):
        self.control_drops[reason] += 1

    # ------------------------------------------------------------------ Server
    def serve_forever(self):
        while not self._stopped.is_set():
            got = self.sw.packet_in(timeout=0.2)
            if got is not None:
                self._control_request(*got)

    def _control_request(self, frame: bytes, metadata: dict):
        """A punted packet, answered out the port it came in: a control request (JOIN, LEAVE, STATS_REQ,
        ABORT, HEARTBEAT) through the control plane; a data packet whose call differs from its round's
        (the data plane counted it and marked the generation failed); a failed generation's data packet."""
        src = _parse_frame(frame)
        if src is None:
            return self.count_drop("malformed")
        mac, addr, payload = src
        try:
            h = wire.unpack(payload)
        except wire.WireError:
            return self.count_drop("malformed")
        punt = metadata.get("punt", gen_p4.PUNT_CONTROL)
        if punt == gen_p4.PUNT_CONTROL:
            self.ports[addr] = (mac, metadata["ingress_port"])
            out = self.control.handle(h, payload, addr)
        elif punt == gen_p4.PUNT_CALL_MISMATCH:
            out = self._call_mismatch(h, metadata)
        else:
            out = self._failed_packet(h, addr)
        for reply, dst in out:
            self.send(reply, tuple(dst))

    def _current(self, h):
        """The job's control state if the punted data packet is of its admitted generation (a punt queued
        before a re-admission is not), else None."""
        job = self.control.jobs.get(h.job)
        if job is None or self.generations.get(h.job, (None,))[0] != h.session or h.session != job.session:
            return None
        return job

    def _call_mismatch(self, h, metadata):
        """The data plane found a packet of another call than its round's (model.Switch._update): word the
        error as the model does and fail the generation through the control plane (every member is told)."""
        job = self._current(h)
        if job is None:
            return []
        stored = (metadata.get("call", 0), metadata.get("call_kind", 0), metadata.get("call_len", 0))
        text = wire.call_mismatch_text(h.job, h.rank, h.call_id, metadata.get("writer", 0), stored)
        return self.control.fail(job, wire.ERR_CALL_MISMATCH, h.rank, text)

    def _failed_packet(self, h, addr):
        """A failed generation's data packet (counted `failed` in the data plane): the error to its sender."""
        if self._current(h) is None:
            return []
        if h.job not in self.failures:  # the data plane failed it, its mismatch punt never came: say so
            return self.control.fail(self.control.jobs[h.job], wire.ERR_CALL_MISMATCH, wire.NO_RANK,
                                     f"job {h.job}: the ranks' calls differ (the switch lost which ones)")
        return [(self._error(h.job, h.rank, h), addr)]

    def send(self, payload: bytes, dst: tuple):
        """A UDP datagram from the switch's address to dst (an address heard from), as a packet-out."""
        if dst not in self.ports:
            return
        mac, port = self.ports[dst]
        self.sw.packet_out(_udp_frame(SWITCH_MAC, mac, self.address, dst, payload), egress_port=port)
        self.sent += 1

    def stop(self):
        self._stopped.set()

    def close(self):
        """Stop BMv2 and remove its namespace; the counters read last stay readable (serve prints them)."""
        self._stopped.set()
        if getattr(self, "sw", None) is not None and getattr(self, "control", None) is not None:
            try:
                self._last_stats = self.stats(per_slot=True)
            except Exception:  # noqa: BLE001 - a switch that died has no counters to keep
                pass
        if getattr(self, "sw", None) is not None:
            from . import p4rt

            if p4rt._shell_owner is self.sw:
                p4rt.bind_shell(None)
        for part in ("sw", "process", "ns"):
            obj = getattr(self, part, None)
            if obj is not None:
                (obj.stop if part == "process" else obj.close)()
                setattr(self, part, None)
        if getattr(self, "pcap_dir", None):  # BMv2 has stopped: its files are complete
            self.capture = Capture(self.pcap[0], self.address, self.pcap[1])
            self.capture.merge_bmv2(self.pcap_dir)
            self.capture.close()
            shutil.rmtree(self.pcap_dir, ignore_errors=True)
            self.pcap_dir = None
            if hasattr(self, "_last_stats"):
                self._last_stats.update(self.capture.stats())

    # ------------------------------------------------------------------ counters
    def stats(self, per_slot: bool = False) -> dict:
        """The model's counters (Switch.stats), read from the P4 counters, plus the control plane's drops."""
        if self.sw is None:  # closed: what it counted last
            last = copy.deepcopy(getattr(self, "_last_stats", {"dropped": {}, "jobs": {}}))
            for job in last.get("jobs", {}).values():
                if not per_slot:
                    job.pop("per_slot", None)
            return last
        layout = dict(self.layout)  # as it is now: the control plane may add or remove a job meanwhile
        slots = [i for at in layout.values() for i in range(at.slot_base, at.slot_base + at.slots)]
        read = {name: self._read_counter(name, slots) for name in wire.SLOT_COUNTERS}
        read["drops"] = self._read_counter("drops")
        read["io"] = self._read_counter("io")

        def packets(name, i):
            return read[name].get(i, 0)

        drops = {r: packets("drops", i) + self.control_drops[r] for i, r in enumerate(wire.DROP_REASONS)}
        jobs = {str(j): self._job_stats(j, at, packets, per_slot) for j, at in layout.items()}
        out = sum(jobs[str(j)]["multicast"] * at.world + jobs[str(j)]["resent"] for j, at in layout.items())
        out += packets("io", 4) + packets("io", 5) + self.sent  # not-member errors, ERR_DROPPED answers; packet-outs
        s = {"packets_in": packets("io", 0), "packets_out": out, "dropped": drops, "overflows": packets("io", 2),
             "jobs": jobs, "bmv2": {"not_ina": packets("io", 3), "mac": SWITCH_MAC,
                                    "uptime_s": round(time.monotonic() - self.started, 3)}}
        return self.control.annotate(s)

    def _job_stats(self, job: int, at: JobLayout, packets, per_slot: bool) -> dict:
        """A job's counters in the model's layout (Switch.stats), over its own slots."""
        counts = {c: [packets(c, at.slot_base + s) for s in range(at.slots)] for c in wire.SLOT_COUNTERS}
        control = self.control.jobs.get(job)  # a job the control plane has not taken up yet: generation 0
        out = {"world_size": at.world, "slots": at.slots, "generation": control.generation if control else 0,
               "failed": self.failed(job)}
        out.update({c: sum(v) for c, v in counts.items()})
        if per_slot:
            out["per_slot"] = counts
        return out

ETH_IP_UDP = struct.Struct("!6s6sH BBHHHBBH4s4s HHHH")  # Ethernet, IPv4 without options, UDP


def _parse_frame(frame: bytes):
    """(source MAC, (source IP, UDP port), UDP payload) of an Ethernet/IPv4/UDP frame, else None. By hand,
    not scapy: this is the control plane's per-packet path, and scapy takes about a millisecond a frame."""
    if len(frame) < ETH_IP_UDP.size:
        return None
    _, src_mac, ethertype, vihl, _, total, _, frag, _, proto, _, src, _, sport, _, length, _ = \
        ETH_IP_UDP.unpack_from(frame)
    if ethertype != 0x0800 or vihl != 0x45 or proto != 17 or frag & 0x3FFF or length < 8:
        return None
    payload = frame[ETH_IP_UDP.size:ETH_IP_UDP.size + length - 8]
    if len(payload) != length - 8:
        return None
    return ":".join(f"{b:02x}" for b in src_mac), (socket.inet_ntoa(src), sport), payload


def _udp_frame(src_mac: str, dst_mac: str, src: tuple, dst: tuple, payload: bytes) -> bytes:
    """An Ethernet/IPv4/UDP frame (UDP checksum 0, as IPv4 allows)."""
    ip = [0x45, 0, 28 + len(payload), 0, 0x4000, 64, 17, 0, socket.inet_aton(src[0]), socket.inet_aton(dst[0])]
    head = struct.pack("!BBHHHBBH4s4s", *ip)
    words = sum(struct.unpack("!10H", head))
    while words >> 16:
        words = (words & 0xFFFF) + (words >> 16)
    ip[7] = ~words & 0xFFFF
    return (bytes.fromhex(dst_mac.replace(":", "")) + bytes.fromhex(src_mac.replace(":", "")) + b"\x08\x00"
            + struct.pack("!BBHHHBBH4s4s", *ip) + struct.pack("!HHHH", src[1], dst[1], 8 + len(payload), 0) + payload)
