"""What a launch warns of: settings that are valid but cannot act in the run as configured.

``launch_warnings`` is a pure function of the resolved config, the worker count and the warm spares, returning
one line each (none for a run whose settings all can act): the launcher prints them at launch and
``--dry-run`` prints the same (errors, the settings a launch refuses, are ``ValueError``s elsewhere). It warns of:

- **idle workers**: more workers (of replicas of several ranks: more replicas) than ``train.microbatches``; the
  planner's own split of a step without failures says which compute nothing.
- **warm spares that are never used**: ``recovery.policy = "restart"`` stops and relaunches the whole job after a
  failure, so a spare never takes a worker's place.
- **a fail-slow rule that cannot act** (``control.coordinator.failslow``): under ``recovery.slow = "rebalance"`` or
  ``"exclude"``, a worker slow from the first step is found only after ``slow_window x slow_windows`` steps, and
  the action needs a step after its verdict; a slow-down the failure schedule injects (``slow:``) under any
  policy but ``off`` must fill ``slow_windows`` windows running before the run ends. The line says which
  ``--recovery.slow_window`` (and ``slow_windows`` if that must change too) would act. The default ``report`` on
  a run without ``slow:`` events is not warned of: a short run has nothing to report.
"""

from __future__ import annotations

from unbroken.control.coordinator.failslow import SlowRule
from unbroken.core.config import RecoveryPolicy, RunConfig, SlowPolicy
from unbroken.core.failures import FailureKind, FailureSchedule
from unbroken.core.layout import ReplicaLayout
from unbroken.core.plan import plan_step

PREFIX = "unbroken: warning: "


def launch_warnings(cfg: RunConfig, workers: int, spares: int = 0) -> list[str]:
    """The lines a launch of ``workers`` workers and ``spares`` warm spares under ``cfg`` warns with."""
    lines = [idle_warning(cfg, workers), spares_warning(cfg, spares), failslow_warning(cfg)]
    return [PREFIX + line for line in lines if line]


def idle_warning(cfg: RunConfig, workers: int) -> str:
    """Which replicas compute nothing in a step without failures (more replicas than ``train.microbatches``; the
    planner's own split says which), or "" when each has microbatches."""
    layout = ReplicaLayout.of(cfg.parallel)
    replicas = list(range(workers // layout.size))
    M = cfg.train.microbatches
    idle = [r for r, ids in plan_step(0, replicas, M).ids.items() if not ids]
    if not idle:
        return ""
    if layout.size == 1:
        who = f"worker{'s' if len(idle) > 1 else ''} {', '.join(map(str, idle))}"
    else:
        ranks = ", ".join(f"{r} (workers {layout.workers_of(r)[0]}-{layout.workers_of(r)[-1]})" for r in idle)
        who = f"replica{'s' if len(idle) > 1 else ''} {ranks}"
    verb = "computes" if len(idle) == 1 else "compute"
    return (
        f"{len(replicas)} {'workers' if layout.size == 1 else 'replicas'} for train.microbatches = {M}: {who} {verb} "
        f"nothing in a step without failures (a step has M microbatches however many work on it; the idle stand by "
        f"to take a failed one's); set train.microbatches >= {len(replicas)} to use them"
    )


def spares_warning(cfg: RunConfig, spares: int) -> str:
    if spares <= 0 or cfg.recovery.policy is not RecoveryPolicy.RESTART:
        return ""
    return (
        f"--spares {spares} with recovery.policy = restart: a failure stops and relaunches the whole job from its "
        "last checkpoint, so a warm spare never takes a worker's place; use another recovery.policy (recover, drop, "
        "mecefo, mecefo-spread) to use them, or leave --spares out"
    )


def failslow_warning(cfg: RunConfig) -> str:
    """Why the fail-slow rule cannot act in this run, and what would let it; "" when it can (or need not)."""
    r, steps = cfg.recovery, cfg.train.steps
    if r.slow is SlowPolicy.OFF:
        return ""
    spells = [
        (e.describe(), e.step, e.last_step)
        for e in FailureSchedule.parse(cfg.failures.schedule).events
        if e.kind is FailureKind.SLOW
    ]
    if not spells and r.slow is SlowPolicy.REPORT:
        return ""
    # A report needs its verdict within the run; an action also needs a step after it to act on.
    last = steps - 1 if r.slow is SlowPolicy.REPORT else steps - 2
    if not spells:
        spells = [("a worker slow from the first step", 0, steps - 1)]

    def missed(rule: SlowRule) -> list[str]:
        return [what for what, first, end in spells if (found := rule.found_at(first, end)) is None or found > last]

    if not (missing := missed(SlowRule(r.slow_window, r.slow_windows, r.slow_ratio))):
        return ""
    line = (
        f"recovery.slow = {r.slow} cannot act in this run of {steps} steps: the fail-slow rule needs "
        f"recovery.slow_windows = {r.slow_windows} windows running of recovery.slow_window = {r.slow_window} steps, "
        f"each more than half slow, which {missing[0]} does not fill by step {last}"
        + ("" if r.slow is SlowPolicy.REPORT else " (an action needs a step after its verdict)")
    )
    for windows in range(r.slow_windows, 0, -1):
        for window in range(r.slow_window - 1 if windows == r.slow_windows else r.slow_window, 1, -1):
            if not missed(SlowRule(window, windows)):
                more = f" --recovery.slow_windows={windows}" if windows != r.slow_windows else ""
                return f"{line}; --recovery.slow_window={window}{more} would act"
    return f"{line}; no window would"
