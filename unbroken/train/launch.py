"""What a host's workers run: the built-in trainer's command, or a user's script's, with what the zygote preloads.

Owns ``trainer_worker`` (``python -m unbroken.train``, fork-safe) and ``script_worker`` (a user's program, forked only
when its launch asks for it), each with the list of what the host's zygote imports before it forks a worker: the
trainer (and with it ``unbroken.ft``), Hugging Face's model for a run of ``model.hf_config`` (``train.hf``), and the
exact fold's kernels warmed up in exact mode (``ft.foldkernel.warm``; an fp32 worker never loads numba). The control
plane is handed the result (``control.host.command.WorkerCommand``) by the command line or a benchmark, and names
none of these modules itself.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from unbroken.control.host.command import WorkerCommand
from unbroken.core.config import Reduction, RunConfig
from unbroken.train.hf import worker_imports

TRAINER_MODULE = "unbroken.train"  # ``python -m`` this: one worker of the built-in trainer
TRAINER_IMPORTS = ("unbroken.train.trainer",)  # what every zygote imports beyond torch: the trainer, the library
FOLD_WARMUP = "unbroken.ft.foldkernel:warm"  # the exact fold's numba kernels, loaded and run once


def preload(cfg: RunConfig, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """What the zygote of a run of ``cfg`` imports and warms up before forking its workers, in order: the trainer,
    ``extra`` (modules the workers import beyond), the exact fold's kernels in exact mode."""
    fold = (FOLD_WARMUP,) if cfg.recovery.reduction is Reduction.EXACT else ()
    return (*TRAINER_IMPORTS, *extra, *fold)


def trainer_worker(cfg: RunConfig) -> WorkerCommand:
    """The built-in trainer's worker for a run of ``cfg`` (``unbroken train``, ``unbroken agent`` without a script)."""
    argv = (sys.executable, "-m", TRAINER_MODULE)
    return WorkerCommand(argv, preload(cfg, worker_imports(cfg.model.hf_config)), fork_safe=True)


def script_worker(argv: tuple[str, ...]) -> Callable[[RunConfig], WorkerCommand]:
    """A user's program ``argv`` (``unbroken launch SCRIPT``, ``unbroken agent SCRIPT``), for a run's config."""
    return lambda cfg: WorkerCommand(tuple(argv), preload(cfg))
