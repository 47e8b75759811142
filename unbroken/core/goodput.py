"""Goodput: committed tokens per second of the run's wall time, against the ideal, and where the rest went.

Owns the one definition, computed from the metrics records alone (so the summary, the status page, the
periodic ``goodput`` record and ``unbroken report`` agree, and any finished run can be accounted again):

- **wall**: each session's span, first record to last (``records.wall_s``), plus the time a restart-policy
  relaunch spent between its sessions (the job was down, not finished).
- **goodput**: the tokens of committed steps (each step once) per second of wall.
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
  ``time_recovered - time_reformed``); then ``slow``, up to what is left: the wait for the slowest member
  beyond the median member (each member's quota times its seconds per microbatch, from the step record);
  then all that is left to ``recompute`` if the step recomputed lost microbatches, ``nonfinite`` if it redid
  microbatches after an overflow, ``workers_down`` if fewer workers than the run's full strength computed it,
  else ``unattributed``. Measured durations that overdraw the step's excess (they overlapped the survivors'
  own work) come off ``unattributed``.

``unattributed`` is what no record explains (noise between steps of the same kind, which can be negative:
steps faster than the median); its share of the badput says how much of the account to trust.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from unbroken.core.records import RecordKind, is_join, sessions


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


def _number(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) else None


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


def _slow_wait(step: Mapping[str, Any]) -> float:
    """The seconds the step waited for its slowest member beyond the median member: each member's microbatches
    (``quotas``) times its seconds per microbatch (``speeds``)."""
    if (kept := _number(step.get("slow_wait_s"))) is not None:
        return kept  # a Tracker's slim copy of the record
    quotas, speeds = step.get("quotas") or {}, step.get("speeds") or {}
    busy = []
    for worker, quota in quotas.items():
        count, per_microbatch = _number(quota), _number(speeds.get(worker))
        if count is not None and per_microbatch is not None:
            busy.append(count * per_microbatch)
    return max(busy) - statistics.median(busy) if len(busy) > 1 else 0.0


class _Timeline:
    """Records by time, for the records inside an interval (half-open: ``start < time <= stop``)."""

    def __init__(self, records: Iterable[Mapping[str, Any]]) -> None:
        timed = sorted(((t, i, r) for i, r in enumerate(records) if (t := _number(r.get("time"))) is not None))
        self.times = [t for t, _, _ in timed]
        self.records = [r for _, _, r in timed]

    def between(self, start: float, stop: float) -> list[Mapping[str, Any]]:
        return self.records[bisect.bisect_right(self.times, start) : bisect.bisect_right(self.times, stop)]


def _timed_steps(records: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in records if r.get("type") == RecordKind.STEP and _number(r.get("step_time_s")) is not None]


def _is_clean(step: Mapping[str, Any], full: int) -> bool:
    return (
        bool(step.get("committed", True))
        and not step.get("skipped")
        and not step.get("recoveries")
        and not step.get("recomputed")
        and not step.get("overflow_redos")
        and int(step.get("alive", 0)) == full
    )


def account(records: Iterable[Mapping[str, Any]]) -> Goodput:
    """The goodput account of ``records`` (a run's metrics records, every session, in file order)."""
    records = [r for r in records if isinstance(r, Mapping)]
    final: dict[int, Mapping[str, Any]] = {}
    for r in _timed_steps(records):
        final[int(r["step"])] = r  # a step's last record is the one that counts (as ``records.committed_steps``)
    committed = [r for r in final.values() if r.get("committed", True) and not r.get("skipped")]
    counted = {id(r) for r in committed}
    tokens = sum(int(r.get("tokens", 0)) for r in committed)
    # A step known only from a republished record (its leader did not take part in its commit, or died before
    # publishing it: the record has no tokens or timing of its own) committed as usual: the run's usual tokens
    # per step, less what it dropped.
    untimed = {
        int(r["step"]): r
        for r in records
        if r.get("type") == RecordKind.STEP and r.get("republished") and int(r["step"]) not in final
    }
    untimed_tokens: list[tuple[float, int]] = []  # (when it was recorded, its tokens)
    if committed and untimed:
        usual = statistics.median(int(r.get("tokens", 0)) for r in committed)
        for r in untimed.values():
            if r.get("committed", True) and not r.get("skipped"):
                m = int(r.get("microbatches") or 1)
                untimed_tokens.append((float(r["time"]), round(usual * (m - int(r.get("dropped") or 0)) / m)))
        tokens += sum(n for _, n in untimed_tokens)
    full = max((int(r.get("alive", 0)) for r in final.values()), default=0)

    # The sessions' timelines, and the steps of each in commit order.
    runs = [(_Timeline(session), session) for session in sessions(records)]
    runs = [(t, session) for t, session in runs if t.times]
    ordered = [sorted(_timed_steps(session), key=lambda r: float(r["time"])) for _, session in runs]
    # The cadence: the usual time from one commit to the next step's start (publishing, the data of the next
    # step), the median over the gaps in which nothing else was recorded. Part of every step's ideal.
    quiet: list[float] = []
    clean: list[Mapping[str, Any]] = []
    for (timeline, _), steps in zip(runs, ordered, strict=True):
        for before, r in zip(steps, steps[1:], strict=False):
            start = float(r["time"]) - float(r["step_time_s"])
            if all(x.get("type") == RecordKind.STEP for x in timeline.between(float(before["time"]), start)):
                quiet.append(max(0.0, start - float(before["time"])))
            if id(r) in counted and _is_clean(r, full):
                clean.append(r)  # not a session's first step: its time holds the warm-up (``start``)
    cadence = statistics.median(quiet) if quiet else 0.0
    clean = clean or committed
    # A clean step's time without its wait for a member slower than the median one: a slow worker is not ideal.
    balanced = [float(r["step_time_s"]) - min(_slow_wait(r), float(r["step_time_s"])) for r in clean]
    ideal_step = statistics.median(balanced) + cadence if clean else math.nan
    ideal_tokens = statistics.median(r.get("tokens", 0) for r in clean) if clean else 0
    ideal_rate = ideal_tokens / ideal_step if clean and ideal_step > 0 else math.nan
    per_token = 1.0 / ideal_rate if ideal_rate > 0 else 0.0  # (nan > 0 is False: then every step is excess)

    def productive(begin: float, end: float) -> float:
        """The ideal time of the untimed steps recorded in (begin, end]: productive, not a gap's badput."""
        return sum(n for t, n in untimed_tokens if begin < t <= end) * per_token

    members = {int(r["epoch"]): list(r["members"]) for r in records if r.get("type") == RecordKind.MEMBERSHIP}
    events = _Timeline(r for r in records if r.get("type") in (RecordKind.FAILURE, RecordKind.RECOVERY))

    ledger = _Ledger()
    wall = 0.0
    previous_end: float | None = None
    relaunches = [any(r.get("type") == RecordKind.RESTART for r in session) for _, session in runs]
    for n, ((timeline, _), steps) in enumerate(zip(runs, ordered, strict=True)):
        begin, end = timeline.times[0], timeline.times[-1]
        relaunch = relaunches[n]
        relaunched = n + 1 < len(runs) and relaunches[n + 1]  # this session ended in a failure and a restart
        opening = Bucket.RESTART if relaunch else Bucket.START
        wall += end - begin
        if relaunch and previous_end is not None and begin > previous_end:
            wall += begin - previous_end  # the job was down between the two sessions, restarting
            ledger.buckets[Bucket.RESTART] += begin - previous_end
        previous_end = end
        cursor = begin
        for k, r in enumerate(steps):
            seconds, stop = float(r["step_time_s"]), float(r["time"])
            start = stop - seconds
            if k == 0:
                ledger.split(start - cursor - productive(cursor, start), [], opening)
                usual = 0.0
            else:
                usual = min(max(0.0, start - cursor), cadence)
                gap = start - cursor - usual - productive(cursor, start)
                _gap(ledger, timeline.between(cursor, start), gap, members)
            cursor = stop
            seconds -= productive(start, stop)  # an untimed step recorded while this one ran
            if r.get("skipped") or not r.get("committed", True):
                ledger.split(seconds + usual, [], Bucket.NONFINITE)
            elif id(r) not in counted:  # computed again later (after a restart or resume): this attempt is lost
                ledger.split(seconds + usual, [], Bucket.RESTART)
            else:
                excess = seconds + usual - r.get("tokens", 0) * per_token
                if k == 0:
                    ledger.split(excess, [], opening)  # the first step's warm-up
                else:
                    _step(ledger, r, excess, full, events.between(start, stop), members)
        if relaunched:
            ledger.split(end - cursor - productive(cursor, end), [], Bucket.RESTART)
        else:
            _gap(ledger, timeline.between(cursor, end), end - cursor - productive(cursor, end), members)
    return Goodput(wall, tokens, ideal_step, ideal_rate, ledger.buckets, cadence)


def _gap(ledger: _Ledger, inside: list[Mapping[str, Any]], length: float, members: dict[int, list[int]]) -> None:
    """The time between two steps of a session, or after its last, with the records written in it (a recovery
    between two steps, a join's above all, is measured here as inside a step)."""
    kinds = {r.get("type") for r in inside}
    checkpoint = sum(_number(r.get("seconds")) or 0.0 for r in inside if r.get("type") == RecordKind.CHECKPOINT)
    lost = RecordKind.COORDINATOR_LOST in kinds or any(
        r.get("type") == RecordKind.COORDINATOR and r.get("restored_epoch") for r in inside
    )
    rest = Bucket.COORDINATOR if lost else Bucket.EVALUATION if RecordKind.EVAL in kinds else Bucket.UNATTRIBUTED
    events = [r for r in inside if r.get("type") in (RecordKind.FAILURE, RecordKind.RECOVERY)]
    ledger.split(length, [(Bucket.CHECKPOINT, checkpoint)], rest, _measured(events, members))


def _measured(events: list[Mapping[str, Any]], members: dict[int, list[int]]) -> list[tuple[Bucket, float]]:
    """What the failures and recoveries among ``events`` measured: detection (a delivered kill's), each
    re-formation, and a join's state transfer."""
    measured: list[tuple[Bucket, float]] = []
    for r in events:
        if r.get("type") == RecordKind.FAILURE:
            measured.append((Bucket.DETECTION, _number(r.get("detection_s")) or 0.0))  # known for a delivered kill
        else:
            measured.append((Bucket.REFORMATION, _number(r.get("reform_s")) or 0.0))
            if is_join(r, members) and r.get("state_bytes"):
                formed, recovered = _number(r.get("time_reformed")), _number(r.get("time_recovered"))
                if formed is not None and recovered is not None:
                    measured.append((Bucket.TRANSFER, recovered - formed))
    return measured


def _step(
    ledger: _Ledger,
    step: Mapping[str, Any],
    excess: float,
    full: int,
    events: list[Mapping[str, Any]],
    members: dict[int, list[int]],
) -> None:
    """A committed step's time beyond its ideal (``excess``, negative for a step faster than the median), with
    the failures and recoveries inside it."""
    measured = _measured(events, members)
    if step.get("recomputed"):
        rest = Bucket.RECOMPUTE
    elif step.get("overflow_redos"):
        rest = Bucket.NONFINITE
    elif int(step.get("alive", full)) < full:
        rest = Bucket.WORKERS_DOWN
    else:
        rest = Bucket.UNATTRIBUTED
    ledger.split(excess, [(Bucket.SLOW, _slow_wait(step))], rest, measured)


class Tracker:
    """The live account: the run's records so far, and a ``goodput`` record's fields every ``every`` committed
    steps (the coordinator writes it; ``every`` 0: never). Each account reads every record kept (the step
    records and the few others it needs), so a record every ``every`` steps costs O(steps) each time."""

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

    # What the account reads of a step record: the members' quotas and speeds (as many as there are members, at
    # every step) are kept as the one number they give (the wait for the slowest member).
    STEP_FIELDS = ("type", "time", "step", "step_time_s", "tokens", "alive", "committed", "skipped", "recoveries")
    STEP_FIELDS += ("recomputed", "overflow_redos", "republished")

    def __init__(self, every: int, records: Iterable[Mapping[str, Any]] = ()) -> None:
        self.every = every
        self.records: list[Mapping[str, Any]] = []
        self.committed = 0
        for r in records:
            self.add(r, replaying=True)

    def add(self, record: Mapping[str, Any], replaying: bool = False) -> dict[str, Any] | None:
        """Keep ``record``; the fields of a ``goodput`` record when one is due (never while ``replaying``)."""
        if record.get("type") not in self.KINDS:
            return None
        if record.get("type") == RecordKind.STEP:
            record = {**{k: record[k] for k in self.STEP_FIELDS if k in record}, "slow_wait_s": _slow_wait(record)}
        self.records.append(record)
        if record.get("type") != RecordKind.STEP or not record.get("committed") or record.get("republished"):
            return None
        self.committed += 1
        if self.every <= 0 or self.committed % self.every or replaying:
            return None
        return {"step": record.get("step"), **account(self.records).fields()}
