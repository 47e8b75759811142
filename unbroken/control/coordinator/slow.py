"""The coordinator's fail-slow policy: ``SlowRecorder``, a sink of the run's records that judges the step records
with ``failslow.SlowDetector``, writes a ``slow`` record for each verdict and decides under ``recovery.slow``
(report, rebalance, exclude); and ``FailSlowActions``, what the coordinator then does (the workers to exclude, those
barred from coming back, the workload the next epochs carry). The detection rule, the verdicts and the exclusion
estimate are ``failslow``'s."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from unbroken.control.coordinator.failslow import (
    Exclusion,
    SlowDecision,
    SlowDetector,
    SlowRule,
    SlowState,
    Verdict,
    exclusion,
)
from unbroken.control.coordinator.failslow import describe as describe_slow
from unbroken.core.config import RunConfig, SlowPolicy, Workload
from unbroken.core.layout import ReplicaLayout
from unbroken.core.records import RecordKind, make

log = logging.getLogger(__name__)


class RecordWriter(Protocol):
    """Where the records a collaborator writes go (the coordinator's ``status.model.MetricsTee``)."""

    def write(self, record: dict[str, Any]) -> None: ...


class SlowRecorder:
    """A sink that watches the step records for fail-slow workers (``failslow``) and writes a ``slow``
    record into ``tee`` for each verdict. Under ``recovery.slow = "report"`` that, and a warning, is all it
    does; under ``"rebalance"`` it calls ``rebalance(True)`` at a worker's verdict and ``rebalance(False)`` when
    no worker is fail-slow any more (the coordinator switches the throughput workload on and off); under
    ``"exclude"`` a fail-slow worker whose exclusion pays off (``failslow.exclusion``, with the steps left
    of ``total_steps``) is handed to ``exclude`` (the coordinator removes it like a failed one), unless it leads
    the group (the lowest member, of replicas of ``replica_size`` ranks the lowest replica: it publishes the
    records and writes the checkpoints): that one is rebalanced around instead, as under ``"rebalance"``, until
    it recovers or leaves (kept, where ``workload`` is already throughput). ``records``: the run's so far,
    replayed without records (a restarted coordinator goes on where it was)."""

    def __init__(
        self,
        tee: RecordWriter,
        rule: SlowRule,
        records: Iterable[Mapping[str, Any]] = (),
        policy: SlowPolicy = SlowPolicy.REPORT,
        total_steps: int = 0,
        exclude: Callable[[int, str], None] | None = None,
        rebalance: Callable[[bool], None] | None = None,
        workload: Workload = Workload.EVEN,
        replica_size: int = 1,
    ) -> None:
        self.tee = tee
        self.detector = SlowDetector(rule)
        self.policy = policy
        self.total_steps = total_steps
        self.exclude = exclude
        self.rebalance = rebalance
        self.workload = workload
        self.replica_size = replica_size
        self.members: tuple[int, ...] = ()  # the newest membership record's
        self.leader_rebalanced: set[int] = set()  # leaders rebalanced around under "exclude", not yet recovered
        for r in records:
            if r.get("type") == RecordKind.STEP:
                self.detector.observe(r)
            elif r.get("type") == RecordKind.MEMBERSHIP:
                self.members = tuple(r.get("members") or ())

    def leader(self, step: Mapping[str, Any]) -> int | None:
        """The unit (worker, or replica) that leads the group now: the newest membership's lowest, else the
        lowest of the step's own members."""
        if self.members:
            return min(self.members) // self.replica_size
        units = [int(w) for w in (step.get("quotas") or step.get("speeds") or {})]
        return min(units) if units else None

    def write(self, record: Mapping[str, Any]) -> None:
        if record.get("type") == RecordKind.MEMBERSHIP:
            self.members = tuple(record.get("members") or ())
            units = {w // self.replica_size for w in self.members}
            gone = [w for w in self.detector.slow if w not in units]
            for worker in gone:  # it died or was excluded: should it come back, it is judged afresh
                self.detector.forget(worker)
            if gone and not self.detector.slow and self.policy is SlowPolicy.REBALANCE and self.rebalance:
                self.rebalance(False)
            self._leader_well({w for w in self.leader_rebalanced if w not in units})
            return
        if record.get("type") != RecordKind.STEP:
            return
        for v in self.detector.observe(record):
            estimate = None
            if self.policy is SlowPolicy.EXCLUDE and v.state is SlowState.SLOW:
                estimate = exclusion(record, v.worker, self.total_steps - 1 - v.step)
            decision, leader = self._decide(v, record, estimate)
            fields = {**v.fields(), "decision": str(decision), "floor_s": self.detector.rule.floor_s}
            fields |= estimate.fields() if estimate is not None else {}
            fields |= {"leader": True} if leader else {}
            slow = make(RecordKind.SLOW, time.time(), **fields)
            log.log(logging.WARNING if v.state is SlowState.SLOW else logging.INFO, "%s", describe_slow(slow))
            self.tee.write(slow)
            self._act(v, decision)

    def _decide(self, v: Verdict, record: Mapping[str, Any], estimate: Exclusion | None) -> tuple[SlowDecision, bool]:
        """What the policy does about verdict ``v`` (the step record ``record`` decided it; ``estimate``: what
        excluding the worker would save, under "exclude"), and whether it is the leader that exclude spared."""
        if self.policy is SlowPolicy.REBALANCE:
            return SlowDecision.REBALANCE, False
        if self.policy is not SlowPolicy.EXCLUDE:
            return SlowDecision.REPORT, False
        if v.state is SlowState.RECOVERED:
            return (SlowDecision.REBALANCE if v.worker in self.leader_rebalanced else SlowDecision.REPORT), False
        if estimate is None or not estimate.pays_off:
            return SlowDecision.KEEP, False
        if v.worker != self.leader(record):
            return SlowDecision.EXCLUDE, False
        # The leader publishes the records and writes the checkpoints; the leadership moves only when it leaves.
        # Rather than make a failure of the group's leader out of a slowness, the work is routed around it.
        usable = self.rebalance is not None and self.workload is not Workload.THROUGHPUT
        return (SlowDecision.REBALANCE if usable else SlowDecision.KEEP), True

    def _act(self, v: Verdict, decision: SlowDecision) -> None:
        if self.policy is SlowPolicy.REBALANCE and self.rebalance is not None:
            if v.state is SlowState.SLOW or not self.detector.slow:
                self.rebalance(v.state is SlowState.SLOW)
        elif self.policy is SlowPolicy.EXCLUDE and decision is SlowDecision.REBALANCE and self.rebalance is not None:
            if v.state is SlowState.SLOW:
                if not self.leader_rebalanced:
                    self.rebalance(True)
                self.leader_rebalanced.add(v.worker)
            else:
                self._leader_well({v.worker})
        if decision is SlowDecision.EXCLUDE and self.exclude is not None:
            self.exclude(v.worker, f"fail-slow: {v.relative:.2f}x the others' time per microbatch")

    def _leader_well(self, workers: set[int]) -> None:
        """Leaders rebalanced around that recovered or left: the config's workload again once none is left."""
        if workers & self.leader_rebalanced:
            self.leader_rebalanced -= workers
            if not self.leader_rebalanced and self.rebalance is not None:
                self.rebalance(False)


class FailSlowActions:
    """What the coordinator does on ``SlowRecorder``'s word (on the coordinator's thread, while it drains): the
    fail-slow workers to remove at its next look for the dead, those barred from coming back
    (``recovery.slow_rejoin = false``), and the workload every epoch published carries (``recovery.slow =
    "rebalance"``: the throughput workload while a worker is fail-slow). ``members``: the current epoch's."""

    def __init__(self, layout: ReplicaLayout, slow_rejoin: bool, members: Callable[[], tuple[int, ...]]) -> None:
        self.layout = layout
        self.slow_rejoin = slow_rejoin
        self.members = members
        self.exclusions: dict[int, str] = {}  # removed at the next look for the dead
        self.barred: dict[int, str] = {}  # refused at registration, with the line they read
        self.workload_override = ""  # the workload every epoch published carries ("": the config's)
        self.rebalance_due: str | None = None  # the override to publish at the next look ("" switches it off)

    def recorder(self, cfg: RunConfig, tee: RecordWriter, records: Iterable[Mapping[str, Any]]) -> SlowRecorder:
        """The fail-slow rule's sink (``recovery.slow``) acting through this; ``records``: the run's so far."""
        r = cfg.recovery
        rule = SlowRule(r.slow_window, r.slow_windows, r.slow_ratio)
        act = (self.exclude, self.rebalance, r.workload, self.layout.size)
        return SlowRecorder(tee, rule, records, r.slow, cfg.train.steps, *act)

    def rebalance(self, on: bool) -> None:
        """Switch the throughput workload on (a worker is fail-slow) or off (none is any more), from the next
        epoch on: published at the next look (``workload_due``)."""
        self.rebalance_due = str(Workload.THROUGHPUT) if on else ""

    def workload_due(self) -> str | None:
        """The reason to publish an epoch that switches the workload, once (None: no switch is due)."""
        if self.rebalance_due is None:
            return None
        self.workload_override, self.rebalance_due = self.rebalance_due, None
        if self.workload_override:
            return f"workload {self.workload_override} (a worker is fail-slow)"
        return "workload back to the config's"

    def exclude(self, unit: int, why: str) -> None:
        """A fail-slow worker (of replicas of several ranks, replica ``unit``: its first rank, whose removal takes
        the replica down) to remove like a failed one. Never the group's leader: the recorder rebalances around
        it instead, and this holds whatever the recorder saw."""
        wid = self.layout.workers_of(unit)[0]
        members = self.members()
        if wid in members and wid != min(members):
            self.exclusions[wid] = why
            if not self.slow_rejoin:
                for w in self.layout.workers_of(unit):
                    self.barred[w] = f"worker {w} was excluded as fail-slow and recovery.slow_rejoin = false"

    def removals(self, members: tuple[int, ...]) -> dict[int, str]:
        """The members of ``members`` to exclude now, each with why, handed out once (those that left meanwhile
        are forgotten)."""
        due = {w: why for w, why in self.exclusions.items() if w in members}
        self.exclusions.clear()
        return due
