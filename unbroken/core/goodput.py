"""Goodput: committed tokens per second of the run's wall time, against the ideal, and where the rest went.

Owns the one account, computed from the run's facts (``core.runfacts``: its records folded once, the same facts
the summary, the status view and ``unbroken report`` read), so any finished run can be accounted again; the
coordinator's periodic ``goodput`` record is the account so far (``Tracker``):

- **wall**: ``RunFacts.wall_s``: each session's span, first record to last, plus the time a restart-policy
  relaunch spent between its sessions (the job was down, not finished).
- **goodput**: the run's tokens (``RunFacts.tokens``: committed steps, each once) per second of wall.
- **ideal**: the failure-free rate of the configuration: the median tokens over the median step time of the
  *clean* steps (committed, every worker of the run up, no recovery, no recomputed microbatch, no overflow redo,
  not a session's first), each without its wait for a member slower than the median member (``slow`` below),
  plus the *cadence*: the median time from a commit to the next step's start when nothing else happened between.
- **badput**: wall minus the time the committed tokens take at the ideal rate. It is split into ``Bucket``s
  that add up to it exactly, by walking the timeline: every step occupies ``[time - step_time_s, time]``
  (``time``: its commit); the rest of a session is before its first step, between steps, or after its last.

Where each second goes (an estimate never takes more than what is left of its interval; a measured duration is
taken in full):

- before a session's first step: ``start`` (launch, imports, group, data, a resume's load), or ``restart``
  when the session is a restart-policy relaunch (its ``restart`` record), with the time between the sessions
  and the end of the session before it (after its last step: the failure, the stop);
- between steps (beyond the cadence) and after the last: ``checkpoint`` (each checkpoint record's ``seconds``
  written there), then all that is left to ``coordinator`` (a coordinator lost or replaced there),
  ``evaluation`` (an eval recorded there), else ``unattributed``;
- a skipped step (non-finite gradient): all of it to ``nonfinite``; a step computed again after a restart
  or resume (an earlier record of a step that was committed again): all of it to ``restart``;
- a session's first step: its time beyond the ideal is warm-up, to ``start`` (or ``restart``);
- a committed step's time beyond its ideal (its tokens at the ideal rate, the usual time between steps
  included): the recovery durations the records measured inside it, in full: ``detection`` (a failure
  record's ``detection_s``: from a delivered kill to its declaration; unknown for a kill from outside),
  ``reformation`` (each recovery's ``reform_s``) and ``transfer`` (state sent to joiners: a join's
  ``time_recovered`` less the later of its ``time_reformed`` and the interval's start: a joiner's group formed
  ahead, while the survivors still computed the step before, waits for that step's end, and that wait is the
  step's own time, not the transfer's); then ``slow``, up to what is left: the wait for the slowest member
  beyond the median member (each member's quota times its seconds per microbatch, from the step record);
  then all that is left to ``recompute`` if the step recomputed lost microbatches, ``nonfinite`` if it redid
  microbatches after an overflow, ``workers_down`` if fewer workers than the run's full strength computed it,
  else ``unattributed``. Measured durations that overdraw the step's excess (they overlapped the survivors'
  own work) come off ``unattributed``.

``unattributed`` is what no record explains: steps of the same kind slower or faster than the median one (on a
loaded machine the step times are skewed: their mean lies above their median, and that surplus is unattributed),
and gaps between steps beyond the cadence; its share of the badput says how much of the account to trust.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from unbroken.core.records import RecordKind
from unbroken.core.runfacts import Mark, RunFacts, Step, kind_of


class Bucket(StrEnum):
    """Where the badput went (the module's doc says how each is measured)."""

    START = "start"
    DETECTION = "detection"
    REFORMATION = "reformation"
    RECOMPUTE = "recompute"
    TRANSFER = "transfer"
    CHECKPOINT = "checkpoint"
    EVALUATION = "evaluation"
    NONFINITE = "nonfinite"
    SLOW = "slow"
    WORKERS_DOWN = "workers_down"
    COORDINATOR = "coordinator"
    RESTART = "restart"
    UNATTRIBUTED = "unattributed"


@dataclass(frozen=True)
class Goodput:
    """A run's account (all times in seconds)."""

    wall_s: float
    tokens: int  # committed, each step once
    ideal_step_s: float  # the median time of a clean step (nan: no step yet)
    ideal_tokens_per_s: float
    buckets: dict[Bucket, float] = field(default_factory=dict)
    cadence_s: float = 0.0  # the usual time from a commit to the next step's start (part of the ideal step)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def ratio(self) -> float:
        """Goodput over the ideal (nan before the first clean step)."""
        if not self.ideal_tokens_per_s or math.isnan(self.ideal_tokens_per_s):
            return math.nan
        return self.tokens_per_s / self.ideal_tokens_per_s

    @property
    def badput_s(self) -> float:
        return sum(self.buckets.values())

    @property
    def unattributed_share(self) -> float:
        """The unattributed seconds over the badput (0 when there is no badput)."""
        bad = self.badput_s
        return abs(self.buckets.get(Bucket.UNATTRIBUTED, 0.0)) / bad if bad > 0 else 0.0

    def top(self, n: int = 3) -> list[tuple[Bucket, float]]:
        """The ``n`` largest attributed buckets (``unattributed`` not among them), largest first."""
        named = [(b, s) for b, s in self.buckets.items() if b is not Bucket.UNATTRIBUTED and s > 0]
        return sorted(named, key=lambda item: -item[1])[:n]

    def fields(self) -> dict[str, Any]:
        """The ``goodput`` record's fields."""
        return {
            "wall_s": self.wall_s,
            "tokens": self.tokens,
            "tokens_per_s": self.tokens_per_s,
            "ideal_tokens_per_s": self.ideal_tokens_per_s,
            "ideal_step_s": self.ideal_step_s,
            "ratio": self.ratio,
            "buckets": {str(b): s for b, s in self.buckets.items()},
        }

    def line(self) -> str:
        """One line: ``goodput 812 tokens/s of an ideal 1,020 (79.6 %); badput: recompute 4.1 s, start 3.0 s,
        checkpoint 1.2 s; unattributed 3 %``."""
        if math.isnan(self.ratio):
            return f"goodput {self.tokens_per_s:,.0f} tokens/s (no clean step yet: no ideal to compare with)"
        top = ", ".join(f"{b} {s:.2f} s" for b, s in self.top()) or "none"
        return (
            f"goodput {self.tokens_per_s:,.0f} tokens/s of an ideal {self.ideal_tokens_per_s:,.0f} "
            f"({100 * self.ratio:.1f} %); badput {self.badput_s:.2f} s: {top}; "
            f"unattributed {100 * self.unattributed_share:.0f} %"
        )


class _Ledger:
    """Seconds by bucket."""

    def __init__(self) -> None:
        self.buckets = {b: 0.0 for b in Bucket}

    def split(
        self,
        total: float,
        claims: Iterable[tuple[Bucket, float]],
        rest: Bucket,
        measured: Iterable[tuple[Bucket, float]] = (),
    ) -> None:
        """Hand out the ``total`` seconds of an interval: first the ``measured`` durations in full (a recovery's
        times: what it took, whatever else ran meanwhile), then each of the ``claims`` up to what is left, then
        the rest to ``rest``; what the measured durations overdraw (they overlapped work the interval needed
        anyway) comes off ``unattributed``."""
        left = total
        for bucket, amount in measured:
            self.buckets[bucket] += max(0.0, amount)
            left -= max(0.0, amount)
        for bucket, amount in claims:
            take = min(max(0.0, amount), max(0.0, left))
            self.buckets[bucket] += take
            left -= take
        self.buckets[rest if left >= 0 else Bucket.UNATTRIBUTED] += left


class _Timeline:
    """A session's marks by time, for those inside an interval (half-open: ``start < time <= stop``)."""

    def __init__(self, marks: Iterable[Mark]) -> None:
        self.marks = sorted(marks, key=lambda m: m.time)  # stable: records of the same time keep the file's order
        self.times = [m.time for m in self.marks]

    def between(self, start: float, stop: float) -> list[Mark]:
        return self.marks[bisect.bisect_right(self.times, start) : bisect.bisect_right(self.times, stop)]


def _is_clean(step: Step, full: int) -> bool:
    return step.committed and not (step.recoveries or step.recomputed or step.overflow_redos) and step.alive == full


def _time(step: Step) -> float:
    return float(step.time)  # type: ignore[arg-type]  # a timed step's


def _start(step: Step) -> float:
    return float(step.time) - float(step.step_time_s)  # type: ignore[arg-type]  # a timed step's


class _Account:
    """The walk over a run's sessions (``account``): the ideal first, then every interval of every session."""

    def __init__(self, facts: RunFacts) -> None:
        self.facts = facts
        timed = [s for s in facts.steps.values() if s.step_time_s is not None and s.time is not None]
        self.counted = {id(s) for s in timed if s.committed}  # a step's last record: the attempt that counts
        self.full = max((s.alive for s in timed), default=0)
        self.untimed = facts.untimed_tokens()
        self.runs = [  # each session with a time, its marks, and its timed steps in commit order
            (session, _Timeline(session.marks), sorted((s for s in session.steps if s.time is not None), key=_time))
            for session in facts.sessions
            if session.begin is not None
        ]
        self.cadence, clean = self._cadence()
        clean = clean or [s for s in timed if s.committed]
        # A clean step's time without its wait for a member slower than the median one: a slow worker is not ideal.
        balanced = [s.step_time_s - min(s.slow_wait_s, s.step_time_s) for s in clean]  # type: ignore[operator]
        self.ideal_step = statistics.median(balanced) + self.cadence if clean else math.nan
        ideal_tokens = statistics.median(s.tokens for s in clean) if clean else 0
        self.ideal_rate = ideal_tokens / self.ideal_step if clean and self.ideal_step > 0 else math.nan
        self.per_token = 1.0 / self.ideal_rate if self.ideal_rate > 0 else 0.0  # (nan > 0 is False: all excess)
        self.ledger = _Ledger()

    def _cadence(self) -> tuple[float, list[Step]]:
        """The usual time from one commit to the next step's start (publishing, the data of the next step), the
        median over the gaps in which nothing else was recorded, part of every step's ideal; and the clean steps
        (never a session's first: its time holds the warm-up)."""
        quiet: list[float] = []
        clean: list[Step] = []
        for _, timeline, steps in self.runs:
            for before, s in zip(steps, steps[1:], strict=False):
                if not timeline.between(before.time, _start(s)):  # type: ignore[arg-type]
                    quiet.append(max(0.0, _start(s) - before.time))  # type: ignore[operator]
                if id(s) in self.counted and _is_clean(s, self.full):
                    clean.append(s)
        return (statistics.median(quiet) if quiet else 0.0), clean

    def productive(self, begin: float, end: float) -> float:
        """The ideal time of the untimed steps recorded in (begin, end]: productive, not a gap's badput."""
        return sum(n for t, n in self.untimed if begin < t <= end) * self.per_token

    def run(self) -> Goodput:
        previous_end: float | None = None
        for n, (session, timeline, steps) in enumerate(self.runs):
            begin, end = float(session.begin), float(session.end)  # type: ignore[arg-type]
            if session.relaunch and previous_end is not None and begin > previous_end:
                self.ledger.buckets[Bucket.RESTART] += begin - previous_end  # the job was down, restarting
            previous_end = end
            opening = Bucket.RESTART if session.relaunch else Bucket.START
            cursor = self._steps(timeline, steps, begin, opening)
            if n + 1 < len(self.runs) and self.runs[n + 1][0].relaunch:  # it ended in a failure and a relaunch
                self.ledger.split(end - cursor - self.productive(cursor, end), [], Bucket.RESTART)
            else:
                _gap(self.ledger, timeline.between(cursor, end), end - cursor - self.productive(cursor, end), cursor)
        f = self.facts
        return Goodput(f.wall_s, f.tokens, self.ideal_step, self.ideal_rate, self.ledger.buckets, self.cadence)

    def _steps(self, timeline: _Timeline, steps: list[Step], cursor: float, opening: Bucket) -> float:
        """A session's steps and the gaps before them; the time of its last commit."""
        for k, s in enumerate(steps):
            seconds, stop = float(s.step_time_s), float(s.time)  # type: ignore[arg-type]
            start = stop - seconds
            if k == 0:
                self.ledger.split(start - cursor - self.productive(cursor, start), [], opening)
                usual = 0.0
            else:
                usual = min(max(0.0, start - cursor), self.cadence)
                gap = start - cursor - usual - self.productive(cursor, start)
                _gap(self.ledger, timeline.between(cursor, start), gap, cursor)
            cursor = stop
            seconds -= self.productive(start, stop)  # an untimed step recorded while this one ran
            if not s.committed:
                self.ledger.split(seconds + usual, [], Bucket.NONFINITE)
            elif id(s) not in self.counted:  # computed again later (after a restart or resume): this attempt is lost
                self.ledger.split(seconds + usual, [], Bucket.RESTART)
            else:
                excess = seconds + usual - s.tokens * self.per_token
                if k == 0:
                    self.ledger.split(excess, [], opening)  # the first step's warm-up
                else:
                    _step(self.ledger, s, excess, self.full, timeline.between(start, stop), start)
        return cursor


def account(source: RunFacts | Iterable[Mapping[str, Any]]) -> Goodput:
    """The goodput account of a run: its facts (``core.runfacts``), or its metrics records (every session, in
    file order)."""
    facts = source if isinstance(source, RunFacts) else RunFacts.of(source)
    return _Account(facts).run()


def _gap(ledger: _Ledger, inside: list[Mark], length: float, begin: float) -> None:
    """The time between two steps of a session, or after its last, from ``begin`` on, with the marks in it (a
    recovery between two steps, a join's above all, is measured here as inside a step)."""
    kinds = {m.kind for m in inside}
    checkpoint = sum(m.seconds for m in inside if m.kind is RecordKind.CHECKPOINT)
    lost = any(m.lost for m in inside)
    rest = Bucket.COORDINATOR if lost else Bucket.EVALUATION if RecordKind.EVAL in kinds else Bucket.UNATTRIBUTED
    ledger.split(length, [(Bucket.CHECKPOINT, checkpoint)], rest, _measured(inside, begin))


def _measured(marks: list[Mark], begin: float) -> list[tuple[Bucket, float]]:
    """What the failures and recoveries among the ``marks`` of an interval from ``begin`` on measured: detection
    (a delivered kill's), each re-formation, and a join's state transfer from the later of its group's formation
    and ``begin`` (a group formed ahead, while the survivors still computed the step before, waited for that
    step's end, which is that step's time)."""
    measured: list[tuple[Bucket, float]] = []
    for m in marks:
        if m.kind is RecordKind.FAILURE:
            measured.append((Bucket.DETECTION, m.seconds))
        elif m.kind is RecordKind.RECOVERY:
            measured.append((Bucket.REFORMATION, m.seconds))
            if m.transfer is not None:
                formed, received = m.transfer
                measured.append((Bucket.TRANSFER, received - max(formed, begin)))
    return measured


def _step(ledger: _Ledger, step: Step, excess: float, full: int, marks: list[Mark], start: float) -> None:
    """A committed step's time beyond its ideal (``excess``, negative for a step faster than the median), with
    the failures and recoveries inside it."""
    if step.recomputed:
        rest = Bucket.RECOMPUTE
    elif step.overflow_redos:
        rest = Bucket.NONFINITE
    elif step.alive < full:
        rest = Bucket.WORKERS_DOWN
    else:
        rest = Bucket.UNATTRIBUTED
    ledger.split(excess, [(Bucket.SLOW, step.slow_wait_s)], rest, _measured(marks, start))


class Tracker:
    """The live account: the run's records so far folded (``core.runfacts``), and a ``goodput`` record's fields
    every ``every`` committed steps (the coordinator writes it; ``every`` 0: never). It folds only the kinds the
    account reads (``KINDS``); each account walks every step folded, so a record every ``every`` steps costs
    O(steps) each time."""

    KINDS = frozenset(
        {
            RecordKind.STEP,
            RecordKind.EVAL,
            RecordKind.MEMBERSHIP,
            RecordKind.FAILURE,
            RecordKind.RECOVERY,
            RecordKind.CHECKPOINT,
            RecordKind.RESUME,
            RecordKind.COORDINATOR_LOST,
            RecordKind.RESTART,
            RecordKind.COORDINATOR,
            RecordKind.FINAL,
        }
    )

    def __init__(self, every: int, records: Iterable[Mapping[str, Any]] = ()) -> None:
        self.every = every
        self.facts = RunFacts()
        self.committed = 0
        for r in records:
            self.add(r, replaying=True)

    def add(self, record: Mapping[str, Any], replaying: bool = False) -> dict[str, Any] | None:
        """Fold ``record``; the fields of a ``goodput`` record when one is due (never while ``replaying``)."""
        kind = kind_of(record)
        if kind not in self.KINDS:
            return None
        self.facts.add(record)
        if kind is not RecordKind.STEP or not record.get("committed") or record.get("republished"):
            return None
        self.committed += 1
        if self.every <= 0 or self.committed % self.every or replaying:
            return None
        return {"step": record.get("step"), **account(self.facts).fields()}
