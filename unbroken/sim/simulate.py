"""Cluster-scale discrete-event simulator behind ``unbroken simulate``. Pure Python + numpy: no torch.

Owns the scenario schema (``Scenario``: [run], [cluster], [model], [cost], [failures], [checkpoint]), the
cost model (``Costs``), the planner adapter (``Planner``) and ``simulate``, which runs every policy of the
scenario over one failure timeline (``sim_timeline``) with the event loop of ``sim_engine``; the tables,
plots and files are ``sim_report``'s. Who computes which microbatch is always decided by ``unbroken.core.plan``
(the planner the trainer runs), never re-derived here.

The model. G GPUs form G / (shard x pipeline x tensor) replicas (data-parallel workers; ``gpus_per_replica``
is the product's other spelling); one dead GPU stops its replica. A step computes M microbatches: a
replica's time is its planned microbatches (plus pipeline - 1 for the bubble) x the microbatch time
(MeCeFO's efficient ones x ``efficient_factor``), then an all-reduce (ring formula, or measured).
Failures come from a per-GPU exponential MTBF, MeCeFO's scenarios (``failures.SCENARIOS``), ReCoVer's
"half the GPUs lost spread across the run", a CSV trace, or step-keyed kills in the failures.py grammar;
repairs after an MTTR; an optional spare pool. Policies:

- ``recover``: the survivors finish their own work, wait for the detection, re-form, compute the dead
  replica's microbatches (planned over them by ``plan.plan_ids``) and reduce: the step keeps all M.
- ``mecefo`` / ``mecefo-spread``: the same, with ``plan.mecefo_plan`` (neighbour, efficient mode).
- ``drop``: the survivors re-form and reduce without the dead replica's microbatches (counted dropped).
- ``restart``: everyone stops; after detection and ``restart_s`` the survivors resume from the last
  checkpoint (the steps since are redone). A repaired replica also restarts the job (``restart_on_rejoin``).

Plans for the even policies are computed on canonical labels (members 0..R-1, ids 0..n-1) and relabelled,
which is exact because ``plan.plan_ids`` depends on its labels only through their order (checked by
tests/test_simulate.py); this is what keeps 10^5 GPUs fast. The method and its assumptions, the checks
against real runs and the papers' figures are in docs/simulation.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from unbroken.core.config import RecoveryPolicy
from unbroken.core.goodput import Bucket
from unbroken.sim.engine import BUCKET_OF, Engine, NeedLongerTimeline, makespan
from unbroken.sim.planner import Planner
from unbroken.sim.scenario import GIVE_UP_S, HOUR, Costs, Scenario
from unbroken.sim.timeline import Timeline, build_timeline, failure_rate_per_s

# -- results --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyResult:
    """One policy's run over the scenario's timeline."""

    policy: str
    wall_s: float
    finished: bool  # reached run.steps (or ran for run.hours)
    steps: int  # committed steps of the final trajectory (rolled-back ones excluded)
    committed_microbatches: int
    dropped_microbatches: int
    recomputed_microbatches: int  # in-step recomputation, or committed work rolled back and redone
    failures: int  # members lost while in the group
    restarts: int
    gpu_hours: float
    lost_s: dict[str, float]  # wall time lost by cause; "degraded" is the rest (smaller group, efficient mode)
    series_t: np.ndarray  # wall time (s) of the series points
    series_microbatches: np.ndarray  # committed microbatches at those times
    series_members: np.ndarray  # replicas in the group at those times
    tokens_per_microbatch: int
    failure_free_tokens_per_s: float  # the full cluster with no failure, this policy's checkpoint saves included
    tokens_at_gpu_hours: float = math.nan  # committed tokens at run.report_gpu_hours, if reached

    @property
    def committed_tokens(self) -> int:
        return self.committed_microbatches * self.tokens_per_microbatch

    @property
    def tokens_per_s(self) -> float:
        return self.committed_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def badput(self) -> dict[Bucket, float]:
        """The time lost, in the buckets of a real run's goodput account (``core.goodput``; ``BUCKET_OF``)."""
        out = {b: 0.0 for b in Bucket}
        for cause, seconds in self.lost_s.items():
            out[BUCKET_OF[cause]] += seconds
        return out


@dataclass(frozen=True)
class SimResult:
    scenario: Scenario
    costs: Costs
    timeline: Timeline
    failure_free_step_s: float  # the full cluster's step
    policies: list[PolicyResult]
    planner_calls: int


# -- the whole simulation -------------------------------------------------------------------------------


def check_finishes(sc: Scenario, costs: Costs, step_s: float) -> None:
    """Refuse a scenario whose random failures come so fast that a policy would wait longer than ten
    simulated years, on average, for the failure-free window it needs to make progress that lasts: with
    failures at rate r, a window of w seconds comes after (e^(r w) - 1) / r seconds on average."""
    rate = failure_rate_per_s(sc)
    if rate == 0:
        return
    for policy in sc.run.policies:
        if policy is RecoveryPolicy.RESTART:
            steps = sc.checkpoint.every or sc.run.steps or 1
            window = costs.detect_s + costs.restart_s + steps * step_s + (costs.save_s if sc.checkpoint.every else 0)
            needs = "detect_s + restart_s + the steps to the next checkpoint"
        else:
            window = (
                costs.detect_s + costs.reform_s + float(costs.compute_s(1)) + costs.allreduce_s(sc.cluster.replicas)
            )
            needs = "detect_s + reform_s + one microbatch and reduction"
        if rate * window > math.log1p(GIVE_UP_S * rate):
            raise ValueError(
                f"failures: the cluster fails every {1 / rate:.3g} s on average, but policy {policy} needs "
                f"{window:.3g} s without a failure ({needs}); no step would ever commit: raise failures.mtbf_h "
                "or lower the cost times"
            )


def simulate(sc: Scenario) -> SimResult:
    """Run every policy of ``sc.run.policies`` over one failure timeline. The result's scenario has the
    checkpoint intervals given in seconds resolved to steps (``CheckpointSection.in_steps``).

    Raises:
        ValueError: the scenario would never finish (failures faster than any step can commit, or every
            replica down for good).
    """
    costs = Costs.of(sc)
    replicas = sc.cluster.replicas
    planner = Planner(sc.model.microbatches, replicas)
    full = planner.steady(replicas)
    full_work = costs.compute_s(np.array([len(full.ids[k]) for k in range(replicas)]))
    step_s = makespan(full_work, sc.cluster.shared_cores, sc.cluster.oversubscription) + costs.allreduce_s(replicas)
    sc = replace(sc, checkpoint=sc.checkpoint.in_steps(step_s))
    check_finishes(sc, costs, step_s)
    cap_s = GIVE_UP_S
    end_s = sc.run.hours * HOUR if sc.run.hours > 0 else cap_s
    horizon = end_s if sc.run.hours > 0 else min(cap_s, max(HOUR, 2.0 * sc.run.steps * step_s))
    timelines = {horizon: build_timeline(sc, horizon)}
    results = []
    for policy in sc.run.policies:
        while True:
            try:
                engine = Engine.of(policy, sc, costs, timelines[horizon], planner, end_s).run()
                break
            except NeedLongerTimeline:
                horizon = min(cap_s, 4 * horizon)
                timelines.setdefault(horizon, build_timeline(sc, horizon))
        results.append(_result(engine, step_s))
    return SimResult(sc, costs, timelines[horizon], step_s, results, planner.calls)


def _result(engine: Engine, full_step_s: float) -> PolicyResult:
    sc, costs, timeline = engine.sc, engine.c, engine.tl
    wall, steps, committed = min(engine.t, engine.end_s), engine.step, engine.committed_mb
    t, mb, members = (np.array(column) for column in zip(*engine.series, strict=True))
    lost = dict(engine.lost)
    useful = committed / sc.model.microbatches * full_step_s
    every = sc.checkpoint.of(engine.policy)
    save_share = costs.save_s / every if every else 0.0
    lost["degraded"] = wall - useful - sum(v for k, v in lost.items() if k != "degraded")
    finished = sc.run.steps > 0 and steps >= sc.run.steps or sc.run.steps == 0 and wall >= sc.run.hours * HOUR
    at_budget = math.nan
    if sc.run.report_gpu_hours > 0:
        grid = np.union1d(t, timeline.count_times[timeline.count_times <= wall])
        used = timeline.gpu_hours(grid)
        if used[-1] >= sc.run.report_gpu_hours:
            when = float(np.interp(sc.run.report_gpu_hours, used, grid))
            at_budget = float(np.interp(when, t, mb)) * costs.tokens_per_microbatch
    return PolicyResult(
        policy=engine.policy,
        wall_s=wall,
        finished=bool(finished),
        steps=steps,
        committed_microbatches=committed,
        dropped_microbatches=engine.dropped_mb,
        recomputed_microbatches=engine.recomputed_mb,
        failures=engine.failures,
        restarts=engine.restarts,
        gpu_hours=float(timeline.gpu_hours(wall)),
        lost_s=lost,
        series_t=t,
        series_microbatches=mb,
        series_members=members,
        tokens_per_microbatch=costs.tokens_per_microbatch,
        failure_free_tokens_per_s=sc.model.microbatches * costs.tokens_per_microbatch / (full_step_s + save_share),
        tokens_at_gpu_hours=at_budget,
    )
