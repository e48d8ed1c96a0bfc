"""One switch configuration for every backend, the CLI, the harness and the tests, and the interfaces a
backend and a server implement (typing.Protocol), so a new backend (BMv2) knows what to provide."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Protocol

from inaproto import wire
from inaproto.timers import PEER_SILENT

DEFAULT_SLOTS = 512
DEFAULT_MAX_ELEMENTS = 1024
DEFAULT_MAX_JOBS = 4  # a shared switch's equal shares: its pool divided by this many jobs
DEFAULT_POOL = DEFAULT_MAX_JOBS * DEFAULT_SLOTS  # so a job alone on a shared switch gets today's 512 slots
ADMISSION_RULES = ("open", "keyed")


@dataclass
class SwitchConfig:
    """What a switch serves and how.

    Args:
        jobs: job id -> world size.
        slots: slots per job (each has two sets).
        max_elements: the most elements a packet (and a slot) may carry.
        nc_rounding: how the switch re-compresses NC sums: "stochastic" or "deterministic".
        seed: the switch's NC random stream.
        keys: job id -> key (bytes); joins of those jobs must carry its MAC.
        control_hosts: hosts besides loopback that may read the counters.
        first_packet_id: every slot's first packet id (even); None: random per generation.
        shared: a shared switch (`serve` without --job): no job is served at start; a job is admitted at
            its first join, its world size from the join, and ends when its members leave or fall silent.
            `slots` is then each job's quota (its share of the pool) and `jobs` must be empty.
        pool: a shared switch's slots over every job (each job's `slots` come out of it).
        min_slots: the fewest slots a shared switch admits a job with (None: its quota, `slots`); a job
            that cannot get them is refused at once (wire.ERR_POOL_FULL).
        admit: a shared switch's admission rule: "open" (any job id) or "keyed" (only jobs whose key the
            operator issued into key_dir, `switchsim key issue`; every join carries the key's MAC).
        key_dir: where a keyed shared switch finds the keys it issued (JOB.key files).
        peer_silent: seconds of silence (no packet, no heartbeat) after which a member is dead: its
            generation fails, and a shared switch's job whose members are all silent ends.
    """

    jobs: dict[int, int] = field(default_factory=lambda: {1: 2})
    slots: int = DEFAULT_SLOTS
    max_elements: int = DEFAULT_MAX_ELEMENTS
    nc_rounding: str = "stochastic"
    seed: int = 0
    keys: dict[int, bytes] = field(default_factory=dict)
    control_hosts: tuple[str, ...] = ()
    first_packet_id: int | None = None
    shared: bool = False
    pool: int = DEFAULT_POOL
    min_slots: int | None = None
    admit: str = "open"
    key_dir: str | None = None
    peer_silent: float = PEER_SILENT

    def __post_init__(self):
        self.jobs, self.keys, self.control_hosts = dict(self.jobs), dict(self.keys), tuple(self.control_hosts)
        if not 1 <= self.slots <= wire.MAX_SLOTS:
            raise ValueError(f"slots must be in 1..{wire.MAX_SLOTS}")
        if not 1 <= self.max_elements <= wire.MAX_ELEMENTS:
            raise ValueError(f"max_elements must be in 1..{wire.MAX_ELEMENTS}")
        if self.nc_rounding not in ("stochastic", "deterministic"):
            raise ValueError("nc_rounding must be 'stochastic' or 'deterministic'")
        for job_id, n in self.jobs.items():
            if not 0 <= job_id <= 0xFFFF:
                raise ValueError(f"job id {job_id} out of range 0..65535")
            if not 1 <= n <= wire.MAX_WORKERS:
                raise ValueError(f"job {job_id}: world size {n} out of range 1..{wire.MAX_WORKERS}")
        unknown = sorted(set(self.keys) - set(self.jobs))
        if unknown:
            raise ValueError(f"keys for jobs {unknown} that are not served")
        self._check_shared()
        if not self.peer_silent > 0:
            raise ValueError(f"peer_silent {self.peer_silent}: must be positive seconds")
        f = self.first_packet_id
        if f is not None and (f & 1 or not 0 <= f <= wire.PACKET_ID_MASK):
            raise ValueError(f"first packet id {f}: must be even and fit 32 bits (set 0 comes first)")

    def _check_shared(self):
        if not self.shared:
            if self.admit != "open" or self.key_dir is not None:
                raise ValueError("--admit and --key-dir are a shared switch's (serve without --job)")
            return
        if self.jobs:
            raise ValueError("a shared switch admits its jobs as they join: no --job")
        if not 1 <= self.pool <= wire.MAX_SLOTS * 64:
            raise ValueError(f"pool of {self.pool} slots: must be positive")
        if self.slots > self.pool:
            raise ValueError(f"each job's {self.slots} slots exceed the pool of {self.pool}")
        m = self.min_slots
        if m is not None and not 1 <= m <= self.slots:
            raise ValueError(f"min_slots {m}: must be in 1..{self.slots} (a job's quota)")
        if self.admit not in ADMISSION_RULES:
            raise ValueError(f"admission rule {self.admit!r}: one of {', '.join(ADMISSION_RULES)}")
        if (self.admit == "keyed") != (self.key_dir is not None):
            raise ValueError("a keyed shared switch needs --key-dir (the keys it issued), and only it takes one")

    @property
    def least_slots(self) -> int:
        """The fewest slots a shared switch admits a job with."""
        return self.min_slots or self.slots

    def control(self) -> dict:
        """The control plane's part (switchsim.control.ControlPlane keyword arguments)."""
        return {"keys": self.keys, "control_hosts": self.control_hosts, "first_packet_id": self.first_packet_id}

    def replace(self, **changes) -> "SwitchConfig":
        return SwitchConfig(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **changes})


def config_of(jobs_or_config, kw: dict) -> tuple[SwitchConfig, dict]:
    """A backend's constructor arguments -> (SwitchConfig, the rest): backends take either a SwitchConfig
    or the jobs dict with the config's fields as keywords (the tests' short form)."""
    if isinstance(jobs_or_config, SwitchConfig):
        return jobs_or_config, kw
    names = {f.name for f in fields(SwitchConfig)}
    cfg = SwitchConfig(jobs_or_config, **{k: v for k, v in kw.items() if k in names})
    return cfg, {k: v for k, v in kw.items() if k not in names}


class DataPlane(Protocol):
    """What a switch backend provides: the model (switchsim.model.Switch), the C core
    (switchsim.native.CoreSwitch); the control plane calls the methods after stats."""

    config: SwitchConfig

    def process(self, data, src) -> list[tuple[bytes, object]]: ...
    def stats(self, per_slot: bool = False) -> dict: ...
    def admit(self, job_id: int, generation: int, session: int, first_id: int, addresses: list,
              elements: int | None = None, group=None): ...
    def member_packets(self, job_id: int) -> list[int]: ...
    def count_drop(self, reason: str): ...
    def set_boot(self, boot: int): ...
    def fail(self, job_id: int, code: int, rank: int, text: str) -> list[tuple[bytes, object]]: ...
    def failed(self, job_id: int) -> bool: ...


class Server(Protocol):
    """What serves a backend on a network: switchsim.server.UDPServer, switchsim.native.CUDPServer,
    switchsim.dpdk.DPDKServer."""

    address: tuple[str, int]

    def serve_forever(self): ...
    def stop(self): ...
    def close(self): ...
    def stats(self, per_slot: bool = False) -> dict: ...
