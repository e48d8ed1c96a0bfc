"""The C aggregator core (csrc/ina_core.c) and its C UDP loop, behind the same interfaces as the reference
model (`Switch`) and the Python server (`UDPServer`). Built by cffi at install time."""
from __future__ import annotations

import errno
import os
import re
import threading
import time
from types import SimpleNamespace

from inaproto import net, wire

from .control import ControlPlane
from .config import SwitchConfig, config_of
from .model import DROP_REASONS, SLOT_COUNTERS
from .capture import capture_address
from .server import bind_udp, check_probabilities, offer_groups

try:
    from ._native import ffi, lib
except ImportError as e:  # not built (no compiler at install time)
    ffi = lib = None
    IMPORT_ERROR = str(e)
else:
    IMPORT_ERROR = ""

MASK64 = (1 << 64) - 1
SHARED_PORTS = 64  # a shared switch's shared-memory ports by default: it has no jobs to size them by at start


def available() -> bool:
    """Returns:
        Whether the C core was built, so callers can fall back to the model instead of failing.
    """
    return lib is not None


def require():
    """Raises:
        RuntimeError: the C core was not built, naming the import error and the fix.
    """
    if lib is None:
        raise RuntimeError(f"the C core is not built ({IMPORT_ERROR}); reinstall with a C compiler: pip install -e .")


def core_stats(core, per_slot: bool = False, ffi=ffi, lib=lib) -> dict:
    """model.Switch.stats() for a C core (an `ina_switch *` of the cffi module (ffi, lib)), the same keys
    and numbers; each job's per-slot arrays have its own slot count. The caller keeps jobs from being added
    or removed meanwhile (CoreSwitch's lock): a removed job's counters are freed memory."""
    c = lib.ina_switch_counters(core)
    jobs = {}
    job_id, world, gen = ffi.new("uint32_t *"), ffi.new("uint32_t *"), ffi.new("uint64_t *")
    n_slots = ffi.new("uint32_t *")
    for i in range(lib.ina_switch_jobs(core)):
        lib.ina_switch_job_info(core, i, job_id, world, gen, n_slots)
        counters, slots = lib.ina_switch_job_slot_counters(core, i), n_slots[0]
        arrays = {name: [counters[k * slots + s] for s in range(slots)] for k, name in enumerate(SLOT_COUNTERS)}
        j = {"world_size": world[0], "slots": slots, "generation": gen[0],
             "failed": lib.ina_switch_failed(core, job_id[0]) == 1}
        j.update({name: sum(a) for name, a in arrays.items()})
        if per_slot:
            j["per_slot"] = arrays
        jobs[str(job_id[0])] = j
    return {"packets_in": c.packets_in, "packets_out": c.packets_out,
            "dropped": {name: c.drops[k] for k, name in enumerate(DROP_REASONS)},
            "overflows": c.overflows, "jobs": jobs}


def new_core(config: SwitchConfig, ffi=ffi, lib=lib):
    """An `ina_switch *` of the cffi module (ffi, lib), freed with the returned object, serving config's jobs."""
    if lib is None:
        require()
    c = config
    core = ffi.gc(lib.ina_switch_new(c.slots, c.max_elements, c.nc_rounding == "deterministic", c.seed & MASK64),
                  lib.ina_switch_free)
    if core == ffi.NULL:
        raise MemoryError("cannot allocate the switch")
    for job_id, n in c.jobs.items():
        if lib.ina_switch_add_job(core, job_id, n, c.slots) != 0:
            raise MemoryError(f"cannot allocate job {job_id}")
    return core


LOCAL_IDS = 1 << 48  # address ids above the 48-bit IPv4:port range name in-process test addresses


class CoreSwitch:
    """model.Switch's interface on the C core: process(data, src) -> [(bytes, dst)], stats(), and the data
    plane calls of the control plane (add_job, remove_job, admit, set_boot, fail, failed, member_packets,
    count_drop). (ffi, lib) name the cffi module the core is compiled into (the DPDK module has its own
    copy)."""

    def __init__(self, config: SwitchConfig | dict[int, int], ffi=ffi, lib=lib, **kw):
        """Args:
            config, **kw: as model.Switch.
            ffi, lib: the cffi module the core is compiled into (default switchsim._native).

        Raises:
            RuntimeError: the C core is not built.
            MemoryError: the core's slots cannot be allocated.
            ValueError: an invalid configuration.
        """
        self.config, control = config_of(config, kw)
        self.ffi, self.lib = ffi, lib
        self.core = new_core(self.config, ffi=ffi, lib=lib)
        self.slots, self.max_elements = self.config.slots, self.config.max_elements
        self.jobs = {j: SimpleNamespace(job_id=j, world_size=n, slots=self.slots) for j, n in self.config.jobs.items()}
        # add_job / remove_job against stats() from another thread (a Prometheus scrape): cffi calls drop the
        # GIL, and a removed job's counters are freed
        self._jobs_lock = threading.Lock()
        self._out = ffi.new("ina_out[]", lib.INA_MAX_OUT)
        self._ids: dict[object, int] = {}  # in-process source addresses (not (ip, port)) -> ids
        self._addrs: list[object] = []
        self.control = ControlPlane(self, self.config, **control)

    def address_id(self, src) -> int:
        """The id the core keeps for a source: IPv4 << 16 | port for (ip, port), else a local number."""
        if isinstance(src, tuple):
            return net.address_id(*src)  # (ip, port), or ("shm", port)
        i = self._ids.get(src)
        if i is None:
            i = self._ids[src] = LOCAL_IDS + len(self._addrs)
            self._addrs.append(src)
        return i

    def address(self, i: int):
        """The inverse of address_id, for the destinations the core emits.

        Args:
            i: an address id.

        Returns:
            (ip, port), or the in-process address that got the id.
        """
        if i >= net.SHM_IDS:
            return net.SHM_HOST, i - net.SHM_IDS
        if i >= LOCAL_IDS:
            return self._addrs[i - LOCAL_IDS]
        return net.int_to_ip(i >> 16), i & 0xFFFF

    def process(self, data, src) -> list[tuple[bytes, object]]:
        """model.Switch.process on the C core, one packet per call through cffi (tests compare the two
        packet for packet; servers use the C loops instead).

        Args:
            data: the datagram's bytes.
            src: the sender's address ((ip, port), or any hashable in-process name).

        Returns:
            The packets to emit, as (bytes, destination); never raises on bad input.
        """
        data = bytes(data)
        n = self.lib.ina_switch_process(self.core, data, len(data), self.address_id(src), self._out)
        if n == self.lib.INA_PUNT:
            return self.control_request(data, src)
        return self._emitted(n)

    def _emitted(self, n: int) -> list[tuple[bytes, object]]:
        """The first n packets the core wrote into its out array, as (bytes, destination)."""
        buf = self.ffi.buffer
        return [(bytes(buf(o.hdr)) + bytes(buf(o.payload, o.len)), self.address(o.dst)) for o in self._out[0:n]]

    def control_request(self, data: bytes, src) -> list[tuple[bytes, object]]:
        """A request the core punted (it parsed it): the control plane's answer, counted as sent."""
        out = self.control.handle(wire.unpack(data), data, src)
        self.lib.ina_switch_count_out(self.core, len(out))
        return out

    # ------------------------------------------------------------------ the control plane's calls
    def add_job(self, job_id: int, world_size: int, slots: int, base: int = 0):
        """model.Switch.add_job: a shared switch admitted a job, with `slots` clean slots of its own in the
        core (admit() follows). Called only while no C loop runs (between its run() calls).

        Args:
            base: the slots' offset in a pooled switch's registers (P4); the core's jobs each own theirs.

        Raises:
            ValueError: a job already served, or an id, world size or slot count the core cannot hold.
            MemoryError: the job's slots cannot be allocated.
        """
        if job_id in self.jobs:
            raise ValueError(f"job {job_id} is already served")
        if not (0 <= job_id <= 0xFFFF and 1 <= world_size <= wire.MAX_WORKERS and 1 <= slots <= wire.MAX_SLOTS):
            raise ValueError(f"job {job_id} of {world_size} workers and {slots} slots: out of range")
        with self._jobs_lock:
            if self.lib.ina_switch_add_job(self.core, job_id, world_size, slots) != 0:
                raise MemoryError(f"cannot allocate job {job_id}'s {slots} slots")
            self.jobs[job_id] = SimpleNamespace(job_id=job_id, world_size=world_size, slots=slots)

    def remove_job(self, job_id: int):
        """model.Switch.remove_job: the job ended; the core frees its slots and drops its later packets as
        unknown_job. Called only while no C loop runs, and no loop keeps a pointer into a job between runs
        (they send or copy every result before run() returns).

        Raises:
            KeyError: a job not served.
        """
        if job_id not in self.jobs:
            raise KeyError(f"job {job_id} is not served")
        with self._jobs_lock:
            self.lib.ina_switch_remove_job(self.core, job_id)
            del self.jobs[job_id]

    def admit(self, job_id: int, generation: int, session: int, first_id: int, addresses: list,
              elements: int | None = None, group=None):
        """model.Switch.admit: the control plane's decision, written into the core.

        Raises:
            KeyError: a job the switch does not serve.
        """
        ids = self.ffi.new("uint64_t[]", [self.address_id(a) for a in addresses])
        to = self.address_id(group) if group is not None else 0
        if self.lib.ina_switch_admit(self.core, job_id, generation, session, first_id, ids, elements or 0, to) != 0:
            raise KeyError(f"job {job_id} is not served")

    def set_boot(self, boot: int):
        """model.Switch.set_boot: the boot id everything the core sends carries."""
        self.lib.ina_switch_set_boot(self.core, boot & 0xFFFFFFFF)

    def fail(self, job_id: int, code: int, rank: int, text: str) -> list[tuple[bytes, object]]:
        """model.Switch.fail in the core: the generation's first failure stands; its error to every member.

        Returns:
            The error for each member, as (bytes, address); empty for a job without a generation.

        Raises:
            KeyError: a job the switch does not serve.
        """
        data = text.encode()
        n = self.lib.ina_switch_fail(self.core, job_id, code, rank, data, len(data), self._out)
        if n < 0:
            raise KeyError(f"job {job_id} is not served")
        return self._emitted(n)

    def failed(self, job_id: int) -> bool:
        """model.Switch.failed: whether the job's current generation failed.

        Raises:
            KeyError: a job the switch does not serve.
        """
        failed = self.lib.ina_switch_failed(self.core, job_id)
        if failed < 0:
            raise KeyError(f"job {job_id} is not served")
        return bool(failed)

    def member_packets(self, job_id: int) -> list[int]:
        """model.Switch.member_packets: admitted packets per rank, read from the core."""
        out = self.ffi.new("uint64_t[]", wire.MAX_WORKERS)
        self.lib.ina_switch_member_packets(self.core, job_id, out)
        return list(out[0:self.jobs[job_id].world_size])

    def count_drop(self, reason: str):
        """model.Switch.count_drop, in the core's counters.

        Raises:
            ValueError: a reason not in DROP_REASONS.
        """
        self.lib.ina_switch_count_drop(self.core, DROP_REASONS.index(reason))

    def stats(self, per_slot: bool = False) -> dict:
        """model.Switch.stats from the core's counters: the same keys and numbers, so tests and tools
        need not know the backend.

        Args:
            per_slot: add each job's per-slot arrays.

        Returns:
            The counters, as model.Switch.stats.
        """
        with self._jobs_lock:
            s = core_stats(self.core, per_slot, ffi=self.ffi, lib=self.lib)
        return self.control.annotate(s)


def impairment_stats(c) -> dict:
    """Impairment counters of a C loop ([0] received side, [1] sent side), as Impairment.stats()."""
    return {side: {"dropped": c.dropped[i], "duplicated": c.duplicated[i], "reordered": c.reordered[i]}
            for i, side in enumerate(("rx", "tx"))}


class _CLoopServer:
    """What the C loops' servers share: serve_forever (the loop in C, control requests up to the control
    plane and every packet it answers with back through the loop), start_thread and stop. A subclass names
    its loop's calls in _ops: run, punt, punt_clear, send and stop, each taking the loop first."""

    _ops: tuple[str, ...]
    thread_name = "switchsim-c"

    def serve_forever(self):
        """Serve until stop(); the C loop returns every few milliseconds (and whenever control requests
        wait), so signals and stop() are seen.

        Raises:
            OSError: the loop's transport failed.
        """
        run, punt, punt_clear, send, _ = (getattr(lib, name) for name in self._ops)
        length, src = ffi.new("uint32_t *"), ffi.new("uint64_t *")
        while not self._stopped.is_set():
            n = run(self.loop)  # releases the GIL until stopped, idle or a control request waits
            if n < 0:
                raise OSError(ffi.errno, "switch loop failed")
            for i in range(n):
                data = bytes(ffi.buffer(punt(self.loop, i, length, src), length[0]))
                for reply, dst in self.backend.control_request(data, self.backend.address(src[0])):
                    send(self.loop, net.address_id(*dst), reply, len(reply))  # impaired, captured
            punt_clear(self.loop)

    def start_thread(self) -> threading.Thread:
        """serve_forever in a daemon thread (it runs without the GIL most of the time).

        Returns:
            The started thread.
        """
        t = threading.Thread(target=self.serve_forever, name=self.thread_name, daemon=True)
        t.start()
        return t

    def stop(self):
        """Ask serve_forever to return (the C loop sees it within one pass); safe from a signal handler."""
        self._stopped.set()
        getattr(lib, self._ops[4])(self.loop)


class CUDPServer(_CLoopServer):
    """UDPServer's interface with the per-packet loop in C (csrc/ina_udp.c). Control requests (join, leave,
    abort, heartbeat, stats) come up to the Python control plane, rate-limited in C, and what it answers
    (replies, a failed generation's errors to every member) goes out through the loop; everything else
    stays in C.

    Args:
        backend: the CoreSwitch whose core the loop drives.
        host, port, loss, dup, reorder, seed: as UDPServer.

    Raises:
        ValueError: a probability outside [0, 1).
        OSError: the address cannot be bound.
        MemoryError: the loop's buffers cannot be allocated.
    """

    _ops = ("ina_udp_run", "ina_udp_punt", "ina_udp_punt_clear", "ina_udp_send", "ina_udp_stop")

    def __init__(self, backend: CoreSwitch, host="127.0.0.1", port=wire.DEFAULT_PORT, loss=0.0, dup=0.0,
                 reorder=0.0, seed=None):
        check_probabilities(loss, dup, reorder)
        self.backend = backend
        self.sock = bind_udp(host, port)
        self.address = self.sock.getsockname()
        self.loop = ffi.gc(lib.ina_udp_new(backend.core, self.sock.fileno(), loss, dup, reorder,
                                           (seed or 0) & MASK64), lib.ina_udp_free)
        if self.loop == ffi.NULL:
            raise MemoryError("cannot allocate the UDP loop")
        # result runs as UDP GSO sends (csrc/ina_gso.h): INA_GSO=0 none, 1 to every worker, unset to loopback ones
        gso = os.environ.get("INA_GSO", "auto")
        lib.ina_udp_set_gso(self.loop, {"0": lib.INA_UDP_GSO_OFF, "1": lib.INA_UDP_GSO_ALL}.get(
            gso, lib.INA_UDP_GSO_LOOPBACK))
        self._stopped = threading.Event()
        self.capturing = False
        self.started = time.monotonic()
        backend.control.stats = self.stats  # stats replies carry the loop's counters too
        offer_groups(self.sock, backend.control)

    def start_capture(self, path: str, max_mb: float):
        """As UDPServer.start_capture, written by the C loop (csrc/ina_capture.h).

        Raises:
            OSError: the file cannot be written.
        """
        me = capture_address(self.address)
        if lib.ina_udp_capture(self.loop, path.encode(), int(max_mb * 2**20), net.address_id(*me)):
            raise OSError(ffi.errno, f"cannot write the capture {path}")
        self.capturing = True

    def close(self):
        """Close the socket (after serve_forever returned), freeing the port, and the capture."""
        lib.ina_udp_capture_close(self.loop)
        self.sock.close()

    def stats(self, per_slot: bool = False) -> dict:
        """UDPServer.stats with the C loop's transport and impairment counters.

        Args:
            per_slot: add each job's per-slot arrays.

        Returns:
            The counters, in UDPServer.stats' layout.
        """
        s = self.backend.stats(per_slot=per_slot)
        c = lib.ina_udp_counters_of(self.loop)
        s.update({"bytes_in": c.bytes_in, "bytes_out": c.bytes_out, "send_errors": c.send_errors,
                  "gso_sends": c.gso_sends, "gro_segments": c.gro_segments,  # csrc/ina_gso.h
                  "impairment": impairment_stats(c), "uptime_s": round(time.monotonic() - self.started, 3)})
        if self.capturing:
            s.update({"captured": c.captured, "capture_skipped": c.capture_skipped})
        return s


class CShmServer(_CLoopServer):
    """The C core behind the shared-memory transport (`serve --backend c --shm NAME`, csrc/ina_shm_switch.c):
    workers on this host connect to "shm://NAME" and exchange the same packets through rings in
    /dev/shm/ina-NAME instead of UDP. Control requests come up to the Python control plane as with
    CUDPServer; impairments are applied in C.

    Args:
        backend: the CoreSwitch whose core the loop drives.
        name: the segment's name ([A-Za-z0-9_.-], at most 64).
        ports: workers that may be connected at once (default: twice the jobs' workers, at least 8; a shared
            switch, whose jobs come later, SHARED_PORTS).
        loss, dup, reorder, seed: as UDPServer.

    Raises:
        ValueError: a probability outside [0, 1) or a bad name.
        OSError: the segment cannot be made (EADDRINUSE: a live switch has that name; ENOSPC: /dev/shm full).
    """

    _ops = ("ina_shm_switch_run", "ina_shm_switch_punt", "ina_shm_switch_punt_clear", "ina_shm_switch_send",
            "ina_shm_switch_stop")
    thread_name = "switchsim-shm"

    def __init__(self, backend: CoreSwitch, name: str, ports: int | None = None, loss=0.0, dup=0.0, reorder=0.0,
                 seed=None):
        check_probabilities(loss, dup, reorder)
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ValueError(f"shared-memory name must be 1..64 of [A-Za-z0-9_.-], got {name!r}")
        self.backend = backend
        if not ports:
            shared = backend.config.shared
            ports = SHARED_PORTS if shared else max(8, 2 * sum(j.world_size for j in backend.jobs.values()))
        self.loop = ffi.gc(lib.ina_shm_switch_new(backend.core, name.encode(), ports, loss, dup, reorder,
                                                  (seed or 0) & MASK64), lib.ina_shm_switch_free)
        if self.loop == ffi.NULL:
            err = ffi.errno
            raise OSError(err, f"cannot make the shared-memory segment /dev/shm/ina-{name}: {os.strerror(err)}"
                          + (" (another switch serves that name)" if err == errno.EADDRINUSE else ""))
        self.address = (net.SHM_HOST, 0)
        self.url = net.SHM_SCHEME + name
        self._stopped = threading.Event()
        self.started = time.monotonic()
        backend.control.stats = self.stats

    def start_capture(self, path: str, max_mb: float):
        """Raises:
            RuntimeError: always; a shared-memory switch has no wire to capture (serve it on UDP for --pcap).
        """
        raise RuntimeError("--pcap needs a UDP switch: the shared-memory transport has no datagrams on a wire")

    def close(self):
        """Remove the segment (after serve_forever returned); connected workers then time out."""
        if self.loop is not None:
            self._final = self._transport()
            ffi.release(self.loop)
            self.loop = None

    def _transport(self) -> dict:
        c = lib.ina_shm_switch_counters(self.loop)
        return {"bytes_in": c.bytes_in, "bytes_out": c.bytes_out, "send_errors": c.send_errors,
                "bad_records": c.bad_records, "wakeups": c.wakeups, "impairment": impairment_stats(c)}

    def stats(self, per_slot: bool = False) -> dict:
        """UDPServer.stats' layout with the ring loop's counters (bad_records: records that could not be,
        which emptied their ring; wakeups: futex wakes of sleeping workers)."""
        s = self.backend.stats(per_slot=per_slot)
        s.update(self._transport() if self.loop is not None else self._final)
        s["uptime_s"] = round(time.monotonic() - self.started, 3)
        return s
