"""The event loop of the cluster simulator (``unbroken.sim.simulate``): one recovery policy over one failure
timeline. Pure Python + numpy.

Owns the step-level model: strides of identical steps between events, the steps an event falls into
simulated event by event, checkpoints, and the accounting of committed work and of the time lost by cause.
``Engine`` is what every policy shares (and the restart after every member died); ``InStepEngine`` recovers
inside the step (recover, drop, MeCeFO) and ``RestartEngine`` stops, rolls back and relaunches (restart). The
events come from ``events.EventQueue``. The device model
(``finish_offsets``): a replica runs on its own devices, or, to replay a real CPU run, processor-shares the
host's cores with the other replicas.
"""

from __future__ import annotations

import bisect
import math

import numpy as np

from unbroken.core import plan as planlib
from unbroken.core.config import RecoveryPolicy
from unbroken.core.failures import FailureSchedule, Phase
from unbroken.core.goodput import Bucket
from unbroken.sim.events import EventQueue, NeedLongerTimeline
from unbroken.sim.planner import Planner
from unbroken.sim.scenario import HOUR, Costs, Scenario
from unbroken.sim.timeline import Timeline

LOST_CAUSES = ("detection", "re-formation", "recompute", "restart", "rollback", "idle", "checkpoint", "degraded")
# The goodput bucket (core.goodput, what a real run's records are accounted in) of each cause.
BUCKET_OF = {
    "detection": Bucket.DETECTION,
    "re-formation": Bucket.REFORMATION,
    "recompute": Bucket.RECOMPUTE,
    "restart": Bucket.RESTART,
    "rollback": Bucket.RESTART,
    "idle": Bucket.RESTART,
    "checkpoint": Bucket.CHECKPOINT,
    "degraded": Bucket.WORKERS_DOWN,
}


def _rates(active: np.ndarray, cores: int, penalty: float) -> np.ndarray:
    """Speed of each of ``active`` processes processor-sharing ``cores`` cores: a core each at most, and each
    process beyond the cores costs ``penalty`` of a core's throughput per core (context switches, caches)."""
    oversubscribed = np.maximum(0, active - cores) / cores
    return np.minimum(1.0, cores / active) / (1.0 + penalty * oversubscribed)


def finish_offsets(work: np.ndarray, cores: int, penalty: float = 0.0) -> np.ndarray:
    """When each job of ``work`` seconds (at full speed) finishes if all start together: on its own device
    (``cores`` = 0), or processor-shared on ``cores`` CPU cores (see ``_rates``)."""
    if cores == 0 or len(work) <= cores:
        return work.copy()
    order = np.argsort(work, kind="stable")
    ordered = work[order]
    rate = _rates(len(work) - np.arange(len(work)), cores, penalty)
    out = np.empty_like(work)
    out[order] = np.cumsum(np.diff(ordered, prepend=0.0) / rate)
    return out


def makespan(work: np.ndarray, cores: int, penalty: float = 0.0) -> float:
    """When the last job of ``work`` finishes (see ``finish_offsets``)."""
    if cores == 0 or len(work) <= cores:
        return float(work.max()) if len(work) else 0.0
    return float(finish_offsets(work, cores, penalty).max())


def remaining_work(work: np.ndarray, cores: int, elapsed: float, penalty: float = 0.0) -> np.ndarray:
    """The work left of each job ``elapsed`` seconds after they all started (see ``finish_offsets``)."""
    if cores == 0 or len(work) <= cores:
        return np.maximum(work - elapsed, 0.0)
    order = np.argsort(work, kind="stable")
    ordered = work[order]
    rate = _rates(len(work) - np.arange(len(work)), cores, penalty)
    finish = np.cumsum(np.diff(ordered, prepend=0.0) / rate)
    done = int(np.searchsorted(finish, elapsed, side="right"))
    if done == len(work):
        return np.zeros_like(work)
    progress = (ordered[done - 1] if done else 0.0) + (elapsed - (finish[done - 1] if done else 0.0)) * rate[done]
    return np.maximum(work - progress, 0.0)


__all__ = ["Engine", "InStepEngine", "NeedLongerTimeline", "RestartEngine", "makespan"]


class Engine:
    """One policy over one timeline (``Engine.of``). Time advances in strides of identical steps between events;
    a step an event falls into is simulated event by event (``_step``)."""

    def __init__(
        self,
        policy: RecoveryPolicy,
        sc: Scenario,
        costs: Costs,
        timeline: Timeline,
        planner: Planner,
        end_s: float,
    ) -> None:
        self.policy, self.sc, self.c, self.tl, self.planner = policy, sc, costs, timeline, planner
        self.M = sc.model.microbatches
        self.cores = sc.cluster.shared_cores
        self.penalty = sc.cluster.oversubscription
        self.every = sc.checkpoint.of(policy)
        self.end_s = end_s
        replicas = sc.cluster.replicas
        self.events = EventQueue(timeline, replicas, end_s)
        self.members: list[int] = list(range(replicas))
        self.joiners: set[int] = set()
        self.schedule = list(FailureSchedule.parse(sc.failures.schedule).events)
        self.t = 0.0
        self.step = 0
        self.committed_mb = self.dropped_mb = self.recomputed_mb = 0
        self.failures = self.restarts = 0
        self.lost = dict.fromkeys(LOST_CAUSES, 0.0)
        self.checkpoint = (0, 0, 0, 0.0, 0.0)  # step, committed mb, dropped mb, time saved, lost time then
        self.series: list[tuple[float, int, int]] = [(0.0, 0, replicas)]
        self._steady: dict[object, tuple[float, np.ndarray, planlib.Assignment]] = {}

    @staticmethod
    def of(
        policy: RecoveryPolicy, sc: Scenario, costs: Costs, timeline: Timeline, planner: Planner, end_s: float
    ) -> Engine:
        """The engine of ``policy``: in-step recovery (recover, drop, MeCeFO) or checkpoint-and-restart."""
        kind = RestartEngine if policy is RecoveryPolicy.RESTART else InStepEngine
        return kind(policy, sc, costs, timeline, planner, end_s)

    def _boundary(self) -> None:
        """Between steps: apply the events known by now."""
        raise NotImplementedError

    def _step(self) -> None:
        """One step an event falls into, simulated event by event."""
        raise NotImplementedError

    # -- accounting -----------------------------------------------------------------------------------
    def _position(self, replica: int, members: list[int]) -> int:
        i = bisect.bisect_left(members, replica)
        return i if i < len(members) and members[i] == replica else -1

    def _spend(self, cause: str, start: float, end: float) -> None:
        self.lost[cause] += max(0.0, min(end, self.end_s) - start)

    def _point(self) -> None:
        self.series.append((min(self.t, self.end_s), self.committed_mb, len(self.members)))

    def _done(self) -> bool:
        return self.t >= self.end_s or (self.sc.run.steps > 0 and self.step >= self.sc.run.steps)

    # -- plans ----------------------------------------------------------------------------------------
    def _steady_plan(self) -> tuple[float, np.ndarray, planlib.Assignment]:
        """(step time, each member's compute, plan) of the current group; the plan is canonical (members
        0..n-1) for the even policies and in replica ids for MeCeFO."""
        mecefo = self.policy.mecefo
        key: object = tuple(self.members) if mecefo else len(self.members)
        if key not in self._steady:
            if mecefo:
                assignment = self.planner.mecefo(tuple(self.members), None, self.policy is RecoveryPolicy.MECEFO_SPREAD)
                work = np.array([self._work(assignment, w) for w in self.members])
            else:
                assignment = self.planner.steady(len(self.members))
                work = self.c.compute_s(np.fromiter(map(len, assignment.ids.values()), dtype=float))
            step_s = makespan(work, self.cores, self.penalty) + self.c.allreduce_s(len(self.members))
            self._steady[key] = (step_s, work, assignment)
        return self._steady[key]

    def _work(self, assignment: planlib.Assignment, worker: int) -> float:
        """A pass of ``worker``'s ids, its efficient ones at ``efficient_factor``, plus a pipeline's bubble."""
        ids = assignment.ids_for(worker)
        if not ids:
            return 0.0
        efficient = sum(1 for j in ids if j in assignment.efficient)
        return (len(ids) - efficient + efficient * self.c.efficient_factor + self.c.bubble) * self.c.microbatch_s

    def _own_ids(self, assignment: planlib.Assignment, members: list[int], i: int) -> tuple[int, ...]:
        if self.policy.mecefo:
            return assignment.ids_for(members[i])
        return assignment.ids[i]

    # -- the run --------------------------------------------------------------------------------------
    def run(self) -> Engine:
        while not self._done():
            self.events.check_horizon(self.t)
            self._boundary()
            if self._done():
                break
            step_s = self._steady_plan()[0]
            strides = self._strides(step_s)
            if strides > 0:
                self.t += strides * step_s
                self.step += strides
                self.committed_mb += strides * self.M
                self._point()
            else:
                self._step()
            if self.every and self.step % self.every == 0 and self.step > self.checkpoint[0] and not self._done():
                self._save()
        return self

    def _strides(self, step_s: float) -> int:
        """How many whole steps fit before anything happens: an event, a checkpoint, a scheduled kill, the end."""
        limits = [self._event_strides(step_s)]
        if self.tl.horizon_s < self.end_s:
            limits.append((self.tl.horizon_s - self.t) // step_s)
        if self.every:
            limits.append(self.every - self.step % self.every)
        pending = [e.step - self.step for e in self.schedule if e.step >= self.step]
        if pending:
            limits.append(min(pending))
        if self.sc.run.steps:
            limits.append(self.sc.run.steps - self.step)
        if self.end_s < math.inf:
            limits.append((self.end_s - self.t) // step_s if step_s > 0 else math.inf)
        return max(0, int(min(limits)))

    def _event_strides(self, step_s: float) -> float:
        """Whole steps before an event changes one. Under ``restart`` any event does; for the in-step policies
        a member's death does, while a repair lets the step it falls in finish (the replica joins after it)."""
        if self.policy is RecoveryPolicy.RESTART:
            t = self.events.peek()[0]
            return (t - self.t) // step_s if t < math.inf else math.inf
        limit = math.inf
        for t, replica, up in self.events.upcoming():
            if t >= self.t + (limit + 1) * step_s:
                break
            if up:
                limit = min(limit, (t - self.t) // step_s + 1)
            elif self._position(replica, self.members) >= 0:
                return min(limit, (t - self.t) // step_s)
        return limit

    def _save(self) -> None:
        """A blocking checkpoint save; under ``restart`` a failure during it leaves the previous checkpoint."""
        end = self.t + self.c.save_s
        te, replica, up = self.events.peek()
        relevant = self.sc.run.restart_on_rejoin if up else self._position(replica, self.members) >= 0
        if self.policy is RecoveryPolicy.RESTART and te < end and relevant:
            self._spend("checkpoint", self.t, te)
            self.t = te
            return
        self._spend("checkpoint", self.t, end)
        self.t = end
        self.checkpoint = (self.step, self.committed_mb, self.dropped_mb, self.t, sum(self.lost.values()))

    def _fire_schedule(self, t0: float, work: np.ndarray, members: list[int], assignment: planlib.Assignment) -> None:
        """Turn this step's scheduled kills into timed events at their phase of the victim's work."""
        for e in [e for e in self.schedule if e.step == self.step]:
            self.schedule.remove(e)  # each event fires once, also when a restart replays its step
            i = self._position(e.worker, members)
            if i < 0:
                continue
            finishes = finish_offsets(work, self.cores, self.penalty)
            finish = float(finishes[i])
            per_mb = finish / max(1, len(self._own_ids(assignment, members, i)))
            step_end = float(finishes.max()) + self.c.allreduce_s(len(members))
            offset = {
                Phase.START: 0.0,
                Phase.FORWARD: per_mb / 6,  # inside the first microbatch's forward
                Phase.BACKWARD: finish - per_mb / 3,  # inside the last microbatch's backward
                Phase.REDUCTION: finish,
                Phase.OPTIMIZER: step_end,  # the others commit; the death shows in the next step
            }[e.phase]
            self.events.schedule_kill(t0 + offset, e.worker, e.rejoin_after_s)

    def _restart(self, at: float, detected: bool) -> None:
        """Everyone stops at ``at``: roll back to the last checkpoint, relaunch on the replicas that are up
        (again if one fails meanwhile; after waiting for a repair if none is up)."""
        self.restarts += 1
        step, committed, dropped, saved_at, lost_then = self.checkpoint
        self.lost["rollback"] += max(0.0, (at - saved_at) - (sum(self.lost.values()) - lost_then))
        self.recomputed_mb += self.committed_mb - committed
        self.step, self.committed_mb, self.dropped_mb = step, committed, dropped
        self.members = []
        self.t = at
        self._point()
        detect = self.c.detect_s if detected else 0.0
        segments = [("detection", at, at + detect)]
        start = at + detect
        ready = start + self.c.restart_s
        while True:
            te, _, up = self.events.peek()
            if te < ready and te < self.end_s:
                self.events.check_horizon(te)
                self.events.pop()
                if not up:
                    ready = max(ready, te + self.c.detect_s + self.c.restart_s)
                continue
            self.events.check_horizon(min(ready, self.end_s))
            if self.events.up.any() or ready >= self.end_s:
                break
            segments.append(("restart", start, ready))
            while not self.events.peek()[2]:  # wait for a repair
                self.events.check_horizon(self.events.peek()[0])
                if self.events.peek()[0] == math.inf:
                    raise ValueError(
                        f"failures: every replica is down from hour {ready / HOUR:.3g} and none comes back "
                        "(no repair, no spare); the run would never finish: set failures.mttr_h or cluster.spares"
                    )
                self.events.pop()
            te, _, _ = self.events.pop()
            segments.append(("idle", ready, te))
            start, ready = te, te + self.c.restart_s
        segments.append(("restart", start, ready))
        for cause, begin, end in segments:
            self._spend(cause, begin, end)
        self.t = ready
        self.members = list(self.events.up_sorted)
        self.joiners.clear()
        self._point()


class InStepEngine(Engine):
    """recover, drop and MeCeFO: a death inside a step is recovered in that step by the survivors."""

    def _boundary(self) -> None:
        """Between steps: apply the events that are known by now (deaths detected, repairs), re-form for the
        dead and admit the repaired; a death not yet detected is left to the coming step."""
        died = False
        while True:
            te, replica, up = self.events.peek()
            member = not up and self._position(replica, self.members) >= 0
            if te > self.t or (member and te + self.c.detect_s > self.t):
                break
            self.events.pop()
            if up:
                self.joiners.add(replica)
            elif member:
                del self.members[self._position(replica, self.members)]
                self.failures += 1
                died = True
                if not self.members:
                    self._restart(te, detected=True)
                    return
            else:
                self.joiners.discard(replica)
        if died:
            self._spend("re-formation", self.t, self.t + self.c.reform_s)
            self.t += self.c.reform_s
        if self.joiners:
            self._spend("re-formation", self.t, self.t + self.c.rejoin_s)
            self.t += self.c.rejoin_s
            for replica in self.joiners:
                bisect.insort(self.members, replica)
            self.joiners.clear()
            self._point()

    def _step(self) -> None:
        """One step with failures inside it: survivors finish their work, wait for the detection, re-form,
        compute the orphaned microbatches (none under ``drop``) and reduce; repeated if another one dies."""
        t0, members = self.t, self.members
        _, work0, assignment = self._steady_plan()
        self._fire_schedule(t0, work0, members, assignment)
        alive = np.ones(len(members), dtype=bool)
        num_alive = len(members)
        work, phase_start = work0.copy(), t0  # a dead member's work is 0: it no longer delays anyone
        extras: dict[int, tuple[int, ...]] = {}
        pending: list[int] = []
        detect_ready = last_death = -math.inf
        recomputing_since: float | None = None
        dropped = 0
        while True:
            busy_until = phase_start + makespan(work, self.cores, self.penalty)
            if pending:
                milestone = max(detect_ready, busy_until) + self.c.reform_s
            else:
                milestone = busy_until + self.c.allreduce_s(num_alive)
            te, replica, up = self.events.peek()
            if min(te, milestone) >= self.end_s:
                self.t = self.end_s
                return
            self.events.check_horizon(min(te, milestone))
            if te < milestone:
                self.events.pop()
                i = -1 if up else self._position(replica, members)
                if up or i < 0 or not alive[i]:
                    (self.joiners.add if up else self.joiners.discard)(replica)
                    continue
                at = max(te, phase_start)
                if not pending and at > busy_until:  # the reduction was under way: it is redone
                    self.lost["recompute"] += at - busy_until
                work = remaining_work(work, self.cores, at - phase_start, self.penalty)
                phase_start = at
                alive[i], work[i] = False, 0.0
                num_alive -= 1
                self.failures += 1
                pending += self._own_ids(assignment, members, i) + extras.pop(i, ())
                detect_ready, last_death = max(detect_ready, te + self.c.detect_s), at
                if num_alive == 0:
                    self.members = []
                    self._restart(te, detected=True)
                    return
                continue
            if recomputing_since is not None:
                self.lost["recompute"] += busy_until - recomputing_since
                recomputing_since = None
            if not pending:
                break
            # The survivors' group is formed at `milestone`: plan the orphaned microbatches over it.
            self.lost["detection"] += max(0.0, detect_ready - max(busy_until, last_death))
            self.lost["re-formation"] += self.c.reform_s
            phase_start, work[:] = milestone, 0.0
            if self.policy is RecoveryPolicy.DROP:
                dropped += len(pending)
            else:
                self.recomputed_mb += len(pending)
                recomputing_since = milestone
                self._assign(sorted(pending), np.flatnonzero(alive), members, work, extras)
            pending, detect_ready = [], -math.inf
        self.t = milestone
        self.step += 1
        self.committed_mb += self.M - dropped
        self.dropped_mb += dropped
        for i in np.flatnonzero(~alive)[::-1]:
            del self.members[int(i)]
        self._point()

    def _assign(
        self,
        todo: list[int],
        live: np.ndarray,
        members: list[int],
        work: np.ndarray,
        extras: dict[int, tuple[int, ...]],
    ) -> None:
        """Plan ``todo`` over the live members (positions ``live`` of ``members``) with unbroken.core.plan."""
        if self.policy is RecoveryPolicy.RECOVER:
            for k, ids in self.planner.spread_nonempty(live.size, len(todo)):
                if ids:
                    extras[int(live[k])] = extras.get(int(live[k]), ()) + tuple(todo[j] for j in ids)
                    work[live[k]] = self.c.compute_s(len(ids))
            return
        survivors = tuple(members[int(i)] for i in live)
        assignment = self.planner.mecefo(survivors, tuple(todo), self.policy is RecoveryPolicy.MECEFO_SPREAD)
        for worker, ids in assignment.ids.items():
            if ids:
                i = self._position(worker, members)
                extras[i] = extras.get(i, ()) + ids
                work[i] = self._work(assignment, worker)


class RestartEngine(Engine):
    """restart: any death (and, with ``run.restart_on_rejoin``, any repair) stops everyone, rolls back to the last
    checkpoint and relaunches."""

    def _boundary(self) -> None:
        while True:
            te, replica, up = self.events.peek()
            if te > self.t:
                return
            self.events.pop()
            if up and self.sc.run.restart_on_rejoin:
                self._restart(te, detected=False)
            elif up:
                self.joiners.add(replica)
            elif self._position(replica, self.members) >= 0:
                self.failures += 1
                self._restart(te, detected=True)
            else:
                self.joiners.discard(replica)

    def _step(self) -> None:
        t0 = self.t
        step_s, work0, assignment = self._steady_plan()
        self._fire_schedule(t0, work0, self.members, assignment)
        commit = t0 + step_s
        while True:
            te, replica, up = self.events.peek()
            if min(te, commit) >= self.end_s:
                self.t = self.end_s
                return
            self.events.check_horizon(min(te, commit))
            if te >= commit:
                break
            self.events.pop()
            if up and self.sc.run.restart_on_rejoin:
                self._restart(te, detected=False)
                return
            if up:
                self.joiners.add(replica)
            elif self._position(replica, self.members) >= 0:
                self.failures += 1
                self._restart(te, detected=True)
                return
            else:
                self.joiners.discard(replica)
        self.t = commit
        self.step += 1
        self.committed_mb += self.M
        self._point()
