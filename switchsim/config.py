"""One switch configuration for every backend, the CLI, the harness and the tests, and the interfaces a
backend and a server implement (typing.Protocol), so a new backend (BMv2) knows what to provide."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Protocol

from inaproto import wire

DEFAULT_SLOTS = 512
DEFAULT_MAX_ELEMENTS = 1024


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
    """

    jobs: dict[int, int] = field(default_factory=lambda: {1: 2})
    slots: int = DEFAULT_SLOTS
    max_elements: int = DEFAULT_MAX_ELEMENTS
    nc_rounding: str = "stochastic"
    seed: int = 0
    keys: dict[int, bytes] = field(default_factory=dict)
    control_hosts: tuple[str, ...] = ()
    first_packet_id: int | None = None

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
        f = self.first_packet_id
        if f is not None and (f & 1 or not 0 <= f <= wire.PACKET_ID_MASK):
            raise ValueError(f"first packet id {f}: must be even and fit 32 bits (set 0 comes first)")

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
