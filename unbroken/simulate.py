"""Cluster-scale discrete-event simulator behind ``unbroken simulate``. Pure Python + numpy: no torch.

Owns the scenario schema (``Scenario``: [run], [cluster], [model], [cost], [failures], [checkpoint]), the
cost model (``Costs``), the planner adapter (``Planner``) and ``simulate``, which runs every policy of the
scenario over one failure timeline (``sim_timeline``) with the event loop of ``sim_engine``; the tables,
plots and files are ``sim_report``'s. Who computes which microbatch is always decided by ``unbroken.plan``
(the planner the trainer runs), never re-derived here.

The model. G GPUs form G / gpus_per_replica replicas (data-parallel workers); one dead GPU stops its
replica. A step computes M microbatches: a replica's time is its planned microbatches x the microbatch
time (MeCeFO's efficient ones x ``efficient_factor``), then an all-reduce (ring formula, or measured).
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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from unbroken import plan as planlib
from unbroken.config import POLICIES, load_tree
from unbroken.failures import FATAL_KINDS, SCENARIOS, FailureSchedule, Phase
from unbroken.flavours import FLAVOURS, flops_per_token, model_args, num_params
from unbroken.sim_engine import Engine, NeedLongerTimeline, makespan
from unbroken.sim_timeline import HOUR, Timeline, build_timeline, failure_rate_per_s, read_trace

GIVE_UP_S = 10 * 365 * 24 * HOUR  # run.steps only: a policy that has not finished after ten simulated years
MODELLED_KINDS = FATAL_KINDS  # a replica stops; the rest is not modelled
STEP_PHASES = (Phase.START, Phase.FORWARD, Phase.BACKWARD, Phase.REDUCTION, Phase.OPTIMIZER)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _positive(key: str, section: object, names: tuple[str, ...], allow_zero: bool = False) -> None:
    for name in names:
        value = getattr(section, name)
        ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
        rule = ">= 0 (0 = from the cost model)" if allow_zero else "> 0"
        _check(ok, f"{key}.{name} = {value} must be a finite number {rule}")


@dataclass(frozen=True)
class RunSection:
    policies: tuple[str, ...] = ("recover", "restart")  # compared side by side on one failure timeline
    hours: float = 24.0  # simulated wall-clock hours; 0 = until `steps` are committed
    steps: int = 0  # stop once this many steps are committed; 0 = run for `hours`
    restart_on_rejoin: bool = True  # restart: a repaired replica joins by restarting the job (torchelastic)
    report_gpu_hours: float = 0.0  # also report the committed tokens when this many GPU-hours are used

    def __post_init__(self) -> None:
        _check(bool(self.policies), f"run.policies is empty; allowed: {', '.join(POLICIES)}")
        for p in self.policies:
            _check(p in POLICIES, f"run.policies: {p!r} is unknown; allowed: {', '.join(POLICIES)}")
        _check(len(set(self.policies)) == len(self.policies), f"run.policies = {list(self.policies)} repeats one")
        _check(math.isfinite(self.hours) and self.hours >= 0, f"run.hours = {self.hours} must be >= 0")
        _check(self.steps >= 0, f"run.steps = {self.steps} must be >= 0")
        _check(self.hours > 0 or self.steps > 0, "run.hours and run.steps are both 0; give at least one")
        _check(self.report_gpu_hours >= 0, f"run.report_gpu_hours = {self.report_gpu_hours} must be >= 0")


@dataclass(frozen=True)
class ClusterSection:
    gpus: int = 512  # GPUs in the job
    gpus_per_replica: int = 8  # GPUs of one data-parallel replica (its TP x PP group)
    spares: int = 0  # spare GPUs outside the job; one replaces a failed GPU after cost.spare_swap_s
    # 0: every replica has its own devices (a cluster). N: the replicas time-share N CPU cores, one core each
    # at most, as the worker processes of a real CPU run on one machine do (to check the model against one).
    shared_cores: int = 0
    # With shared_cores: each process beyond the cores costs this share of a core's throughput per core
    # (context switches, caches); measured from a run's periods with more and with fewer processes than cores.
    oversubscription: float = 0.0

    def __post_init__(self) -> None:
        for name in ("gpus", "gpus_per_replica"):
            _check(getattr(self, name) >= 1, f"cluster.{name} = {getattr(self, name)} must be >= 1")
        _check(
            self.gpus % self.gpus_per_replica == 0,
            f"cluster.gpus = {self.gpus} must be a multiple of cluster.gpus_per_replica = {self.gpus_per_replica}",
        )
        _check(self.spares >= 0, f"cluster.spares = {self.spares} must be >= 0")
        _check(self.shared_cores >= 0, f"cluster.shared_cores = {self.shared_cores} must be >= 0 (0 = not shared)")
        _check(self.oversubscription >= 0, f"cluster.oversubscription = {self.oversubscription} must be >= 0")

    @property
    def replicas(self) -> int:
        return self.gpus // self.gpus_per_replica


@dataclass(frozen=True)
class ModelSection:
    flavour: str = "7b"  # one of flavours.FLAVOURS (its FLOPs and parameters drive the cost model)
    seq_len: int = 2048
    microbatch_size: int = 1  # sequences per microbatch
    microbatches: int = 512  # M per step, fixed whatever the number of replicas
    vocab_size: int = 0  # 0 = the flavour's

    def __post_init__(self) -> None:
        _check(self.flavour in FLAVOURS, f"model.flavour = {self.flavour!r} is unknown; allowed: {', '.join(FLAVOURS)}")
        for name in ("seq_len", "microbatch_size", "microbatches"):
            _check(getattr(self, name) >= 1, f"model.{name} = {getattr(self, name)} must be >= 1")
        _check(self.vocab_size >= 0, f"model.vocab_size = {self.vocab_size} must be >= 0 (0 = the flavour's)")


@dataclass(frozen=True)
class CostSection:
    device_tflops: float = 312.0  # peak dense bf16 TFLOP/s of one GPU (A100 312, H100 SXM 989)
    mfu: float = 0.4  # model FLOPs utilisation
    bandwidth_gbs: float = 25.0  # GB/s per GPU for the cross-replica all-reduce (200 Gb/s InfiniBand)
    latency_us: float = 10.0  # per step of the ring
    grad_bytes: float = 2.0  # bytes per gradient element (bf16)
    # Measured times replace the cost model (0 = from the cost model):
    microbatch_s: float = 0.0  # one exact microbatch, forward + backward, on one replica
    allreduce_s: float = 0.0  # the part of a step that does not scale with microbatches (reduction, optimizer)
    rejoin_s: float = 0.0  # admitting a repaired replica; 0 = reform_s + its state over the bandwidth
    detect_s: float = 5.0  # a failure until the survivors know
    reform_s: float = 10.0  # forming the survivors' group
    restart_s: float = 600.0  # checkpoint-and-restart after detection: relaunch, load, initialise
    save_s: float = 30.0  # one blocking checkpoint save
    spare_swap_s: float = 300.0  # a spare GPU takes a failed one's place
    efficient_factor: float = 0.86  # MeCeFO: an efficient microbatch costs this fraction of an exact one (CPU)

    def __post_init__(self) -> None:
        _positive("cost", self, ("device_tflops", "mfu", "bandwidth_gbs", "grad_bytes", "efficient_factor"))
        _positive("cost", self, ("detect_s", "reform_s", "restart_s", "save_s", "spare_swap_s"))
        _positive("cost", self, ("microbatch_s", "allreduce_s", "rejoin_s", "latency_us"), allow_zero=True)
        _check(self.mfu <= 1, f"cost.mfu = {self.mfu} must be in (0, 1]")


@dataclass(frozen=True)
class FailureSection:
    mtbf_h: float = 0.0  # per-GPU mean time between failures (exponential, seeded); 0 = none
    mttr_h: float = 0.0  # a failed GPU is back this long after (mtbf and trace failures); 0 or inf = never
    scenario: str = ""  # MeCeFO's low / mid / high (failures.SCENARIOS; reading explained in failures.py)
    lost_gpus: int = 0  # ReCoVer: this many GPUs lost (whole replicas), spread evenly over run.hours, for good
    trace: str = ""  # CSV file of `time_s,gpu,event` rows, event fail or repair
    schedule: str = ""  # step-keyed kills in the failures.py grammar; worker = replica
    seed: int = 0

    def __post_init__(self) -> None:
        _check(math.isfinite(self.mtbf_h) and self.mtbf_h >= 0, f"failures.mtbf_h = {self.mtbf_h} must be >= 0")
        _check(self.mttr_h >= 0, f"failures.mttr_h = {self.mttr_h} must be >= 0 (0 or inf = never repaired)")
        _check(
            self.scenario in ("", *SCENARIOS),
            f"failures.scenario = {self.scenario!r} is unknown; allowed: {', '.join(SCENARIOS)}",
        )
        _check(self.lost_gpus >= 0, f"failures.lost_gpus = {self.lost_gpus} must be >= 0")
        _check(self.seed >= 0, f"failures.seed = {self.seed} must be >= 0")
        for e in FailureSchedule.parse(self.schedule).events:
            _check(
                e.kind in MODELLED_KINDS, f"failures.schedule: {e.describe()!r}: the simulator models kill, hang, cut"
            )
            _check(e.phase in STEP_PHASES, f"failures.schedule: {e.describe()!r}: phase {e.phase} is not modelled")

    @property
    def repaired_after_s(self) -> float:
        return math.inf if self.mttr_h == 0 else self.mttr_h * HOUR


@dataclass(frozen=True)
class CheckpointSection:
    every: int = 1000  # steps between the checkpoints of `restart` (it rolls back to the last); 0 = never
    # Steps between the checkpoints of the in-step policies (recover, drop, mecefo*), which need one only when
    # every member of the group is lost; 0 = never (they then fall back to the initial state).
    in_place_every: int = 1000

    def __post_init__(self) -> None:
        for name in ("every", "in_place_every"):
            value = getattr(self, name)
            _check(value >= 0, f"checkpoint.{name} = {value} must be >= 0 (0 = never)")

    def of(self, policy: str) -> int:
        return self.every if policy == "restart" else self.in_place_every


@dataclass(frozen=True)
class Scenario:
    run: RunSection = field(default_factory=RunSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    model: ModelSection = field(default_factory=ModelSection)
    cost: CostSection = field(default_factory=CostSection)
    failures: FailureSection = field(default_factory=FailureSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)


def load_scenario(path: str | Path | None, overrides: list[str] | None = None) -> Scenario:
    """Read a scenario TOML (``config.load_tree``: CLI > file > defaults) and check it across sections.

    Raises:
        ValueError: one line naming the key, for anything the simulator cannot run.
    """
    sc: Scenario = load_tree(Scenario, path, overrides)
    c, f = sc.cluster, sc.failures
    if f.lost_gpus:
        _check(
            f.lost_gpus % c.gpus_per_replica == 0 and f.lost_gpus < c.gpus,
            f"failures.lost_gpus = {f.lost_gpus} must be whole replicas ({c.gpus_per_replica} GPUs) and < cluster.gpus",
        )
        _check(sc.run.hours > 0, "failures.lost_gpus spreads the losses over run.hours; set run.hours > 0")
    schedule = FailureSchedule.parse(f.schedule)
    if schedule.events:
        schedule.validate(c.replicas, sc.run.steps or 2**62)
    if f.trace:
        read_trace(f.trace, c.gpus)
    return sc


# -- the cost model -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Costs:
    """Resolved times (s) of one scenario: measured where given, else from the flavour's FLOPs and bytes."""

    microbatch_s: float
    tokens_per_microbatch: int
    params: int
    measured_allreduce_s: float
    grad_bytes_per_gpu: float
    bandwidth: float  # bytes/s per GPU
    latency_s: float
    detect_s: float
    reform_s: float
    rejoin_s: float
    restart_s: float
    save_s: float
    spare_swap_s: float
    efficient_factor: float

    @staticmethod
    def of(sc: Scenario) -> Costs:
        m, c, k = sc.model, sc.cost, sc.cluster.gpus_per_replica
        args = model_args(m.flavour, vocab_size=m.vocab_size, max_seq_len=m.seq_len)
        tokens = m.microbatch_size * m.seq_len
        flops = flops_per_token(args, m.seq_len) * tokens
        params = num_params(args)
        bandwidth = c.bandwidth_gbs * 1e9
        state_bytes = 12.0 * params / k  # fp32 weights and AdamW's two moments, sharded over the replica
        return Costs(
            microbatch_s=c.microbatch_s or flops / (k * c.device_tflops * 1e12 * c.mfu),
            tokens_per_microbatch=tokens,
            params=params,
            measured_allreduce_s=c.allreduce_s,
            grad_bytes_per_gpu=c.grad_bytes * params / k,
            bandwidth=bandwidth,
            latency_s=c.latency_us * 1e-6,
            detect_s=c.detect_s,
            reform_s=c.reform_s,
            rejoin_s=c.rejoin_s or c.reform_s + state_bytes / bandwidth,
            restart_s=c.restart_s,
            save_s=c.save_s,
            spare_swap_s=c.spare_swap_s,
            efficient_factor=c.efficient_factor,
        )

    def allreduce_s(self, replicas: int) -> float:
        """Ring all-reduce of the gradient over ``replicas`` (each GPU of a replica runs its own ring)."""
        if self.measured_allreduce_s > 0:
            return self.measured_allreduce_s
        if replicas <= 1:
            return 0.0
        steps = 2 * (replicas - 1)
        return steps / replicas * self.grad_bytes_per_gpu / self.bandwidth + steps * self.latency_s


# -- the planner ----------------------------------------------------------------------------------------


class Planner:
    """``unbroken.plan`` behind caches. The even policies' plans are computed on canonical labels and
    relabelled (``plan_ids`` sorts its members and ids and assigns contiguous blocks, so its plan depends on
    them only through their order); MeCeFO's plans depend on ring positions and are computed as they are."""

    def __init__(self, num_microbatches: int, ring: int) -> None:
        self.M = num_microbatches
        self.ring = tuple(range(ring))
        self._steady: dict[int, planlib.Assignment] = {}
        self._spread: dict[tuple[int, int], planlib.Assignment] = {}
        self._nonempty: dict[tuple[int, int], list[tuple[int, tuple[int, ...]]]] = {}
        self._mecefo: dict[tuple[tuple[int, ...], tuple[int, ...], bool], planlib.Assignment] = {}
        self.calls = 0  # calls into unbroken.plan

    def steady(self, num_members: int) -> planlib.Assignment:
        """``plan_step`` over members 0..n-1 (the k-th smallest member id computes ``ids[k]``)."""
        if num_members not in self._steady:
            self.calls += 1
            self._steady[num_members] = planlib.plan_step(0, range(num_members), self.M)
        return self._steady[num_members]

    def spread(self, num_members: int, num_ids: int) -> planlib.Assignment:
        """``plan_ids`` of ids 0..num_ids-1 over members 0..n-1 (ReCoVer's in-step redistribution)."""
        key = (num_members, num_ids)
        if key not in self._spread:
            self.calls += 1
            self._spread[key] = planlib.plan_ids(0, range(num_members), range(num_ids), self.M)
        return self._spread[key]

    def spread_nonempty(self, num_members: int, num_ids: int) -> list[tuple[int, tuple[int, ...]]]:
        """The (member, ids) entries of ``spread`` that have ids (at most num_ids of the num_members)."""
        key = (num_members, num_ids)
        if key not in self._nonempty:
            self._nonempty[key] = [(k, ids) for k, ids in self.spread(num_members, num_ids).ids.items() if ids]
        return self._nonempty[key]

    def mecefo(self, members: tuple[int, ...], todo: tuple[int, ...] | None, spread: bool) -> planlib.Assignment:
        key = (members, todo or (), spread)
        if key not in self._mecefo:
            self.calls += 1
            self._mecefo[key] = planlib.mecefo_plan(0, self.ring, members, self.M, todo, spread=spread)
        return self._mecefo[key]

    def assignment(self, step: int, members: list[int]) -> planlib.Assignment:
        """The relabelled steady plan of ``members``: equal to ``plan.plan_step(step, members, M)``."""
        canon = self.steady(len(members))
        ordered = sorted(members)
        ids = {ordered[k]: canon.ids[k] for k in range(len(ordered))}
        return planlib.Assignment(step, self.M, tuple(ordered), ids)

    def recovery(self, step: int, members: list[int], todo: list[int]) -> planlib.Assignment:
        """The relabelled redistribution: equal to ``plan.plan_ids(step, members, todo, M)``."""
        ordered, ids = sorted(members), sorted(todo)
        canon = self.spread(len(ordered), len(ids))
        out = {ordered[k]: tuple(ids[j] for j in canon.ids[k]) for k in range(len(ordered))}
        return planlib.Assignment(step, self.M, tuple(ordered), out)


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
        if policy == "restart":
            steps = sc.checkpoint.every or sc.run.steps or 1
            window = costs.detect_s + costs.restart_s + steps * step_s + (costs.save_s if sc.checkpoint.every else 0)
            needs = "detect_s + restart_s + the steps to the next checkpoint"
        else:
            window = costs.detect_s + costs.reform_s + costs.microbatch_s + costs.allreduce_s(sc.cluster.replicas)
            needs = "detect_s + reform_s + one microbatch and reduction"
        if rate * window > math.log1p(GIVE_UP_S * rate):
            raise ValueError(
                f"failures: the cluster fails every {1 / rate:.3g} s on average, but policy {policy} needs "
                f"{window:.3g} s without a failure ({needs}); no step would ever commit: raise failures.mtbf_h "
                "or lower the cost times"
            )


def simulate(sc: Scenario) -> SimResult:
    """Run every policy of ``sc.run.policies`` over one failure timeline.

    Raises:
        ValueError: the scenario would never finish (failures faster than any step can commit, or every
            replica down for good).
    """
    costs = Costs.of(sc)
    replicas = sc.cluster.replicas
    planner = Planner(sc.model.microbatches, replicas)
    full = planner.steady(replicas)
    full_work = np.array([len(full.ids[k]) for k in range(replicas)]) * costs.microbatch_s
    step_s = makespan(full_work, sc.cluster.shared_cores, sc.cluster.oversubscription) + costs.allreduce_s(replicas)
    check_finishes(sc, costs, step_s)
    cap_s = GIVE_UP_S
    end_s = sc.run.hours * HOUR if sc.run.hours > 0 else cap_s
    horizon = end_s if sc.run.hours > 0 else min(cap_s, max(HOUR, 2.0 * sc.run.steps * step_s))
    timelines = {horizon: build_timeline(sc, horizon)}
    results = []
    for policy in sc.run.policies:
        while True:
            try:
                engine = Engine(policy, sc, costs, timelines[horizon], planner, end_s).run()
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
