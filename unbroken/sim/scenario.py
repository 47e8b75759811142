"""The simulator's input: the scenario schema (``Scenario``: [run], [cluster], [model], [cost], [failures],
[checkpoint]), its loading and cross-checks, failure traces, and the cost model (``Costs``) derived from it,
including what a replica's shard x pipeline x tensor layout costs (docs/simulation.md, "The model").
Pure Python + numpy: no torch.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from unbroken.core.config import RecoveryPolicy, load_tree
from unbroken.core.failures import FATAL_KINDS, SCENARIOS, FailureSchedule, Phase
from unbroken.core.flavours import FLAVOURS, flops_per_token, model_args, num_params

HOUR = 3600.0
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


def read_trace(path: str, gpus: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(times, gpus, is_fail) of a CSV trace; ValueError (one line, with the line number) on a bad row."""
    p = Path(path)
    _check(p.is_file(), f"failures.trace = {path!r} does not exist")
    rows: list[tuple[float, int, bool]] = []
    down: set[int] = set()
    with open(p, newline="") as f:
        for number, row in enumerate(csv.reader(f), start=1):
            if not row or row[0].strip().startswith("#") or (number == 1 and row[0].strip() == "time_s"):
                continue
            where = f"failures.trace {path} line {number}"
            _check(len(row) == 3, f"{where}: expected time_s,gpu,event, got {','.join(row)!r}")
            try:
                t, g, event = float(row[0]), int(row[1]), row[2].strip()
            except ValueError:
                raise ValueError(f"{where}: {','.join(row)!r} is not time_s,gpu,event") from None
            _check(math.isfinite(t) and t >= 0, f"{where}: time_s = {row[0]} must be a finite number >= 0")
            _check(0 <= g < gpus, f"{where}: gpu {g} does not exist (gpus 0..{gpus - 1})")
            _check(event in ("fail", "repair"), f"{where}: event {event!r} is unknown; allowed: fail, repair")
            wrong = "fails again before a repair" if event == "fail" else "is repaired but not failed"
            _check((event == "fail") != (g in down), f"{where}: gpu {g} {wrong}")
            (down.add if event == "fail" else down.discard)(g)
            rows.append((t, g, event == "fail"))
    if not rows:
        return np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
    times, ids, fails = zip(*rows, strict=True)
    return np.array(times, dtype=float), np.array(ids, dtype=np.int64), np.array(fails, dtype=bool)


@dataclass(frozen=True)
class RunSection:
    # compared side by side on one failure timeline
    policies: tuple[RecoveryPolicy, ...] = (RecoveryPolicy.RECOVER, RecoveryPolicy.RESTART)
    hours: float = 24.0  # simulated wall-clock hours; 0 = until `steps` are committed
    steps: int = 0  # stop once this many steps are committed; 0 = run for `hours`
    restart_on_rejoin: bool = True  # restart: a repaired replica joins by restarting the job (torchelastic)
    report_gpu_hours: float = 0.0  # also report the committed tokens when this many GPU-hours are used

    def __post_init__(self) -> None:
        allowed = ", ".join(RecoveryPolicy)
        _check(bool(self.policies), f"run.policies is empty; allowed: {allowed}")
        for p in self.policies:
            _check(isinstance(p, RecoveryPolicy), f"run.policies: {p!r} is unknown; allowed: {allowed}")
        _check(len(set(self.policies)) == len(self.policies), f"run.policies = {list(self.policies)} repeats one")
        _check(math.isfinite(self.hours) and self.hours >= 0, f"run.hours = {self.hours} must be >= 0")
        _check(self.steps >= 0, f"run.steps = {self.steps} must be >= 0")
        _check(self.hours > 0 or self.steps > 0, "run.hours and run.steps are both 0; give at least one")
        _check(self.report_gpu_hours >= 0, f"run.report_gpu_hours = {self.report_gpu_hours} must be >= 0")


@dataclass(frozen=True)
class ClusterSection:
    gpus: int = 512  # GPUs in the job
    # GPUs of one data-parallel replica; 0 = shard x pipeline x tensor. Given with shard = 0, shard is the rest.
    gpus_per_replica: int = 0
    # A replica's layout, named as the trainer's [parallel]; the replica is their product of GPUs.
    shard: int = 0  # FSDP ranks per replica; 0 = the rest of gpus_per_replica (1 when that is 0 too)
    pipeline: int = 1  # pipeline stages per replica (the schedule's bubble is modelled)
    tensor: int = 1  # tensor-parallel ranks per stage (their activation all-reduces are modelled)
    spares: int = 0  # spare GPUs outside the job; one replaces a failed GPU after cost.spare_swap_s
    # 0: every replica has its own devices (a cluster). N: the replicas time-share N CPU cores, one core each
    # at most, as the worker processes of a real CPU run on one machine do (to check the model against one).
    shared_cores: int = 0
    # With shared_cores: each process beyond the cores costs this share of a core's throughput per core
    # (context switches, caches); measured from a run's periods with more and with fewer processes than cores.
    oversubscription: float = 0.0

    def __post_init__(self) -> None:
        for name in ("gpus", "pipeline", "tensor"):
            _check(getattr(self, name) >= 1, f"cluster.{name} = {getattr(self, name)} must be >= 1")
        for name in ("gpus_per_replica", "shard"):
            value = getattr(self, name)
            _check(value >= 0, f"cluster.{name} = {value} must be >= 1 (or 0: derived from the other degrees)")
        g, (k, p, t) = self.gpus_per_replica, (self.shard or 1, self.pipeline, self.tensor)
        if g and self.shard:
            _check(
                g == k * p * t,
                f"cluster.gpus_per_replica = {g} contradicts cluster.shard x pipeline x tensor = {k} x {p} x {t} "
                f"= {k * p * t}; give one of them, or make them agree",
            )
        elif g:
            _check(
                g % (p * t) == 0,
                f"cluster.gpus_per_replica = {g} must be a multiple of cluster.pipeline x tensor = {p} x {t} "
                "(shard = 0 takes the rest)",
            )
        k, p, t = self.degrees
        _check(
            self.gpus % self.replica_gpus == 0,
            f"cluster.gpus = {self.gpus} must be a multiple of cluster.gpus_per_replica = "
            f"{self.replica_gpus} (shard x pipeline x tensor = {k} x {p} x {t})",
        )
        _check(self.spares >= 0, f"cluster.spares = {self.spares} must be >= 0")
        _check(self.shared_cores >= 0, f"cluster.shared_cores = {self.shared_cores} must be >= 0 (0 = not shared)")
        _check(self.oversubscription >= 0, f"cluster.oversubscription = {self.oversubscription} must be >= 0")

    @property
    def degrees(self) -> tuple[int, int, int]:
        """(shard, pipeline, tensor) of a replica, with shard = 0 resolved."""
        rest = self.gpus_per_replica // (self.pipeline * self.tensor) if self.gpus_per_replica else 1
        return self.shard or rest, self.pipeline, self.tensor

    @property
    def replica_gpus(self) -> int:
        """GPUs of one replica: shard x pipeline x tensor (= gpus_per_replica when that is given)."""
        k, p, t = self.degrees
        return k * p * t

    @property
    def replicas(self) -> int:
        return self.gpus // self.replica_gpus


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
    # GB/s per GPU, each way, for the activation all-reduces of tensor parallelism inside a replica (A100 NVLink
    # 3: 300); 0 = taken as hidden inside mfu, like the FSDP traffic
    tensor_bandwidth_gbs: float = 300.0
    latency_us: float = 10.0  # per step of the ring
    grad_bytes: float = 2.0  # bytes per gradient element (bf16)
    # Measured times replace the cost model (0 = from the cost model):
    # one exact microbatch, forward + backward, on one replica (with pipeline stages: one stage's part of it,
    # as the schedule runs microbatches + pipeline - 1 of them per pass)
    microbatch_s: float = 0.0
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
        tp = self.tensor_bandwidth_gbs
        _check(
            math.isfinite(tp) and tp >= 0,
            f"cost.tensor_bandwidth_gbs = {tp} must be a finite number >= 0 (0 = hidden inside mfu)",
        )
        _check(self.mfu <= 1, f"cost.mfu = {self.mfu} must be in (0, 1]")


@dataclass(frozen=True)
class FailureSection:
    mtbf_h: float = 0.0  # per-GPU mean time between failures (exponential, seeded); 0 = none
    mttr_h: float = 0.0  # a failed GPU is back this long after (mtbf and trace failures); 0 or inf = never
    # mtbf failures: each repair takes an exponential time of mean mttr_h (seeded) rather than exactly mttr_h,
    # so that repairs do not all land at one phase of restart's checkpoint cycle
    random_repair: bool = False
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
    # The same intervals in seconds of the full cluster's failure-free steps, rounded to whole steps (at least
    # one); when > 0 they replace `every` / `in_place_every`, so that runs whose steps differ in length (other
    # replica sizes in a sweep) save equally often in wall time. 0 = use the intervals in steps.
    every_s: float = 0.0
    in_place_every_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("every", "in_place_every"):
            value = getattr(self, name)
            _check(value >= 0, f"checkpoint.{name} = {value} must be >= 0 (0 = never)")
        for name in ("every_s", "in_place_every_s"):
            value = getattr(self, name)
            ok = math.isfinite(value) and value >= 0
            _check(ok, f"checkpoint.{name} = {value} must be a finite number >= 0 (0 = use the interval in steps)")

    def in_steps(self, step_s: float) -> CheckpointSection:
        """The intervals given in seconds turned into whole steps of ``step_s`` (at least one)."""
        every, in_place = self.every, self.in_place_every
        if self.every_s > 0:
            every = max(1, round(self.every_s / step_s))
        if self.in_place_every_s > 0:
            in_place = max(1, round(self.in_place_every_s / step_s))
        return replace(self, every=every, in_place_every=in_place)

    def of(self, policy: str) -> int:
        return self.every if policy is RecoveryPolicy.RESTART else self.in_place_every


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
            f.lost_gpus % c.replica_gpus == 0 and f.lost_gpus < c.gpus,
            f"failures.lost_gpus = {f.lost_gpus} must be whole replicas ({c.replica_gpus} GPUs) and < cluster.gpus",
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

    microbatch_s: float  # a replica's time per microbatch: a pipeline's per stage, TP's all-reduces included
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
    bubble: int = 0  # pipeline - 1: the microbatch times a pass through a replica's stages adds

    @staticmethod
    def of(sc: Scenario) -> Costs:
        m, c = sc.model, sc.cost
        k, p, t = sc.cluster.degrees
        g = k * p * t
        args = model_args(m.flavour, vocab_size=m.vocab_size, max_seq_len=m.seq_len)
        tokens = m.microbatch_size * m.seq_len
        flops = flops_per_token(args, m.seq_len) * tokens
        params = num_params(args)
        bandwidth = c.bandwidth_gbs * 1e9
        # Each GPU holds a distinct 1/g of the parameters (FSDP shard of a TP slice of a stage's layers): its
        # gradient slice, and the fp32 weights and AdamW's two moments it is sent on rejoining.
        state_bytes = 12.0 * params / g
        flops_s = flops / (g * c.device_tflops * 1e12 * c.mfu)
        return Costs(
            microbatch_s=c.microbatch_s or flops_s + _tensor_s(sc, args.dim, args.n_layers, tokens),
            tokens_per_microbatch=tokens,
            params=params,
            measured_allreduce_s=c.allreduce_s,
            grad_bytes_per_gpu=c.grad_bytes * params / g,
            bandwidth=bandwidth,
            latency_s=c.latency_us * 1e-6,
            detect_s=c.detect_s,
            reform_s=c.reform_s,
            rejoin_s=c.rejoin_s or c.reform_s + state_bytes / bandwidth,
            restart_s=c.restart_s,
            save_s=c.save_s,
            spare_swap_s=c.spare_swap_s,
            efficient_factor=c.efficient_factor,
            bubble=p - 1,
        )

    def compute_s(self, num_microbatches: np.ndarray | int) -> np.ndarray:
        """Each replica's compute for its ``num_microbatches``: one pipeline pass of (n + pipeline - 1)
        microbatch times, none for n = 0."""
        n = np.asarray(num_microbatches, dtype=float)
        return np.where(n > 0, (n + self.bubble) * self.microbatch_s, 0.0)

    def allreduce_s(self, replicas: int) -> float:
        """Ring all-reduce of the gradient over ``replicas`` (each GPU of a replica runs its own ring)."""
        if self.measured_allreduce_s > 0:
            return self.measured_allreduce_s
        if replicas <= 1:
            return 0.0
        steps = 2 * (replicas - 1)
        return steps / replicas * self.grad_bytes_per_gpu / self.bandwidth + steps * self.latency_s


def _tensor_s(sc: Scenario, dim: int, n_layers: int, tokens: int) -> float:
    """Tensor parallelism's activation all-reduces in one microbatch's time on a replica (Megatron-LM: two in
    the forward and two in the backward of every layer). A TP group of t ranks carries the activations of its
    1/k of the microbatch's tokens through its stage's n_layers / p layers; each all-reduce is a bandwidth-only
    ring over the t ranks (2 (t - 1) / t of the bytes), not overlapped with compute. 0 with t = 1, or with
    cost.tensor_bandwidth_gbs = 0 (taken as hidden inside mfu)."""
    k, p, t = sc.cluster.degrees
    if t == 1 or sc.cost.tensor_bandwidth_gbs == 0:
        return 0.0
    activation_bytes = tokens / k * dim * sc.cost.grad_bytes
    per_allreduce = 2 * (t - 1) / t * activation_bytes / (sc.cost.tensor_bandwidth_gbs * 1e9)
    return 4 * n_layers / p * per_allreduce
