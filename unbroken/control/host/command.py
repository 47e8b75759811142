"""What a host's workers run, as the caller of the launcher and the agent gives it.

Owns ``WorkerCommand``: the command line of each worker, the modules the host's zygote imports before it forks
one (``control.host.zygote``), and whether the command is safe to fork whatever the launch said. The control plane
runs what it is given and never names a program of its own: the built-in trainer's command and preload list come
from the layer that owns the trainer, through the command line (``unbroken train``, ``unbroken agent``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from unbroken.core.config import RunConfig


@dataclass(frozen=True)
class WorkerCommand:
    """A worker's program.

    Args:
        argv: the command line each worker runs (its environment says which worker it is).
        preload: what the zygote runs before it forks workers, in order: a module path (imported; one that cannot
            be imported is logged and skipped, each worker then says what is wrong in its own log) or
            ``module:function`` (imported, then the function called with no argument: a warm-up).
        fork_safe: the program holds no per-process state a fork would share (e.g. data seeded with ``hash()``), so
            its workers are forked by default; otherwise only when the launch asks for it (``--fork``).
    """

    argv: tuple[str, ...]
    preload: tuple[str, ...] = ()
    fork_safe: bool = False


# The worker's program for a run, from the run's config (which the agent of a multi-host job reads from the store).
WorkerFor = Callable[[RunConfig], WorkerCommand]
