"""The errors a worker raises for what went wrong outside its own input (the input's own errors stay
TypeError / ValueError / OverflowError, agreed with the peers first). One base, INAError, with the cause
in attributes, so a framework can react to the kind of failure without parsing messages:

- `cause`: a short name ("call_mismatch", "aborted", "peer_dead", "not_member", "restarted",
  "unreachable", "silent", "rejected", "rank_taken", "pool_full", "timeout");
- `rank`: the rank the error names (the one that differed, aborted, died or holds a rank), or None;
- `switch`: the switch's address as the worker was given it ("HOST:PORT" or "shm://NAME").

CollectiveError and its subclasses mean the call failed on every rank of the job (the switch told every
member); the communicator re-joins on its next call, so that call is exact again. SwitchFault and its
subclasses mean the switch is gone or not the one the job joined: a framework may fall back to another
transport (hostlib's torch backend does).
"""
from __future__ import annotations


class INAError(RuntimeError):
    """A failure outside the caller's input, with its cause, the rank it names and the switch."""

    cause = "error"

    def __init__(self, message: str, *, cause: str | None = None, rank: int | None = None,
                 switch: str | None = None, job: int | None = None):
        super().__init__(message)
        if cause is not None:
            self.cause = cause
        self.rank, self.switch, self.job = rank, switch, job


class JoinRejected(INAError):
    """The switch refused the join (unknown job, wrong world size, rank out of range, bad MAC)."""

    cause = "rejected"


class RankTaken(JoinRejected):
    """Another address holds this rank of a job without a key (a second job with the same id, or a stranger)."""

    cause = "rank_taken"


class PoolFull(JoinRejected):
    """A shared switch cannot give this job the slots it needs now (its pool is lent to other jobs): refused
    at once, the message saying what is in use. A later join may be admitted once jobs end."""

    cause = "pool_full"


class CollectiveError(INAError):
    """The call failed on every rank of the job; the next call re-joins and is exact again."""


class CallMismatch(CollectiveError):
    """The ranks called differently (call number, codec, length): `rank` is one that differed."""

    cause = "call_mismatch"


class CallAborted(CollectiveError):
    """A rank's call failed before it was sent (its own input error): `rank` is that rank."""

    cause = "aborted"


class PeerDead(CollectiveError):
    """A member fell silent (no packet, no heartbeat for seconds) or left: `rank` is that rank."""

    cause = "peer_dead"


class SwitchFault(INAError):
    """The switch is gone, or not the switch (generation) the job joined."""


class SwitchUnreachable(SwitchFault, ConnectionError):
    """Nothing listens at the switch's address (connection refused), or the shared-memory switch exited."""

    cause = "unreachable"


class SwitchSilent(SwitchFault, TimeoutError):
    """The switch stopped answering (no result, no heartbeat answer for SWITCH_SILENT seconds) while the
    worker waited on it: it is stopped, hung, or the path to it is cut."""

    cause = "silent"


class SwitchRestarted(SwitchFault):
    """The switch answered with another boot id: it restarted and lost the job's state."""

    cause = "restarted"


class NotMember(SwitchFault):
    """The switch (same boot) no longer has this worker's generation: the job re-formed without it."""

    cause = "not_member"


class CallTimeout(INAError, TimeoutError):
    """No result within the communicator's timeout while every peer and the switch still seemed alive."""

    cause = "timeout"


ERROR_CLASSES = {"call_mismatch": CallMismatch, "aborted": CallAborted, "peer_dead": PeerDead,
                 "rejected": JoinRejected, "rank_taken": RankTaken, "pool_full": PoolFull}
