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
   in a whole window has **recovered**.

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
    RECOVERED = "recovered"  # a fail-slow worker not slow in a whole window since


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


def describe(record: Mapping[str, Any]) -> str:
    """One line for a ``slow`` record (a verdict): the summary, the status page, the log and the alerts say it so."""
    relative = record.get("relative")
    times = f"{relative:.2f}x" if isinstance(relative, int | float) else "?x"
    if record.get("state") == SlowState.SLOW:
        what = f"is fail-slow: {times} the other members' time per microbatch over {record.get('windows')} windows"
    else:
        what = f"is no longer slow: {times} the other members' time per microbatch"
    return f"worker {record.get('worker')} {what} (step {record.get('step')}; {record.get('decision')})"


def relative_times(step: Mapping[str, Any]) -> dict[int, float]:
    """Each member's seconds per microbatch over the median of the other members', in one step record (empty
    without ``speeds`` for two members or more)."""
    speeds: dict[int, float] = {}
    for worker, value in (step.get("speeds") or {}).items():
        if isinstance(value, int | float) and math.isfinite(value) and value > 0:
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
    _slow: set[int] = field(default_factory=set)  # fail-slow now

    @property
    def slow(self) -> frozenset[int]:
        return frozenset(self._slow)

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
        for worker in sorted(set(self._streak) | set(figures)):
            figure = figures.get(worker)
            others = [x for w, v in seen.items() if w != worker for x in v]
            if figure is None or not others:
                self._streak.pop(worker, None)
                continue
            typical = statistics.median(others)
            sigma = MAD_TO_SIGMA * statistics.median(abs(x - typical) for x in others)
            threshold = max(self.rule.ratio, 1.0 + self.rule.mad_z * sigma)
            if figure > threshold:
                self._streak[worker] = self._streak.get(worker, 0) + 1
                if self._streak[worker] == self.rule.windows:
                    self._slow.add(worker)
                    verdicts.append(Verdict(worker, SlowState.SLOW, last_step, figure, threshold, self._streak[worker]))
                continue
            self._streak.pop(worker, None)
            if worker in self._slow:
                self._slow.discard(worker)
                verdicts.append(Verdict(worker, SlowState.RECOVERED, last_step, figure, threshold, 0))
        return verdicts
