"""What every part of the step protocol shares: its settings and the ways a worker's protocol ends.

Owns ``ProtocolConfig`` (the settings the protocol reads from the run's config), ``StopRun`` and
``InvariantViolation`` (this worker, or the whole job, stops, with which exit status: ``core.exits`` owns the
numbers, which it names here for the protocol's parts) and ``Interrupted`` (a collective was abandoned because the
membership changed). It knows nothing else: ``protocol`` and each of its parts import it, and ``protocol`` gives its
names to the callers that import them from there.
"""

from __future__ import annotations

from dataclasses import dataclass

from unbroken.core.config import NonfinitePolicy, RecoveryPolicy, Reduction, RunConfig, Workload

# The protocol's parts and ``protocol`` (which gives them to the library's callers) import the statuses from here.
from unbroken.core.exits import EXIT_COORDINATOR_LOST, EXIT_INVARIANT, EXIT_NONFINITE, EXIT_STOPPED  # noqa: F401


class StopRun(Exception):
    """This worker must stop. ``fatal``: the whole job must stop too (else only this worker leaves).
    ``shared``: every member reached the same decision from the same reduced values, so the group's leader
    stops the job (after the records that explain it) and the others wait for it."""

    def __init__(self, reason: str, fatal: bool = True, code: int = EXIT_STOPPED, shared: bool = False) -> None:
        super().__init__(reason)
        self.fatal = fatal
        self.code = code
        self.shared = shared


class InvariantViolation(StopRun):
    """A check that guards the training state failed: the run stops before anything is committed."""

    def __init__(self, reason: str, shared: bool = True) -> None:
        super().__init__(reason, fatal=True, code=EXIT_INVARIANT, shared=shared)


class Interrupted(Exception):
    """A collective was abandoned because the membership changed; recovery starts (internal only)."""


@dataclass(frozen=True)
class ProtocolConfig:
    """The settings the protocol reads, from the run's config."""

    microbatches: int
    policy: RecoveryPolicy
    reduction: Reduction
    workload: Workload
    op_timeout_s: float
    join_timeout_s: float
    bucket_bytes: int
    first_bucket_bytes: int
    nonfinite: NonfinitePolicy
    max_nonfinite_skips: int
    checkpoint_every: int
    checkpoint_keep: int
    workers_per_gpu: int = 1
    heartbeat_timeout_s: float = 2.0

    @staticmethod
    def of(cfg: RunConfig) -> ProtocolConfig:
        return ProtocolConfig(
            microbatches=cfg.train.microbatches,
            policy=cfg.recovery.policy,
            reduction=cfg.recovery.reduction,
            workload=cfg.recovery.workload,
            op_timeout_s=cfg.comm.op_timeout_s,
            join_timeout_s=cfg.comm.join_timeout_s,
            bucket_bytes=int(cfg.comm.bucket_mb * 2**20),
            first_bucket_bytes=int(cfg.comm.first_bucket_mb * 2**20),
            nonfinite=cfg.train.nonfinite,
            max_nonfinite_skips=cfg.train.max_nonfinite_skips,
            checkpoint_every=cfg.checkpoint.every,
            checkpoint_keep=cfg.checkpoint.keep,
            workers_per_gpu=cfg.train.workers_per_gpu,
            heartbeat_timeout_s=cfg.comm.heartbeat_timeout_s,
        )
