"""Fail-slow workers: the rule that says a worker stays slow, from the speeds the step records already carry.

A failing GPU (or a host with a bad fan, a throttled NIC) is often slow for a long time before it dies. One slow
step proves nothing: a checkpoint, a garbage collection, the page cache or a neighbour's job make any worker
slow once. The rule, per worker:

1. Each committed step gives every member's seconds per microbatch (``speeds``); the worker's **relative
   time** in that step is its own over the median of the *other* members' (1.0: as fast as they are; with
   two members, the other one).
2. The steps are cut into **windows** of ``window`` steps. A worker's figure for a window is the median of its
   relative times in it (at least half the window's steps must have one): fewer slow steps than half a window
   do not move a median.
3. The worker is **slow in a window** when that figure exceeds the **threshold**, the largest of three bounds
   (below): what the window's timing noise explains, what one preemption by the OS explains, and ``ratio``.
4. A worker slow in ``windows`` consecutive windows is **fail-slow** (a ``Verdict``); one that is then not slow
   in ``windows`` consecutive windows has **recovered**: the same evidence both ways, so one window whose
   yardstick was thrown by another member's pause (with three members, the others' median is their mean)
   does not switch a policy off and on again.

The threshold, derived:

- **The noise of the window's own timings**: 1 + ``mad_z`` x sigma, sigma being how much the other members'
  relative times wander from step to step in that window (1.4826 x their median absolute deviation from their
  median: the standard deviation of a normal spread, estimated robustly, so one member's pause does not widen
  it). The steps of a window are not independent samples (a neighbour's job loads a CPU for seconds, and a
  member's speed is a moving average over its microbatches), so a window's median is given no more credit than
  one step's time: a member as fast as the others exceeds 1 + 3 sigma with probability 0.13% in a window (a
  normal spread), and ``windows`` windows running (3 by default) are asked for besides.
- **One preemption** (``PREEMPTION_S``): a time per microbatch is no finer than the OS lets a thread run. A
  runnable thread that a neighbour preempts waits for that neighbour's slice, which the kernel ends at the first
  tick after it is used up: a slice and up to a tick. Linux's default slice is 0.75 ms x (1 + log2 of the CPUs,
  at most 8), so at most ``SCHED_SLICE_S`` = 3 ms (EEVDF's base slice, as CFS's minimum granularity was); a tick
  is 1/HZ, measured here as the resolution of ``CLOCK_MONOTONIC_COARSE`` (4 ms at HZ = 250, so 7 ms in all;
  10 ms, the coarsest, where it cannot be read); and a time is the difference of two readings of
  ``perf_counter``, each within its resolution (1 ns here). A worker whose
  excess time per microbatch, (figure - 1) x the other members' median seconds per microbatch t in the window,
  is within one preemption is not slow: the bound is 1 + ``floor_s`` / t. With microbatches of 1 ms that is
  about 8x (the scheduler dominates: only an extreme slowness counts), with 20 ms 1.35x, with a GPU's 200 ms
  1.04x.
- **``ratio``**: the least slowness that matters (``recovery.slow_ratio``, 1.5 by default). A policy, not a
  test of noise: a worker 1.1x the others, however surely, is not worth a verdict by default.

So a persistent slow-down is found within ``window x (windows + 1)`` steps of its start (``windows`` whole
windows, and the one it started in), while slow steps that are fewer than half of every window never make a
worker fail-slow: a one-off slow step, or a slow spell shorter than ``(windows - 1) x window`` steps (a
window's median needs half of it slow, so ``windows`` consecutive windows need the last half of one, all of
those between and half of the last). ``SlowRule.found_at`` says when a given spell is found (the launch warns
of a rule that cannot act within the run: ``control.launchcheck``).

The detector is pure Python: the coordinator feeds it the step records (``recovery.slow``: what happens then),
and it can be replayed on any finished run's records (on a host of the same tick: ``floor_s``, which the
``slow`` records carry).
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from unbroken.core.records import RecordKind

MAD_TO_SIGMA = 1.4826  # the median absolute deviation of a normal distribution is sigma / 1.4826
SCHED_SLICE_S = 0.003  # Linux's default scheduler slice at 8 CPUs or more, its largest (module docstring)
CLOCK_MONOTONIC_COARSE = 6  # linux/time.h (Python's time module does not name it): read at the tick's resolution
COARSEST_TICK_S = 0.01  # HZ = 100: the tick where it cannot be read


def scheduler_tick_s() -> float:
    """The kernel's tick (1/HZ), which ends a preempting neighbour's slice: the resolution of the coarse clock,
    which advances once a tick; ``COARSEST_TICK_S`` where it cannot be read."""
    if sys.platform == "linux":
        try:
            tick = time.clock_getres(CLOCK_MONOTONIC_COARSE)
        except OSError:
            return COARSEST_TICK_S
        return tick if tick > 0 else COARSEST_TICK_S
    return COARSEST_TICK_S


# How much one preemption adds to a microbatch's time on this host: a neighbour's slice, ended at the next tick,
# plus the error of the two timer readings a time is the difference of.
PREEMPTION_S = SCHED_SLICE_S + scheduler_tick_s() + 2 * time.get_clock_info("perf_counter").resolution


class SlowState(StrEnum):
    SLOW = "slow"  # slow in `windows` consecutive windows
    RECOVERED = "recovered"  # a fail-slow worker not slow in `windows` consecutive windows since


class SlowDecision(StrEnum):
    """What a ``slow`` record says was done."""

    REPORT = "report"  # recovery.slow = "report", or a recovery
    # the throughput workload switched on (a verdict) or off (the last one recovered); under "exclude", for the
    # group's leader, whose exclusion would pay off (``leader`` in the record: it is never excluded for slowness)
    REBALANCE = "rebalance"
    EXCLUDE = "exclude"  # removed from the membership like a failed worker
    # recovery.slow = "exclude", but excluding it would not pay off (``Exclusion``), or it leads the group and the
    # workload is already "throughput"
    KEEP = "keep"


@dataclass(frozen=True)
class SlowRule:
    window: int = 10  # steps per window
    windows: int = 3  # consecutive slow windows that make a worker fail-slow
    ratio: float = 1.5  # a window's median relative time above this, at least (the least that matters)
    mad_z: float = 3.0  # ... and above 1 + mad_z x the members' robust spread (the noise)
    floor_s: float = PREEMPTION_S  # ... and an excess time per microbatch above this (one preemption)

    def __post_init__(self) -> None:
        if self.window < 2 or self.windows < 1 or not self.ratio > 1.0 or self.mad_z < 0 or self.floor_s < 0:
            raise ValueError(
                f"slow rule window = {self.window}, windows = {self.windows}, ratio = {self.ratio}, mad_z = "
                f"{self.mad_z}, floor_s = {self.floor_s}: needs window >= 2, windows >= 1, ratio > 1, mad_z >= 0 "
                "and floor_s >= 0"
            )

    def threshold(self, sigma: float, microbatch_s: float) -> float:
        """What a window's figure must exceed: the largest of the three bounds (module docstring), for the other
        members' spread ``sigma`` and median seconds per microbatch ``microbatch_s``."""
        return max(self.ratio, 1.0 + self.mad_z * sigma, 1.0 + self.floor_s / microbatch_s)

    def found_at(self, first: int, last: int) -> int | None:
        """The step at which a worker slow (well past the threshold) in steps ``first`` to ``last`` and in no
        other is found fail-slow, windows cut from step 0; None if never. A window counts as slow only when more
        than half of its steps are (a window half slow has a median between the two halves: it may go either
        way), so this is when the rule surely acts, not the earliest it might."""
        streak = 0
        start = first - first % self.window
        while start <= last:
            end = start + self.window - 1
            slow_steps = min(end, last) - max(start, first) + 1
            streak = streak + 1 if 2 * slow_steps > self.window else 0
            if streak == self.windows:
                return end
            start += self.window
        return None


@dataclass(frozen=True)
class Verdict:
    worker: int
    state: SlowState
    step: int  # the last step of the window that decided
    relative: float  # the worker's median relative time in that window
    threshold: float  # what it had to exceed (slow) or stay under (recovered)
    windows: int  # consecutive slow windows so far (0 for a recovery)
    sigma: float = 0.0  # the other members' spread of relative times in that window
    microbatch_s: float = 0.0  # the other members' median seconds per microbatch in that window

    def fields(self) -> dict[str, Any]:
        """The ``slow`` record's fields that say what was judged (the decision is the policy's)."""
        return {
            "worker": self.worker,
            "state": str(self.state),
            "step": self.step,
            "relative": self.relative,
            "threshold": self.threshold,
            "windows": self.windows,
            "sigma": self.sigma,
            "microbatch_s": self.microbatch_s,
        }


@dataclass(frozen=True)
class Exclusion:
    """Whether removing a fail-slow worker pays off (``recovery.slow = "exclude"``), estimated from the step
    record whose window decided it: that step's microbatches (``quotas``) and seconds per microbatch
    (``speeds``).

    - A step takes as long as its slowest member: ``step_s`` = the largest quota x speed among the members.
    - Without the worker, its microbatches go to the others: ``step_without_s`` = ceil(microbatches / others)
      x the others' median speed.
    - Excluding it costs one in-step recovery: its microbatches of the step it leaves in, computed again by the
      others, ``cost_s`` = ceil(its quota / others) x their median speed (the group's re-formation, tens of
      milliseconds, is left out).
    - It pays off when (``step_s`` - ``step_without_s``) x the steps left exceeds ``cost_s``."""

    step_s: float
    step_without_s: float
    cost_s: float
    steps_left: int

    @property
    def saving_s(self) -> float:
        return (self.step_s - self.step_without_s) * self.steps_left

    @property
    def pays_off(self) -> bool:
        return self.saving_s > self.cost_s

    def fields(self) -> dict[str, float | int]:
        return {"saving_s": self.saving_s, "cost_s": self.cost_s, "steps_left": self.steps_left}


def exclusion(step: Mapping[str, Any], worker: int, steps_left: int) -> Exclusion | None:
    """The estimate for excluding ``worker`` after ``step`` (a step record); None when the record lacks the
    speeds or quotas of its members, or nobody else would be left."""
    speeds = {int(w): float(v) for w, v in (step.get("speeds") or {}).items() if isinstance(v, int | float)}
    quotas = {int(w): int(v) for w, v in (step.get("quotas") or {}).items() if isinstance(v, int | float)}
    others = [w for w in speeds if w != worker]
    if worker not in speeds or worker not in quotas or not others or any(w not in quotas for w in speeds):
        return None
    typical = statistics.median(speeds[w] for w in others)
    step_s = max(quotas[w] * speeds[w] for w in speeds)
    without = math.ceil(sum(quotas.values()) / len(others)) * typical
    cost = math.ceil(quotas[worker] / len(others)) * typical
    return Exclusion(step_s, without, cost, max(0, steps_left))


def describe(record: Mapping[str, Any]) -> str:
    """One line for a ``slow`` record (a verdict): the summary, the status page, the log and the alerts say it so."""
    relative = record.get("relative")
    times = f"{relative:.2f}x" if isinstance(relative, int | float) else "?x"
    if record.get("state") == SlowState.SLOW:
        what = f"is fail-slow: {times} the other members' time per microbatch over {record.get('windows')} windows"
    else:
        what = f"is no longer slow: {times} the other members' time per microbatch"
    decision = str(record.get("decision"))
    if "saving_s" in record:
        estimate = (
            f"{record['saving_s']:.1f} s saved over {record.get('steps_left')} steps against "
            f"{record.get('cost_s', 0):.2f} s of recovery"
        )
        if record.get("leader"):
            decision += (
                f" instead of exclude ({estimate}): the group's leader, which publishes the records and writes the "
                "checkpoints, is never excluded for slowness"
            )
        else:
            decision += f": {estimate}"
    return f"worker {record.get('worker')} {what} (step {record.get('step')}; {decision})"


def measured_speeds(step: Mapping[str, Any]) -> dict[int, float]:
    """The members' seconds per microbatch that one step record measured (empty for fewer than two members). A
    member the step gave no microbatch (``quotas``: the throughput workload routing around a slow one) measured
    nothing in it: it has no time there and is no yardstick for the others."""
    idle = {int(w) for w, n in (step.get("quotas") or {}).items() if n == 0}
    speeds: dict[int, float] = {}
    for worker, value in (step.get("speeds") or {}).items():
        if isinstance(value, int | float) and math.isfinite(value) and value > 0 and int(worker) not in idle:
            speeds[int(worker)] = float(value)
    return speeds if len(speeds) >= 2 else {}


def relative_times(step: Mapping[str, Any]) -> dict[int, float]:
    """Each member's seconds per microbatch over the median of the other members', in one step record (empty
    without ``speeds`` for two members or more; none for a member given no microbatch: ``measured_speeds``)."""
    return _relative(measured_speeds(step))


def _relative(speeds: Mapping[int, float]) -> dict[int, float]:
    if len(speeds) < 2:
        return {}
    return {w: s / statistics.median(x for v, x in speeds.items() if v != w) for w, s in speeds.items()}


@dataclass
class SlowDetector:
    """Feed it the committed step records in order (``observe``); it returns the verdicts each step decides."""

    rule: SlowRule = field(default_factory=SlowRule)
    _window: list[dict[int, float]] = field(default_factory=list)  # each step's measured speeds
    _streak: dict[int, int] = field(default_factory=dict)  # consecutive slow windows
    _well: dict[int, int] = field(default_factory=dict)  # a fail-slow worker's consecutive windows not slow
    _slow: set[int] = field(default_factory=set)  # fail-slow now

    @property
    def slow(self) -> frozenset[int]:
        return frozenset(self._slow)

    def forget(self, worker: int) -> None:
        """``worker`` left (excluded): should it come back, it is judged afresh."""
        self._streak.pop(worker, None)
        self._well.pop(worker, None)
        self._slow.discard(worker)
        self._window = [{w: t for w, t in speeds.items() if w != worker} for speeds in self._window]

    def observe(self, step: Mapping[str, Any]) -> list[Verdict]:
        kind = step.get("type", RecordKind.STEP)
        if kind != RecordKind.STEP or not step.get("committed", True) or step.get("republished"):
            return []
        self._window.append(measured_speeds(step))
        if len(self._window) < self.rule.window:
            return []
        window, self._window = self._window, []
        return self._judge(window, int(step["step"]))

    def _judge(self, window: list[dict[int, float]], last_step: int) -> list[Verdict]:
        relative: dict[int, list[float]] = {}  # each worker's relative times in the window's steps
        for speeds in window:
            for worker, r in _relative(speeds).items():
                relative.setdefault(worker, []).append(r)
        figures = {w: statistics.median(v) for w, v in relative.items() if len(v) * 2 >= len(window)}
        verdicts = []
        for worker in sorted(set(self._streak) | set(self._well) | set(figures)):
            figure = figures.get(worker)
            others = [x for w, v in relative.items() if w != worker for x in v]
            if figure is None or not others:  # no evidence either way: neither streak goes on
                self._streak.pop(worker, None)
                self._well.pop(worker, None)
                continue
            typical = statistics.median(others)
            sigma = MAD_TO_SIGMA * statistics.median(abs(x - typical) for x in others)
            seconds = statistics.median(s for speeds in window for w, s in speeds.items() if w != worker)
            threshold = self.rule.threshold(sigma, seconds)
            state = self._count(worker, figure > threshold)
            if state is not None:
                streak = self._streak.get(worker, 0) if state is SlowState.SLOW else 0
                verdicts.append(Verdict(worker, state, last_step, figure, threshold, streak, sigma, seconds))
        return verdicts

    def _count(self, worker: int, slow: bool) -> SlowState | None:
        """One more window, slow or not, for ``worker``: the state it now changes to, if it changes."""
        if slow:
            self._well.pop(worker, None)
            self._streak[worker] = self._streak.get(worker, 0) + 1
            if self._streak[worker] == self.rule.windows and worker not in self._slow:
                self._slow.add(worker)
                return SlowState.SLOW
            return None
        self._streak.pop(worker, None)
        if worker in self._slow:
            self._well[worker] = self._well.get(worker, 0) + 1
            if self._well[worker] == self.rule.windows:
                self._slow.discard(worker)
                del self._well[worker]
                return SlowState.RECOVERED
        return None
