"""The environment that tells a worker process where its job is, and the parse of the coordinator's address list.

A launcher, the per-host agent, or a user under torchrun/srun sets these variables; ``unbroken.ft`` reads them
(the job's token is ``store.gateway.TOKEN_ENV``). This module owns their names; what a worker does with them is
its client's (``control.member.client``).
"""

from __future__ import annotations

COORDINATOR_ENV = "UNBROKEN_COORDINATOR"  # HOST:PORT of the coordinator (a comma-separated list: standbys)
WORKER_ID_ENV = "UNBROKEN_WORKER_ID"  # this worker's id (else RANK or SLURM_PROCID; else the coordinator picks)
LOCAL_WORKERS_ENV = "UNBROKEN_LOCAL_WORKERS"  # workers on this host (to size each one's threads)
SPARE_ENV = "UNBROKEN_SPARE"  # a warm spare's index: it waits, initialised, for the id of a dead worker to replace
DEVICE_INDEX_ENV = "UNBROKEN_DEVICE_INDEX"  # a warm spare's device on its host (the workers' come from their ids)
RUN_DIR_ENV = "UNBROKEN_RUN_DIR"  # where this worker writes checkpoints (default: the coordinator's run dir)
# With a failure schedule: a pipe's write end (its descriptor number) on which the worker wakes its agent once it
# has reached an injection point (ft.inject), so the agent waits instead of polling the store for it.
INJECT_FD_ENV = "UNBROKEN_INJECT_FD"
# Set by the agent that starts the process: when it asked for it (time.time()), and "1" if a zygote forked it
# (control.host.zygote). The registration reports how long the start took, in wall time and in the process's CPU.
STARTED_AT_ENV = "UNBROKEN_STARTED_AT"
FORKED_ENV = "UNBROKEN_FORKED"


def addresses_of(spec: str) -> list[str]:
    """``HOST:PORT[,HOST:PORT...]`` -> the list (the leading coordinator and its standbys)."""
    out = [a.strip() for a in spec.split(",") if a.strip()]
    if not out:
        raise ValueError(f"no coordinator address in {spec!r}; expected HOST:PORT[,HOST:PORT...]")
    return out
