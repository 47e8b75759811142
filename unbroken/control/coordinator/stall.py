"""The coordinator's stall judge: what to do about a collective that timed out while every heartbeat arrives (a
stalled member, a slow or partitioned link), from the members' reports (``keys.timeout(e, id)``). Pure Python.

The first time, the same members are re-formed (an epoch marked ``reform``: every member abandons the old group and
forms a fresh one); if the re-formed group times out again, the members that never reported either time (with their
whole replicas) are excluded and the rest go on, as after a kill; the job stops when nobody would be excluded (every
member reported: a link that fails them all) or no majority of the group where the stall began would be left.

A decision waits until every member reported, or a window passed since the first report: half a heartbeat timeout
before a re-formation (cheap, and it changes nothing if wrong), a whole one before an exclusion (a member that is
only slow, still computing when the others' collective timed out, reports late and must not be excluded for it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from unbroken.core.layout import ReplicaLayout


class StallAction(enum.StrEnum):
    """What the coordinator does about a stall (the ``decision`` of a ``stall`` record)."""

    REFORM = "re-form"
    EXCLUDE = "exclude"
    STOP = "stop"


@dataclass(frozen=True)
class Stall:
    """A collective that timed out with every heartbeat arriving: what the coordinator did about it."""

    base: tuple[int, ...]  # the members when it began (the majority rule counts from these)
    retry_epoch: int  # the epoch that re-formed them
    suspects: frozenset[int]  # members that did not report the first timeout


@dataclass(frozen=True)
class StallDecision:
    """The judge's answer for ``epoch``: ``members`` are the next epoch's (re-form, exclude), ``line`` the reason it
    is published with (or, for a stop, the stop line), ``excluded`` the members removed."""

    action: StallAction
    epoch: int
    reported: tuple[int, ...]
    suspects: tuple[int, ...]
    members: tuple[int, ...]
    line: str
    excluded: tuple[int, ...] = ()

    def fields(self) -> dict[str, Any]:
        """The ``stall`` record's fields."""
        return {
            "epoch": self.epoch,
            "reported": list(self.reported),
            "suspects": list(self.suspects),
            "decision": str(self.action),
        }

    def failure_why(self) -> str:
        """The ``failure`` record's words for a member this decision excluded (the epoch re-formed, and its
        predecessor, both stalled)."""
        return f"stalled in the collectives of epochs {self.epoch - 1} and {self.epoch}"


class StallJudge:
    """Decides stalls for one coordinator (``heartbeat_timeout_s`` sets the windows; replicas of ``layout`` are
    excluded whole)."""

    def __init__(self, heartbeat_timeout_s: float, layout: ReplicaLayout) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.layout = layout
        self.stall: Stall | None = None
        self.first_report: dict[int, float] = {}  # epoch -> when its first timeout report was seen

    def retrying(self, epoch: int) -> bool:
        """``epoch`` re-formed a stalled group: a second timeout in it excludes, not re-forms."""
        return self.stall is not None and self.stall.retry_epoch == epoch

    def pending(self, epoch: int) -> bool:
        """A report of ``epoch`` was seen: the coordinator looks again at its next tick, rung or not."""
        return epoch in self.first_report

    def due(self, epoch: int, members: tuple[int, ...], reported: set[int], now: float) -> set[int] | None:
        """The members that reported a timed-out collective of ``epoch`` once it is time to decide (every member
        reported, or the window passed since the first report seen, at ``now``); None before that."""
        if not reported:
            return None
        first = self.first_report.setdefault(epoch, now)
        window = self.heartbeat_timeout_s if self.retrying(epoch) else self.heartbeat_timeout_s / 2
        if len(reported) < len(members) and now - first < window:
            return None
        return set(reported)

    def decide(self, epoch: int, members: tuple[int, ...], reported: set[int]) -> StallDecision:
        """What to do now that ``reported`` (of ``members``, in ``epoch``) reported a timeout (``due``)."""
        suspects = frozenset(members) - reported
        said, stall = tuple(sorted(reported)), self.stall
        if stall is None or stall.retry_epoch != epoch:
            self.stall = Stall(members, epoch + 1, suspects)
            line = f"a collective of epoch {epoch} timed out (reported by {list(said)}); re-forming"
            return StallDecision(StallAction.REFORM, epoch, said, tuple(sorted(suspects)), members, line)
        stalled = frozenset(self.layout.with_replicas((suspects & stall.suspects) or suspects))
        survivors = tuple(w for w in members if w not in stalled)
        if not stalled or 2 * len(survivors) <= len(stall.base):
            why = (
                f"collectives keep timing out among {list(members)} although every heartbeat arrives"
                if not stalled
                else f"after excluding {sorted(stalled)} no majority of {list(stall.base)} would be left"
            )
            line = f"{why}; stopping (the last checkpoint is kept)"
            return StallDecision(StallAction.STOP, epoch, said, tuple(sorted(suspects)), members, line)
        self.stall = None
        excluded = tuple(sorted(stalled))
        line = "stalled twice: " + ", ".join(map(str, excluded))
        return StallDecision(StallAction.EXCLUDE, epoch, said, excluded, survivors, line, excluded)
