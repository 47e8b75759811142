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
3. The worker is **slow in a window** when that figure exceeds both ``ratio`` (slow enough to matter) and
   1 + ``mad_z`` x sigma, where sigma is how much the other members' relative times wander from step to step
   in that window (1.4826 x their median absolute deviation from their median: the standard deviation of a
   normal spread, estimated robustly). On a noisy machine, where everyone wanders, it takes more to stand out.
4. A worker slow in ``windows`` consecutive windows is **fail-slow** (a ``Verdict``); one that is then not slow
   in ``windows`` consecutive windows has **recovered**: the same evidence both ways, so one window whose
   yardstick was thrown by another member's pause (with three members, the others' median is their mean)
   does not switch a policy off and on again.

So a persistent slow-down is found within ``window x (windows + 1)`` steps of its start (``windows`` whole
windows, and the one it started in), while slow steps that are fewer than half of every window never make a
worker fail-slow: a one-off slow step, or a slow spell shorter than ``(windows - 1) x window`` steps (a
window's median needs half of it slow, so ``windows`` consecutive windows need the last half of one, all of
those between and half of the last).

The detector is pure Python: the coordinator feeds it the step records (``recovery.slow``: what happens then),
and it can be replayed on any finished run's records.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

MAD_TO_SIGMA = 1.4826  # the median absolute deviation of a normal distribution is sigma / 1.4826


class SlowState(StrEnum):
    SLOW = "slow"  # slow in `windows` consecutive windows
    RECOVERED = "recovered"  # a fail-slow worker not slow in `windows` consecutive windows since


class SlowDecision(StrEnum):
    """What a ``slow`` record says was done."""

    REPORT = "report"  # recovery.slow = "report", or a recovery
    REBALANCE = "rebalance"  # the throughput workload switched on (a verdict) or off (the last one recovered)
    EXCLUDE = "exclude"  # removed from the membership like a failed worker
    KEEP = "keep"  # recovery.slow = "exclude", but excluding it would not pay off (``Exclusion``)


@dataclass(frozen=True)
class SlowRule:
    window: int = 10  # steps per window
    windows: int = 3  # consecutive slow windows that make a worker fail-slow
    ratio: float = 1.5  # a window's median relative time above this, at least
    mad_z: float = 3.0  # ... and above 1 + mad_z x the members' robust spread

    def __post_init__(self) -> None:
        if self.window < 2 or self.windows < 1 or not self.ratio > 1.0 or self.mad_z < 0:
            raise ValueError(
                f"slow rule window = {self.window}, windows = {self.windows}, ratio = {self.ratio}, mad_z = "
                f"{self.mad_z}: needs window >= 2, windows >= 1, ratio > 1 and mad_z >= 0"
            )


@dataclass(frozen=True)
class Verdict:
    worker: int
    state: SlowState
    step: int  # the last step of the window that decided
    relative: float  # the worker's median relative time in that window
    threshold: float  # what it had to exceed (slow) or stay under (recovered)
    windows: int  # consecutive slow windows so far (0 for a recovery)


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
    decision = record.get("decision")
    if "saving_s" in record:
        decision = (
            f"{decision}: {record['saving_s']:.1f} s saved over {record.get('steps_left')} steps against "
            f"{record.get('cost_s', 0):.2f} s of recovery"
        )
    return f"worker {record.get('worker')} {what} (step {record.get('step')}; {decision})"


def relative_times(step: Mapping[str, Any]) -> dict[int, float]:
    """Each member's seconds per microbatch over the median of the other members', in one step record (empty
    without ``speeds`` for two members or more). A member the step gave no microbatch (``quotas``: the
    throughput workload routing around a slow one) measured nothing in it: it has no relative time there and
    is no yardstick for the others."""
    idle = {int(w) for w, n in (step.get("quotas") or {}).items() if n == 0}
    speeds: dict[int, float] = {}
    for worker, value in (step.get("speeds") or {}).items():
        if isinstance(value, int | float) and math.isfinite(value) and value > 0 and int(worker) not in idle:
            speeds[int(worker)] = float(value)
    if len(speeds) < 2:
        return {}
    return {w: s / statistics.median(x for v, x in speeds.items() if v != w) for w, s in speeds.items()}


@dataclass
class SlowDetector:
    """Feed it the committed step records in order (``observe``); it returns the verdicts each step decides."""

    rule: SlowRule = field(default_factory=SlowRule)
    _window: list[dict[int, float]] = field(default_factory=list)
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
        self._window = [{w: t for w, t in times.items() if w != worker} for times in self._window]

    def observe(self, step: Mapping[str, Any]) -> list[Verdict]:
        if step.get("type", "step") != "step" or not step.get("committed", True) or step.get("republished"):
            return []
        self._window.append(relative_times(step))
        if len(self._window) < self.rule.window:
            return []
        window, self._window = self._window, []
        return self._judge(window, int(step["step"]))

    def _judge(self, window: list[dict[int, float]], last_step: int) -> list[Verdict]:
        seen: dict[int, list[float]] = {}
        for times in window:
            for worker, relative in times.items():
                seen.setdefault(worker, []).append(relative)
        figures = {w: statistics.median(v) for w, v in seen.items() if len(v) * 2 >= len(window)}
        verdicts = []
        for worker in sorted(set(self._streak) | set(self._well) | set(figures)):
            figure = figures.get(worker)
            others = [x for w, v in seen.items() if w != worker for x in v]
            if figure is None or not others:  # no evidence either way: neither streak goes on
                self._streak.pop(worker, None)
                self._well.pop(worker, None)
                continue
            typical = statistics.median(others)
            sigma = MAD_TO_SIGMA * statistics.median(abs(x - typical) for x in others)
            threshold = max(self.rule.ratio, 1.0 + self.rule.mad_z * sigma)
            if figure > threshold:
                self._well.pop(worker, None)
                self._streak[worker] = self._streak.get(worker, 0) + 1
                if self._streak[worker] == self.rule.windows and worker not in self._slow:
                    self._slow.add(worker)
                    verdicts.append(Verdict(worker, SlowState.SLOW, last_step, figure, threshold, self._streak[worker]))
                continue
            self._streak.pop(worker, None)
            if worker in self._slow:
                self._well[worker] = self._well.get(worker, 0) + 1
                if self._well[worker] == self.rule.windows:
                    self._slow.discard(worker)
                    del self._well[worker]
                    verdicts.append(Verdict(worker, SlowState.RECOVERED, last_step, figure, threshold, 0))
        return verdicts
